"""One sign bit per element plus one l2 norm per block: `SignNorm` and `sign_norm`."""

# jaxtyping shape strings such as "*batch n" are not Python expressions.
# ruff: noqa: F722

import functools
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, Float, UInt8

from .._core import _validate
from .._core._base import ChunkCompressor
from .._core._registry import rule
from . import _blocked
from ._blocked import BlockedArray


def _check_block_size(block_size: Any) -> int | None:
    if block_size is None:
        return None
    return _validate.check_positive_int(
        "block_size", block_size, hint=" (use None for one block)"
    )


class SignNorm(BlockedArray):
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

    _payload_field: ClassVar[str] = "bits"  # pyright: ignore[reportIncompatibleVariableOverride]
    _stat_field: ClassVar[str] = "norms"  # pyright: ignore[reportIncompatibleVariableOverride]

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
        self.block_size = block_size
        self.event_shape, self.value_dtype = _blocked.static_fields(event_shape, dtype)

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

    def _check_settings(self) -> None:
        _check_block_size(self.block_size)

    def _check_payload(self, event_shape: tuple[int, ...]) -> None:
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

    @property
    def block_elems(self) -> int:
        """Elements per (full) block: `block_size`, or the event size for None."""
        return _elems(self.event_shape, self.block_size)

    def block_counts(self) -> np.ndarray:
        """The number of real elements of each block, `n_b` (static)."""
        return _block_counts(self.event_shape, self.block_elems)

    def signs(self) -> Float[Array, "*batch blocks block_elems"]:
        """`+1.0` / `-1.0` per element as float32, in blocks (padding dropped within a
        block, but the last block padded to `block_elems`)."""
        return _signs(self.bits, self.block_elems)

    def materialise(self) -> Array:
        return _decode(
            self.bits, self.norms, self.event_shape, self.block_size, self.value_dtype
        )

    def chunk_compressor(self) -> ChunkCompressor:
        # With blocks, chunks of whole blocks; with one block (`block_size=None`),
        # one norm per chunk.
        compress = functools.partial(sign_norm, block_size=self.block_size)
        return ChunkCompressor(compress, self.block_size or 8)

    def _scaled(self, scalar: Array, dtype: Any) -> "SignNorm":
        # The scalar may be traced: choose the bit pattern with `where`, not `if`.
        bits = jnp.where(scalar < 0, jnp.bitwise_not(self.bits), self.bits)
        return self._replace(
            bits=bits, norms=self.norms * jnp.abs(scalar), value_dtype=dtype
        )


def _non_negative(bits: Array, block_elems: int) -> Array:
    """Whether each element is non-negative, as uint8 0/1 in blocks of
    `block_elems` (padding bits dropped)."""
    # Bit j of byte i is element 8i + j (little-endian within a byte). Shifts by
    # hand: `jnp.unpackbits` fails on zero-size arrays.
    shifts = jnp.arange(8, dtype=jnp.uint8)
    unpacked = (bits[..., None] >> shifts) & 1
    unpacked = unpacked.reshape(*bits.shape[:-1], bits.shape[-1] * 8)
    return unpacked[..., :block_elems]


def _signs(bits: Array, block_elems: int) -> Array:
    return jnp.where(_non_negative(bits, block_elems) != 0, 1.0, -1.0).astype(
        jnp.float32
    )


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
    magnitude = (norms / np.sqrt(counts))[..., None]
    # A select, not a product with +-1: the same values, one operation fewer.
    positive = _non_negative(bits, elems) != 0
    values = jnp.where(positive, magnitude, -magnitude)
    return _blocked.unblock(values, event_shape, dtype)


def _power_of_two_scales(largest: Array) -> tuple[Array, Array]:
    """`(2**-e, 2**e)` for the exponent `e` that `jnp.frexp` gives `largest >= 0`
    (so `largest * 2**-e` is in `[0.5, 1)`), clipped to `[-125, 125]` so that both
    are normal floats. Built from the float32 bits: a shift and two bit patterns,
    where `frexp`/`ldexp` handle subnormals and infinities element by element and
    cost several times the rest of the encoder."""
    biased = lax.bitcast_convert_type(largest, jnp.int32) >> 23
    exponent = jnp.clip(biased - 126, -125, 125)
    down = lax.bitcast_convert_type((127 - exponent) << 23, jnp.float32)
    up = lax.bitcast_convert_type((127 + exponent) << 23, jnp.float32)
    return down, up


def _block_norms(blocks: Array) -> Array:
    """The l2 norm of each row of `blocks` `(num_blocks, elems)`, overflow-safe."""
    # One block is reduced as a whole array: XLA compiles a reduction to a scalar
    # into a faster loop than a reduction along one long row (about 2x on CPU).
    axis = None if blocks.shape[0] == 1 else -1
    largest = jnp.max(jnp.abs(blocks), axis=axis, initial=0.0, keepdims=True)
    # Scale each block by a power of two near `1 / largest`: one exact multiply per
    # element, so that squares of values up to float32's maximum neither overflow
    # nor (for the block's largest values) underflow. Dividing by `largest` instead
    # is compiled as a product with its reciprocal, which is subnormal for `largest`
    # above about 8.5e37 and flushed to zero where subnormals are (XLA on CPU).
    down, up = _power_of_two_scales(largest)
    unit = blocks * down
    norms = jnp.sqrt(jnp.sum(unit * unit, axis=axis, keepdims=True)) * up
    return norms[..., 0]


@functools.partial(jax.jit, static_argnums=(1,))
def _encode(x, elems: int) -> tuple[Array, Array]:
    blocks = _blocked.flat_blocks(x, _blocked.num_blocks(x.size, elems), elems)
    bits = jnp.packbits(blocks >= 0, axis=-1, bitorder="little")
    return bits, _block_norms(blocks)


def _check_norms_fit(norms: Array, block_size: int | None) -> None:
    if _validate.checks_values(norms) and not bool(np.all(np.isfinite(norms))):
        raise ValueError(
            "`x` has a block whose l2 norm overflows float32 (above about 3.4e38), "
            "the dtype `SignNorm` stores its norms in"
            + (
                " (`block_size=None` makes all of `x` one block)"
                if block_size is None
                else ""
            )
            + ". Pass a smaller `block_size` (`block_size=1` keeps every magnitude), "
            "or scale `x` down."
        )


def sign_norm(x: Float[ArrayLike, "*shape"], block_size: int | None = None) -> SignNorm:
    """Compresses `x` to its signs and the l2 norm of each block.

    `x` is flattened row-major and split into blocks of `block_size` elements (the
    last block may be partial; see [`quax_tangents.SignNorm`][] for the layout). The
    result materialises to `sign(x) * norm_b / sqrt(n_b)`: per block the l2 norm is
    kept exactly (up to float32 rounding) and every element keeps its sign (zero counts
    as positive); magnitudes within a block are flattened to their root mean square.
    With `block_size=None` (the default) the whole array is one block, costing one bit
    per element plus 4 bytes. A `block_size` larger than `x` is reduced to `x.size`.

    **Error bound.** Each stored norm is the block's l2 norm with a relative error of a
    few float32 ulps (`n_b` of them at most), whatever the magnitudes: the norm is
    computed in float32 with the block's largest magnitude factored out as a power of
    two, so values up to float32's maximum neither overflow nor underflow in between.
    A block whose norm itself exceeds float32's maximum (`sqrt(n_b) * 1e38` does for
    `n_b >= 12`) is an error for concrete `x` and stores `inf` under `jit`. Subnormal
    values (below float32's smallest normal, about 1.2e-38) count as zero where the
    backend flushes subnormals, as XLA on CPU does: a materialised element, or a norm,
    below that bound may come out as zero.

    Works under `jax.jit` and `jax.vmap`.

    **Arguments:**

    - `x`: a finite floating array (finiteness is checked when `x` is concrete).
    - `block_size`: elements per block (a positive Python int, static), or None for a
        single block.

    **Returns:**

    A `SignNorm` with `event_shape == x.shape` and `dtype == x.dtype`.
    """
    block_size = _check_block_size(block_size)
    x = _validate.as_array("x", x)
    _validate.check_floating("x", x)
    _validate.check_finite("x", x)
    size = x.size
    if block_size is not None:
        block_size = min(block_size, max(size, 1))
    bits, norms = _encode(x, _elems(x.shape, block_size))
    _check_norms_fit(norms, block_size)
    return SignNorm(
        bits, norms, event_shape=x.shape, block_size=block_size, dtype=x.dtype
    )


# ---------------------------------------------------------------------------------
# Rules of `SignNorm` alone; `transpose`, `reshape`, `convert_element_type` and `copy`
# are registered once for every `BlockedArray` in `_blocked`. A product with a
# non-scalar densifies through `densify` (counted, subject to the fallback mode).


@rule(lax.neg_p)
def _neg(x: SignNorm) -> SignNorm:
    return x._replace(bits=jnp.bitwise_not(x.bits))


@rule(lax.mul_p, commutative=True)
def _mul_scalar(x: SignNorm, y: ArrayLike, **params: Any) -> SignNorm | Array:
    return x._mul_scalar(y, (x, y), params)
