"""Sums of compressed values across devices, moving only the compressed fields.

Everything here runs inside the body of `jax.shard_map` (or anything else that binds a
named axis), on concrete compressed values whose fields are traced arrays: no quax
trace is involved, so `check_vma=True` types every field like any other array.

Why not `jax.lax.psum`: handed a compressed value, `lax.psum` flattens it and sums its
fields, which is not the sum of the arrays it represents (the sum of the left factors
times the sum of the right factors is not the sum of the products; summed indices
point elsewhere; summed int8 codes wrap). Every compressed value's guard leaf (see
`_guard.py`) makes it raise instead, with a message that names the fix; `all_reduce`
is the path to use.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Float, PyTree

from .._core._base import CompressedArray
from .._core._devices import (
    AxisName,
    axis_size,
    dense_all_reduce,
    gather,
)
from .._core._unchecked import unchecked
from .._types.lowrank import LowRank
from .._types.signnorm import SignNorm
from ._scatter import TwoPhase
from ._schedule import Cheapest


# ---------------------------------------------------------------------------------------
# Methods


class GatherSum(eqx.Module):
    """The exact sum, by each type's own `CompressedArray.all_reduce`: for the
    library's types an all-gather of every compressed field.

    Each device sends its own fields once, so the bytes sent per device are the
    compressed bytes, whatever the number of devices. Results:

    - `LowRank`: a `LowRank` whose factors hold every device's factors (rank
        `devices * r`); or, inside `shard_map(..., check_vma=True)` when JAX types
        one factor as the same on every device (a projector passed in replicated),
        that factor and the `psum` of the other (rank `r`, exact).
    - `Sparse`: a `Sparse` holding every device's entries (`devices * k`).
    - `Quantized`, `SignNorm`: a dense array, every device's value decoded and summed
        in float32, then cast to the value's dtype.
    - Any other `CompressedArray` subclass: its own `all_reduce`; by default the
        materialised value (counted as a densification) summed with `lax.psum`.
    """

    def reduce(self, x: CompressedArray, axis_name: AxisName, mean: bool) -> Any:
        return x.all_reduce(axis_name, mean=mean)


class PowerSum(eqx.Module):
    """A rank-`r` approximation of the sum of `LowRank` values by PowerSGD rounds
    (Vogels et al., 2019), for `r` the rank of the input.

    Each round all-reduces `P = sum_i M_i Q` (`m x r`), orthonormalises it on every
    device alike, and all-reduces `Q = sum_i M_i^T P` (`n x r`): `r * (m + n)` elements
    of the value's dtype per matrix per round instead of `m * n`. Products and the
    orthonormalisation run in (at least) float32; what crosses the wire is cast to the
    value's dtype. The result is the `LowRank` `P Q^T`.
    It is exact when the sum has rank at most `r` and the start `Q` spans its row space;
    otherwise it is the projection of the sum onto the range of `P`.

    **Arguments:**

    - `iters`: rounds (power iterations); each sharpens a decaying spectrum.
    - `seed`: seed of the starting `Q`, a standard normal matrix drawn from a constant
        key, so that it is identical on every device without communication.
    """

    iters: int = eqx.field(default=1, static=True)
    seed: int = eqx.field(default=0, static=True)

    def __check_init__(self) -> None:
        if isinstance(self.iters, bool) or not isinstance(self.iters, int):
            raise TypeError(f"`iters` must be an int, got {self.iters!r}.")
        if self.iters < 1:
            raise ValueError(f"`iters` must be at least 1, got {self.iters}.")

    def reduce(self, x: CompressedArray, axis_name: AxisName, mean: bool) -> LowRank:
        if not isinstance(x, LowRank):
            raise _wrong_type(self, x, LowRank)
        work = jnp.promote_types(x.dtype, jnp.float32)
        left, right = x.left.astype(work), x.right.astype(work)
        *batch, n, r = right.shape
        q = start_q(jax.random.key(self.seed), (*batch, n, r), work)
        p, q = power_rounds(
            lambda q: left @ _matmul_t(right, q),
            lambda p: right @ _matmul_t(left, p),
            q,
            self.iters,
            # Computed in float32, sent in the value's own dtype.
            lambda a: dense_all_reduce(a.astype(x.dtype), axis_name, mean=mean).astype(
                work
            ),
        )
        return unchecked(LowRank, left=p.astype(x.dtype), right=q.astype(x.dtype))


class MajorityVote(eqx.Module):
    """signSGD with majority vote (Bernstein et al., 2018) for `SignNorm` values.

    Every device's sign bits and norms are all-gathered. Each element of the result
    takes the sign held by most devices (a tie counts as `+`, like a zero); the norm
    of each block is the sum of the devices' norms of that block (their mean with
    `mean=True`). The result is a `SignNorm`. It equals the exact sum when the devices
    agree on every sign and have equal magnitudes, and is a biased estimate otherwise.
    """

    def reduce(self, x: CompressedArray, axis_name: AxisName, mean: bool) -> SignNorm:
        if not isinstance(x, SignNorm):
            raise _wrong_type(self, x, SignNorm)
        gathered = x._with_blocks(gather(x.bits, axis_name), gather(x.norms, axis_name))
        votes = jnp.sum(gathered.signs(), axis=0)
        bits = jnp.packbits(votes >= 0, axis=-1, bitorder="little")
        norms = jnp.sum(gathered.norms, axis=0)
        if mean:
            norms = norms / axis_size(axis_name)
        return x._with_blocks(bits, norms)


Method = GatherSum | PowerSum | MajorityVote | TwoPhase | Cheapest


def _wrong_type(method: eqx.Module, x: CompressedArray, cls: type) -> TypeError:
    return TypeError(
        f"`{type(method).__name__}` reduces {cls.__name__} values (and dense "
        f"arrays), not a {type(x).__name__}; use `GatherSum()` for an exact sum."
    )


# ---------------------------------------------------------------------------------------
# PowerSGD rounds, shared with `quax_tangents.optax.powersgd`


def orthonormalise(p: Float[Array, "*batch m r"]) -> Float[Array, "*batch m r"]:
    """Orthonormal columns spanning those of `p`, by Gram-Schmidt done twice.

    A column that is zero after removing the previous ones (a zero gradient, or a
    rank lower than `r`) stays zero instead of becoming NaN, which a plain QR or a
    normalisation without a guard gives for rank 1 and 2. Each column is divided by
    its largest magnitude before its norm is taken, so tiny columns (whose squares
    underflow) are normalised, not dropped. Running the projections twice keeps the
    columns orthogonal to rounding ("twice is enough").

    **Arguments:**

    - `p`: floating array `(..., m, r)`; `r` is small (a Python loop over columns).

    **Returns:**

    An array of `p`'s shape and dtype, computed in at least float32.
    """
    dtype = p.dtype
    work = p.astype(jnp.promote_types(dtype, jnp.float32))
    columns: list[Array] = []
    for j in range(work.shape[-1]):
        v = work[..., j]
        for _ in range(2):
            for u in columns:
                v = v - jnp.sum(u * v, axis=-1, keepdims=True) * u
        largest = jnp.max(jnp.abs(v), axis=-1, keepdims=True)
        nonzero = largest > 0
        unit = v / jnp.where(nonzero, largest, 1.0)
        # At least 1 where the column is nonzero: its largest entry is now 1.
        norm = jnp.linalg.norm(unit, axis=-1, keepdims=True)
        columns.append(jnp.where(nonzero, unit / jnp.where(nonzero, norm, 1.0), 0.0))
    return jnp.stack(columns, axis=-1).astype(dtype)


def power_rounds(
    apply: Callable[[Array], Array],
    apply_transposed: Callable[[Array], Array],
    q: Array,
    iters: int,
    reduce: Callable[[Array], Array],
) -> tuple[Array, Array]:
    """`iters` PowerSGD rounds on the matrix `M = reduce(M_i)` that each device holds
    a term `M_i` of, without forming it: returns `(P, Q)` with orthonormal `P` and
    `P @ Q^T` the approximation of `M`.

    **Arguments:**

    - `apply`: `q -> M_i @ q`, this device's term applied to an `(n, r)` matrix.
    - `apply_transposed`: `p -> M_i^T @ p`.
    - `q`: the start `(n, r)`, identical on every device.
    - `iters`: the number of rounds.
    - `reduce`: the all-reduce (sum or mean over devices; the identity on one device).
    """
    p = orthonormalise(reduce(apply(q)))
    q = reduce(apply_transposed(p))
    for _ in range(iters - 1):
        p = orthonormalise(reduce(apply(q)))
        q = reduce(apply_transposed(p))
    return p, q


def start_q(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> Array:
    """A standard normal start for PowerSGD, from a key that every device shares."""
    return jax.random.normal(key, shape, dtype)


def _matmul_t(a: Array, b: Array) -> Array:
    """`swapaxes(a, -1, -2) @ b` as one contraction."""
    return jnp.einsum("...mn,...mk->...nk", a, b)


# ---------------------------------------------------------------------------------------
# all_reduce


def _reduce_leaf(x: Any, axis_name: AxisName, method: Method, mean: bool) -> Any:
    if isinstance(x, CompressedArray):
        return method.reduce(x, axis_name, mean)
    return dense_all_reduce(x, axis_name, mean=mean)


def all_reduce(
    tree: PyTree,
    axis_name: AxisName,
    method: Method | None = None,
    *,
    mean: bool = False,
) -> PyTree:
    """The sum (or mean) over devices of every value in `tree`, moving only the
    compressed fields of compressed values.

    Call it inside a `jax.shard_map` body (with `check_vma` on or off) on values that
    each device computed itself, for example its own gradient compressed with
    `quax_tangents.low_rank`. Dense arrays are summed with `lax.psum`. Compressed
    values are summed as `method` says:

    - [`quax_tangents.Cheapest`][] (the default, `None`): per value, whichever of
        `GatherSum`, `TwoPhase` and the dense ring all-reduce of the materialised
        value receives the fewest bytes per device at the axis size in use (ties go
        to `GatherSum`); see `docs/collectives.md` for the crossover.
    - [`quax_tangents.GatherSum`][]: exact, by each type's
        `all_reduce` (all-gathering the fields); LowRank and Sparse results stay
        compressed, Quantized and SignNorm results are dense sums computed in float32.
    - [`quax_tangents.PowerSum`][]: LowRank only; PowerSGD rounds, approximate,
        `r * (m + n)` elements per matrix per round.
    - [`quax_tangents.MajorityVote`][]: SignNorm only; a SignNorm of the majority signs.
    - [`quax_tangents.TwoPhase`][]: Quantized, SignNorm and Sparse; an `all_to_all` of
        compressed chunks, then an all-gather of the compressed chunks of the sum:
        about two compressed values received per device whatever the device count,
        approximate (the sum is compressed once more). Other types use `GatherSum`.

    Values that are replicated (not varying over `axis_name`) are made varying first
    (`pvary`), so each device's copy counts once, as `lax.psum` counts it.

    Do not hand compressed values to `lax.psum` instead: it would sum their fields,
    and raises (see this module's documentation). Inside a quaxified function
    `lax.psum` sees quax tracers; with `check_vma=True` it is this exact sum for a
    `LowRank` (whose type says where its factors vary) and raises for the other types
    (their types do not say they vary), and with `check_vma=False` it densifies,
    counted and subject to `quax_tangents.fallback`. Call `all_reduce` outside the
    quaxified function, on the values it returns.

    **Arguments:**

    - `tree`: a pytree of dense arrays and compressed values.
    - `axis_name`: the mesh axis (or tuple of axes) to reduce over.
    - `method`: how to reduce compressed values; `None` means `Cheapest()`.
    - `mean`: divide by the number of devices.

    **Returns:**

    A pytree of the same structure, identical (invariant) on every device.
    """
    method = Cheapest() if method is None else method
    if not callable(getattr(method, "reduce", None)):
        raise TypeError(
            "`method` must be `Cheapest()`, `GatherSum()`, `PowerSum(...)`, "
            "`MajorityVote()` or `TwoPhase()` (or "
            f"an object with a `reduce(x, axis_name, mean)` method), got {method!r}."
        )
    return jtu.tree_map(
        lambda x: _reduce_leaf(x, axis_name, method, mean),
        tree,
        is_leaf=lambda x: isinstance(x, CompressedArray),
    )
