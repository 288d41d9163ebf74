"""GaLore-style training on projected gradients: the base optimiser runs on the small
factor of each projected weight, and row-sparse gradients update only the rows read.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import Array, Bool, Int, PyTree

from .._base import CompressedArray
from .._cotangents import Projector
from .._types.lowrank import LowRank
from .._types.rows import SparseRows
from .._unchecked import unchecked
from ._apply import is_compressed, reject_compressed
from ._common import Filter, check_int, filter_flags


class ProjectedState(NamedTuple):
    """The state of [`quax_tangents.optax.projected`][].

    **Fields:**

    - `count`: steps taken (int32, saturating).
    - `refresh`: whether the next step computes fresh projectors.
    - `projector`: per projected leaf of shape `(m, n)`, the projector of its smaller
        side, `(min(m, n), rank)`; `None` for the other leaves.
    - `base_state`: the base transformation's state, initialised on `(max(m, n),
        rank)` arrays for projected leaves and on the leaves themselves otherwise.
    """

    count: Int[Array, ""]  # pyright: ignore[reportIncompatibleMethodOverride]
    refresh: Bool[Array, ""]
    projector: PyTree
    base_state: Any


_ONLY = (
    "`quax_tangents.optax.projected` takes, per leaf, a dense array, the `LowRank` "
    "gradient of `quax_tangents.projected_cotangent` (for a projected leaf) or a "
    "`SparseRows` gradient (for a leaf that is not projected)"
)


# ---------------------------------------------------------------------------------------
# Sides and shapes


def _projects_rows(shape: tuple[int, ...]) -> bool:
    """Whether a weight `(m, n)` is projected on its rows (`m <= n`: `P` is `(m, r)`
    and the small factor `G^T P` is `(n, r)`), else on its columns."""
    m, n = shape
    return m <= n


def _projector_shape(shape: tuple[int, ...], rank: int) -> tuple[int, int]:
    return (min(shape), rank)


def _factor_shape(shape: tuple[int, ...], rank: int) -> tuple[int, int]:
    return (max(shape), rank)


def _default_plan(rank: int, params: PyTree, project: Filter) -> list[bool]:
    flags = filter_flags(project, params)
    plan = []
    for flag, leaf in zip(flags, jtu.tree_leaves(params)):
        chosen = flag and jnp.ndim(leaf) == 2 and rank < min(jnp.shape(leaf))
        if flag and project is not None and not chosen:
            raise ValueError(
                f"`project` selects a leaf of shape {list(jnp.shape(leaf))}, which "
                f"cannot be projected at rank {rank}: only 2-d leaves whose smaller "
                "side exceeds `rank` can."
            )
        plan.append(chosen)
    return plan


# ---------------------------------------------------------------------------------------
# Projecting one leaf's gradient


def _fresh_projector(grad: Array, rank: int) -> Array:
    """The top-`rank` singular vectors of the smaller side of a dense gradient."""
    g = grad.astype(jnp.float32)
    if _projects_rows(grad.shape):
        u, _, _ = jnp.linalg.svd(g, full_matrices=False)
        return u[:, :rank].astype(grad.dtype)
    _, _, vh = jnp.linalg.svd(g, full_matrices=False)
    return vh[:rank].T.astype(grad.dtype)


def _project_dense(
    grad: Array, projector: Array, refresh: Array, rank: int
) -> tuple[Array, Array]:
    """A dense gradient projected after the fact, as GaLore does: the projector is
    replaced on refresh steps. Returns (projector, small factor)."""
    projector = jax.lax.cond(
        refresh, lambda: _fresh_projector(grad, rank), lambda: projector
    )
    if _projects_rows(grad.shape):
        return projector, grad.T @ projector
    return projector, grad @ projector


def _split_low_rank(grad: LowRank, shape: tuple[int, ...], rank: int, where: str):
    """(projector, small factor) of a projected gradient."""
    expected = (_projector_shape(shape, rank), _factor_shape(shape, rank))
    if _projects_rows(shape):
        got = (grad.left, grad.right)
    else:
        got = (grad.right, grad.left)
    if grad.left.ndim != 2 or (got[0].shape, got[1].shape) != expected:
        raise TypeError(
            f"{where}: a LowRank gradient with factors {list(grad.left.shape)} and "
            f"{list(grad.right.shape)} is not the projection of a {list(shape)} "
            f"weight at rank {rank}. Mark the weight with "
            f"`quax_tangents.projected_cotangent(w, {rank}, projector=...)` using "
            "`quax_tangents.optax.projectors(state)`, or use "
            "`quax_tangents.optax.lift` on a dense optimiser."
        )
    return got


def _rebuild(shape: tuple[int, ...], projector: Array, factor: Array) -> LowRank:
    # Computed from the gradient: a NaN in it flows on, as in a dense optimiser.
    if _projects_rows(shape):
        return unchecked(LowRank, left=projector, right=factor)
    return unchecked(LowRank, left=factor, right=projector)


# ---------------------------------------------------------------------------------------
# Row-sparse leaves: lazy updates


def _distinct_rows(grad: SparseRows) -> tuple[Array, Array]:
    """The distinct rows read (sorted; unused slots hold `num_rows`, out of range)
    and each one's summed gradient row. There are at most `min(k, num_rows)`."""
    size = min(grad.k, grad.num_rows)
    rows = jnp.unique(grad.indices, size=size, fill_value=grad.num_rows)
    position = jnp.searchsorted(rows, grad.indices)
    summed = jnp.zeros((size, *grad.row_shape), grad.dtype)
    summed = summed.at[position].add(grad.rows)
    return rows, summed


def _gather(state_leaf: Array, rows: Array | None) -> Array:
    if rows is None:
        return state_leaf
    return state_leaf.at[rows].get(mode="fill", fill_value=0)


def _scatter(old: Any, new: Any, rows: Any) -> Any:
    if rows is None:
        return new
    return old.at[rows].set(new, mode="drop")


def _param_slots(base: optax.GradientTransformation, state: Any, tree: PyTree) -> Any:
    """`state`'s structure with each copy of the parameter tree replaced by `tree`,
    and `None` in the other fields."""
    return optax.tree_map_params(
        base,
        lambda _, value: value,
        state,
        tree,
        transform_non_params=lambda _: None,
        is_leaf=lambda x: x is None,
    )


def _lazy_base_update(
    base: optax.GradientTransformation,
    proxies: list[Any],
    rows: list[Array | None],
    state: Any,
    treedef: Any,
) -> tuple[list[Any], Any]:
    """Runs `base` once on every leaf, with the state of row-sparse leaves cut down
    to the rows read and written back afterwards."""
    rows_tree = jtu.tree_unflatten(treedef, rows)
    cut = optax.tree_map_params(
        base,
        _gather,
        state,
        rows_tree,
        is_leaf=lambda x: x is None,
    )
    updates, new_cut = base.update(jtu.tree_unflatten(treedef, proxies), cut)
    slots = _param_slots(base, state, rows_tree)
    new_state = jtu.tree_map(
        _scatter, state, new_cut, slots, is_leaf=lambda x: x is None
    )
    return treedef.flatten_up_to(updates), new_state


def _rows_update(grad: SparseRows, rows: Array, update: Array) -> SparseRows:
    unused = rows == grad.num_rows
    per_row = unused.reshape(-1, *(1,) * len(grad.row_shape))
    update = jnp.where(per_row, 0, update).astype(grad.dtype)
    return SparseRows.build(jnp.where(unused, 0, rows), update, grad.num_rows)


# ---------------------------------------------------------------------------------------
# The transformation


def projected(
    base: optax.GradientTransformation,
    *,
    rank: int,
    refresh_every: int = 200,
    scale: float = 1.0,
    project: Filter = None,
) -> optax.GradientTransformation:
    """GaLore on gradients that are already projected: `base` runs on the small
    factor of each projected weight only.

    For a weight `W` of shape `(m, n)` and its gradient `G`, with `m <= n` the
    projector `P` is `(m, rank)` with orthonormal columns, the small factor is
    `R = G^T P` `(n, rank)`, and the update is `scale * P base(R)^T`, returned as
    `LowRank(P, scale * base(R))`. With `m > n` the projector `Q` is `(n, rank)`,
    `R = G Q` `(m, rank)`, and the update is `LowRank(scale * base(R), Q)`. The
    state per projected weight is `base`'s state for a `(max(m, n), rank)` array
    plus the projector.

    The gradient of a projected leaf is either

    - the `LowRank` that `quax_tangents.projected_cotangent` gives: its projector
        factor is taken as the leaf's projector (so on a refresh step the loss
        computes the new one, from the implicit gradient). Pass
        [`quax_tangents.optax.projectors`][]`(state)` as the loss's projectors; or
    - a dense array, projected after the fact as `optax.contrib.galore` does: on a
        refresh step the projector becomes the top-`rank` singular vectors of the
        gradient's smaller side.

    The projectors are refreshed on the first step and every `refresh_every` steps
    after; between refreshes the projector stays fixed. The decision is carried in
    the state as an array, so one jitted step serves every step.

    Leaves that are not projected go through `base` as they are (`scale` does not
    apply to them). A `SparseRows` gradient updates only the rows it stores, lazily
    (as TensorFlow's `LazyAdam`): `base`'s state keeps its full shape, and on each
    step only the rows read are gathered, updated and written back; the other rows'
    state (Adam's moments) is left as it was, not decayed. Fields of the state that
    are not per element (Adam's step count, and so its bias correction) advance
    every step, whether a row is read or not. A row read several times in one step
    is updated once, with its gradients summed, and the update stores each row
    read once (at most `num_rows` rows, however many were read). A stored row
    counts as read even when its values are zero. Lazy updates need a `base` whose
    state per parameter is elementwise (`scale_by_adam`, `scale_by_rms`,
    `trace`...).

    **Arguments:**

    - `base`: a transformation that takes no parameters, with the learning rate
        in it, e.g. `optax.chain(optax.scale_by_adam(),
        optax.scale_by_learning_rate(1e-3))`. Do not chain a transformation
        *after* `projected`: optax would scale both factors of each `LowRank`
        update (see the sharp bits).
    - `rank`: the projection rank.
    - `refresh_every`: steps between projector refreshes.
    - `scale`: multiplies the updates of projected leaves (GaLore's alpha).
    - `project`: which leaves are projected: `None` for every 2-d leaf whose
        smaller side exceeds `rank`, or a callable or pytree of bools over the
        parameters (as in `optax.masked`). Leave out a table whose gradient is
        `SparseRows`.

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

    def init(params: PyTree) -> ProjectedState:
        reject_compressed(
            params, "`projected(...).init`", "initialise it with the parameters."
        )
        leaves, treedef = jtu.tree_flatten(params)
        plan = _default_plan(rank, params, project)
        projectors, proxies = [], []
        for chosen, leaf in zip(plan, leaves):
            if chosen:
                shape = jnp.shape(leaf)
                projectors.append(jnp.zeros(_projector_shape(shape, rank), leaf.dtype))
                proxies.append(jnp.zeros(_factor_shape(shape, rank), leaf.dtype))
            else:
                projectors.append(None)
                proxies.append(leaf)
        return ProjectedState(
            count=jnp.zeros([], jnp.int32),
            refresh=jnp.ones([], bool),
            projector=jtu.tree_unflatten(treedef, projectors),
            base_state=base.init(jtu.tree_unflatten(treedef, proxies)),
        )

    def update(
        updates: PyTree, state: Any, params: PyTree = None
    ) -> tuple[PyTree, ProjectedState]:
        del params
        grads, treedef = jtu.tree_flatten(updates, is_leaf=is_compressed)
        projectors = treedef.flatten_up_to(state.projector)
        new_projectors, proxies, rows = [], [], []
        for grad, projector in zip(grads, projectors):
            new_projector, proxy, read = _prepare(grad, projector, state.refresh, rank)
            new_projectors.append(new_projector)
            proxies.append(proxy)
            rows.append(read)
        if any(r is not None for r in rows):
            base_updates, base_state = _lazy_base_update(
                base, proxies, rows, state.base_state, treedef
            )
        else:
            out, base_state = base.update(
                jtu.tree_unflatten(treedef, proxies), state.base_state
            )
            base_updates = treedef.flatten_up_to(out)
        final = [
            _finish(grad, projector, update, read, scale)
            for grad, projector, update, read in zip(
                grads, new_projectors, base_updates, rows
            )
        ]
        count = jnp.asarray(optax.safe_int32_increment(state.count))
        new_state = ProjectedState(
            count=count,
            refresh=jnp.asarray(count % refresh_every == 0),
            projector=jtu.tree_unflatten(treedef, new_projectors),
            base_state=base_state,
        )
        return jtu.tree_unflatten(treedef, final), new_state

    return optax.GradientTransformation(init, update)


def _prepare(grad: Any, projector: Any, refresh: Array, rank: int):
    """(new projector, what `base` sees, rows read) for one leaf."""
    where = "`quax_tangents.optax.projected`"
    if grad is None:
        return projector, None, None
    if projector is not None:
        shape = tuple(grad.shape)
        if isinstance(grad, LowRank):
            new_projector, factor = _split_low_rank(grad, shape, rank, where)
            return new_projector, factor, None
        if is_compressed(grad):
            raise TypeError(
                f"{where} got a {type(grad).__name__} gradient for a projected "
                f"{list(shape)} leaf. {_ONLY}; leave this leaf out with `project=`, "
                "or wrap a dense optimiser in `quax_tangents.optax.lift`."
            )
        new_projector, factor = _project_dense(grad, projector, refresh, rank)
        return new_projector, factor, None
    if isinstance(grad, SparseRows):
        read, summed = _distinct_rows(grad)
        return None, summed, read
    if isinstance(grad, CompressedArray):
        raise TypeError(
            f"{where} got a {type(grad).__name__} gradient for a leaf of shape "
            f"{list(grad.shape)} that it does not project. {_ONLY}. Select the leaf "
            "with `project=` (for a LowRank), or wrap a dense optimiser in "
            "`quax_tangents.optax.lift`."
        )
    return None, grad, None


def _finish(grad: Any, projector: Any, update: Any, read: Any, scale: float) -> Any:
    if grad is None:
        return None
    if projector is not None:
        factor = (scale * update).astype(grad.dtype)
        return _rebuild(tuple(grad.shape), projector.astype(grad.dtype), factor)
    if read is not None:
        return _rows_update(grad, read, update)
    return update


def projectors(state: Any) -> PyTree:
    """What the loss passes to `quax_tangents.projected_cotangent` as `projector`,
    per projected leaf, for the next step of [`quax_tangents.optax.projected`][].

    **Arguments:**

    - `state`: the optimiser state, or a state that contains exactly one
        [`quax_tangents.optax.ProjectedState`][] (an `optax.chain`'s).

    **Returns:**

    A pytree with the parameters' structure: a [`quax_tangents.Projector`][] for
    each projected leaf (the current projector, and whether this step replaces it
    by a fresh one) and `None` elsewhere.
    """
    found = [
        node
        for node in jtu.tree_leaves(
            state, is_leaf=lambda x: isinstance(x, ProjectedState)
        )
        if isinstance(node, ProjectedState)
    ]
    if len(found) != 1:
        raise ValueError(
            "`state` must contain exactly one state of "
            f"`quax_tangents.optax.projected`; found {len(found)}."
        )
    (inner,) = found
    return jtu.tree_map(
        lambda p: None if p is None else Projector(p, inner.refresh),
        inner.projector,
        is_leaf=lambda x: x is None,
    )
