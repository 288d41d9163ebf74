"""Which schedule sums a compressed value over devices with the fewest bytes received.

One device receives, summing a value over `n` devices (`_hlo.received_bytes` reads
the same from a compiled program):

- `"gather"`, an all-gather of every compressed field (`GatherSum`):
    `(n - 1)` compressed values;
- `"two_phase"`, an all-to-all of compressed chunks and an all-gather of the
    compressed chunks of the sum (`TwoPhase`): `2 (n - 1)` compressed chunks of
    `1/n` of the value;
- `"dense"`, the ring all-reduce of the materialised value (`lax.psum`):
    `2 (n - 1) / n` dense values.

The bytes come from shapes alone (`jax.eval_shape` of the chunk compressor), so the
choice is made when the program is traced, at the axis size in use.
"""

import math
from typing import Any, Literal, cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._core._base import CompressedArray
from .._core._devices import AxisName, axis_size, dense_all_reduce, shared_factor
from .._core._fallback import record_densification
from .._core._guard import is_guard
from .._types.lowrank import LowRank
from .._types.rows import SparseRows
from .._types.sparse import Sparse
from ._scatter import TwoPhase, chunk_elems


Schedule = Literal["gather", "two_phase", "dense"]
# On equal bytes, the exact sum that stays compressed wins, then the one that moves
# compressed bytes.
_PREFERENCE: tuple[Schedule, ...] = ("gather", "two_phase", "dense")


def _struct_nbytes(tree: Any) -> int:
    return sum(
        math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        for leaf in jax.tree_util.tree_leaves(tree)
        if not is_guard(leaf)  # zero bytes, and no numpy dtype
    )


def schedule_bytes(x: CompressedArray, devices: int) -> dict[str, float]:
    """The bytes one device receives to sum `x` over `devices` devices, per schedule.

    **Arguments:**

    - `x`: a compressed value (or its shape, from `jax.eval_shape`).
    - `devices`: the number of devices `n` summed over.

    **Returns:**

    A dict from `"gather"`, `"dense"` and, for types with a chunk compressor and no
    batch dims, `"two_phase"` to the bytes received per device (all `0.0` on one
    device). See `docs/collectives.md` for the formulas.
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"`devices` must be a positive int, got {devices!r}.")
    n = devices
    out = {
        "gather": float((n - 1) * x.nbytes),
        "dense": 2 * (n - 1) / n * x.dense_nbytes,
    }
    codec = x.chunk_compressor() if x.batch_ndim == 0 else None
    if codec is not None:
        size = math.prod(x.shape)
        chunk = chunk_elems(size, n, codec.multiple)
        struct = jax.ShapeDtypeStruct((chunk,), x.dtype)
        one_chunk = _struct_nbytes(jax.eval_shape(codec.compress, struct))
        out["two_phase"] = float(2 * (n - 1) * one_chunk)
    return out


def _gathers(x: CompressedArray) -> bool:
    """Whether the type's `all_reduce` is its own (the library's all-gather the
    fields), not the protocol's default, which materialises and runs `lax.psum`."""
    return type(x).all_reduce is not CompressedArray.all_reduce


def cheapest_schedule(
    x: CompressedArray, devices: int, allowed: tuple[Schedule, ...] = _PREFERENCE
) -> Schedule:
    """The schedule among `allowed` that receives the fewest bytes (ties: the first
    of gather, two-phase, dense). A type without its own `all_reduce` sums densely
    by that default, so "gather" is no candidate for it."""
    costs = schedule_bytes(x, devices)
    options = [s for s in _PREFERENCE if s in allowed and s in costs]
    if not _gathers(x):
        options = [s for s in options if s != "gather"]
    return cast(Schedule, min(options, key=lambda s: (costs[s], options.index(s))))


def _keeps_compressed(x: CompressedArray) -> bool:
    """Whether the gathered sum of `x` is itself compressed (so that a dense result
    is a densification)."""
    return isinstance(x, (LowRank, Sparse, SparseRows))


def dense_sum(x: CompressedArray, axis_name: AxisName, mean: bool) -> Array:
    """The ring all-reduce of the materialised `x`: the exact sum, as dense bytes."""
    return dense_all_reduce(x.materialise(), axis_name, mean=mean)


def _sums_one_factor(x: CompressedArray, axis_name: AxisName) -> bool:
    """Whether `x` is a `LowRank` with a factor that is the same on every device (a
    projector passed in replicated), whose own `all_reduce` then sums the other
    factor alone (a dense all-reduce of it), and that factor is no larger than the
    matrix: fewer bytes than the dense all-reduce, without the gather's rank growth."""
    if not isinstance(x, LowRank):
        return False
    side = shared_factor(x, axis_name)
    if side is None:
        return False
    summed = x.right if side == "left" else x.left
    return summed.size <= math.prod(x.shape)


class Cheapest(eqx.Module):
    """The sum by whichever schedule receives the fewest bytes per device at the
    axis size in use: the default of [`quax_tangents.all_reduce`][].

    For each compressed value, from its shapes and the number of devices `n` (known
    when the program is traced), the bytes one device would receive are compared
    (`quax_tangents.hlo.schedule_bytes`):

    - `GatherSum` (`(n - 1)` compressed values): exact, and `LowRank` and `Sparse`
        sums stay compressed. Chosen on ties, so on 2 devices and for `LowRank`
        (which has no chunks) while `n` is small.
    - `TwoPhase` (`2 (n - 1)` compressed chunks of `1/n`): `Quantized`, `SignNorm`
        and `Sparse` from 3 devices on; the sum is compressed once more
        (approximate), and dense.
    - the dense ring all-reduce of the materialised value (`2 (n - 1) / n` dense
        values), when neither compressed schedule receives fewer bytes (a `top_k`
        keeping over half the entries, a high-rank `LowRank` on many devices): the
        exact sum, dense. For `LowRank` and `Sparse`, whose gathered sum would stay
        compressed, that is counted as a densification (`quax_tangents.fallback`);
        `Quantized` and `SignNorm` sums are dense whatever the schedule.

    A `LowRank` with a factor the same on every device (a projected gradient with a
    replicated projector, under `check_vma`) is summed by its own `all_reduce`,
    which all-reduces only the other factor, whenever that factor is no larger than
    the matrix: exact, rank kept, fewer bytes than any schedule above.
    """

    def reduce(self, x: CompressedArray, axis_name: AxisName, mean: bool) -> Any:
        if _sums_one_factor(x, axis_name):
            return x.all_reduce(axis_name, mean=mean)
        schedule = cheapest_schedule(x, axis_size(axis_name))
        if schedule == "two_phase":
            return TwoPhase().reduce(x, axis_name, mean)
        if schedule == "dense" and not _gathers(x):
            return x.all_reduce(axis_name, mean=mean)  # counted by the default
        if schedule == "dense":
            if _keeps_compressed(x):
                record_densification(
                    "all_reduce",
                    (type(x).__name__,),
                    "the dense all-reduce receives fewer bytes than gathering it; "
                    "pass `GatherSum()` to keep the sum compressed",
                )
            return dense_sum(x, axis_name, mean)
        return x.all_reduce(axis_name, mean=mean)
