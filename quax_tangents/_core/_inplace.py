"""Writing slices of a stacked array inside a loop, in place.

XLA on CPU computes bfloat16 slicing in float32, and so copies a whole bfloat16
array to update one slice of it inside a loop; it updates a `uint16` array in place.
A bitcast costs nothing on any backend, so loops that write slices carry bfloat16
arrays as their bits.
"""

from typing import Any

import jax.numpy as jnp
from jax import lax


def as_bits(x: Any) -> Any:
    """A bfloat16 array as its `uint16` bits; any other array as it is."""
    if jnp.dtype(x.dtype) == jnp.bfloat16:
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


def bits_dtype(dtype: Any) -> Any:
    """The dtype `as_bits` gives an array of `dtype`."""
    return jnp.uint16 if jnp.dtype(dtype) == jnp.bfloat16 else dtype


def from_bits(x: Any, dtype: Any) -> Any:
    """The inverse of `as_bits` for an array that was of `dtype`."""
    if jnp.dtype(dtype) == jnp.bfloat16 and x.dtype == jnp.uint16:
        return lax.bitcast_convert_type(x, jnp.bfloat16)
    return x
