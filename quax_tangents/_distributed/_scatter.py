"""Collectives that give each device one chunk: the two-phase compressed all-reduce and
the compressed reduce-scatter.

Both send every device the compressed chunk it owns with one `all_to_all`, so what a
device receives is about one compressed value whatever the number of devices, and
what it decodes is `n` chunks of `1/n` of the array. Like `_collective.py` they run
inside `jax.shard_map` on concrete compressed values (no quax trace).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from .._core._base import ChunkCompressor, CompressedArray, map_fields
from .._core._devices import AxisName, axes_of, axis_size, gather, vary_leaf
from .._core._validate import values_unchecked


# ---------------------------------------------------------------------------------------
# Moving batched compressed values


def _exchange(sent: CompressedArray, axis_name: AxisName) -> CompressedArray:
    """`all_to_all` of every field of `sent`, a value with a leading axis of one chunk
    per device: element `i` of the result is the chunk that device `i` sent here."""
    axes = axes_of(axis_name)
    return map_fields(
        lambda f: lax.all_to_all(vary_leaf(f, axes), axis_name, 0, 0), sent
    )


def _gather_value(value: CompressedArray, axis_name: AxisName) -> CompressedArray:
    """Every device's `value` stacked on a new leading (batch) axis, by an all-gather
    of its fields."""
    return map_fields(lambda f: gather(f, axis_name), value)


def _decode_sum(received: CompressedArray) -> Float[Array, "..."]:
    """The sum over the leading axis of a batched compressed value, in float32."""
    decoded = received.materialise().astype(jnp.float32)
    # As a product with ones: XLA's CPU compiler fuses a sum over the leading axis
    # into the decoding (bit unpacking, for one) and runs it many times slower.
    ones = jnp.ones(decoded.shape[0], jnp.float32)
    return jnp.tensordot(ones, decoded, axes=1)


def _compress_chunks(
    compress: Callable[[Array], CompressedArray], chunks: Array
) -> CompressedArray:
    # Chunks of values the program computed: a NaN flows on (see `_validate`).
    with values_unchecked():
        out = jax.vmap(compress)(chunks)
    if not isinstance(out, CompressedArray):
        raise TypeError(
            "`compressor` must return a compressed value (Quantized, SignNorm, Sparse "
            f"or LowRank), got {type(out).__name__}."
        )
    return out


# ---------------------------------------------------------------------------------------
# Flat chunks


def chunk_elems(size: int, devices: int, multiple: int) -> int:
    """Elements per chunk when `size` elements are split into `devices` equal chunks
    (the last ones padded with zeros): a multiple of `multiple` where each device gets
    at least that many, so that chunks align with blocks without padding small arrays
    to `devices` whole blocks."""
    per_device = max(-(-size // devices), 1)
    if per_device < multiple:
        return per_device
    return -(-per_device // multiple) * multiple


def _flat_chunks(x: Array, devices: int, chunk: int) -> Array:
    flat = jnp.reshape(x, (-1,))
    return jnp.pad(flat, (0, devices * chunk - flat.shape[0])).reshape(devices, chunk)


def _unchunk(chunks: Array, like: Array) -> Array:
    return chunks.reshape(-1)[: like.size].reshape(like.shape).astype(like.dtype)


def _mask_padding(shard: Array, axis_name: AxisName, size: int) -> Array:
    """Zeros where this device's chunk runs past the array's `size` elements."""
    start = lax.axis_index(axis_name) * shard.shape[0]
    position = start + jnp.arange(shard.shape[0])
    return jnp.where(position < size, shard, 0.0)


# ---------------------------------------------------------------------------------------
# Two-phase all-reduce


class TwoPhaseSum(NamedTuple):
    """What [`two_phase_sum`][] computes on one device.

    - `total`: the (approximate) sum or mean over devices, of the input's shape and
        dtype, identical on every device.
    - `sent`: this device's input as the other devices decoded it (the chunks it sent,
        decoded and joined): `input - sent` is its compression error.
    - `server_error`: the new server-side error of this device's chunk (float32,
        `(chunk,)`), or `None` when none was given.
    """

    total: Array
    sent: Array
    server_error: Array | None


def two_phase_sum(
    x: Array,
    compressor: ChunkCompressor,
    axis_name: AxisName,
    *,
    mean: bool = False,
    server_error: Array | None = None,
) -> TwoPhaseSum:
    """The two-phase compressed all-reduce of the dense arrays `x` over `axis_name`.

    1. Each device flattens `x` into `n` chunks (one per device, zero-padded) and
       compresses each; an `all_to_all` gives device `j` every device's chunk `j`.
    2. Device `j` decodes and sums them (its chunk of the sum, in float32), adds its
       `server_error`, compresses that and keeps what compression dropped as the new
       server error; an all-gather of the compressed chunks gives every device the
       whole sum.

    **Arguments:**

    - `x`: this device's dense array.
    - `compressor`: how to compress one chunk.
    - `axis_name`: the mesh axis (or tuple of axes).
    - `mean`: divide the sum by the number of devices.
    - `server_error`: float32 `(chunk,)`, the server-side error carried from the last
        call (error feedback), or `None` for none.
    """
    devices = axis_size(axis_name)
    chunk = chunk_elems(x.size, devices, compressor.multiple)
    chunks = _flat_chunks(x, devices, chunk)
    sent = _compress_chunks(compressor.compress, chunks)
    shard = _decode_sum(_exchange(sent, axis_name))
    if mean:
        shard = shard / devices
    shard = _mask_padding(shard, axis_name, x.size)
    if server_error is not None:
        shard = shard + server_error
    with values_unchecked():
        reply = compressor.compress(shard.astype(x.dtype))
    new_error = None
    if server_error is not None:
        dropped = shard - reply.materialise().astype(jnp.float32)
        new_error = _mask_padding(dropped, axis_name, x.size)
    gathered = _gather_value(reply, axis_name).materialise()
    # Decoded apart from its use (see `_decode_sum`).
    sent_decoded = lax.optimization_barrier(sent.materialise())
    return TwoPhaseSum(_unchunk(gathered, x), _unchunk(sent_decoded, x), new_error)


class TwoPhase(eqx.Module):
    """The two-phase compressed all-reduce (as in DeepSpeed's 1-bit Adam) for
    `Quantized`, `SignNorm` and `Sparse` values.

    Each device decodes its value once, splits it into `n` flat chunks (one per device,
    aligned with the type's blocks) and compresses each with the value's own settings
    (`CompressedArray.chunk_compressor`); an `all_to_all` sends chunk `j` to device
    `j`, which decodes and sums the `n` chunks it received, compresses the sum, and an
    all-gather of those compressed chunks completes the sum on every device.

    Per device that receives about `2 (n - 1) / n` compressed values per call, where
    `GatherSum` receives `n - 1` of them, and decodes `2 n` chunks of `1/n` of the
    array instead of `n` whole values. The price is a second compression (of each
    chunk of the sum): the result is the compressed sum, not the exact sum. For
    `Quantized`, each element is off by at most half its block's scale of the sum
    (`max|block| / 254` for 8 bits), plus the error of compressing chunks of the
    decoded input (none for `Quantized` and blocked `SignNorm` holding at least `n`
    blocks, whose chunks then align with their blocks).

    The result is a dense array of the value's dtype. A type without a chunk
    compressor (`LowRank`) and batched values are summed by their `all_reduce`
    (`GatherSum`). For error feedback on the second compression, use
    `quax_tangents.optax.compress_updates(..., method=TwoPhase())`, which keeps the
    server-side error as state.
    """

    def reduce(self, x: CompressedArray, axis_name: AxisName, mean: bool) -> Any:
        codec = x.chunk_compressor() if x.batch_ndim == 0 else None
        if codec is None:
            return x.all_reduce(axis_name, mean=mean)
        dense = x.materialise()
        return two_phase_sum(dense, codec, axis_name, mean=mean).total


# ---------------------------------------------------------------------------------------
# Reduce-scatter


def _check_scatter(x: Array, devices: int, dimension: int) -> int:
    if isinstance(dimension, bool) or not isinstance(dimension, int):
        raise TypeError(f"`scatter_dimension` must be an int, got {dimension!r}.")
    if not -x.ndim <= dimension < x.ndim:
        raise ValueError(
            f"`scatter_dimension={dimension}` is out of range for an array of shape "
            f"{x.shape}."
        )
    dimension %= x.ndim
    if x.shape[dimension] % devices:
        raise ValueError(
            f"`x` has {x.shape[dimension]} elements along `scatter_dimension="
            f"{dimension}`, not a multiple of the {devices} devices; pad it or scatter "
            "along another dimension."
        )
    return dimension


def scatter_chunks(x: Array, devices: int, dimension: int) -> Array:
    """`x` split along `dimension` into `devices` chunks, stacked on a new axis 0."""
    shape = x.shape
    split = (*shape[:dimension], devices, shape[dimension] // devices)
    return jnp.moveaxis(x.reshape(*split, *shape[dimension + 1 :]), dimension, 0)


def unscatter_chunks(chunks: Array, dimension: int) -> Array:
    """The inverse of `scatter_chunks`."""
    moved = jnp.moveaxis(chunks, 0, dimension)
    shape = list(chunks.shape[1:])
    shape[dimension] *= chunks.shape[0]
    return moved.reshape(shape)


class ReduceScatter(NamedTuple):
    """`shard`: this device's chunk of the sum; `sent`: this device's input as the
    others decoded it (its compression error is `input - sent`)."""

    shard: Array
    sent: Array


def compressed_reduce_scatter(
    x: Array,
    compressor: Callable[[Array], CompressedArray],
    axis_name: AxisName,
    *,
    scatter_dimension: int = 0,
    mean: bool = False,
) -> ReduceScatter:
    """[`quax_tangents.reduce_scatter`][] that also returns what this device sent,
    decoded (for error feedback)."""
    devices = axis_size(axis_name)
    dimension = _check_scatter(x, devices, scatter_dimension)
    sent = _compress_chunks(compressor, scatter_chunks(x, devices, dimension))
    shard = _decode_sum(_exchange(sent, axis_name))
    if mean:
        shard = shard / devices
    decoded = unscatter_chunks(sent.materialise(), dimension)
    return ReduceScatter(shard.astype(x.dtype), decoded.astype(x.dtype))


def reduce_scatter(
    x: Float[Array, "..."],
    compressor: Callable[[Array], CompressedArray] | None,
    axis_name: AxisName,
    *,
    scatter_dimension: int = 0,
    mean: bool = False,
) -> Float[Array, "..."]:
    """This device's shard of the sum over devices of `x`, each device's `x`
    compressed chunk by chunk: ZeRO / FSDP-style gradient reduction that moves only
    compressed fields.

    Call it inside `jax.shard_map` with each device's own dense gradient. `x` is split
    along `scatter_dimension` into `n` equal chunks (one per device); each chunk is
    compressed with `compressor` (`vmap`ped over the chunks); one `all_to_all` of the
    compressed fields gives device `j` every device's chunk `j`, which it decodes and
    sums in float32. Per device that receives `(n - 1) / n` of one compressed gradient,
    where `lax.psum_scatter` receives `(n - 1) / n` of the dense one. The result is the
    exact sum of the compressed chunks; add error feedback around it (as
    `quax_tangents.optax.compress_updates(..., sharded=True)` does) for a biased compressor.

    **Arguments:**

    - `x`: this device's dense array; `x.shape[scatter_dimension]` must be a multiple
        of the number of devices.
    - `compressor`: a function from a chunk (the shape of the result) to a compressed
        value, e.g. `functools.partial(qt.quantize, bits=8)` or `qt.sign_norm`; `None`
        for the dense `lax.psum_scatter`.
    - `axis_name`: the mesh axis (or tuple of axes).
    - `scatter_dimension`: the dimension to split.
    - `mean`: divide by the number of devices.

    **Returns:**

    This device's chunk of the sum: `x`'s shape with `scatter_dimension` divided by
    the number of devices, `x`'s dtype.
    """
    if compressor is None:
        devices = axis_size(axis_name)
        dimension = _check_scatter(x, devices, scatter_dimension)
        x = vary_leaf(x, axes_of(axis_name))
        out = lax.psum_scatter(x, axis_name, scatter_dimension=dimension, tiled=True)
        return out / devices if mean else out
    if not callable(compressor):
        raise TypeError(
            f"`compressor` must be callable or None, got {compressor!r}: e.g. "
            "`functools.partial(qt.quantize, bits=8)`."
        )
    return compressed_reduce_scatter(
        x, compressor, axis_name, scatter_dimension=scatter_dimension, mean=mean
    ).shard
