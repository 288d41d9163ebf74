"""GaLore-style training on projected gradients: the base optimiser runs on the small
factor of each projected weight (per layer of a stacked weight), and row-sparse
gradients update only the rows read.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import Array, Bool, Int, PyTree

from .._core._fallback import record_densification
from .._core._layout import constrain, explicit_sharding
from .._marks._cotangents import Projector
from .._types.lowrank import LowRank
from .._types.rows import SparseRows
from ._apply import is_compressed, reject_compressed
from ._common import Filter, base_update, check_int
from ._galore_leaves import (
    NOT_A_PROJECTION_SUM,
    DimsSpec,
    LeafPlan,
    make_plan,
    project_dense,
    rebuild,
    split_low_rank,
)
from ._lazy_rows import distinct_rows, lazy_base_update, rows_update
from ._stacks import handing_whole, stacked_leaves


class ProjectedState(NamedTuple):
    """The state of [`quax_tangents.optax.projected`][].

    **Fields:**

    - `count`: steps taken (int32, saturating).
    - `refresh`: whether the next step computes fresh projectors.
    - `projector`: per projected leaf, viewed as a stack `(*batch, m, n)` of
        matrices, the projector of each matrix's smaller side, `(*batch, min(m, n),
        rank)`; `None` for the other leaves.
    - `base_state`: the base transformation's state, initialised on `(*batch,
        max(m, n), rank)` arrays for projected leaves and on the leaves themselves
        otherwise.
    - `plan`: per leaf, what `projected` does with it (static, no arrays): read by
        [`quax_tangents.optax.mark`][] and [`quax_tangents.optax.accumulate_gradients`][].
    """

    count: Int[Array, ""]  # pyright: ignore[reportIncompatibleMethodOverride]
    refresh: Bool[Array, ""]
    projector: PyTree
    base_state: Any
    plan: PyTree = None


_ONLY = (
    "`quax_tangents.optax.projected` takes, per leaf, a dense array, the `LowRank` "
    "gradient of `quax_tangents.projected_cotangent` (for a projected leaf) or a "
    "`SparseRows` gradient (for a leaf that is not projected)"
)

LearningRate = float | optax.Schedule | None


def learning_rate_at(learning_rate: float | optax.Schedule, count: Array) -> Array:
    """The learning rate at step `count`: a schedule's value there, or the float."""
    if callable(learning_rate):
        return jnp.asarray(learning_rate(count))
    return jnp.asarray(learning_rate)


def _step_size(learning_rate: LearningRate, count: Array) -> Any:
    """What the base direction is multiplied by: `-learning_rate` (at `count` for a
    schedule, as `optax.scale_by_learning_rate`), or 1 without a learning rate."""
    if learning_rate is None:
        return 1.0
    if callable(learning_rate):
        return -learning_rate_at(learning_rate, count)
    return -learning_rate


def _first_step_sign(base: optax.GradientTransformation) -> int:
    """`_step_sign`, once per `base` (a pipeline builds its transformation anew at
    each trace); uncached for a `base` that cannot be hashed."""
    try:
        return _cached_step_sign(base)
    except TypeError:  # `_step_sign` raises nothing: `base` is unhashable
        return _step_sign(base)


@functools.lru_cache(maxsize=64)
def _cached_step_sign(base: optax.GradientTransformation) -> int:
    return _step_sign(base)


def _step_sign(base: optax.GradientTransformation) -> int:
    """The sign of `base`'s first update for a gradient of ones: +1 for a direction
    (`optax.scale_by_adam()`), -1 for a step down the gradient, which holds a
    learning rate (`optax.adam(lr)`), 0 where it cannot tell (a zero first step, as
    a warmup from 0 gives, or a `base` that does not take a small vector alone)."""
    ones = np.ones((2,), np.float32)
    try:
        # Eagerly, even when the optimiser is built inside a traced function.
        with jax.ensure_compile_time_eval():
            update, _ = base.update(ones, base.init(ones))
            total = float(jnp.sum(jnp.asarray(update)))
    except Exception:  # a base that needs parameters, matrices or other inputs
        return 0
    return int(np.sign(total)) if np.isfinite(total) else 0


def check_step_sign(
    base: optax.GradientTransformation, learning_rate: LearningRate, where: str
) -> None:
    """Refuses a `base` that already steps down the gradient given a
    `learning_rate` as well, which would scale its steps a second time."""
    if learning_rate is None or _first_step_sign(base) >= 0:
        return
    raise ValueError(
        f"{where}: `base` already holds a learning rate: its first update for a "
        "gradient of ones is negative, a step down the gradient as `optax.adam(lr)` "
        "makes, and `learning_rate=` would scale each step a second time. Pass a "
        "direction as `base` (such as `optax.scale_by_adam()`) with "
        "`learning_rate=`, or leave `learning_rate=None`."
    )


def check_steps_descend(base: optax.GradientTransformation, where: str) -> None:
    """Refuses a `base` whose updates are a direction (`optax.scale_by_adam()`) with
    no learning rate: each step would climb the loss at a learning rate of 1."""
    if _first_step_sign(base) <= 0:
        return
    raise ValueError(
        f"{where}: `learning_rate` is None, so `base` must hold the learning rate, "
        "but its first update for a gradient of ones is positive: a direction, as "
        "`optax.scale_by_adam()` (the default `base`) gives, which would climb the "
        "loss at a learning rate of 1. Pass `learning_rate=` (a float or an optax "
        "schedule)."
    )


def _zeros_like_factor(plan: LeafPlan, leaf: Any, projector_side: bool) -> Array:
    """Zeros for a projector (`projector_side`) or a factor `G^T P` of `leaf`'s
    gradient, laid out like `leaf` under explicit mesh axes (there, a layout is part
    of the type that the step's gradients will have)."""
    shape = plan.projector_shape if projector_side else plan.factor_shape
    zeros = jnp.zeros(shape, leaf.dtype)
    if plan.is_view:
        return zeros
    return constrain(
        zeros, plan.factor_layout(explicit_sharding(leaf), shape, projector_side)
    )


def projected(
    base: optax.GradientTransformation,
    *,
    rank: int,
    learning_rate: LearningRate = None,
    refresh_every: int = 200,
    scale: float = 1.0,
    project: Filter = None,
    rows: Filter = None,
    dims: DimsSpec = None,
) -> optax.GradientTransformation:
    """GaLore on gradients that are already projected: `base` runs on the small
    factor of each projected weight only.

    For a weight `W` of shape `(m, n)` and its gradient `G`, with `m <= n` the
    projector `P` is `(m, rank)` with orthonormal columns, the small factor is
    `R = G^T P` `(n, rank)`, and the update is `-lr * scale * P base(R)^T`, returned
    as `LowRank(P, -lr * scale * base(R))`. With `m > n` the projector `Q` is
    `(n, rank)`, `R = G Q` `(m, rank)`, and the update is
    `LowRank(-lr * scale * base(R), Q)`. The state per projected weight is
    `base`'s state for a `(max(m, n), rank)` array plus the projector.

    A leaf of more than two dims, `(*batch, m, n)`, is a stack of matrices (the
    layers of a model whose blocks are stacked with `equinox.filter_vmap` and run by
    `lax.scan`): each `(m, n)` slice has its own projector, the projector state is
    `(*batch, min(m, n), rank)` and `base`'s state is on `(*batch, max(m, n),
    rank)`. `dims=` views a leaf as other matrices (a `(d, heads, head_dim)`
    projection as `(d, heads * head_dim)`).

    The gradient of a projected leaf is either

    - the `LowRank` that `quax_tangents.projected_cotangent` gives (with
        `projector_side` set, and `batch_ndim` the stack's dims), of the leaf's
        matrices `(*batch, m, n)` (for a leaf viewed with `dims=`, of its matrix
        view, as [`quax_tangents.optax.mark`][] makes it): its projector
        factor is taken as the leaf's projector (so on a refresh step the loss
        computes the new one, from the implicit gradient). Mark the parameters in
        the loss with [`quax_tangents.optax.mark`][]`(params, state)`. A `LowRank`
        that is not tagged as a projection (from `factored_cotangent` or
        `low_rank`) is refused, whatever its rank; or
    - a dense array, projected after the fact as `optax.contrib.galore` does: on a
        refresh step the projector of each slice becomes the top-`rank` singular
        vectors of that slice's smaller side. The whole gradient was then computed,
        so this is counted as a densification and follows
        [`quax_tangents.fallback`][] (a warning by default, an error under
        `"error"`): it is what a forgotten mark, or `jax.grad` of a marked loss,
        gives. Project dense gradients on purpose under `fallback("silent")`.

    The projectors are refreshed on the first step and every `refresh_every` steps
    after; between refreshes the projector stays fixed. The decision is carried in
    the state as an array, so one jitted step serves every step.

    Leaves that are not projected go through `base` as they are (`scale` does not
    apply to them; `learning_rate` does). A `SparseRows` gradient updates only the
    rows it stores, lazily (as TensorFlow's `LazyAdam`): `base`'s state keeps its
    full shape, and on each step only the rows read are gathered, updated and
    written back; the other rows' state (Adam's moments) is left as it was, not
    decayed. Fields of the state that are not per element (Adam's step count, and
    so its bias correction) advance every step, whether a row is read or not. A
    row read several times in one step is updated once, with its gradients summed,
    and the update stores each row read once (at most `num_rows` rows, however many
    were read). A stored row counts as read even when its values are zero. Lazy
    updates need a `base` whose state per parameter is elementwise
    (`scale_by_adam`, `scale_by_rms`, `trace`...).

    **Arguments:**

    - `base`: a transformation that takes no parameters, e.g.
        `optax.scale_by_adam()`. With `learning_rate=None` it holds the learning
        rate (`optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(lr))`).
        Nothing needs to follow `projected` in a chain: a transformation chained
        after it would scale both factors of each `LowRank` update, and raises a
        `TypeError` naming `learning_rate=` instead (see the sharp bits).
    - `rank`: the projection rank.
    - `learning_rate`: a float or an optax schedule (evaluated at the step count),
        applied to every update as `optax.scale_by_learning_rate` would; `None`
        when `base` applies it. Given with a `base` that already steps down the
        gradient (its first update for a gradient of ones is negative, as
        `optax.adam(lr)`'s), a `ValueError`: the learning rate would apply twice.
    - `refresh_every`: steps between projector refreshes.
    - `scale`: multiplies the updates of projected leaves (GaLore's alpha).
    - `project`: which leaves are projected, in any form `optax.masked` takes: a
        pytree of bools with the parameters' structure (an Equinox module
        included) or a prefix of it, or a callable that maps the parameters to one.
        `None` projects every leaf of 2 dims or more whose matrices' smaller side
        exceeds `rank`.
    - `rows`: which leaves are tables updated by rows (in the same forms):
        [`quax_tangents.optax.mark`][] marks them with
        `quax_tangents.sparse_rows_cotangent`, and they are not projected. A
        `SparseRows` gradient of any unprojected leaf is updated by rows, selected
        or not.
    - `dims`: how a leaf is viewed as a stack of matrices: a callable from a leaf
        to `(batch_ndim, row_ndim)` (its leading stack dims, then the dims that
        form the rows; the rest form the columns) or `None`, or a pytree of such
        pairs (or `None`) with the parameters' structure or a prefix of it. `None`
        (the default, and for a leaf): every dim but the last two is a stack dim.
        The updates of a leaf with other dims are `LowRank` values in the matrix
        view, which [`quax_tangents.optax.apply_updates`][] reshapes; its marked
        gradient ([`quax_tangents.optax.mark`][],
        [`quax_tangents.optax.accumulate_gradients`][]) is in the matrix view too.

    **Returns:**

    An `optax.GradientTransformation` whose state is a
    [`quax_tangents.optax.ProjectedState`][] and whose updates are `LowRank` for
    projected leaves, `SparseRows` for row-sparse ones, dense otherwise. Apply them
    with [`quax_tangents.optax.apply_updates`][].
    """
    rank = check_int("rank", rank, 1)
    refresh_every = check_int("refresh_every", refresh_every, 1)
    if not isinstance(base, optax.GradientTransformation):
        raise TypeError(
            f"`base` must be an optax.GradientTransformation, got {type(base).__name__}."
        )
    if learning_rate is not None and not (
        callable(learning_rate)
        or (
            isinstance(learning_rate, (int, float))
            and not isinstance(learning_rate, bool)
        )
    ):
        raise TypeError(
            "`learning_rate` must be a float, an optax schedule or None, got "
            f"{learning_rate!r}."
        )
    check_step_sign(base, learning_rate, "`quax_tangents.optax.projected`")

    def init(params: PyTree) -> ProjectedState:
        reject_compressed(
            params, "`projected(...).init`", "initialise it with the parameters."
        )
        leaves, treedef = jtu.tree_flatten(params)
        plan = make_plan(params, rank=rank, project=project, rows=rows, dims=dims)
        projectors, proxies = [], []
        for leaf_plan, leaf in zip(plan, leaves):
            if leaf_plan is not None and leaf_plan.kind == "project":
                projectors.append(_zeros_like_factor(leaf_plan, leaf, True))
                proxies.append(_zeros_like_factor(leaf_plan, leaf, False))
            else:
                projectors.append(None)
                proxies.append(leaf)
        return ProjectedState(
            count=jnp.zeros([], jnp.int32),
            refresh=jnp.ones([], bool),
            projector=jtu.tree_unflatten(treedef, projectors),
            base_state=base.init(jtu.tree_unflatten(treedef, proxies)),
            plan=jtu.tree_unflatten(treedef, plan),
        )

    def update(
        updates: PyTree, state: Any, params: PyTree = None
    ) -> tuple[PyTree, ProjectedState]:
        del params
        with_paths, treedef = jtu.tree_flatten_with_path(updates, is_leaf=is_compressed)
        paths = [jtu.keystr(path) or "the root" for path, _ in with_paths]
        grads = [grad for _, grad in with_paths]
        projectors = treedef.flatten_up_to(state.projector)
        plans = _flat_plan(state, treedef)
        prepared = [
            _prepare(grad, projector, plan, state.refresh, rank, path)
            for grad, projector, plan, path in zip(grads, projectors, plans, paths)
        ]
        new_projectors = [p[0] for p in prepared]
        proxies = [p[1] for p in prepared]
        rows_read = [p[2] for p in prepared]
        with handing_whole(stacked_leaves(state.plan)):
            if any(r is not None for r in rows_read):
                base_updates, base_state = lazy_base_update(
                    base, proxies, rows_read, state.base_state, treedef
                )
            else:
                out, base_state = base_update(
                    base,
                    jtu.tree_unflatten(treedef, proxies),
                    state.base_state,
                    "`quax_tangents.optax.projected`",
                )
                base_updates = treedef.flatten_up_to(out)
        step_size = _step_size(learning_rate, state.count)
        final = [
            _finish(grad, projector, plan, update, read, scale, step_size)
            for grad, projector, plan, update, read in zip(
                grads, new_projectors, plans, base_updates, rows_read
            )
        ]
        count = jnp.asarray(optax.safe_int32_increment(state.count))
        new_state = ProjectedState(
            count=count,
            refresh=jnp.asarray(count % refresh_every == 0),
            projector=jtu.tree_unflatten(treedef, new_projectors),
            base_state=base_state,
            plan=state.plan,
        )
        return jtu.tree_unflatten(treedef, final), new_state

    return optax.GradientTransformation(init, update)


def _flat_plan(state: ProjectedState, treedef: Any) -> list[LeafPlan | None]:
    if state.plan is None:
        return [None] * treedef.num_leaves
    return treedef.flatten_up_to(state.plan)


def _prepare(
    grad: Any,
    projector: Any,
    plan: LeafPlan | None,
    refresh: Array,
    rank: int,
    path: str,
):
    """(new projector, what `base` sees, rows read) for one leaf."""
    where = f"`quax_tangents.optax.projected`, leaf `{path}`"
    if grad is None:
        return projector, None, None
    if projector is not None:
        assert plan is not None and plan.kind == "project"
        if isinstance(grad, LowRank):
            new_projector, factor = split_low_rank(grad, plan, where)
            return new_projector, factor, None
        if is_compressed(grad):
            raise TypeError(
                f"{where}: got a {type(grad).__name__} gradient for a projected "
                f"leaf of shape {list(grad.shape)}. {_ONLY}; leave this leaf out "
                "with `project=`, or wrap a dense optimiser in "
                "`quax_tangents.optax.lift`."
            )
        _record_dense_gradient(path)
        new_projector, factor = project_dense(grad, projector, refresh, plan)
        return new_projector, factor, None
    if isinstance(grad, SparseRows):
        read, summed = distinct_rows(grad)
        return None, summed, read
    if isinstance(grad, LowRank):
        raise TypeError(_unprojected_low_rank(grad, rank, where))
    if is_compressed(grad):
        raise TypeError(
            f"{where}: got a {type(grad).__name__} gradient for a leaf of shape "
            f"{list(grad.shape)} that it does not project. {_ONLY}. Wrap a dense "
            "optimiser in `quax_tangents.optax.lift` for other compressed gradients."
        )
    return None, grad, None


def _record_dense_gradient(path: str) -> None:
    # A dense gradient here means the loss computed the whole gradient the
    # projection exists to avoid (no mark, or `jax.grad` of a marked loss): the step
    # is right but the saving is gone, so it is a densification like any other.
    record_densification(
        "quax_tangents.optax.projected",
        ("LowRank",),
        f"the gradient of the projected leaf `{path}` came dense, so the whole "
        "gradient was computed and is projected after the fact",
        fix="With `quax_tangents.optax.galore`, take the gradient with its "
        "`opt.value_and_grad(loss_fn)(params, state, batch)`, which marks for you "
        "(not `jax.value_and_grad`). Otherwise mark the weight inside the loss with "
        "`quax_tangents.optax.mark(params, state)` and take the gradient with "
        "`quax_tangents.grad` or `quax_tangents.value_and_grad` (`jax.grad` of a "
        "marked loss computes the dense gradient). To project dense gradients on "
        "purpose, as GaLore does, run the update under "
        "`quax_tangents.fallback('silent')`.",
    )


def _unprojected_low_rank(grad: LowRank, rank: int, where: str) -> str:
    shape = list(grad.shape)
    if grad.projector_side is None:
        return (
            f"{where}: got a LowRank gradient of shape {shape} that is not a "
            "projection (from `factored_cotangent` or `low_rank`) for a leaf it does "
            f"not project. {_ONLY}. Wrap a dense optimiser in "
            "`quax_tangents.optax.lift`, or mark the weight with "
            "`quax_tangents.optax.mark(params, state)`. "
            f"{NOT_A_PROJECTION_SUM}"
        )
    return (
        f"{where}: got a projected LowRank gradient of shape {shape} for a leaf "
        "that this optimiser does not project: `project=` (or the default, which "
        f"projects leaves of 2 dims or more whose matrices' smaller side exceeds "
        f"rank={rank}) leaves it out, or `rows=` selects it. Select the leaf with "
        "`project=` (with `dims=` to view it as other matrices), or mark it with "
        "`quax_tangents.optax.mark(params, state)`, which marks only the leaves "
        "projected."
    )


def _finish(
    grad: Any,
    projector: Any,
    plan: LeafPlan | None,
    update: Any,
    read: Any,
    scale: float,
    step_size: Any,
) -> Any:
    if grad is None:
        return None
    if projector is not None:
        assert plan is not None
        factor = (scale * step_size * update).astype(grad.dtype)
        return rebuild(plan, projector.astype(grad.dtype), factor)
    if read is not None:
        return rows_update(grad, read, step_size * update)
    if isinstance(step_size, float) and step_size == 1.0:
        return update
    return (step_size * update).astype(jnp.result_type(update))


_ACCUMULATE = (
    "`quax_tangents.optax.accumulate_gradients(loss_fn, params, state, microbatches)`"
)


def find_state(state: Any, where: str, accumulate: str = _ACCUMULATE) -> ProjectedState:
    """The one `ProjectedState` inside `state` (an `optax.chain`'s, say);
    `accumulate` names the way to accumulate microbatches, for the error that
    refuses `optax.MultiSteps`."""
    found = [
        node
        for node in jtu.tree_leaves(
            state, is_leaf=lambda x: isinstance(x, ProjectedState)
        )
        if isinstance(node, ProjectedState)
    ]
    if _inside_multi_steps(state) and found:
        raise TypeError(
            f"{where} was given the state of `optax.MultiSteps` around "
            "`quax_tangents.optax.projected`. MultiSteps adds the fields of the "
            "compressed gradients leaf by leaf, which is not their sum (each "
            f"microbatch's fresh projector differs). Accumulate microbatches with "
            f"{accumulate} inside one step instead."
        )
    if not found:
        raise ValueError(
            f"{where}: `state` must contain a state of "
            "`quax_tangents.optax.projected`, and it holds none (a "
            f"{type(state).__name__}). Pass the state that the optimiser's `init` "
            "returned (`opt.init(params)` for `quax_tangents.optax.galore`), in its "
            "place: `(params, state, ...)`."
        )
    if len(found) != 1:
        raise ValueError(
            f"{where}: `state` must contain exactly one state of "
            f"`quax_tangents.optax.projected`; found {len(found)}."
        )
    return found[0]


def _inside_multi_steps(state: Any) -> bool:
    nodes = jtu.tree_leaves(
        state, is_leaf=lambda x: isinstance(x, optax.MultiStepsState)
    )
    return any(isinstance(node, optax.MultiStepsState) for node in nodes)


def projectors(state: Any) -> PyTree:
    """What the loss passes to `quax_tangents.projected_cotangent` as `projector`,
    per projected leaf, for the next step of [`quax_tangents.optax.projected`][].
    [`quax_tangents.optax.mark`][] applies the marks with these projectors.

    **Arguments:**

    - `state`: the optimiser state, or a state that contains exactly one
        [`quax_tangents.optax.ProjectedState`][] (an `optax.chain`'s).

    **Returns:**

    A pytree with the parameters' structure: a [`quax_tangents.Projector`][] for
    each projected leaf (the current projector, `(*batch, min(m, n), rank)`, and
    whether this step replaces it by a fresh one) and `None` elsewhere.
    """
    inner = find_state(state, "`quax_tangents.optax.projectors`")
    return jtu.tree_map(
        lambda p: None if p is None else Projector(p, inner.refresh),
        inner.projector,
        is_leaf=lambda x: x is None,
    )
