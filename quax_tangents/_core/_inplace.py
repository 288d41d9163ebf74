"""Writing slices of a stacked array inside a loop, in place.

XLA on CPU computes bfloat16 slicing in float32, and so copies a whole bfloat16
array to add into one slice of it inside a loop (a slice read, changed and written
back); it updates a `uint16` array in place. Loops that add into slices (the
running sums of factors, `layerwise`'s state) carry bfloat16 arrays as their bits.
A loop that writes each slice from a product of the slice (the refresh's
orthonormalisation, `quax_tangents.optax._accumulate`) needs no bits: XLA on CPU
updates that bfloat16 array in place, and the bitcast back would itself be a copy
on CPU, where it is free on other backends.

The buffer such a loop starts from (zeros, or a copy of an input) depends on nothing
computed, so XLA may make it at the start of the program and hold it through
everything before the loop; `zeros_after` and `as_bits(x, after=...)` tie it to an
array the loop needs anyway, so that it is made when that array is.
"""

from typing import Any

import jax.numpy as jnp
from jax import lax


def as_bits(x: Any, after: Any = None) -> Any:
    """A bfloat16 array as its `uint16` bits; any other array as it is. With
    `after` (a floating array, or `None`), not made before `after` exists."""
    if jnp.dtype(x.dtype) == jnp.bfloat16:
        x = lax.bitcast_convert_type(x, jnp.uint16)
    if after is None:
        return x
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x | _zero_after(after, x.dtype)
    if jnp.issubdtype(x.dtype, jnp.floating):
        # Exact: x, or x itself where x is NaN (the select is never taken).
        return jnp.where(_never(after), jnp.zeros((), x.dtype), x)
    return x


def zeros_after(shape: tuple, dtype: Any, after: Any) -> Any:
    """Zeros of `shape` and `dtype` that XLA cannot make before `after` (a
    floating array, or `None` for plain zeros) exists."""
    if after is None:
        return jnp.zeros(shape, dtype)
    return jnp.broadcast_to(_zero_after(after, dtype), shape)


def _never(after: Any) -> Any:
    # `x != x and x == x` is false for every float, NaN included; XLA does not fold
    # it, so what is computed from it waits for `after`.
    # The first element read through its bits: slicing a bfloat16 array on CPU
    # converts the whole array to float32 first. A corner, not `ravel(...)[0]`: the
    # partitioner gathers a sharded array whole to flatten it.
    x = corner(after)
    return jnp.logical_and(x != x, x == x)


def corner(x: Any) -> Any:
    """The first element of `x`, as a scalar: read through its bits and as a corner
    (see `_never`), so that it costs one element on any backend."""
    bits = as_bits(x)
    first = lax.slice(bits, (0,) * bits.ndim, (1,) * bits.ndim)
    return from_bits(jnp.reshape(first, ()), x.dtype)


def _zero_after(after: Any, dtype: Any) -> Any:
    return jnp.where(_never(after), 1, 0).astype(dtype)


def bits_dtype(dtype: Any) -> Any:
    """The dtype `as_bits` gives an array of `dtype`."""
    return jnp.uint16 if jnp.dtype(dtype) == jnp.bfloat16 else dtype


def from_bits(x: Any, dtype: Any) -> Any:
    """The inverse of `as_bits` for an array that was of `dtype`."""
    if jnp.dtype(dtype) == jnp.bfloat16 and x.dtype == jnp.uint16:
        return lax.bitcast_convert_type(x, jnp.bfloat16)
    return x
