"""`accumulate_gradients`: the projected gradient of a batch, from its microbatches,
inside one step, carrying only the small factors.

Per projected weight the gradient of the batch is `G = (1/k) sum_i G_i`. With the
state's projector `P` (a step that keeps it), `G^T P = (1/k) sum_i G_i^T P`: one pass
over the microbatches, each marked with `P`, adding up their small factors. On a
refresh step every microbatch must use the same fresh projector, the range finder's
of `G`, which only needs products with `G`, and so sums of products with each `G_i`:

1. `Y = (1/k) sum_i G_i Ω` for the random-sign test matrix `Ω` (`rank` columns) that
   the mark's range finder draws from the same key; `Q = orth(Y)`;
2. (per power iteration, `T = orth(G^T Q)`, then `Q = orth(G T)`);
3. `B = (1/k) sum_i G_i^T Q`; then, as the range finder ends, `U` the left singular
   vectors of `B^T` and `P = Q U`, written over the old projector.

That is the full batch's range finder (with no oversampling, as the optax layer's
marks draw it), step for step; only the order of additions differs. (Written for
`m <= n`; a tall weight is projected on its columns, `G^T`.)

Every pass marks each projected matrix with one `Phased` mark whose phase, an
operand, picks the product (`G^T M`, `G Ω`, `G T`), and every pass is a trip of one
`while_loop` over (trip, microbatch) around the one compiled copy of the model's
pass: one trip on a step that keeps the projectors; on a refresh, the range
finder's `2 + 2 * iters`, the last writing `P`, then the step's own with `P`
(`G^T P`, which is `B U`): `3 + 2 * iters` passes. The loop carries the running
sums and zeroes them at each trip's first microbatch, in place: a loop over trips
around a loop over microbatches held the sums of both at once (0.84 GiB more at 1B
for one TPU v5e chip, `benchmarks/bench_scale.py --target tpu-v5e --models 1B`).
Rotating the refresh's last factors (`B U`) instead of making the step's own pass
held 0.36 GiB more there, in an earlier two-pass form of the refresh.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._autodiff import _ad
from .._core._devices import AxisName
from .._core._layout import constrain
from .._core._unchecked import unchecked
from .._distributed._collective import GatherSum, all_reduce
from .._marks._sources import PHASE_GIVEN
from .._types.lowrank import LowRank
from .._types.rows import SparseRows
from ._apply import is_compressed
from ._common import split_arrays, traced, with_others
from ._data_parallel import (
    WHERE as _WHERE,
    check_axis_name,
    refuse_per_device,
    varying_over,
)
from ._galore_leaves import LeafPlan
from ._mark import leaf_keys, plan_leaves
from ._passes import PhasedPass, mark_leaf
from ._projected import find_state
from ._refresh import (
    KEEP,
    PerMatrix,
    in_place_per_matrix,
    refresh_phase,
    step,
    step_after,
)
from ._trip_layout import (
    carried_leaves,
    leaf_shardings,
    loop_weights,
    row_major,
    sum_layout,
)


def _test_keys(plan: LeafPlan, key: Any) -> Array:
    """The key data the mark's range finder draws `Ω` from: for a stack, one key per
    slice split from the leaf's key (as `projected_cotangent` splits it)."""
    if plan.batch:
        key = jax.random.split(key, math.prod(plan.batch)).reshape(plan.batch)
    return jax.random.key_data(key)


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


def _zeros(shape: tuple, dtype: Any, layout: Callable, n: int) -> Array:
    """Leaf `n`'s running sum at the start, laid out by `layout(n, ...)`."""
    return constrain(
        jnp.zeros(shape, dtype), layout(n, jax.ShapeDtypeStruct(shape, dtype))
    )


def _check_sums(parts: list, totals: list, paths: list) -> None:
    """A mark that adds into a running sum returns it: same shape and dtype."""
    for part, total, path in zip(parts, totals, paths):
        if total is not None and (part.shape, part.dtype) != (total.shape, total.dtype):
            raise AssertionError(
                f"{_WHERE}: the projected factor of `{path}` is "
                f"{part.dtype}{list(part.shape)}, its running sum "
                f"{total.dtype}{list(total.shape)}."
            )


def _trips(
    loss_fn: Callable,
    params: PyTree,
    microbatches: PyTree,
    plans: list,
    treedef: Any,
    has_aux: bool,
    by_layer: bool,
    shardings: list,
    modes: Callable[[Array, Any], list],
    after: Callable[[Array, Array, Any, list], Any],
    state: Any,
    trips: Array,
    carried: list[bool],
    axis_name: AxisName = None,
) -> tuple[Any, Array, Any, list]:
    """`trips` passes over the microbatches in one `while_loop` over (trip,
    microbatch), so that the model's pass is compiled once, whatever the trips; the
    loop carries the leaves of `params` that `carried` flags (see `loop_weights`).

    Trip `t` marks the leaves with `modes(t, state)` (the marks add into the
    running sums themselves); after each microbatch, `state = after(t, last,
    state, sums)`, `last` saying whether it was the trip's last. Returns the final
    `state` and, of the last trip, the mean loss, the aux stacked over the
    microbatches and the mean contributions per leaf. `shardings`: per leaf, the
    weight's `NamedSharding` or None; each running sum is laid out like its weight
    (see `quax_tangents._core._layout`). With `axis_name` (inside `jax.shard_map`),
    the weights, the loss, the sums and the aux are typed as varying over that axis:
    each device's own gradient and sums."""
    vary = varying_over(axis_name)
    # Each device's own gradient of the replicated weights: the marks' rules then
    # give each device's factors, whose mean over the devices is taken after the
    # loop. Without it JAX's AD would all-reduce every weight's gradient densely.
    params = vary(params)
    paths = [
        jtu.keystr(p)
        for p, _ in jtu.tree_flatten_with_path(
            jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
        )[0]
    ]

    def layout(i: int, x: Any) -> Any:
        return sum_layout(shardings[i], plans[i], x, False)

    def loss_of(params: PyTree, batch: Any, modes: list, totals: list) -> Any:
        leaves = treedef.flatten_up_to(params)
        marked = [
            mark_leaf(x, p, m, t, by_layer, layout(i, t))
            for i, (x, p, m, t) in enumerate(zip(leaves, plans, modes, totals))
        ]
        return loss_fn(jtu.tree_unflatten(treedef, marked), batch)

    value_and_grad = _ad.value_and_grad(loss_of, argnums=0, has_aux=has_aux)

    def one(
        batch: Any, t: Array, state: Any, totals: list, weights: list
    ) -> tuple[Array, Any, list]:
        value, grads = value_and_grad(
            with_weights(weights), batch, modes(t, state), totals
        )
        loss, aux = value if has_aux else (value, None)
        flat = treedef.flatten_up_to(grads)
        parts = [_contribution(g, p, path) for g, p, path in zip(flat, plans, paths)]
        return loss, aux, parts

    k = jtu.tree_leaves(microbatches)[0].shape[0]
    first = jtu.tree_map(lambda x: x[0], microbatches)
    leaves = treedef.flatten_up_to(params)
    # Each projected leaf's mark adds its product into the running sum itself: the
    # small factor, whose shape its plan gives.
    into = [p is not None and p.kind == "project" for p in plans]
    totals = vary(
        [
            _zeros(plans[n].factor_shape, leaves[n].dtype, layout, n) if add else None
            for n, add in enumerate(into)
        ]
    )
    weights, with_weights = loop_weights(params, treedef, carried)
    # The model's pass is traced once: its shapes give the loop's carry, and the
    # loop's body replays it (tracing it again would double the step's lowering).
    replay, shapes = traced(one, first, jnp.int32(0), state, totals, weights)
    _check_sums(shapes[2], totals, paths)
    summed = [not isinstance(s, SparseRows) for s in shapes[2]]

    def stacked(x: Any) -> Any:
        return jnp.zeros((k, *x.shape), x.dtype)

    def body(carry: tuple) -> tuple:
        j, weights, state, loss_sum, sums, aux, rows = carry
        weights = [row_major(w) for w in weights]
        t, i = j // k, j % k
        # A trip starts its sums from zero (in place: the carry's own buffers).
        start = i == 0
        loss_sum = jnp.where(start, jnp.zeros_like(loss_sum), loss_sum)
        sums = [
            None if s is None else jnp.where(start, jnp.zeros_like(s), s) for s in sums
        ]
        batch = jtu.tree_map(
            lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), microbatches
        )
        # Tied to the loop's counter: with one microbatch the pass's inputs are the same
        # on every trip, and the TPU compiler hoists the forward out of the loop,
        # holding its results (the head's gradient among them) across the loop and
        # copying them on each trip: the 1B step of one microbatch held 6.17 GiB
        # instead of 6.11 on v5e and 6.30 instead of 6.26 on v5p (`benchmarks/
        # bench_scale.py --target tpu-v5e --models 1B --accumulation 1`, before and
        # after), and the 7B one 22.16 instead of 22.00 on v5p (the step compiled
        # with and without the tie). Not at every size: at 60M, whose peak is the
        # loss's float32 logits inside the pass, the hoisted step holds less (0.30
        # GiB against 0.37 tied).
        batch, _ = jax.lax.optimization_barrier((batch, j))
        totals = [s if add else None for s, add in zip(sums, into)]
        loss, one_aux, parts = replay(batch, t, state, totals, weights)
        sums = [
            constrain(x if add else s + x, layout(n, x))
            if x is not None and (keep or add)
            else None
            for n, (s, x, keep, add) in enumerate(zip(sums, parts, summed, into))
        ]
        put = lambda buffer, x: jax.lax.dynamic_update_index_in_dim(buffer, x, i, 0)  # noqa: E731
        aux = vary(jtu.tree_map(put, aux, one_aux))
        rows = vary(
            [
                r if keep else jtu.tree_map(put, r, x)
                for r, x, keep in zip(rows, parts, summed)
            ]
        )
        state = after(t, i == k - 1, state, sums)
        return j + 1, weights, state, vary(loss_sum + loss), vary(sums), aux, rows

    # Made again, not reused from the trace's: in the order of the leaves, as the
    # carry takes them.
    zeros = [
        _zeros(s.shape, s.dtype, layout, n) if keep and s is not None else None
        for n, (s, keep) in enumerate(zip(shapes[2], summed))
    ]
    rows = [
        None if keep else jtu.tree_map(stacked, s) for s, keep in zip(shapes[2], summed)
    ]
    init = (
        jnp.int32(0),
        weights,
        state,
        vary(jnp.zeros(shapes[0].shape, shapes[0].dtype)),
        vary(zeros),
        vary(jtu.tree_map(stacked, shapes[1])),
        vary(rows),
    )
    _, _, state, loss_sum, sums, aux, rows = jax.lax.while_loop(
        lambda carry: carry[0] < trips * k, body, init
    )
    means = [
        constrain((s / k).astype(s.dtype), layout(n, s))
        if keep and s is not None
        else _rows_mean(r, k)
        for n, (s, r, keep) in enumerate(zip(sums, rows, summed))
    ]
    return state, loss_sum / k, aux, means


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
    axis_name: AxisName = None,
) -> tuple[Any, PyTree]:
    """The loss and gradient of a batch split into `k` microbatches, inside one step,
    in the form [`quax_tangents.optax.projected`][] takes: a loop over the
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
    one per step); every pass is a trip of one loop, so the compiled step holds
    one copy of the model's pass whatever `iters`.

    A leaf that `dims=` views as other matrices than its last two dims is marked
    through its matrix view, as [`quax_tangents.optax.mark`][] marks it: its
    gradient is the `LowRank` of the matrix view `(*batch, m, n)`.

    Leaves chosen with `rows=` are marked with `sparse_rows_cotangent`; their
    gradient holds the rows of every microbatch. Other leaves are averaged densely.

    **Arguments:**

    - `loss_fn`: `loss_fn(params, microbatch) -> loss` (or `(loss, aux)` with
        `has_aux`), the mean loss of one microbatch, *without* marks: this function
        applies them.
    - `params`: the parameters, with the structure the state was initialised with
        (or a whole Equinox model: leaves that are not arrays get `None` gradients).
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
        loop over the layers does not. `False` keeps every layer's factors until
        the scan ends, for any use, with the same result, and does not warn.
    - `shardings`: under `jax.jit` with sharded parameters (FSDP), the parameters'
        `jax.sharding.NamedSharding`s, with the structure of `params` (a leaf may be
        `None`): the same tree one gives `jax.jit`'s `in_shardings`. Each running sum
        (and a refresh step's bases and new projectors) is then laid out like its
        weight, dim for dim, the weight's other mesh axis on its rows where it
        divides them (else on the rank), so that each device holds its share and
        each microbatch's factors are reduce-scattered into it, not all-reduced
        into a copy on every device. `None` (the default) leaves their layout to
        XLA, which replicates them. A leaf that `dims=` views as other matrices is
        left to XLA.
    - `axis_name`: data parallel inside `jax.shard_map`, each device holding its
        share of the batch (split into `k` microbatches on every device) and the
        parameters and state replicated: the mesh axis (or tuple of axes) the
        batch is split over. The loss and the gradients are then the whole
        batch's, the same on every device: on a refresh step the sums are added up
        over the devices before each step of the range finder (an all-reduce per
        projected matrix, on refresh steps only), and the resulting small factors,
        dense leaves and loss are averaged over the devices once, after the last
        microbatch (`lax.pmean`: a projected weight sends its `(max(m, n), rank)`
        factor, not its `m x n` gradient). `aux` stays each device's own. Inside
        `jax.shard_map` without it, a batch or parameters that differ per device
        are refused, with the axis named.

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
    check_axis_name(axis_name, shardings)
    params, others = split_arrays(params)  # a whole Equinox model's functions...
    loss_fn = with_others(loss_fn, others)  # ...reach the loss untraced
    refuse_per_device((params, microbatches), axis_name)
    inner = find_state(state, _WHERE)
    plans, leaves, projectors, treedef = plan_leaves(inner, params, _WHERE)
    layouts = leaf_shardings(shardings, treedef, plans, leaves)
    if not jtu.tree_leaves(microbatches):
        raise ValueError(f"{_WHERE}: `microbatches` has no arrays.")
    projected = [
        i for i, p in enumerate(plans) if p is not None and p.kind == "project"
    ]
    keys = leaf_keys(key, inner, len(projected))
    key_of = {i: keys[j] for j, i in enumerate(projected)}
    key_impl = str(jax.random.key_impl(keys))

    matrices = [q if i in key_of else None for i, q in enumerate(projectors)]
    tests = [
        jnp.zeros(plans[i].factor_shape, leaves[i].dtype)
        if iters and i in key_of
        else None
        for i in range(len(plans))
    ]
    keys = {i: _test_keys(plans[i], k) for i, k in key_of.items()}
    refresh = jnp.asarray(inner.refresh, bool)

    def modes(t: Array, state: tuple) -> list:
        matrices, tests = state
        phase = jnp.where(refresh, refresh_phase(t, iters), PHASE_GIVEN).astype(
            jnp.int32
        )
        return [
            PhasedPass(matrices[i], keys[i], phase, tests[i], key_impl)
            if i in key_of
            else None
            for i in range(len(plans))
        ]

    def layout_of(i: int, x: Any, projector_side: bool) -> Any:
        return sum_layout(layouts[i], plans[i], x, projector_side)

    def after(t: Array, last: Array, state: tuple, sums: list) -> tuple:
        """After a microbatch: on the last of a refresh's trip, the range finder's
        step that follows it, per matrix (`step`); otherwise nothing."""
        action = jnp.where(last & refresh, step_after(t, iters), KEEP)
        matrices, tests = list(state[0]), list(state[1])
        entries = [
            PerMatrix(
                (matrices[i], tests[i]),
                (sums[i],),
                (layout_of(i, matrices[i], True), layout_of(i, sums[i], False)),
            )
            for i in key_of
        ]
        written = in_place_per_matrix(
            lambda mt, s: step(action, mt, s, tested=iters > 0, axis_name=axis_name),
            entries,
        )
        for i, (matrix, test) in zip(key_of, written):
            matrices[i], tests[i] = matrix, test
        return matrices, tests

    trips = jnp.where(refresh, 3 + 2 * iters, 1) if key_of else jnp.int32(1)
    (matrices, _), loss, aux, factors = _trips(
        loss_fn,
        params,
        microbatches,
        plans,
        treedef,
        has_aux,
        by_layer,
        layouts,
        modes,
        after,
        (matrices, tests),
        trips,
        carried_leaves(leaves, shardings, treedef),
        axis_name,
    )
    if axis_name is not None:
        # Exact, and compressed values stay compressed: a row leaf's rows are
        # gathered from every device.
        loss, factors = all_reduce((loss, factors), axis_name, GatherSum(), mean=True)
    grads = _finish(plans, leaves, matrices, factors)
    grads = jtu.tree_unflatten(treedef, grads)
    return ((loss, aux) if has_aux else loss), grads
