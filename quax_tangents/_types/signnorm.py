"""One sign bit per element plus one l2 norm per block: `SignNorm` and `sign_norm`."""

# jaxtyping shape strings such as "*batch n" are not Python expressions.
# ruff: noqa: F722

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, Float, UInt8

from .. import _validate
from .._base import CompressedArray, densify
from .._registry import rule
from . import _blocked


def _check_block_size(block_size: Any) -> int | None:
    if block_size is None:
        return None
    return _validate.check_positive_int(
        "block_size", block_size, hint=" (use None for one block)"
    )


class SignNorm(CompressedArray):
    """An array stored as one sign bit per element and one l2 norm per block: the
    lossy "sign + norm" compression (signSGD with norm scaling).

    **Layout.** The trailing `event_shape` dims of the represented array are flattened
    row-major and split into blocks of `block_size` elements (`block_size=None`: one
    block holding every element); the last block may be partial and is padded. Within
    each block the sign bits are padded to a multiple of 8 and packed eight per byte,
    little-endian (element `8i + j` of a block is bit `j` of byte `i`); padding bits
    are ignored. A set bit means non-negative, so zero (and -0.0) counts as `+`.

    - `bits`: uint8 `(*batch, num_blocks, ceil(block_elems / 8))`.
    - `norms`: float32 `(*batch, num_blocks)`, the l2 norm of each block, `>= 0`.

    Materialising gives `sign * norm / sqrt(n_b)` per element, where `n_b` is the number
    of real (not padding) elements of its block, so each materialised block has exactly
    the stored l2 norm (up to float32 rounding), then casts to `dtype`. Leading dims of
    `bits` and `norms` beyond the block dims are batch dims (for example from
    `jax.vmap`).

    Create one with [`quax_tangents.sign_norm`][].
    """

    bits: Array
    norms: Array
    event_shape: tuple[int, ...] = eqx.field(static=True)
    block_size: int | None = eqx.field(static=True)
    value_dtype: Any = eqx.field(static=True)

    def __init__(
        self,
        bits: UInt8[ArrayLike, "*batch blocks bytes"],
        norms: Float[ArrayLike, "*batch blocks"],
        *,
        event_shape: tuple[int, ...],
        block_size: int | None = None,
        dtype: Any = jnp.float32,
    ):
        """**Arguments:**

        - `bits`: uint8 packed sign bits `(*batch, num_blocks, ceil(block_elems / 8))`.
        - `norms`: float32 `(*batch, num_blocks)`, finite and non-negative.
        - `event_shape`: the trailing dims of the represented array.
        - `block_size`: elements per block, or None for one block of every element.
        - `dtype`: the floating dtype of the represented array.
        """
        self.bits = jnp.asarray(bits)
        self.norms = jnp.asarray(norms)
        self.event_shape = (
            tuple(event_shape) if isinstance(event_shape, list) else event_shape
        )
        self.block_size = block_size
        try:
            self.value_dtype = jnp.dtype(dtype)
        except TypeError:
            self.value_dtype = dtype

    def __check_init__(self):
        self._check_structure()
        _validate.check_finite("norms", self.norms)
        if _validate.is_concrete(self.norms) and bool(
            np.any(np.asarray(self.norms) < 0)
        ):
            raise ValueError(
                "`norms` must be non-negative (they are l2 norms); put the sign into "
                "`bits` instead."
            )

    def _check_structure(self) -> None:
        _check_block_size(self.block_size)
        event_shape = _blocked.check_event_shape("event_shape", self.event_shape)
        if not isinstance(self.event_shape, tuple):
            raise TypeError(f"`event_shape` must be a tuple, got {self.event_shape!r}.")
        _blocked.check_value_dtype("dtype", self.value_dtype)
        _validate.check_ndim("bits", self.bits, 2)
        _validate.check_dtype("bits", self.bits, jnp.uint8)
        size = _blocked.event_size(event_shape)
        elems = self.block_elems
        shape = self.bits.shape
        _blocked.check_shape(
            "bits",
            shape,
            (*shape[:-2], _blocked.num_blocks(size, elems), -(-elems // 8)),
            f"ceil({size}/{elems}) blocks of ceil({elems}/8) bytes",
        )
        _validate.check_dtype("norms", self.norms, jnp.float32)
        _blocked.check_shape(
            "norms", self.norms.shape, shape[:-1], "one norm per block of `bits`"
        )

    @property
    def block_elems(self) -> int:
        """Elements per (full) block: `block_size`, or the event size for None."""
        return _elems(self.event_shape, self.block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks per batch element."""
        return self.bits.shape[-2]

    def block_counts(self) -> np.ndarray:
        """The number of real elements of each block, `n_b` (static)."""
        return _block_counts(self.event_shape, self.block_elems)

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(
            (*self.bits.shape[:-2], *self.event_shape), self.value_dtype
        )

    def signs(self) -> Float[Array, "*batch blocks block_elems"]:
        """`+1.0` / `-1.0` per element as float32, in blocks (padding dropped within a
        block, but the last block padded to `block_elems`)."""
        return _signs(self.bits, self.block_elems)

    def materialise(self) -> Array:
        return _decode(
            self.bits, self.norms, self.event_shape, self.block_size, self.value_dtype
        )

    def _replace(self, **changes: Any) -> "SignNorm":
        return _blocked.unchecked(type(self), **{**_blocked.fields_of(self), **changes})


def _signs(bits: Array, block_elems: int) -> Array:
    # Bit j of byte i is element 8i + j (little-endian within a byte).
    shifts = jnp.arange(8, dtype=jnp.uint8)
    unpacked = (bits[..., None] >> shifts) & 1
    unpacked = unpacked.reshape(*bits.shape[:-1], bits.shape[-1] * 8)[..., :block_elems]
    return jnp.where(unpacked != 0, 1.0, -1.0).astype(jnp.float32)


def _block_counts(event_shape: tuple[int, ...], block_elems: int) -> np.ndarray:
    size = _blocked.event_size(event_shape)
    starts = np.arange(_blocked.num_blocks(size, block_elems)) * block_elems
    return np.minimum(block_elems, size - starts)


def _elems(event_shape: tuple[int, ...], block_size: int | None) -> int:
    if block_size is None:
        return max(_blocked.event_size(event_shape), 1)
    return block_size


# Jitted so that eager use compiles one kernel per shape instead of one per op.
@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _decode(bits, norms, event_shape, block_size, dtype) -> Array:
    elems = _elems(event_shape, block_size)
    counts = np.maximum(_block_counts(event_shape, elems), 1).astype(np.float32)
    values = _signs(bits, elems) * (norms / np.sqrt(counts))[..., None]
    return _blocked.unblock(values, event_shape, dtype)


@functools.partial(jax.jit, static_argnums=(1,))
def _encode(x, elems: int) -> tuple[Array, Array]:
    blocks = _blocked.flat_blocks(x, _blocked.num_blocks(x.size, elems), elems)
    largest = jnp.max(jnp.abs(blocks), axis=-1, initial=0.0)
    unit = blocks / jnp.where(largest > 0, largest, 1.0)[..., None]
    norms = largest * jnp.sqrt(jnp.sum(unit * unit, axis=-1))
    bits = jnp.packbits(blocks >= 0, axis=-1, bitorder="little")
    return bits, norms


def sign_norm(x: Float[ArrayLike, "*shape"], block_size: int | None = None) -> SignNorm:
    """Compresses `x` to its signs and the l2 norm of each block.

    `x` is flattened row-major and split into blocks of `block_size` elements (the
    last block may be partial; see [`quax_tangents.SignNorm`][] for the layout). The
    result materialises to `sign(x) * norm_b / sqrt(n_b)`: per block the l2 norm is
    kept exactly (up to float32 rounding) and every element keeps its sign (zero counts
    as positive); magnitudes within a block are flattened to their root mean square.
    With `block_size=None` (the default) the whole array is one block, costing one bit
    per element plus 4 bytes. A `block_size` larger than `x` is reduced to `x.size`.

    Norms are computed in float32 with the block's largest magnitude factored out, so
    they do not overflow for large finite inputs.

    Works under `jax.jit` and `jax.vmap`.

    **Arguments:**

    - `x`: a finite floating array (finiteness is checked when `x` is concrete).
    - `block_size`: elements per block (a positive Python int, static), or None for a
        single block.

    **Returns:**

    A `SignNorm` with `event_shape == x.shape` and `dtype == x.dtype`.
    """
    block_size = _check_block_size(block_size)
    _validate.check_floating("x", x)
    _validate.check_finite("x", x)
    x = jnp.asarray(x)
    size = x.size
    if block_size is not None:
        block_size = min(block_size, max(size, 1))
    bits, norms = _encode(x, _elems(x.shape, block_size))
    return SignNorm(
        bits, norms, event_shape=x.shape, block_size=block_size, dtype=x.dtype
    )


# ---------------------------------------------------------------------------------
# Rules. Each keeps the type where the result is exactly representable and otherwise
# densifies through `densify` (counted, subject to the fallback mode).


@rule(lax.neg_p)
def _neg(x: SignNorm) -> SignNorm:
    return x._replace(bits=jnp.bitwise_not(x.bits))


def _scale(x: SignNorm, other: ArrayLike, values, params) -> SignNorm | Array:
    scalar = _blocked.scalar_operand(x.shape, other)
    out_dtype = params.get("out_dtype")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    if scalar is None:
        return densify(lax.mul_p, values, params, reason="product with a non-scalar")
    if not jnp.issubdtype(out_dtype, jnp.floating):
        return densify(lax.mul_p, values, params, reason="non-floating `out_dtype`")
    scalar = scalar.astype(jnp.float32)
    # The scalar may be traced: choose the bit pattern with `where`, not `if`.
    bits = jnp.where(scalar < 0, jnp.bitwise_not(x.bits), x.bits)
    return x._replace(
        bits=bits, norms=x.norms * jnp.abs(scalar), value_dtype=jnp.dtype(out_dtype)
    )


@rule(lax.mul_p)
def _mul_scalar_right(x: SignNorm, y: ArrayLike, **params: Any) -> SignNorm | Array:
    return _scale(x, y, (x, y), params)


@rule(lax.mul_p)
def _mul_scalar_left(x: ArrayLike, y: SignNorm, **params: Any) -> SignNorm | Array:
    return _scale(y, x, (x, y), params)


@rule(lax.convert_element_type_p)
def _convert_element_type(x: SignNorm, **params: Any) -> SignNorm | Array:
    new_dtype = jnp.dtype(params["new_dtype"])
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return densify(
            lax.convert_element_type_p,
            (x,),
            params,
            reason=f"conversion to {new_dtype}",
        )
    if params.get("sharding") is not None:
        return densify(
            lax.convert_element_type_p, (x,), params, reason="explicit output sharding"
        )
    return x._replace(value_dtype=new_dtype)


@rule(lax.copy_p)
def _copy(x: SignNorm) -> SignNorm:
    return x._replace(bits=jnp.copy(x.bits), norms=jnp.copy(x.norms))


def _permute_batch(x: SignNorm, batch_perm: tuple[int, ...]) -> SignNorm:
    n_batch = len(batch_perm)
    if batch_perm == tuple(range(n_batch)):
        return x
    return x._replace(
        bits=jnp.transpose(x.bits, (*batch_perm, n_batch, n_batch + 1)),
        norms=jnp.transpose(x.norms, (*batch_perm, n_batch)),
    )


@rule(lax.transpose_p)
def _transpose(x: SignNorm, **params: Any) -> SignNorm | Array:
    permutation = params["permutation"]
    n_batch = x.bits.ndim - 2
    layout = _blocked.transpose_event(x.shape, n_batch, permutation)
    if layout is None:
        return densify(
            lax.transpose_p,
            (x,),
            params,
            reason="the permutation reorders the flat event elements",
        )
    batch_perm, event_shape = layout
    return _permute_batch(x, batch_perm)._replace(event_shape=event_shape)


@rule(lax.reshape_p)
def _reshape(x: SignNorm, **params: Any) -> SignNorm | Array:
    n_batch = x.bits.ndim - 2
    shape, out = x.shape, x
    dimensions = params.get("dimensions")
    if params.get("sharding") is not None:
        return densify(lax.reshape_p, (x,), params, reason="explicit output sharding")
    if dimensions is not None:
        layout = _blocked.transpose_event(shape, n_batch, dimensions)
        if layout is None:
            return densify(
                lax.reshape_p, (x,), params, reason="`dimensions` reorders the elements"
            )
        batch_perm, event_shape = layout
        out = _permute_batch(x, batch_perm)._replace(event_shape=event_shape)
        shape = out.shape
    event_shape = _blocked.reshape_event(shape, n_batch, params["new_sizes"])
    if event_shape is None:
        return densify(
            lax.reshape_p, (x,), params, reason="the reshape moves batch dims"
        )
    return out._replace(event_shape=event_shape)
