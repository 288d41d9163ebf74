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
3. final pass: `B = (1/k) sum_i G_i^T Q`, with `Q` given as a projector of width
   `rank + oversample`; then, as the range finder truncates, `U` the left singular
   vectors of `B^T`, `P = Q U_r` and `G^T P = B U_r`.

That is the full batch's range finder, step for step; only the order of additions
differs. (Written for `m <= n`; a tall weight is projected on its columns, `G^T`.)
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PRNGKeyArray, PyTree

from .. import _ad
from .._cotangents import _mark as bind_mark, projected_cotangent, sparse_rows_cotangent
from .._projection import Finish, sketch_width, test_matrix
from .._sharding import column_signs, orthonormal_columns, top_left_singular
from .._types.lowrank import LowRank
from .._types.rows import SparseRows
from .._unchecked import unchecked
from ._apply import is_compressed
from ._galore_leaves import LeafPlan
from ._mark import leaf_keys, plan_leaves
from ._projected import find_state


_OVERSAMPLE = Finish("projected").oversample
_WHERE = "`quax_tangents.optax.accumulate_gradients`"


def _small_shape(plan: LeafPlan) -> tuple[int, int]:
    """The range finder's `(smaller side, larger side)` of one matrix."""
    return (min(plan.m, plan.n), max(plan.m, plan.n))


def _width(plan: LeafPlan) -> int:
    return sketch_width(_small_shape(plan), plan.rank, _OVERSAMPLE)


def _test_matrices(plan: LeafPlan, key: Any) -> Array:
    """`Ω` `(*batch, larger side, width)`, drawn as the mark's range finder draws it:
    for a stack, one key per slice split from the leaf's key."""
    draw = lambda k: test_matrix(k, _small_shape(plan), plan.rank, _OVERSAMPLE)  # noqa: E731
    if not plan.batch:
        return draw(key)
    keys = jax.random.split(key, math.prod(plan.batch)).reshape(plan.batch)
    for _ in plan.batch:
        draw = jax.vmap(draw)
    return draw(keys)


def _per_matrix(fn: Any, x: Array) -> Array:
    """`fn` of each matrix in the last two dims of `x`."""
    for _ in range(x.ndim - 2):
        fn = jax.vmap(fn)
    return fn(x)


def _orthonormal(x: Array) -> Array:
    # The range finder's own orthonormalisation, so that the sums over microbatches
    # give the projector that one full batch gives.
    work = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return _per_matrix(orthonormal_columns, work)


def _top_left_singular(b: Array, rank: int) -> Array:
    return _per_matrix(lambda m: top_left_singular(m, rank), b)


# ---------------------------------------------------------------------------------------
# One pass over the microbatches


def _is_viewed(plan: LeafPlan | None) -> bool:
    """Whether `dims=` views the leaf as other matrices than its own last two dims
    (a `(d, heads, head_dim)` projection as `(d, heads * head_dim)`)."""
    return (
        plan is not None and plan.kind == "project" and plan.shape != plan.matrix_shape
    )


def _matrix_view(leaf: Any, plan: LeafPlan | None) -> Any:
    # The dims of `plan` are contiguous (stack, rows, columns): a reshape is the view.
    return (
        leaf.reshape(plan.matrix_shape)
        if leaf is not None and _is_viewed(plan)
        else leaf
    )


def _marked(leaf: Any, plan: LeafPlan | None, mode: tuple[str, Any] | None) -> Any:
    """`leaf` (in its matrix view) marked as `mode` says, in the parameter's shape:
    a reshape that splits one side of a marked matrix keeps the mark, so the
    gradient of the view is the projection of the matrix that `dims=` names."""
    if plan is None or leaf is None:
        return leaf
    if plan.kind == "rows":
        return sparse_rows_cotangent(leaf)
    kind, matrix = mode  # type: ignore[misc]
    if kind == "given":
        width = matrix.shape[-1]
        marked = projected_cotangent(leaf, width, projector=matrix.astype(leaf.dtype))
    else:
        spec = Finish("projected", matrix.shape[-1], 0, "sketch")
        marked = bind_mark(spec, leaf, (matrix,))
    return marked.reshape(plan.shape) if _is_viewed(plan) else marked


def _contribution(grad: Any, plan: LeafPlan | None, mode: Any, path: str) -> Any:
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
        # both on the side opposite the projector in "given" mode.
        projector_left = plan.side == "left"
        if mode[0] == "sketch":
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
) -> tuple[Array, Any, list]:
    """(mean loss, stacked aux, mean contributions per leaf) over the microbatches."""
    paths = [
        jtu.keystr(p)
        for p, _ in jtu.tree_flatten_with_path(
            jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
        )[0]
    ]

    # Differentiated with respect to the matrix views of the leaves that `dims=`
    # views otherwise: JAX wants a cotangent of its primal's shape, and the
    # projection is a `LowRank` of the view, the form `projected` takes.
    leaves = treedef.flatten_up_to(params)
    views = jtu.tree_unflatten(
        treedef, [_matrix_view(x, p) for x, p in zip(leaves, plans)]
    )

    def loss_of(views: PyTree, batch: Any) -> Any:
        leaves = treedef.flatten_up_to(views)
        marked = [_marked(x, p, m) for x, p, m in zip(leaves, plans, modes)]
        return loss_fn(jtu.tree_unflatten(treedef, marked), batch)

    value_and_grad = _ad.value_and_grad(loss_of, has_aux=has_aux)

    def one(batch: Any) -> tuple[Array, Any, list]:
        value, grads = value_and_grad(views, batch)
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

    def body(carry: Any, batch: Any) -> tuple[Any, Any]:
        loss_sum, sums = carry
        loss, aux, parts = one(batch)
        sums = [
            (s + x if add else None) if x is not None else None
            for s, x, add in zip(sums, parts, summed)
        ]
        rows = [None if add else x for x, add in zip(parts, summed)]
        return (loss_sum + loss, sums), (aux, rows)

    zeros = [
        jnp.zeros(s.shape, s.dtype) if add and s is not None else None
        for s, add in zip(shapes[2], summed)
    ]
    init = (jnp.zeros(shapes[0].shape, shapes[0].dtype), zeros)
    (loss_sum, sums), (aux, rows) = jax.lax.scan(body, init, microbatches)
    k = jtu.tree_leaves(microbatches)[0].shape[0]
    means = [
        (s / k).astype(s.dtype) if add and s is not None else _rows_mean(r, k)
        for s, r, add in zip(sums, rows, summed)
    ]
    return loss_sum / k, aux, means


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
    the sketches `G_i Ω`, a second the products `G_i^T Q` with their orthonormal
    basis `Q`, and the small SVD that truncates the range finder's oversampling
    gives the projector and the small factor. Either way the result equals the
    full batch's projected gradient (`quax_tangents.optax.mark(params, state,
    key=key, iters=iters)` on the whole batch) up to float rounding. A refresh step
    costs `2 + 2 * iters` passes over the microbatches, other steps one.

    Leaves chosen with `rows=` are marked with `sparse_rows_cotangent`; their
    gradient holds the rows of every microbatch. Other leaves are averaged densely.
    A leaf that `dims=` views as other matrices (a `(d, heads, head_dim)`
    projection as `(d, heads * head_dim)`) is marked in that view, and its gradient
    is a `LowRank` of the matrix view, not of the leaf's shape: the form `projected`
    takes (`quax_tangents.optax.mark` cannot do this, and leaves such a leaf dense).

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

    **Returns:**

    `(loss, grads)`, or `((loss, aux), grads)` with `aux` stacked over the
    microbatches: the mean loss, and the gradients of the mean loss (`LowRank` with
    `projector_side` for projected leaves, in their matrix view, `SparseRows` for row leaves, dense
    otherwise), ready for `projected`'s `update`.
    """
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"`iters` must be a non-negative int, got {iters!r}.")
    inner = find_state(state, _WHERE)
    plans, leaves, projectors, treedef = plan_leaves(inner, params, _WHERE)
    if not jtu.tree_leaves(microbatches):
        raise ValueError(f"{_WHERE}: `microbatches` has no arrays.")
    projected = [
        i for i, p in enumerate(plans) if p is not None and p.kind == "project"
    ]
    keys = leaf_keys(key, inner, len(projected))
    key_of = {i: keys[j] for j, i in enumerate(projected)}

    def run(modes: list) -> tuple[Array, Any, list]:
        return _pass(loss_fn, params, microbatches, plans, treedef, modes, has_aux)

    def given(matrices: list) -> list:
        return [None if q is None else ("given", q) for q in matrices]

    def steady(projectors: list) -> tuple[Array, Any, list]:
        matrices = [q if i in key_of else None for i, q in enumerate(projectors)]
        loss, aux, factors = run(given(matrices))
        return loss, aux, _finish(plans, leaves, matrices, factors)

    def refresh(projectors: list) -> tuple[Array, Any, list]:
        del projectors
        omegas = [
            _test_matrices(plans[i], key_of[i]) if i in key_of else None
            for i in range(len(plans))
        ]

        def orthonormal(parts: list) -> list:  # the projected leaves' parts only
            return [
                _orthonormal(x) if i in key_of else None for i, x in enumerate(parts)
            ]

        def sketch(tests: list) -> list:
            return [None if o is None else ("sketch", o) for o in tests]

        bases = orthonormal(run(sketch(omegas))[2])
        for _ in range(iters):
            tests = orthonormal(run(given(bases))[2])
            bases = orthonormal(run(sketch(tests))[2])
        loss, aux, products = run(given(bases))
        matrices, factors = [], []
        for i, (q, b) in enumerate(zip(bases, products)):
            if q is None:
                matrices.append(None)
                factors.append(b)
                continue
            b = b.astype(q.dtype)
            u = _top_left_singular(jnp.swapaxes(b, -1, -2), plans[i].rank)
            u = u * column_signs(q @ u)  # the sign convention of the range finder
            matrices.append(q @ u)
            factors.append(b @ u)
        return loss, aux, _finish(plans, leaves, matrices, factors)

    # The projectors enter as operands: traced, the steady branch does not check the
    # placeholder that a refresh step carries (see `check_orthonormal`).
    if key_of:
        loss, aux, grads = jax.lax.cond(inner.refresh, refresh, steady, projectors)
    else:
        loss, aux, grads = steady(projectors)
    grads = jtu.tree_unflatten(treedef, grads)
    return ((loss, aux) if has_aux else loss), grads
