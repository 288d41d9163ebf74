"""The range finder's steps between the trips of a refresh
(`quax_tangents.optax.accumulate_gradients`), matrix by matrix: the basis of a
sketch, the test matrices of a power iteration, the new projector; and the loop that
applies one of them to every matrix of the projected leaves in place."""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._core._eigh import symmetric_eigh
from .._core._layout import constrain, drop_leading
from .._core._sharding import (
    EXACT,
    ORTHONORMAL_ROUNDS,
    column_signs,
    gram,
    inverse_sqrt_kept,
    like,
    matmul,
    orthonormal_columns,
    orthonormal_start,
    polished,
    shifted,
)
from .._marks._sources import PHASE_DRAWN, PHASE_GIVEN, PHASE_TESTED


class PerMatrix(NamedTuple):
    """One leaf's stacks for `in_place_per_matrix`: `buffers` (None where absent),
    written over; `inputs`, read; each buffer's sharding in `layouts` (or None)."""

    buffers: tuple
    inputs: tuple
    layouts: tuple


def _signature(entry: PerMatrix) -> tuple:
    """What leaves must share to go through one loop: their matrices' shapes and
    dtypes, and their layouts."""
    matrix = lambda x: None if x is None else (x.shape[-2:], x.dtype)  # noqa: E731
    batch_ndim = entry.inputs[0].ndim - 2
    return (
        tuple(map(matrix, entry.buffers + entry.inputs)),
        tuple(drop_leading(sharding, batch_ndim) for sharding in entry.layouts),
    )


def in_place_per_matrix(fn: Callable, entries: list[PerMatrix]) -> list[tuple]:
    """`fn(buffers, inputs)` of each matrix (the last two dims) of every leaf's
    stacks, one matrix after another, its results written over the matrices of the
    buffers: the float32 work is one matrix's size and no stack-sized buffer is
    added (a `lax.switch` inside `fn` copies one matrix; around whole stacks, it
    copies each). The leaves whose matrices agree in shape go through one loop, so
    that `fn` (eigendecompositions, whose compile dominates the refresh's on a
    TPU) is compiled once per shape, not once per leaf. `fn` maps a tuple of
    matrices of the buffers (None where absent) and one of the inputs to a tuple
    of the first's shapes and dtypes. Returns each leaf's new buffers."""
    groups: dict[tuple, list[int]] = {}
    for n, entry in enumerate(entries):
        groups.setdefault(_signature(entry), []).append(n)
    results: list[tuple] = [()] * len(entries)
    for members in groups.values():
        written = _one_loop(fn, [entries[n] for n in members])
        for n, buffers in zip(members, written):
            results[n] = buffers
    return results


def _one_loop(fn: Callable, entries: list[PerMatrix]) -> list[tuple]:
    """`in_place_per_matrix` for leaves whose matrices agree in shape: one
    `fori_loop` over all their matrices, each step reading the matrix of the leaf
    it is at (a select over the leaves) and writing it back (the others' own
    matrices written back unchanged)."""

    def flat(x: Any) -> Any:
        return None if x is None else x.reshape(-1, *x.shape[-2:])

    def stack_layout(entry: PerMatrix, sharding: Any) -> Any:
        # A loop's buffer is replicated unless constrained: a stack of one batch
        # dim keeps its layout; others (one matrix, or two batch dims) are left
        # to XLA.
        return sharding if entry.inputs[0].ndim == 3 else None

    def laid_out(xs: tuple, shardings: tuple) -> tuple:
        return tuple(
            None if x is None else constrain(x, sharding)
            for x, sharding in zip(xs, shardings)
        )

    batch_ndim = [e.inputs[0].ndim - 2 for e in entries]
    counts = [math.prod(e.inputs[0].shape[:-2]) for e in entries]
    starts = jnp.asarray([sum(counts[:n]) for n in range(len(counts))], jnp.int32)
    inputs = [tuple(map(flat, e.inputs)) for e in entries]
    # Equal for every leaf of the group (`_signature`).
    per_matrix = tuple(
        drop_leading(sharding, batch_ndim[0]) for sharding in entries[0].layouts
    )
    carried = [
        tuple(stack_layout(e, sharding) for sharding in e.layouts) for e in entries
    ]

    def body(q: Array, stacks: list) -> list:
        leaf = jnp.sum(q >= starts) - 1
        index = [jnp.clip(q - starts[n], 0, c - 1) for n, c in enumerate(counts)]

        def take(x: Any, n: int) -> Any:
            if x is None:
                return None
            return jax.lax.dynamic_index_in_dim(x, index[n], keepdims=False)

        def pick(parts: list) -> Any:
            if parts[0] is None:
                return None
            return parts[0] if len(parts) == 1 else jax.lax.select_n(leaf, *parts)

        olds = [tuple(take(x, n) for x in stack) for n, stack in enumerate(stacks)]
        ins = [tuple(take(x, n) for x in xs) for n, xs in enumerate(inputs)]
        outs = fn(
            tuple(pick(list(parts)) for parts in zip(*olds)),
            tuple(pick(list(parts)) for parts in zip(*ins)),
        )
        outs = laid_out(outs, per_matrix)
        new = []
        for n, (stack, old) in enumerate(zip(stacks, olds)):
            here = leaf == n
            written = tuple(
                None
                if x is None
                else jax.lax.dynamic_update_index_in_dim(
                    x, jnp.where(here, y, o), index[n], 0
                )
                for x, y, o in zip(stack, outs, old)
            )
            new.append(laid_out(written, carried[n]))
        return new

    start = [
        laid_out(tuple(map(flat, e.buffers)), shardings)
        for e, shardings in zip(entries, carried)
    ]
    done = jax.lax.fori_loop(0, sum(counts), body, start)
    return [
        laid_out(
            tuple(
                None if x is None else x.reshape(b.shape) for x, b in zip(xs, e.buffers)
            ),
            e.layouts,
        )
        for xs, e in zip(done, entries)
    ]


# ---------------------------------------------------------------------------------------
# The trips of a step: one on a step that keeps the projectors; on a refresh, the
# range finder's `2 + 2 * iters` (a sketch `G Ω`; per power iteration `G^T Q` then
# `G T`; last `B = G^T Q`), then the step's own (`G^T P`).


def refresh_phase(t: Array, iters: int) -> Array:
    """The phase of a refresh's trip `t`: `PHASE_DRAWN` first, then `PHASE_GIVEN`
    and `PHASE_TESTED` in turn, the last two `PHASE_GIVEN`."""
    alternate = jnp.where(t % 2 == 1, PHASE_GIVEN, PHASE_TESTED)
    alternate = jnp.where(t == 2 * iters + 2, PHASE_GIVEN, alternate)
    return jnp.where(t == 0, PHASE_DRAWN, alternate)


# What follows a refresh's trip, per matrix (`step`).
KEEP, BASIS, TRUNCATE, TESTS = 0, 1, 2, 3


def step_after(t: Array, iters: int) -> Array:
    given = jnp.where(t == 2 * iters + 1, TRUNCATE, TESTS)
    given = jnp.where(t == 2 * iters + 2, KEEP, given)
    return jnp.where(refresh_phase(t, iters) == PHASE_GIVEN, given, BASIS)


def _keep(mt: tuple, sums: tuple) -> tuple:
    return mt


def _orthonormal(y: Array, dtype: Any) -> Array:
    # The range finder's own orthonormalisation, so that the sums over microbatches
    # give the projector one full batch gives.
    work = y.astype(jnp.promote_types(y.dtype, jnp.float32))
    return orthonormal_columns(work).astype(dtype)


def _basis_or_truncate(action: Array) -> Callable:
    """BASIS or TRUNCATE, as one loop whose body holds the step's one
    eigendecomposition (on a TPU most of the refresh's compile; two call sites
    compiled it twice):

    - BASIS, after a sketch: `Q = orth(G Ω)` of the sketch in the sum's first rows,
      `orthonormal_columns`' rounds;
    - TRUNCATE, after the last `B = G^T Q`, the range finder's last step: `U` the
      top left singular vectors of `B^T` (eigenvectors of `B^T B`, largest first),
      and the new projector `P = Q U` with its sign convention (as
      `quax_tangents.projected_cotangent`'s range finder), one round."""

    def step(mt: tuple, sums: tuple) -> tuple:
        (m, t), (s,) = mt, sums
        work = jnp.promote_types(m.dtype, jnp.float32)
        truncate = action == TRUNCATE
        rows = s[: m.shape[0]]
        rank = m.shape[-1]

        def basis_start() -> tuple:
            q, shift = orthonormal_start(rows.astype(work))
            return q, shift, jnp.zeros((rank, rank), work)

        def truncate_start() -> tuple:
            b_gram = gram(s.astype(work))
            return like(m.astype(work), rows), jnp.zeros((), work), b_gram

        # A `cond`, not both: each start reads a matrix the other does not need.
        y, shift, b_gram = jax.lax.cond(truncate, truncate_start, basis_start)

        def one_round(i: Any, y: Array) -> Array:
            # `gram(y)` is not needed in the truncation's one round: a `cond` here
            # would put a branch in the loop body for an `r x r` product.
            first = (i == 0) & ~truncate
            g = jnp.where(truncate, b_gram, gram(y))
            lam, v = symmetric_eigh(shifted(g, jnp.where(first, shift, 0)))
            rotation = jnp.where(
                truncate, v[:, ::-1], v * inverse_sqrt_kept(lam, i == 0)
            )
            # Laid out as `y` (a loop's carry keeps its type under explicit axes).
            return like(matmul(y, rotation, EXACT), y)

        y = jax.lax.fori_loop(
            0, jnp.where(truncate, 1, ORTHONORMAL_ROUNDS), one_round, y
        )
        # The basis ends as `orthonormal_columns` does, with `polished`.
        y = jax.lax.cond(truncate, lambda y: y * column_signs(y), polished, y)
        return y.astype(m.dtype), t

    return step


def _tests(mt: tuple, sums: tuple) -> tuple:
    """After `G^T Q` within a power iteration: the test matrix `T = orth(G^T Q)`."""
    (m, t), (s,) = mt, sums
    return m, _orthonormal(s, t.dtype)


def _laid_out_as_given(step: Callable) -> Callable:
    """`step` whose matrices come out laid out as they came in: under explicit mesh
    axes the branches of a switch must agree in layout."""

    def laid_out(mt: tuple, sums: tuple) -> tuple:
        return tuple(
            None if y is None else like(y, x) for y, x in zip(step(mt, sums), mt)
        )

    return laid_out


def _summed_over(axis_name: Any, step: Callable) -> Callable:
    """`step` on the trip's sums added up over the devices of `axis_name` (data
    parallel inside `jax.shard_map`): every device then finds the same basis and
    projector, those of the whole batch. Inside the switch's branches, so that the
    all-reduce runs only after a refresh's trips, never on a step that keeps the
    projectors."""
    if axis_name is None:
        return step

    def summed(mt: tuple, sums: tuple) -> tuple:
        return step(mt, tuple(jax.lax.psum(s, axis_name) for s in sums))

    return summed


def step(
    action: Array, mt: tuple, sums: tuple, tested: bool, axis_name: Any = None
) -> tuple:
    """The step `action` (KEEP, BASIS, TRUNCATE or TESTS, the last only when
    `tested`: power iterations) on one matrix of the basis `M` and of the test
    matrices `T` (or None), from the trip's sum `S` (summed over the devices of
    `axis_name` first, when given): the new `(M, T)`."""
    over = lambda step: _summed_over(axis_name, _laid_out_as_given(step))  # noqa: E731
    branches = [_keep, over(_basis_or_truncate(action))]
    index = jnp.where(action == KEEP, 0, 1)
    if tested:
        branches.append(over(_tests))
        index = jnp.where(action == TESTS, 2, index)
    return jax.lax.switch(index, branches, mt, sums)
