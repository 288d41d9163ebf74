"""Storage of a carried error-feedback state: in the gradient's dtype, or as int8
codes with a float32 scale per block (`error_dtype="int8"`)."""

import math
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array

from .._core._devices import axis_is_bound, device_varying
from .._types.quantized import Quantized, quantize
from ._common import AxisName, materialised


ErrorDtype = str | None

# The largest block of an int8 error: one float32 scale per 256 codes adds 1/64 of a
# byte per element.
_MAX_BLOCK = 256


def check_error_dtype(error_dtype: Any) -> ErrorDtype:
    if error_dtype is not None and error_dtype != "int8":
        raise ValueError(
            f'`error_dtype` must be None (the gradient\'s dtype) or "int8", got '
            f"{error_dtype!r}."
        )
    return error_dtype


def block_size(size: int) -> int:
    """At most `_MAX_BLOCK` elements per block, with the blocks as equal as they can
    be, so that padding adds fewer elements than there are blocks (a `(30, 20)`
    error is 3 blocks of 200, not 3 of 256)."""
    blocks = max(1, math.ceil(size / _MAX_BLOCK))
    return max(1, math.ceil(size / blocks))


def store_error(value: Array, dtype: Any, error_dtype: ErrorDtype) -> Array | Quantized:
    """`value` (any floating dtype) as the stored error of a gradient of `dtype`.

    With `"int8"` every element is within `max|block| / 254` of `value` cast to
    `dtype` (nearest rounding, deterministic): the rounding error is carried no
    further, so it is bounded per step and does not accumulate.
    """
    value = value.astype(dtype)
    if error_dtype is None:
        return value
    return quantize(value, bits=8, block_size=block_size(value.size))


def load_error(stored: Array | Quantized) -> Array:
    """The carried error as an array of the gradient's dtype."""
    return materialised(stored)


def zero_error(leaf: Any, axis_name: AxisName, error_dtype: ErrorDtype) -> Any:
    """A zero error for `leaf`; typed as varying when created inside the `shard_map`
    body, so that a `scan` carrying the state keeps one type."""
    zeros = jnp.zeros(jnp.shape(leaf), leaf.dtype)
    stored = store_error(zeros, leaf.dtype, error_dtype)
    if axis_name is not None and axis_is_bound(axis_name):
        stored = device_varying(stored, axis_name)
    return stored
