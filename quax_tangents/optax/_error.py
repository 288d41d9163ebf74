"""Storage of carried errors (error feedback): float, or int8 codes with a scale per
block."""

from typing import Any, Literal

import jax.numpy as jnp
from jaxtyping import Array

from .._devices import axis_is_bound, device_varying
from .._types.quantized import Quantized, quantize


ErrorDtype = Literal["int8"] | None

# Elements per block of a stored int8 error: one float32 scale per 256 codes costs
# 1/64 of the codes, so the error takes 0.254x the bytes of a float32 one.
ERROR_BLOCK = 256


def check_error_dtype(error_dtype: Any) -> ErrorDtype:
    if error_dtype not in (None, "int8"):
        raise ValueError(
            f"`error_dtype` must be None (the update's dtype) or 'int8', got "
            f"{error_dtype!r}."
        )
    return error_dtype


def store_error(error: Array, error_dtype: ErrorDtype, like: Any) -> Array | Quantized:
    """`error` as it is kept in the state: in `like`'s dtype, or as int8 codes with
    one float32 scale per block (nearest rounding, deterministic)."""
    if error_dtype is None:
        return error.astype(like.dtype)
    return quantize(error, bits=8, block_size=ERROR_BLOCK)


def load_error(stored: Array | Quantized, like: Any) -> Array:
    """The stored error as a dense array of `like`'s dtype."""
    if isinstance(stored, Quantized):
        return stored.materialise().astype(like.dtype)
    return stored


def zero_error(shape: tuple[int, ...], dtype: Any, error_dtype: ErrorDtype, axis_name):
    """A stored zero error, typed as varying over `axis_name` inside `shard_map`, so
    that a `scan` carrying the state keeps one type."""
    zeros = jnp.zeros(shape, dtype)
    stored = store_error(zeros, error_dtype, zeros)
    if axis_name is not None and axis_is_bound(axis_name):
        stored = device_varying(stored, axis_name)
    return stored
