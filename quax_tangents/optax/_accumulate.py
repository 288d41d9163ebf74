"""`accumulate_gradients`: the projected gradient of a batch, from its microbatches,
inside one step, carrying only the small factors.

Per projected weight the gradient of the batch is `G = (1/k) sum_i G_i`. With the
state's projector `P` (a step that keeps it), `G^T P = (1/k) sum_i G_i^T P`: one pass
over the microbatches, each marked with `P`, adding up their small factors. On a
refresh step every microbatch must use the same fresh projector, the range finder's
of `G`, which only needs products with `G`, and so sums of products with each `G_i`:

1. sketch pass: `Y = (1/k) sum_i G_i Ω` for the Gaussian test matrix `Ω` that the
   mark's range finder would draw from the same key; `Q = orth(Y)`;
2. (per power iteration, two more passes: `Q = orth(G orth(G^T Q))`);
3. `B = (1/k) sum_i G_i^T Q`, in two passes: one with `Q`'s first `rank` columns,
   written over the old projector (whose buffer is not read again), one with the
   oversampling's few other columns; then, as the range finder truncates, `U` the
   left singular vectors of `B^T` and `P = Q U_r`, written over the old projector
   again;
4. the pass of a step that keeps the projector, with `P`: `G^T P` (`= B U_r`).

That is the full batch's range finder, step for step; only the order of additions
differs. (Written for `m <= n`; a tall weight is projected on its columns, `G^T`.)
A refresh step runs steps 1-3 in the true branch of a `lax.cond`, then step 4 as
every step does: `4 + 2 * iters` passes.
"""

import functools
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
    orthonormal_columns,
    top_left_singular,
)
from .._core._unchecked import unchecked
from .._types.lowrank import LowRank
from .._types.rows import SparseRows
from ._apply import is_compressed
from ._galore_leaves import LeafPlan
from ._mark import flatten_as, leaf_keys, plan_leaves
from ._passes import DrawnSketch, GivenProjector, GivenSketch, Mode, mark_leaf
from ._projected import find_state


_WHERE = "`quax_tangents.optax.accumulate_gradients`"


def _test_keys(plan: LeafPlan, key: Any) -> Array:
    """The key data the mark's range finder draws `Ω` from: for a stack, one key per
    slice split from the leaf's key (as `projected_cotangent` splits it)."""
    if plan.batch:
        key = jax.random.split(key, math.prod(plan.batch)).reshape(plan.batch)
    return jax.random.key_data(key)


def _in_place_per_matrix(fn: Any, xs: tuple, layout: Any = None) -> Array:
    """`fn` of each matrix in the last two dims of `xs`, one after another, each
    result (of the shape and dtype of a matrix of `xs[0]`) written over that matrix
    of `xs[0]`: the float32 work is one matrix's size, and the only stack-sized
    buffer is the one `xs[0]` already holds. `layout`: the stack's sharding, or
    None (a loop's buffer is replicated unless constrained)."""
    batch = xs[0].shape[:-2]
    if not batch:
        return constrain(fn(*xs), layout)
    flat = [x.reshape(-1, *x.shape[-2:]) for x in xs]
    dtype = flat[0].dtype
    if len(batch) != 1:  # the layout is of the stack's own dims
        layout = None

    def body(i: Any, buffer: Array) -> Array:
        take = functools.partial(jax.lax.dynamic_index_in_dim, index=i, keepdims=False)
        out = fn(take(buffer), *map(take, flat[1:]))
        assert out.shape == flat[0].shape[1:] and out.dtype == dtype
        out = constrain(out, drop_leading(layout, 1))
        return constrain(jax.lax.dynamic_update_index_in_dim(buffer, out, i, 0), layout)

    buffer = constrain(flat[0], layout)
    buffer = jax.lax.fori_loop(0, flat[0].shape[0], body, buffer)
    return buffer.reshape(xs[0].shape)


def _orthonormal(x: Array, dtype: Any, layout: Any = None) -> Array:
    # The range finder's own orthonormalisation, so that the sums over microbatches
    # give the projector that one full batch gives; kept in the weight's dtype, and
    # written over the sums it replaces.
    def one(m: Array) -> Array:
        work = m.astype(jnp.promote_types(m.dtype, jnp.float32))
        return orthonormal_columns(work).astype(dtype)

    return _in_place_per_matrix(one, (x.astype(dtype),), layout)


def _write_columns(old: Array, basis: Array, rank: int, layout: Any) -> Array:
    """The first `rank` columns of `basis`, written over `old` matrix by matrix."""

    def first_columns(_: Array, q: Array) -> Array:
        return q[..., :rank].astype(old.dtype)

    return _in_place_per_matrix(first_columns, (old, basis), layout)


def _truncate(q: Array, q_extra: Array, b: Array, b_extra: Array, rank: int) -> Array:
    """The range finder's last step for one matrix, its basis `Q` and the product
    `B = G^T Q` each given as the first `rank` columns and the others: `U` the top
    left singular vectors of `B^T`, and `P = Q U` with its sign convention, in the
    dtype of `q`."""
    work = jnp.promote_types(q.dtype, jnp.float32)
    q_all = jnp.concatenate([q.astype(work), q_extra.astype(work)], axis=-1)
    b_all = jnp.concatenate([b.astype(work), b_extra.astype(work)], axis=-1)
    u = top_left_singular(b_all.T, rank)
    u = u * column_signs(q_all @ u)
    return (q_all @ u).astype(q.dtype)


# ---------------------------------------------------------------------------------------
# One pass over the microbatches


def _contribution(
    grad: Any, plan: LeafPlan | None, mode: "Mode | None", path: str
) -> Any:
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
        # The factor that is not the given matrix: G^T Q (given) or G Ω (sketch),
        # both on the side opposite the projector of a given projector's pass.
        projector_left = plan.side == "left"
        assert mode is not None  # a projected leaf always has a mode
        if mode.sketch:
            return grad.left if projector_left else grad.right
        return grad.right if projector_left else grad.left
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
        sketch = modes[i] is not None and modes[i].sketch
        return _layout(shardings[i], plans[i], x, sketch)

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
        parts = [
            _contribution(g, p, m, path)
            for g, p, m, path in zip(flat, plans, modes, paths)
        ]
        return loss, aux, parts

    # The carry starts as zeros shaped like one microbatch's contributions.
    first = jtu.tree_map(lambda x: x[0], microbatches)
    shapes = jax.eval_shape(one, first)
    summed = [not isinstance(s, SparseRows) for s in shapes[2]]
    # Projections with a given projector, and sketches with drawn test matrices, add
    # into the sum themselves.
    into = [
        p is not None and p.kind == "project" and m is not None and m.into
        for p, m in zip(plans, modes)
    ]

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
    would find from the batch's gradient with the same key: a first pass adds up
    the sketches `G_i Ω`, two more the products `G_i^T Q` with their orthonormal
    basis `Q` (its first `rank` columns, then the others), and the small SVD that
    truncates the range finder's oversampling gives the projector, written over
    the old one in place; then the pass of a step that keeps the projectors gives
    the small factors. Either way the result equals the full batch's projected
    gradient (`quax_tangents.optax.mark(params, state, key=key, iters=iters)` on
    the whole batch) up to float rounding. A refresh step costs `4 + 2 * iters`
    passes over the microbatches, other steps one (at `refresh_every=200`, 1%
    more passes than one per step).

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

    def given(matrices: list) -> list:
        return [None if q is None else GivenProjector(q) for q in matrices]

    def layout_of(i: int, x: Any, projector_side: bool) -> Any:
        return _layout(layouts[i], plans[i], x, projector_side)

    def fresh(projectors: list) -> list:
        """The new projectors of a refresh step, written over `projectors`."""
        # Each slice's test matrix is drawn inside the model's pass, from its key.
        first = [
            DrawnSketch(_test_keys(plans[i], key_of[i]), key_impl)
            if i in key_of
            else None
            for i in range(len(plans))
        ]

        def orthonormal(parts: list, projector_side: bool = True) -> list:
            # The projected leaves' parts only, laid out as the sums they replace.
            return [
                _orthonormal(x, leaves[i].dtype, layout_of(i, x, projector_side))
                if i in key_of
                else None
                for i, x in enumerate(parts)
            ]

        def sketch(tests: list) -> list:
            return [None if o is None else GivenSketch(o) for o in tests]

        bases = orthonormal(run(first)[2])
        for _ in range(iters):
            tests = orthonormal(run(given(bases))[2], projector_side=False)
            bases = orthonormal(run(sketch(tests))[2])
        # The first `rank` columns of each basis are written over the old projector,
        # whose buffer is not read again; the oversampling's few columns (at least
        # one: a projected leaf's smaller side exceeds its rank) go apart. One pass
        # with the whole basis instead, a pass fewer, held 23.98 against 22.84 GiB
        # at 7B for one TPU v5p chip (the basis beside the old projector) and
        # compiled in 65 against 67 s; at 1B on v5e, 6.73 GiB either way with 4
        # microbatches, 6.75 against 7.16 with one
        # (`benchmarks/bench_scale.py --target tpu-v5p --models 7B`).
        main, extra = [], []
        for i, (q, old) in enumerate(zip(bases, projectors)):
            if i not in key_of:
                main.append(None)
                extra.append(None)
                continue
            rank = plans[i].rank
            assert q.shape[-1] > rank
            main.append(_write_columns(old, q, rank, layout_of(i, old, True)))
            extra.append(q[..., rank:])
        products = run(given(main))[2]
        extra_products = run(given(extra))[2]
        new = []
        for i, old in enumerate(projectors):
            if i not in key_of:
                new.append(old)
                continue
            truncate = functools.partial(_truncate, rank=plans[i].rank)
            operands = (main[i], extra[i], products[i], extra_products[i])
            layout = layout_of(i, old, True)
            new.append(_in_place_per_matrix(truncate, operands, layout))
        return new

    if key_of:
        # The refresh is the true branch of a `lax.cond`; the pass with the new
        # projectors (or the kept ones) follows it. Computing the step's factors
        # from the refresh's own last pass instead (`B U`, two passes in all) held
        # more: 8.29 against 6.81 GiB at 1B for one TPU v5e chip
        # (`benchmarks/bench_scale.py --target tpu-v5e --models 1B`), its branch
        # holding the basis, its products, the projectors and the factors at once.
        projectors = jax.lax.cond(
            jnp.asarray(inner.refresh, bool),
            fresh,
            lambda current: list(current),
            list(projectors),
        )
    matrices = [q if i in key_of else None for i, q in enumerate(projectors)]
    loss, aux, factors = run(given(matrices))
    grads = _finish(plans, leaves, matrices, factors)
    grads = jtu.tree_unflatten(treedef, grads)
    return ((loss, aux) if has_aux else loss), grads
