"""Optimiser state stored as 8-bit codes: `quantized_state` wraps any optax
transformation so that its large floating state leaves (Adam's moments) take about a
byte per element.

The code is logarithmic, not linear. Adam's second moment spans many orders of
magnitude within one block (the squares of gradients that differ by 1e4 differ by
1e8): a linear 8-bit code with the block's largest entry at 127 or 255 rounds every
entry below about 1/500 of it to zero, and the update `m / (sqrt(v) + eps)` of such
an entry becomes `m / eps`, a huge step. A logarithmic code spends its levels evenly
over octaves, so every entry keeps about the same relative precision down to a floor
far below the block's largest. Each code is an 8-bit float relative to the block's
largest magnitude: the exponent and the top three mantissa bits of the magnitude
divided by it, eight levels per octave, evenly spaced within each octave:

- a block whose entries are all non-negative (a second moment) gets 255 levels over
  31.75 octaves, `a * 2**e * (1 + f / 8)` for code `k = 255 + 8 e + f` (`e <= 0`,
  `0 <= f < 8`), and zero for `k = 0`: entries down to 2.9e-10 of the largest are
  kept, each within 1/17 (5.9%) of its value when rounded to nearest;
- a block with negative entries (a first moment) gets a sign and 127 levels over
  15.75 octaves (down to 1.9e-5 of the largest), at the same relative precision.
  The first moment lives on the square-root scale of the second, so half the
  octaves cover it.

The kind of code is chosen per block and stored in the sign of the block's float32
scale. Blocks run along the last axis of a leaf (as few as hold at most
`block_size` elements each, all of one size, the last one padded), so a leaf sharded
along any other axis keeps its blocks local. A stack of matrices stores its rows
padded to a multiple of 8 (see `_ROW_MULTIPLE`).

Rounding is stochastic by default: up or down to the neighbouring levels with the
probabilities that make the decoded value unbiased. Adam changes its second moment
by 0.1% a step (`b2 = 0.999`), far less than the gap between two levels; rounded to
nearest, such a change would be undone at every step and the moment would freeze.
"""

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PyTree, UInt8

from ._common import check_int
from ._projected import ProjectedState
from ._stacks import refuse_whole_decode, stacked_leaves


# The non-zero levels of each kind of code, eight per octave below the block's
# largest magnitude: 31.75 octaves for non-negative blocks, 15.75 for signed ones.
_UNSIGNED_LEVELS = 255
_SIGNED_LEVELS = 127
_SIGNED_ZERO = 128  # the byte of a signed zero; codes 1..255 are -127..127


class LogQuantized(eqx.Module):
    """One optimiser-state array stored as 8-bit logarithmic codes with a float32
    scale per block (see [`quax_tangents.optax.quantized_state`][]).

    The last axis of the array is split into `num_blocks` blocks of `block`
    elements each (as few as hold at most the `block_size` asked for, all of one
    size, rounded up to a multiple of 128 when wider than 128 and `block_size` is a
    multiple of 128; the last block zero-padded). A block whose scale `s` is
    positive holds non-negative values `s * 2**e * (1 + f / 8)` for the byte
    `k = 255 + 8 e + f >= 1` (`0 <= f < 8`; zero for `k = 0`); one whose scale is
    negative holds signed values `sign(c) |s| 2**e * (1 + f / 8)` for `c = k - 128`,
    `|c| = 127 + 8 e + f` (zero for `c = 0`).

    **Fields:**

    - `codes`: uint8 `(*shape[:-1], num_blocks, block)`; for a stack of
        matrices (3 dims or more) the rows `shape[-2]` are zero-padded to a
        multiple of 8.
    - `scales`: float32 `(*shape[:-1], num_blocks)`, its rows padded as the
        codes'.
    - `value_shape`, `value_dtype`: the shape and dtype of the array (static).
    """

    codes: UInt8[Array, "*lead blocks block"]
    scales: Float[Array, "*lead blocks"]
    value_shape: tuple[int, ...] = eqx.field(static=True)
    value_dtype: Any = eqx.field(static=True)

    @property
    def nbytes(self) -> int:
        """The bytes of the codes and the scales."""
        return int(self.codes.size + 4 * self.scales.size)

    def decode(self) -> Array:
        """The array the codes stand for, in `value_dtype`."""
        return _decode(self.codes, self.scales, self.value_shape, self.value_dtype)


def log_quantize(
    x: Float[Array, "*shape"],
    block_size: int = 2048,
    *,
    noise: Float[Array, "*blocked"] | None = None,
) -> LogQuantized:
    """Encodes `x` as a [`quax_tangents.optax.LogQuantized`][].

    **Arguments:**

    - `x`: a floating array with at least one dimension.
    - `block_size`: the most elements per block along the last axis; the axis is
        split into as few blocks as that allows, all of one size (rounded up to a
        multiple of 128 when wider than 128 and `block_size` is a multiple of 128).
    - `noise`: `None` to round to the nearest level, or uniform
        numbers in `[0, 1)` of the codes' shape (`(*x.shape[:-1], num_blocks,
        block)`, a stack's rows padded to a multiple of 8) for unbiased
        stochastic rounding.

    **Returns:**

    The codes and scales.
    """
    block_size = check_int("block_size", block_size, 2)
    if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"`x` must be a floating array with at least one dimension, got "
            f"{x.dtype} of shape {list(x.shape)}; cast an integer array first "
            "(`x.astype(jnp.float32)`)."
        )
    blocks = _blocks(x, block_size)
    if noise is not None and tuple(jnp.shape(noise)) != blocks.shape:
        raise ValueError(
            f"`noise` has shape {list(jnp.shape(noise))}; for `x` of shape "
            f"{list(x.shape)} and `block_size={block_size}` it must have the codes' "
            f"shape {list(blocks.shape)} (the last axis in {blocks.shape[-2]} "
            f"block(s) of {blocks.shape[-1]}, a stack's rows padded to a multiple "
            "of 8)."
        )
    codes, scales = _encode(blocks, noise)
    return LogQuantized(codes, scales, tuple(x.shape), jnp.dtype(x.dtype))


# ---------------------------------------------------------------------------------------
# The codes


# The rows of a stack's codes are padded to this multiple (a matrix's are not: its
# rows may be the chunks that `layerwise` cuts a leaf into). A TPU lays out an array
# whose two minor dims are not multiples of its tile with a stack dim inside the
# tiles, so that taking one layer's slice is a relayout of the whole stack: for
# `(24, 5461, 512)` moments (GaLore's 1B MLP factors, encoded one layer's slice at
# a time under `layerwise`) the codes `(24, 5461, 2, 256)` (blocks of 256 then)
# get the layers in the tiles by default, and the 1B step compiled for a TPU v5e
# chip copied all six such stacks to another layout and back around its loop over
# the layers (`benchmarks/bench_scale.py --target tpu-v5e`). Rows padded to 5464
# keep the layers outermost. The padding is at most 7 zero rows per matrix.
_ROW_MULTIPLE = 8


def _padded_rows(shape: tuple[int, ...]) -> int | None:
    """The stored row count of a leaf of `shape`, or None when it is not padded."""
    if len(shape) < 3 or shape[-2] % _ROW_MULTIPLE == 0:
        return None
    return -(-shape[-2] // _ROW_MULTIPLE) * _ROW_MULTIPLE


# A TPU's vector lanes: a block wider than this is padded to a multiple of it, so
# that splitting a row into blocks is no relayout. Blocks of 508 (a 32000-wide
# table in blocks of at most 512) made the 1B model's update, compiled alone for a
# TPU v5e chip, take 12.2 s instead of 7.5 s with blocks of 512.
_LANES = 128


def _block_count_and_size(width: int, block_size: int) -> tuple[int, int]:
    """The blocks a last axis of `width` elements is split into: as few as hold at
    most `block_size` elements each, all of one size, so that little is padded (a
    width of 768 in blocks of at most 512 is two blocks of 384, not one of 512 and
    one of 256 padded to 512). A block wider than 128 is rounded up to a multiple of
    128 where `block_size` is one."""
    count = -(-width // block_size)
    block = -(-width // count)
    if block > _LANES and block_size % _LANES == 0:
        block = -(-block // _LANES) * _LANES
    return count, block


def _blocked_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """The shape of the codes of a leaf of `shape`: `(*shape[:-1], num_blocks,
    block)`, the rows of a stack padded to a multiple of 8."""
    lead = list(shape[:-1])
    rows = _padded_rows(shape)
    if rows is not None:
        lead[-1] = rows
    return (*lead, *_block_count_and_size(shape[-1], block_size))


def _blocks(x: Array, block_size: int) -> Array:
    """`x` as float32 `_blocked_shape(x.shape, block_size)`, zero-padded."""
    *lead, count, block = _blocked_shape(tuple(x.shape), block_size)
    pad = [(0, 0)] * x.ndim
    pad[-1] = (0, count * block - x.shape[-1])
    if x.ndim >= 2:
        pad[-2] = (0, lead[-1] - x.shape[-2])
    x = x.astype(jnp.float32)
    if any(after for _, after in pad):
        x = jnp.pad(x, pad)
    return x.reshape(*lead, count, block)


# The code of a magnitude `u` in `(0, 1]` relative to its block's largest is its
# float32 exponent and top three mantissa bits: the bits of `u` shifted right by 20,
# less those of 1.0 (`127 << 3`), plus the kind's top level. Encoding and decoding
# are integer arithmetic on the bits: a logarithm and two powers per element, as an
# earlier form computed the levels, made the 8-bit update the largest part of the
# projected step's compile time on a TPU (the 1B model's update compiled alone for
# a TPU v5e chip: 7.4 s against 6.7 s with the bits).
_MANTISSA_BITS = 3
_DROPPED_BITS = 23 - _MANTISSA_BITS
_ONE = 127 << _MANTISSA_BITS  # the kept bits of 1.0


def _top_level(signed: Array) -> Array:
    """The level of the block's largest magnitude (levels run `1..top`)."""
    return jnp.where(signed, _SIGNED_LEVELS, _UNSIGNED_LEVELS).astype(jnp.int32)


def _magnitude(level: Array, top: Array) -> Array:
    """The magnitude, relative to the block's largest, of `level >= 1`."""
    bits = (level - top + _ONE) << _DROPPED_BITS
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _level(u: Array, top: Array, noise: Array | None) -> Array:
    """The level `1..top` of magnitudes `u` in `[0, 1]` relative to the block's
    largest, or 0 where `u` rounds to zero."""
    bits = jax.lax.bitcast_convert_type(u, jnp.int32)
    smallest = _magnitude(jnp.ones_like(top), top)
    if noise is None:
        bits = bits + (1 << (_DROPPED_BITS - 1))
        lowest = (u >= smallest / 2).astype(jnp.int32)
    else:
        # Within an octave the levels are evenly spaced and so are the bits of the
        # values between them: adding uniform bits below the kept ones rounds up
        # with the probability that keeps the decoded value unbiased, across the
        # octave's top too. Below the smallest level, between it and zero.
        bits = bits + (noise * (1 << _DROPPED_BITS)).astype(jnp.int32)
        lowest = (noise * smallest < u).astype(jnp.int32)
    level = (bits >> _DROPPED_BITS) - _ONE + top
    return jnp.where(level < 1, lowest, jnp.minimum(level, top))


# Jitted so that eager use compiles one kernel per shape instead of one per op. One
# code per block, its kind chosen per block.
@jax.jit
def _encode(blocks: Array, noise: Array | None) -> tuple[Array, Array]:
    magnitudes = jnp.abs(blocks)
    largest = jnp.max(magnitudes, axis=-1)
    signed = jnp.any(blocks < 0, axis=-1)
    # A division, not a product with the reciprocal: the largest entry is exactly 1.
    u = magnitudes / jnp.where(largest > 0, largest, 1.0)[..., None]
    level = _level(u, _top_level(signed)[..., None], noise)
    signed_code = _SIGNED_ZERO + jnp.where(blocks < 0, -level, level)
    codes = jnp.where(signed[..., None], signed_code, level)
    scales = jnp.where(signed, -largest, largest)
    return codes.astype(jnp.uint8), scales


@functools.partial(jax.jit, static_argnums=(2, 3))
def _decode(codes: Array, scales: Array, shape: tuple[int, ...], dtype: Any) -> Array:
    k = codes.astype(jnp.int32)
    signed = (scales < 0)[..., None]
    c = k - _SIGNED_ZERO
    level = jnp.where(signed, jnp.abs(c), k)
    magnitude = jnp.where(level == 0, 0.0, _magnitude(level, _top_level(signed)))
    values = jnp.where(signed & (c < 0), -magnitude, magnitude)
    values = values * jnp.abs(scales)[..., None]
    values = values.reshape(*values.shape[:-2], -1)[..., : shape[-1]]
    if _padded_rows(shape) is not None:
        values = values[..., : shape[-2], :]
    return values.astype(dtype)


def _is_unpacked(x: Any) -> bool:
    """A `LogQuantized` stored field by field: a mapping of `codes` and `scales`."""
    return isinstance(x, Mapping) and set(x.keys()) == {"codes", "scales"}


def _refuse_unpacked_codes(inner: Any) -> None:
    """Flax's `nnx.Optimizer` keeps the state in its variables and, after an update,
    writes a pytree held in one back as a mapping of its fields: the codes lose
    their shape and dtype, and `tx.update` would read the mapping as a moment."""
    leaves = jtu.tree_leaves_with_path(
        inner, is_leaf=lambda x: isinstance(x, LogQuantized) or _is_unpacked(x)
    )
    for path, leaf in leaves:
        if _is_unpacked(leaf):
            raise TypeError(
                "`quax_tangents.optax.quantized_state`: the 8-bit state at "
                f"`{jtu.keystr(path)}` came back as a mapping of its fields (`codes`, "
                "`scales`), not a `LogQuantized`, as Flax's `nnx.Optimizer` stores a "
                "pytree held in its variables after an update. Keep the state as "
                "`init` returned it: the functional step (`opt.update`, "
                "`opt.apply`, with the state outside the model), or with "
                "`nnx.Optimizer` a float state (`quax_tangents.optax.galore(..., "
                "state_bits=None)`, or `projected` without `quantized_state`)."
            )


# Jitted, as `_encode` and `_decode` are, for the tracing: a jitted function called
# again with the same shapes reuses its first trace, and an update traces the noise
# for every encoded leaf (the moments of many leaves share a shape), `layerwise`
# once more in the `init` it evaluates to learn one slice's state. The compiled
# program is the same.
@functools.partial(jax.jit, static_argnums=0)
def _block_noise(shape: tuple[int, ...], seed: Array) -> Array:
    """Uniform numbers in `[0, 1)` of the blocked shape, from an integer hash of each
    element's position and `seed`: elementwise arithmetic that XLA fuses into the
    encoding, where `jax.random` would write a state-sized array of bits first."""
    # The row-major position of each element (modulo 2**32), as one iota: the
    # same numbers as a sum of one iota per axis times its stride, in fewer ops.
    index = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
    h = index ^ (seed.astype(jnp.uint32) * np.uint32(0x9E3779B9))
    h = h ^ (h >> 16)
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * np.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * (1.0 / 2**24)


# ---------------------------------------------------------------------------------------
# The transformation


class QuantizedState(NamedTuple):
    """The state of [`quax_tangents.optax.quantized_state`][].

    **Fields:**

    - `count`: updates taken (int32), which seeds the stochastic rounding.
    - `inner`: the wrapped transformation's state, with each leaf that is stored as
        codes replaced by a [`quax_tangents.optax.LogQuantized`][].
    """

    count: Int[Array, ""]  # pyright: ignore[reportIncompatibleMethodOverride]
    inner: Any


def _is_stored_as_codes(leaf: Any, block_size: int) -> bool:
    return (
        isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
        and jnp.issubdtype(leaf.dtype, jnp.floating)
        and leaf.ndim >= 1
        and leaf.size >= block_size
    )


def _map_state(fn: Any, state: Any) -> Any:
    """Maps `fn` over the leaves of `state`, except the projectors of a
    `ProjectedState` (an orthonormal basis, not a statistic: it stays as it is)."""

    def node(x: Any) -> Any:
        if isinstance(x, ProjectedState):
            return x._replace(base_state=_map_state(fn, x.base_state))
        return fn(x)

    return jtu.tree_map(
        node,
        state,
        is_leaf=lambda x: isinstance(x, (ProjectedState, LogQuantized)),
    )


def _stacks_within(state: Any) -> tuple:
    """The stacked leaves of the `projected` states inside `state`."""
    nodes = jtu.tree_leaves(state, is_leaf=lambda x: isinstance(x, ProjectedState))
    return tuple(
        stack
        for node in nodes
        if isinstance(node, ProjectedState)
        for stack in stacked_leaves(node.plan)
    )


def quantized_state(
    tx: optax.GradientTransformation,
    *,
    bits: int = 8,
    block_size: int = 2048,
    stochastic: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Stores the state of `tx` as 8-bit logarithmic codes: decoded for each update,
    encoded again after it.

    Each floating state leaf with at least `block_size` elements becomes a
    [`quax_tangents.optax.LogQuantized`][]: about one byte per element plus four per
    block, 0.25x of float32 and 0.50x of bfloat16. Smaller leaves,
    integer leaves (step counts) and the projectors of
    [`quax_tangents.optax.projected`][] are kept as they are.

    **Why logarithmic.** Adam's second moment spans many orders of magnitude, and a
    linear 8-bit code (the block's largest entry at 255) rounds every entry below
    about 1/500 of it to zero; the update `m / (sqrt(v) + eps)` of that entry is then
    `m / eps`, a huge step. Here each code is an 8-bit float relative to the block's
    largest magnitude (its exponent and three mantissa bits: eight levels per
    octave). A block of non-negative values gets 255 levels over 31.75 octaves below
    its largest (entries down to 2.9e-10 of it are kept), and a block with negative
    values (a first moment) a sign and 127 levels over 15.75 octaves (down to 1.9e-5;
    the first moment lives on the square-root scale of the second). Either way each
    entry is within 1/17 (5.9%) of its value when rounded to nearest, at every
    magnitude. The kind of code is chosen per block, from whether the block has
    negative entries, and stored in the sign of the block's scale. bitsandbytes'
    dynamic map makes the same trade (precision relative to the value, not to the
    block's largest) with a different table.

    **Rounding.** With `stochastic=True` (the default) each value is rounded up or
    down to its neighbouring levels with the probabilities that make it unbiased,
    from a hash of its position and the step count (no key needed). Adam moves its
    second moment by 0.1% a step, a fraction of the gap between two levels; rounded
    to nearest, every such change is undone and the moment freezes.

    `quantized_state` composes with [`quax_tangents.optax.projected`][] both ways:
    `projected(quantized_state(adam), rank=...)` and
    `quantized_state(projected(adam, rank=...))` store the same leaves (the small
    factors' moments) and keep the projectors exact; `quax_tangents.optax.projectors`
    reads either state. (The lazy updates of row-sparse gradients need the base's
    state in the parameters' structure, so use the first form without them, or the
    second.)

    **One layer at a time.** Each update decodes the state it updates to float32. On
    a leaf that `projected` projects as a stack of matrices (a scanned model's
    blocks, `(layers, m, n)`) that is every layer's state at once (on XLA:CPU most
    of what the codes save); so such a stack is refused with a `ValueError` unless
    the update runs inside [`quax_tangents.optax.layerwise`][], which decodes one
    layer's slice at a time. [`quax_tangents.optax.galore`][] composes the pieces
    that way.

    **Arguments:**

    - `tx`: any optax transformation.
    - `bits`: bits per stored element; only 8.
    - `block_size`: the most elements per block, along each leaf's last axis
        (split into as few blocks of one size as that allows). The default holds a
        whole row of a rank-512 or 1024 factor's moment, or of a 2048-wide
        embedding's, in one block: with blocks of 256 the 1B step compiled for a
        TPU v5e chip held 0.49 GiB more (`benchmarks/bench_scale.py --target
        tpu-v5e --accumulation 4`; the TPU laid the codes' two minor dims,
        `(2, 256)`, out away from the rows) and its update, compiled alone, took
        6.7 s instead of 4.5 s. Only the codes' floor is relative to the block's
        largest entry; the precision of each entry is not.
    - `stochastic`: unbiased stochastic rounding (`True`) or rounding to the nearest
        level.

    **Returns:**

    A transformation with `tx`'s updates whose state is a
    [`quax_tangents.optax.QuantizedState`][].
    """
    if bits != 8 or isinstance(bits, bool):
        raise ValueError(
            f"`bits` must be 8, got {bits!r}: with 4 bits a logarithmic code has 15 "
            "levels, too few to keep Adam's moments."
        )
    block_size = check_int("block_size", block_size, 2)
    tx = optax.with_extra_args_support(tx)

    def encode(state: Any, count: Array) -> Any:
        position = iter(range(1 << 30))

        def leaf(x: Any) -> Any:
            if not _is_stored_as_codes(x, block_size):
                return x
            noise = None
            if stochastic:
                seed = count * np.int32(7919) + np.int32(next(position))
                noise = _block_noise(_blocked_shape(x.shape, block_size), seed)
            return log_quantize(x, block_size, noise=noise)

        return _map_state(leaf, state)

    def decode(state: Any) -> Any:
        return _map_state(
            lambda x: x.decode() if isinstance(x, LogQuantized) else x, state
        )

    def init(params: PyTree) -> QuantizedState:
        # Under `jax.jit`, the wrapped state (zeros, mostly) and the step count are
        # constants, and XLA would fold their encoding into constants element by
        # element: minutes for a 1B model's moments. Each leaf times a 1 that XLA
        # cannot see through is a value instead, still made inside the encoding's
        # kernels (a barrier around the leaves themselves would write them out whole
        # first: 12 GiB of temporaries for a 1B model's Adam moments).
        count, one = jax.lax.optimization_barrier(
            (jnp.zeros([], jnp.int32), jnp.ones([], jnp.float32))
        )

        def opaque(x: Any) -> Any:
            if not _is_stored_as_codes(x, block_size):
                return x
            return x * one.astype(x.dtype)

        return QuantizedState(count, encode(_map_state(opaque, tx.init(params)), count))

    def update(
        updates: PyTree, state: Any, params: PyTree = None, **extra: Any
    ) -> tuple[PyTree, QuantizedState]:
        _refuse_unpacked_codes(state.inner)
        refuse_whole_decode(_stacks_within(state.inner))
        updates, inner = tx.update(updates, decode(state.inner), params, **extra)
        count = jnp.asarray(optax.safe_int32_increment(state.count))
        return updates, QuantizedState(count, encode(inner, count))

    return optax.GradientTransformationExtraArgs(init, update)
