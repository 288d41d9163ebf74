"""Block-wise symmetric quantisation: `Quantized` and its compressor `quantize`."""

# jaxtyping shape strings such as "*batch n" are not Python expressions.
# ruff: noqa: F722

import functools
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray, UInt8

from .._core import _validate
from .._core._base import ChunkCompressor
from .._core._registry import rule
from . import _blocked
from ._blocked import BlockedArray


_QMAX = {8: 127, 4: 7}
_CODE_DTYPE = {8: jnp.dtype(jnp.int8), 4: jnp.dtype(jnp.uint8)}


def _check_bits(name: str, bits: Any) -> int:
    if isinstance(bits, bool) or bits not in _QMAX:
        raise ValueError(f"`{name}` must be 4 or 8, got {bits!r}.")
    return int(bits)


def _check_block_size(block_size: Any, bits: int) -> int:
    block_size = _validate.check_positive_int("block_size", block_size)
    if bits == 4 and block_size % 2:
        raise ValueError(
            f"`block_size` must be even for bits=4 (two 4-bit codes share a byte), got "
            f"{block_size}."
        )
    return block_size


class Quantized(BlockedArray):
    """An array stored as block-wise symmetric integer codes with one float32 scale per
    block.

    **Layout.** The trailing `event_shape` dims of the represented array are flattened
    row-major, zero-padded at the end to a multiple of `block_size` and split into
    `num_blocks = ceil(prod(event_shape) / block_size)` blocks. Element `j` of block
    `b` represents `codes[..., b, j] * scales[..., b]`; the padding is dropped when the
    value is materialised, which casts to `dtype` last. Leading dims of `codes` and
    `scales` beyond the block dims are batch dims (for example from `jax.vmap`).

    - 8 bits: `codes` is int8 of shape `(*batch, num_blocks, block_size)`, values in
      `[-127, 127]`.
    - 4 bits: `codes` is uint8 of shape `(*batch, num_blocks, block_size // 2)`, two
      codes per byte: element `2i` in the low nibble, `2i + 1` in the high nibble,
      each a 4-bit two's complement number in `[-7, 7]`.

    `scales` is float32 of shape `(*batch, num_blocks)` and may be negative (negation
    flips the scales, not the codes).

    Create one with [`quax_tangents.quantize`][].
    """

    _payload_field: ClassVar[str] = "codes"  # pyright: ignore[reportIncompatibleVariableOverride]
    _stat_field: ClassVar[str] = "scales"  # pyright: ignore[reportIncompatibleVariableOverride]

    codes: Array
    scales: Array
    event_shape: tuple[int, ...] = eqx.field(static=True)
    bits: int = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    value_dtype: Any = eqx.field(static=True)

    def __init__(
        self,
        codes: Int[ArrayLike, "*batch blocks width"],
        scales: Float[ArrayLike, "*batch blocks"],
        *,
        event_shape: tuple[int, ...],
        bits: int,
        block_size: int,
        dtype: Any = jnp.float32,
    ):
        """**Arguments:**

        - `codes`: int8 codes `(*batch, num_blocks, block_size)` for `bits=8`, or uint8
            packed codes `(*batch, num_blocks, block_size // 2)` for `bits=4`.
        - `scales`: float32 `(*batch, num_blocks)`, finite.
        - `event_shape`: the trailing dims of the represented array.
        - `bits`: 4 or 8.
        - `block_size`: elements per block (even for 4 bits).
        - `dtype`: the floating dtype of the represented array.
        """
        self.codes = jnp.asarray(codes)
        self.scales = jnp.asarray(scales)
        self.bits = bits
        self.block_size = block_size
        self.event_shape, self.value_dtype = _blocked.static_fields(event_shape, dtype)

    def __check_init__(self):
        self._check_structure()
        _validate.check_finite("scales", self.scales)

    def _check_settings(self) -> None:
        _check_block_size(self.block_size, _check_bits("bits", self.bits))

    def _check_payload(self, event_shape: tuple[int, ...]) -> None:
        bits = int(self.bits)
        width = self.block_size if bits == 8 else self.block_size // 2
        expected = _blocked.num_blocks(
            _blocked.event_size(event_shape), self.block_size
        )
        code_dtype = jnp.result_type(self.codes)
        if code_dtype != _CODE_DTYPE[bits]:
            raise TypeError(
                f"`codes` must have dtype {_CODE_DTYPE[bits]} for bits={bits}, got "
                f"{code_dtype}."
            )
        shape = self.codes.shape
        _blocked.check_shape(
            "codes",
            shape,
            (*shape[:-2], expected, width),
            f"num_blocks=ceil({_blocked.event_size(event_shape)}/{self.block_size}) "
            f"blocks of {width} {'bytes' if bits == 4 else 'codes'}",
        )

    @property
    def qmax(self) -> int:
        """The largest code magnitude: 127 for 8 bits, 7 for 4 bits."""
        return _QMAX[self.bits]

    def integer_codes(self) -> Int[Array, "*batch blocks block_size"]:
        """The codes as int32, one per element (4-bit codes unpacked)."""
        return _integer_codes(self.codes, self.bits)

    def materialise(self) -> Array:
        return _decode(
            self.codes, self.scales, self.event_shape, self.bits, self.value_dtype
        )

    def chunk_compressor(self) -> ChunkCompressor:
        # Chunks of whole blocks quantise exactly as those blocks of the whole array.
        compress = functools.partial(
            quantize, bits=self.bits, block_size=self.block_size
        )
        return ChunkCompressor(compress, self.block_size)

    def _scaled(self, scalar: Array, dtype: Any) -> "Quantized":
        return self._replace(scales=self.scales * scalar, value_dtype=dtype)


def _pack_nibbles(codes: Int[Array, "*b n"]) -> UInt8[Array, "*b n//2"]:
    """int8 codes in `[-8, 7]`, two per byte: element `2i` in the low nibble."""
    nibbles = lax.bitcast_convert_type(codes, jnp.uint8) & 0xF
    pairs = nibbles.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack_nibbles(packed: UInt8[Array, "*b m"]) -> Int[Array, "*b 2*m"]:
    """The int8 codes of `_pack_nibbles`' bytes, in order."""
    signed = lax.bitcast_convert_type(packed, jnp.int8)
    # Arithmetic shifts sign-extend each 4-bit two's complement nibble.
    low = (signed << 4) >> 4
    high = signed >> 4
    both = jnp.stack([low, high], axis=-1)
    return both.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _signed_codes(codes: Array, bits: int) -> Array:
    """The codes as int8, one per element (4-bit codes unpacked)."""
    return codes if bits == 8 else _unpack_nibbles(codes)


def _integer_codes(codes: Array, bits: int) -> Array:
    return _signed_codes(codes, bits).astype(jnp.int32)


# Jitted so that eager use compiles one kernel per shape instead of one per op.
@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _decode(codes, scales, event_shape, bits, dtype) -> Array:
    values = _signed_codes(codes, bits).astype(jnp.float32) * scales[..., None]
    return _blocked.unblock(values, event_shape, dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _encode(x, bits: int, block_size: int, key) -> tuple[Array, Array]:
    qmax = _QMAX[bits]
    blocks = _blocked.flat_blocks(
        x, _blocked.num_blocks(x.size, block_size), block_size
    )
    scales = jnp.max(jnp.abs(blocks), axis=-1, initial=0.0) / qmax
    scaled = blocks / jnp.where(scales > 0, scales, 1.0)[..., None]
    if key is None:
        rounded = jnp.round(scaled)
    else:
        noise = jax.random.uniform(key, scaled.shape, jnp.float32)
        rounded = jnp.floor(scaled + noise)
    # Straight to int8, the narrowest type that holds the codes: a detour through
    # int32 made the encoder about 1.4x slower.
    codes = jnp.clip(rounded, -qmax, qmax).astype(jnp.int8)
    return (codes if bits == 8 else _pack_nibbles(codes)), scales


def quantize(
    x: Float[ArrayLike, "*shape"],
    bits: int = 8,
    block_size: int = 256,
    *,
    key: PRNGKeyArray | None = None,
) -> Quantized:
    """Block-wise symmetric quantisation of `x`.

    `x` is flattened row-major, zero-padded and split into blocks of `block_size`
    elements (see [`quax_tangents.Quantized`][] for the layout). Each block gets the
    scale `max|block| / qmax` (`qmax` is 127 for 8 bits, 7 for 4 bits; an all-zero
    block gets scale 0 and decodes to zeros) and codes `x / scale`, rounded to the
    nearest integer (ties to even), or, given `key`, rounded stochastically:
    `floor(x / scale + u)` with `u ~ U[0, 1)` drawn independently per element
    (QSGD-style), which is unbiased: `E[dequantised] = x`.

    A `block_size` larger than `x` is reduced to `x.size` (rounded up to even for 4
    bits), so a small array is one block without padding.

    **Error bound.** Per element, with `scale` the scale of its block, the value before
    the final cast to `x.dtype` satisfies `|x - deq| <= scale / 2` for nearest rounding
    and `|x - deq| < scale` for stochastic rounding, up to float32 rounding of
    `x / scale` and `code * scale` (a relative error of a few 1e-7 of `|x|`). The cast
    to a half-precision `dtype` adds its own rounding. A block whose `max|block| / qmax`
    underflows float32 (below about 1e-36) is stored as zeros.

    Works under `jax.jit` and `jax.vmap`; deterministic given `key`.

    **Arguments:**

    - `x`: a finite floating array (finiteness is checked when `x` is concrete).
    - `bits`: 8 (int8 codes) or 4 (two codes per uint8 byte). Static.
    - `block_size`: elements per block, a positive Python int (even for 4 bits).
        Static.
    - `key`: optional PRNG key; selects unbiased stochastic rounding.

    **Returns:**

    A `Quantized` with `event_shape == x.shape` and `dtype == x.dtype`.
    """
    bits = _check_bits("bits", bits)
    block_size = _check_block_size(block_size, bits)
    x = _validate.as_array("x", x)
    _validate.check_floating("x", x)
    _validate.check_finite("x", x)
    if key is not None:
        _validate.check_key("key", key, none_means="for round-to-nearest")
    size = x.size
    block_size = min(block_size, max(size, 1))
    if bits == 4 and block_size % 2:
        block_size += 1
    codes, scales = _encode(x, bits, block_size, key)
    return Quantized(
        codes,
        scales,
        event_shape=x.shape,
        bits=bits,
        block_size=block_size,
        dtype=x.dtype,
    )


# ---------------------------------------------------------------------------------
# Rules of `Quantized` alone; `transpose`, `reshape`, `convert_element_type` and `copy`
# are registered once for every `BlockedArray` in `_blocked`. A product with a
# non-scalar densifies through `densify` (counted, subject to the fallback mode).


@rule(lax.neg_p)
def _neg(x: Quantized) -> Quantized:
    return x._replace(scales=-x.scales)


@rule(lax.mul_p, commutative=True)
def _mul_scalar(x: Quantized, y: ArrayLike, **params: Any) -> Quantized | Array:
    return x._mul_scalar(y, (x, y), params)
