"""Row-major flat-index arithmetic on int32 index arrays (used by `Sparse`)."""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array


INDEX_DTYPE = jnp.int32


def _strides(shape: Sequence[int]) -> list[int]:
    strides = []
    stride = 1
    for side in reversed(shape):
        strides.append(stride)
        stride *= side
    return strides[::-1]


def unravel(flat: Array, shape: Sequence[int]) -> list[Array]:
    """Row-major coordinates of non-negative flat indices (each of `flat`'s shape)."""
    coords = []
    for axis, (stride, side) in enumerate(zip(_strides(shape), shape, strict=True)):
        coord = flat if stride == 1 else jax.lax.div(flat, INDEX_DTYPE(stride))
        if axis > 0:
            coord = jax.lax.rem(coord, INDEX_DTYPE(max(side, 1)))
        coords.append(coord)
    return coords


def ravel(coords: Sequence[Array], shape: Sequence[int], like: Array) -> Array:
    """Row-major flat indices of coordinates; zeros shaped like `like` for `()`."""
    flat = None
    for coord, stride in zip(coords, _strides(shape), strict=True):
        term = coord.astype(INDEX_DTYPE)
        term = term if stride == 1 else term * INDEX_DTYPE(stride)
        flat = term if flat is None else flat + term
    return jnp.zeros(jnp.shape(like), INDEX_DTYPE) if flat is None else flat


def gather(array: Array, *indices: Array) -> Array:
    return array.at[indices].get(mode="promise_in_bounds", wrap_negative_indices=False)


def scatter_add(array: Array, indices: Any, updates: Array) -> Array:
    return array.at[indices].add(updates, mode="drop", wrap_negative_indices=False)
