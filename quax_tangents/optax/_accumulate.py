"""`accumulate_gradients`: the projected gradient of a batch, from its microbatches,
inside one step, carrying only the small factors.

Per projected weight the gradient of the batch is `G = (1/k) sum_i G_i`. With the
state's projector `P` (a step that keeps it), `G^T P = (1/k) sum_i G_i^T P`: one pass
over the microbatches, each marked with `P`, adding up their small factors. On a
refresh step every microbatch must use the same fresh projector, the range finder's
of `G`, which only needs products with `G`, and so sums of products with each `G_i`:

1. `Y = (1/k) sum_i G_i Ω` for the Gaussian test matrix `Ω` (`rank` columns) that
   the mark's range finder draws from the same key; `Q = orth(Y)`;
2. (per power iteration, `T = orth(G^T Q)`, then `Q = orth(G T)`);
3. `B = (1/k) sum_i G_i^T Q`; then, as the range finder ends, `U` the left singular
   vectors of `B^T` and `P = Q U`, written over the old projector.

That is the full batch's range finder (with no oversampling, as the optax layer's
marks draw it), step for step; only the order of additions differs. (Written for
`m <= n`; a tall weight is projected on its columns, `G^T`.)

Every pass marks each projected matrix with one `Phased` mark whose phase, an
operand, picks the product (`G^T M`, `G Ω`, `G T`): the refresh's `2 + 2 * iters`
passes are the trips of one `while_loop` around one compiled pass, and its last
trip writes `P`. The pass every step makes follows, with `P` (`G^T P`, which is
`B U`): `3 + 2 * iters` passes on a refresh, one on other steps, and two compiled
copies of the model's pass. The factors of the refresh's last trip, rotated
(`B U`), would save that pass, but the rotation of the stack after the pass held
0.36 GiB more at 1B for one TPU v5e chip, in every form tried
(`benchmarks/bench_scale.py --target tpu-v5e --models 1B`).
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import NamedSharding
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._autodiff import _ad
from .._core._layout import constrain, drop_leading, explicit_sharding
from .._core._sharding import (
    column_signs,
    like,
    orthonormal_columns,
    top_left_singular,
)
from .._core._unchecked import unchecked
from .._marks._sources import PHASE_DRAWN, PHASE_GIVEN, PHASE_TESTED
from .._types.lowrank import LowRank
from .._types.rows import SparseRows
from ._apply import is_compressed
from ._galore_leaves import LeafPlan
from ._mark import flatten_as, leaf_keys, plan_leaves
from ._passes import PhasedPass, mark_leaf
from ._projected import find_state


_WHERE = "`quax_tangents.optax.accumulate_gradients`"


def _test_keys(plan: LeafPlan, key: Any) -> Array:
    """The key data the mark's range finder draws `Ω` from: for a stack, one key per
    slice split from the leaf's key (as `projected_cotangent` splits it)."""
    if plan.batch:
        key = jax.random.split(key, math.prod(plan.batch)).reshape(plan.batch)
    return jax.random.key_data(key)


def _in_place_per_matrix(
    fn: Callable, buffers: tuple, inputs: tuple, layouts: tuple
) -> tuple:
    """`fn(buffers, inputs)` of each matrix (the last two dims) of the stacks, one
    matrix after another, its results written over the matrices of `buffers`: the
    float32 work is one matrix's size, no stack-sized buffer is added, and a
    `lax.switch` inside `fn` copies one matrix, not the stacks (a switch over whole
    stacks copies each). `fn` maps a tuple of matrices of `buffers` (None where a
    buffer is None) and one of `inputs` to a tuple of the shapes and dtypes of the
    first. `layouts`: each buffer's sharding, or None (a loop's buffer is
    replicated unless constrained)."""

    def laid_out(xs: tuple, shardings: tuple) -> tuple:
        return tuple(
            None if x is None else constrain(x, sharding)
            for x, sharding in zip(xs, shardings)
        )

    batch = inputs[0].shape[:-2]
    if not batch:
        return laid_out(fn(buffers, inputs), layouts)
    if len(batch) != 1:  # the layouts are of the stacks' own dims
        layouts = (None,) * len(buffers)
    per_matrix = tuple(drop_leading(sharding, 1) for sharding in layouts)
    flatten = lambda x: None if x is None else x.reshape(-1, *x.shape[-2:])  # noqa: E731
    flat_inputs = tuple(map(flatten, inputs))

    def body(i: Any, stacks: tuple) -> tuple:
        take = lambda x: (  # noqa: E731
            None if x is None else jax.lax.dynamic_index_in_dim(x, i, keepdims=False)
        )
        outs = fn(tuple(map(take, stacks)), tuple(map(take, flat_inputs)))
        written = tuple(
            None if x is None else jax.lax.dynamic_update_index_in_dim(x, y, i, 0)
            for x, y in zip(stacks, laid_out(outs, per_matrix))
        )
        return laid_out(written, layouts)

    start = laid_out(tuple(map(flatten, buffers)), layouts)
    flat = jax.lax.fori_loop(0, math.prod(batch), body, start)
    return tuple(
        None if x is None else x.reshape(b.shape) for x, b in zip(flat, buffers)
    )


# ---------------------------------------------------------------------------------------
# One pass over the microbatches


def _contribution(grad: Any, plan: LeafPlan | None, path: str) -> Any:
    """What one microbatch adds to the accumulator of one leaf."""
    if grad is None:
        return None
    if plan is not None and plan.kind == "project":
        if not isinstance(grad, LowRank):
            raise TypeError(
                f"{_WHERE}: the gradient of the projected leaf `{path}` came back as "
                f"{type(grad).__name__}, not LowRank: mark nothing in `loss_fn` "
                "(the marks are applied here)."
            )
        # The factor that is not the given matrix: the trip's sum (`Phased`).
        return grad.right if plan.side == "left" else grad.left
    if isinstance(grad, SparseRows):
        return grad
    if is_compressed(grad):
        raise TypeError(
            f"{_WHERE}: the gradient of `{path}` came back as {type(grad).__name__}; "
            "mark nothing in `loss_fn` (the marks are applied here)."
        )
    return grad


def _pass(
    loss_fn: Callable,
    params: PyTree,
    microbatches: PyTree,
    plans: list,
    treedef: Any,
    modes: list,
    has_aux: bool,
    by_layer: bool,
    shardings: list,
) -> tuple[Array, Any, list]:
    """(mean loss, stacked aux, mean contributions per leaf) over the microbatches.
    `shardings`: per leaf, the weight's `NamedSharding` or None; each running sum is
    laid out like its weight (see `quax_tangents._core._layout`)."""
    paths = [
        jtu.keystr(p)
        for p, _ in jtu.tree_flatten_with_path(
            jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
        )[0]
    ]

    def layout(i: int, x: Any) -> Any:
        return _layout(shardings[i], plans[i], x, False)

    def loss_of(params: PyTree, batch: Any, totals: list) -> Any:
        leaves = treedef.flatten_up_to(params)
        marked = [
            mark_leaf(x, p, m, t, by_layer, layout(i, t))
            for i, (x, p, m, t) in enumerate(zip(leaves, plans, modes, totals))
        ]
        return loss_fn(jtu.tree_unflatten(treedef, marked), batch)

    value_and_grad = _ad.value_and_grad(loss_of, has_aux=has_aux)
    none = [None] * len(plans)

    def one(batch: Any, totals: list = none) -> tuple[Array, Any, list]:
        value, grads = value_and_grad(params, batch, totals)
        loss, aux = value if has_aux else (value, None)
        flat = treedef.flatten_up_to(grads)
        parts = [_contribution(g, p, path) for g, p, path in zip(flat, plans, paths)]
        return loss, aux, parts

    # The carry starts as zeros shaped like one microbatch's contributions.
    first = jtu.tree_map(lambda x: x[0], microbatches)
    shapes = jax.eval_shape(one, first)
    summed = [not isinstance(s, SparseRows) for s in shapes[2]]
    # Each projected leaf's mark adds its product into the sum itself.
    into = [p is not None and p.kind == "project" for p in plans]

    def body(carry: Any, batch: Any) -> tuple[Any, Any]:
        loss_sum, sums = carry
        totals = [s if i else None for s, i in zip(sums, into)]
        loss, aux, parts = one(batch, totals)
        sums = [
            constrain(x if i else s + x, layout(k, x))
            if x is not None and (add or i)
            else None
            for k, (s, x, add, i) in enumerate(zip(sums, parts, summed, into))
        ]
        rows = [None if add else x for x, add in zip(parts, summed)]
        return (loss_sum + loss, sums), (aux, rows)

    zeros = [
        constrain(jnp.zeros(s.shape, s.dtype), layout(k, s))
        if add and s is not None
        else None
        for k, (s, add) in enumerate(zip(shapes[2], summed))
    ]
    init = (jnp.zeros(shapes[0].shape, shapes[0].dtype), zeros)
    (loss_sum, sums), (aux, rows) = jax.lax.scan(body, init, microbatches)
    k = jtu.tree_leaves(microbatches)[0].shape[0]
    means = [
        constrain((s / k).astype(s.dtype), layout(i, s))
        if add and s is not None
        else _rows_mean(r, k)
        for i, (s, r, add) in enumerate(zip(sums, rows, summed))
    ]
    return loss_sum / k, aux, means


def _layout(sharding: Any, plan: LeafPlan | None, x: Any, projector_side: bool) -> Any:
    """The layout of a running sum, basis or projector `x` of a weight laid out by
    `sharding`: the sharding itself for a dense sum, one spread over the same mesh
    axes for a factor (`LeafPlan.factor_layout`). None leaves it to XLA."""
    if x is None or sharding is None:
        return None
    if plan is None:
        return sharding
    return plan.factor_layout(sharding, tuple(x.shape), projector_side)


def _rows_mean(stacked: Any, k: int) -> Any:
    """The microbatches' `SparseRows`, side by side, divided by `k`."""
    if stacked is None:
        return None
    return SparseRows(
        stacked.indices.reshape(-1),
        (stacked.rows / k)
        .astype(stacked.rows.dtype)
        .reshape(-1, *stacked.rows.shape[2:]),
        stacked.num_rows,
    )


# ---------------------------------------------------------------------------------------
# Steady and refresh steps


# ---------------------------------------------------------------------------------------
# A refresh: the range finder's `2 + 2 * iters` trips of the pass (a sketch `G Ω`;
# per power iteration `G^T Q` then `G T`; last `B = G^T Q`), each the same compiled
# pass with its phase as an operand, in one `while_loop`


def _phase(t: Array) -> Array:
    """The phase of a refresh's trip `t`: `PHASE_DRAWN` first, then `PHASE_GIVEN`
    and `PHASE_TESTED` in turn, ending on `PHASE_GIVEN`."""
    alternate = jnp.where(t % 2 == 1, PHASE_GIVEN, PHASE_TESTED)
    return jnp.where(t == 0, PHASE_DRAWN, alternate).astype(jnp.int32)


# What follows a trip, per matrix, as the index of a `lax.switch` over `_basis`,
# `_truncate` and (with power iterations) `_tests`; each takes one matrix of the
# basis `M` and of the test matrices `T` (or None), and of the trip's sum `S`.
_BASIS, _TRUNCATE, _TESTS = 0, 1, 2


def _after(t: Array, phase: Array, iters: int) -> Array:
    given = jnp.where(t == 2 * iters + 1, _TRUNCATE, _TESTS)
    return jnp.where(phase == PHASE_GIVEN, given, _BASIS).astype(jnp.int32)


def _orthonormal(y: Array, dtype: Any) -> Array:
    # The range finder's own orthonormalisation, so that the sums over microbatches
    # give the projector one full batch gives.
    work = y.astype(jnp.promote_types(y.dtype, jnp.float32))
    return orthonormal_columns(work).astype(dtype)


def _basis(mt: tuple, sums: tuple) -> tuple:
    """After a sketch: the basis `Q = orth(G Ω)` (or `orth(G T)`) of the sketch in
    the sum's first rows."""
    (m, t), (s,) = mt, sums
    return _orthonormal(s[: m.shape[0]], m.dtype), t


def _tests(mt: tuple, sums: tuple) -> tuple:
    """After `G^T Q` within a power iteration: the test matrix `T = orth(G^T Q)`."""
    (m, t), (s,) = mt, sums
    return m, _orthonormal(s, t.dtype)


def _truncate(mt: tuple, sums: tuple) -> tuple:
    """After the last `B = G^T Q`, the range finder's last step: `U` the top left
    singular vectors of `B^T`, and the new projector `P = Q U` with its sign
    convention (as `quax_tangents.projected_cotangent`'s range finder)."""
    (m, t), (s,) = mt, sums
    work = jnp.promote_types(m.dtype, jnp.float32)
    p = m.astype(work) @ top_left_singular(s.astype(work).T, m.shape[-1])
    return (p * column_signs(p)).astype(m.dtype), t


def _laid_out_as_given(step: Callable) -> Callable:
    """`step` whose matrices come out laid out as they came in: under explicit mesh
    axes the branches of a switch must agree in layout."""

    def laid_out(mt: tuple, sums: tuple) -> tuple:
        return tuple(
            None if y is None else like(y, x) for y, x in zip(step(mt, sums), mt)
        )

    return laid_out


_STEPS = tuple(map(_laid_out_as_given, (_basis, _truncate, _tests)))


def _leaf_shardings(shardings: Any, treedef: Any, plans: list, leaves: list) -> list:
    """Per leaf, its `NamedSharding` from `accumulate_gradients(shardings=...)` (by
    default the leaf's own under explicit mesh axes), or None (none given, or a leaf
    seen through another matrix view)."""
    if shardings is None:
        # Under explicit mesh axes a weight's layout is its type: the sums and bases
        # must follow it (a carry's type may not change across a scan).
        return [
            None
            if p is not None and p.kind == "project" and p.is_view
            else explicit_sharding(x)
            for x, p in zip(leaves, plans)
        ]
    flat = flatten_as(
        treedef,
        shardings,
        f"{_WHERE}: `shardings` must have the structure of `params` (the tree "
        "given to `jax.jit`'s `in_shardings`)",
    )
    for s in flat:
        if s is not None and not isinstance(s, NamedSharding):
            raise TypeError(
                f"{_WHERE}: each leaf of `shardings` must be a "
                f"`jax.sharding.NamedSharding` or None, got {type(s).__name__}; "
                "build them with `NamedSharding(mesh, PartitionSpec(...))`."
            )
    return [
        None if p is not None and p.kind == "project" and p.is_view else s
        for s, p in zip(flat, plans)
    ]


def _low_rank(plan: LeafPlan, projector: Array, factor: Array, dtype: Any) -> LowRank:
    projector, factor = projector.astype(dtype), factor.astype(dtype)
    if plan.side == "left":
        return unchecked(LowRank, left=projector, right=factor, projector_side="left")
    return unchecked(LowRank, left=factor, right=projector, projector_side="right")


def _finish(plans: list, leaves: list, matrices: list, factors: list) -> list:
    return [
        _low_rank(p, q, f, x.dtype) if p is not None and p.kind == "project" else f
        for p, x, q, f in zip(plans, leaves, matrices, factors)
    ]


def accumulate_gradients(
    loss_fn: Callable,
    params: PyTree,
    state: Any,
    microbatches: PyTree,
    *,
    key: PRNGKeyArray | None = None,
    iters: int = 0,
    has_aux: bool = False,
    by_layer: bool = True,
    shardings: PyTree | None = None,
) -> tuple[Any, PyTree]:
    """The loss and gradient of a batch split into `k` microbatches, inside one step,
    in the form [`quax_tangents.optax.projected`][] takes: a `lax.scan` over the
    microbatches whose carry holds, per projected weight, only the small factor
    `(*batch, max(m, n), width)`, never a weight-shaped buffer.

    On a step that keeps the projectors, each microbatch is marked with the state's
    projector `P` and the small factors are averaged: `G^T P` for the batch's
    gradient `G`. On a refresh step (`state`'s `refresh`), every microbatch uses
    the same fresh projector, the one the range finder of `projected_cotangent`
    would find from the batch's gradient with the same key (with no oversampling,
    as [`quax_tangents.optax.mark`][] draws it): a first pass adds up the sketches
    `G_i Ω`, a second the products `G_i^T Q` with their orthonormal basis `Q`, and
    the small SVD of that sum gives the projector, written over the old one in
    place; then the pass of a step that keeps the projectors gives the small
    factors. Either way the result equals the full batch's projected gradient
    (`quax_tangents.optax.mark(params, state, key=key, iters=iters)` on the whole
    batch) up to float rounding. A refresh step costs `3 + 2 * iters` passes over
    the microbatches, other steps one (at `refresh_every=200`, 1% more passes than
    one per step); the refresh's passes are the trips of one loop, so the
    compiled step holds two copies of the model's pass whatever `iters`.

    A leaf that `dims=` views as other matrices than its last two dims is marked
    through its matrix view, as [`quax_tangents.optax.mark`][] marks it: its
    gradient is the `LowRank` of the matrix view `(*batch, m, n)`.

    Leaves chosen with `rows=` are marked with `sparse_rows_cotangent`; their
    gradient holds the rows of every microbatch. Other leaves are averaged densely.

    **Arguments:**

    - `loss_fn`: `loss_fn(params, microbatch) -> loss` (or `(loss, aux)` with
        `has_aux`), the mean loss of one microbatch, *without* marks: this function
        applies them.
    - `params`: the parameters, with the structure the state was initialised with.
    - `state`: the state of `projected`, or one that contains it.
    - `microbatches`: a pytree whose leaves have a leading axis of length `k`, one
        entry per microbatch (of equal sizes, so that the mean of their mean losses
        is the batch's mean loss).
    - `key`: as for [`quax_tangents.optax.mark`][].
    - `iters`: power iterations of the range finder (0 by default: each costs two
        more passes on refresh steps).
    - `has_aux`: whether `loss_fn` returns `(loss, aux)`.
    - `by_layer`: when `loss_fn` runs a stacked projected leaf through `lax.scan`
        (the blocks of a scanned model), project each layer's gradient in that
        scan's backward pass, written into the running sum, so that one layer's
        factors are alive at a time. It needs the stack to be used in exactly one
        scan and nowhere else (a `ValueError` says so otherwise), taken as the
        scan's `xs` (cast, viewed by `dims=`, or inside a `jax.jit` or
        `jax.checkpoint` as it may be). A scan that uses the stack but cannot
        project it so (the stack transposed before the scan, or closed over by an
        outer scan) warns a [`quax_tangents.optax.LayerByLayerWarning`][]; a Python
        loop over the layers does not. `False` keeps every layer's factors until the scan ends,
        for any use, with the same result, and does not warn.
    - `shardings`: under `jax.jit` with sharded parameters (FSDP), the parameters'
        `jax.sharding.NamedSharding`s, with the structure of `params` (a leaf may be
        `None`): the same tree one gives `jax.jit`'s `in_shardings`. Each running sum
        (and a refresh step's bases and new projectors) is then laid out like its
        weight, dim for dim, the rank dim sharded when the weight's mesh axis
        divides it, so that each device holds its share and each microbatch's
        factors are reduce-scattered into it, not all-reduced into a copy on every
        device. `None` (the default) leaves their layout to XLA, which replicates
        them. A leaf that `dims=` views as other matrices is left to XLA.

    **Returns:**

    `(loss, grads)`, or `((loss, aux), grads)` with `aux` stacked over the
    microbatches: the mean loss, and the gradients of the mean loss (`LowRank` with
    `projector_side` for projected leaves, `SparseRows` for row leaves, dense
    otherwise), ready for `projected`'s `update`.
    """
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"`iters` must be a non-negative int, got {iters!r}.")
    if not isinstance(by_layer, bool):
        raise TypeError(f"`by_layer` must be True or False, got {by_layer!r}.")
    inner = find_state(state, _WHERE)
    plans, leaves, projectors, treedef = plan_leaves(inner, params, _WHERE)
    layouts = _leaf_shardings(shardings, treedef, plans, leaves)
    if not jtu.tree_leaves(microbatches):
        raise ValueError(f"{_WHERE}: `microbatches` has no arrays.")
    projected = [
        i for i, p in enumerate(plans) if p is not None and p.kind == "project"
    ]
    keys = leaf_keys(key, inner, len(projected))
    key_of = {i: keys[j] for j, i in enumerate(projected)}
    key_impl = str(jax.random.key_impl(keys))

    def run(modes: list) -> tuple[Array, Any, list]:
        return _pass(
            loss_fn,
            params,
            microbatches,
            plans,
            treedef,
            modes,
            has_aux,
            by_layer,
            layouts,
        )

    matrices = [q if i in key_of else None for i, q in enumerate(projectors)]
    if key_of:
        keys = {i: _test_keys(plans[i], k) for i, k in key_of.items()}

        def modes(matrices: list, tests: list, phase: Any) -> list:
            return [
                PhasedPass(matrices[i], keys[i], phase, tests[i], key_impl)
                if i in key_of
                else None
                for i in range(len(plans))
            ]

        def trip(carry: tuple) -> tuple:
            t, matrices, tests = carry
            phase = _phase(t)
            sums = run(modes(matrices, tests, phase))[2]
            after = _after(t, phase, iters)
            steps = _STEPS if iters else _STEPS[:2]
            matrices, tests = list(matrices), list(tests)
            for i in key_of:
                layout = (layout_of(i, matrices[i], True), layout_of(i, sums[i], False))
                matrices[i], tests[i] = _in_place_per_matrix(
                    lambda mt, s: jax.lax.switch(after, steps, mt, s),
                    (matrices[i], tests[i]),
                    (sums[i],),
                    layout,
                )
            return t + 1, matrices, tests

        def layout_of(i: int, x: Any, projector_side: bool) -> Any:
            return _layout(layouts[i], plans[i], x, projector_side)

        # The refresh writes each new projector over the old one. Its last trip's
        # products `B` would give the step's factors as `B U`, a trip fewer; but
        # rotating them after the pass held more on the TPU compiler (see the
        # module's docstring), so the step's own pass follows, as on every step.
        tests = [
            jnp.zeros(plans[i].factor_shape, leaves[i].dtype)
            if iters and i in key_of
            else None
            for i in range(len(plans))
        ]
        trips = jnp.where(jnp.asarray(inner.refresh, bool), 2 + 2 * iters, 0)
        _, matrices, _ = jax.lax.while_loop(
            lambda carry: carry[0] < trips, trip, (jnp.int32(0), matrices, tests)
        )
        given = jnp.int32(PHASE_GIVEN)
        loss, aux, factors = run(modes(matrices, [None] * len(plans), given))
    else:
        loss, aux, factors = run([None] * len(plans))
    grads = _finish(plans, leaves, matrices, factors)
    grads = jtu.tree_unflatten(treedef, grads)
    return ((loss, aux) if has_aux else loss), grads
