"""Which leaves `projected` projects, as what matrices, and the projection of one
leaf's gradient: per slice of its leading (batch, layer) dims, onto the projector of
its smaller side."""

import math
from collections.abc import Callable
from typing import Any, Literal, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree

from .._core._layout import factor_layout
from .._core._unchecked import unchecked
from .._types.lowrank import LowRank
from ._common import Filter, mask_flags


Dims = tuple[int, int]
DimsSpec = Callable[[Any], Dims | None] | PyTree | None


class LeafPlan(eqx.Module):
    """What `projected` does with one leaf: `kind` is `"project"` (the leaf of
    `shape` is the stack `(*batch, m, n)` of matrices, its first `batch_ndim` dims
    the stack, the next `row_ndim` dims the rows `m` and the rest the columns `n`;
    marked, such a leaf's gradient is a `LowRank` of that matrix view) or `"rows"` (a table whose gradient holds the rows read). Static: it has no
    array leaves, so it rides in the state's tree structure."""

    kind: Literal["project", "rows"] = eqx.field(static=True)
    shape: tuple[int, ...] = eqx.field(static=True)
    batch_ndim: int = eqx.field(static=True, default=0)
    row_ndim: int = eqx.field(static=True, default=1)
    rank: int = eqx.field(static=True, default=0)

    @property
    def batch(self) -> tuple[int, ...]:
        return self.shape[: self.batch_ndim]

    @property
    def m(self) -> int:
        return math.prod(self.shape[self.batch_ndim : self.batch_ndim + self.row_ndim])

    @property
    def n(self) -> int:
        return math.prod(self.shape[self.batch_ndim + self.row_ndim :])

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        return (*self.batch, self.m, self.n)

    @property
    def is_view(self) -> bool:
        """Whether the matrices are not the leaf's own last two dims (`dims=`): its
        marks go on the matrix view, and its gradient comes back in it."""
        return self.batch_ndim != len(self.shape) - 2 or self.row_ndim != 1

    @property
    def side(self) -> str:
        """The factor of the gradient that holds the projector: `"left"` (`m <= n`,
        the rows are projected) or `"right"`."""
        return "left" if self.m <= self.n else "right"

    @property
    def projector_shape(self) -> tuple[int, ...]:
        return (*self.batch, min(self.m, self.n), self.rank)

    @property
    def factor_shape(self) -> tuple[int, ...]:
        return (*self.batch, max(self.m, self.n), self.rank)

    def factor_layout(
        self,
        sharding: Any,
        shape: tuple[int, ...],
        projector_side: bool,
        rows_first: bool = False,
    ) -> Any:
        """The layout of a factor `shape` of this leaf's gradient laid out by
        `sharding` (the weight's `NamedSharding`, or None: left to XLA), spread over
        the same mesh axes. `projector_side`: whether it spans the projector's side
        of the matrices (a sketch, a basis, a projector) rather than the other (a
        factor `G^T P`)."""
        if sharding is None:
            return None
        if self.kind != "project":
            return sharding
        on_rows = (self.side == "left") == projector_side
        side = -2 if on_rows else -1
        return factor_layout(
            sharding, len(self.matrix_shape), side, tuple(shape), rows_first
        )

    def describe(self) -> str:
        if not self.batch:
            return f"a ({self.m}, {self.n}) matrix"
        return f"a stack {list(self.batch)} of ({self.m}, {self.n}) matrices"


# ---------------------------------------------------------------------------------------
# Making the plan


def _default_dims(shape: tuple[int, ...]) -> Dims:
    return (len(shape) - 2, 1)


def _dims_per_leaf(dims: DimsSpec, params: PyTree) -> list[Dims | None]:
    """`(batch_ndim, row_ndim)` per array leaf of `params`, or None for the default
    (every dim but the last two is a stack dim)."""
    leaves = jtu.tree_leaves(params)
    if dims is None:
        return [None] * len(leaves)
    if callable(dims) and not isinstance(dims, eqx.Module):
        return [cast("Dims | None", dims(leaf)) for leaf in leaves]
    is_pair = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)  # noqa: E731
    default = object()  # None would vanish from the leaves below
    try:
        expanded = jtu.tree_map(
            lambda pair, sub: jtu.tree_map(
                lambda _: default if pair is None else pair, sub
            ),
            dims,
            params,
            is_leaf=lambda x: x is None or is_pair(x),
        )
    except ValueError as error:
        raise ValueError(
            "`dims` must be a callable from a leaf to `(batch_ndim, row_ndim)` or "
            "None, or a pytree of such pairs with the parameters' structure (or a "
            "prefix of it)."
        ) from error
    leaves = jtu.tree_leaves(expanded, is_leaf=is_pair)
    return [None if d is default else cast(Dims, d) for d in leaves]


def _check_dims(dims: Any, shape: tuple[int, ...], where: str) -> Dims:
    if (
        not isinstance(dims, tuple)
        or len(dims) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims)
        or dims[0] < 0
        or dims[1] < 1
        or sum(dims) >= len(shape)
    ):
        raise ValueError(
            f"`dims` gives {dims!r} for the leaf {where} of shape {list(shape)}; it "
            "must be `(batch_ndim, row_ndim)`: the leading stack dims, then the dims "
            "that form the rows, the rest the columns (at least one of each), e.g. "
            "`(1, 1)` for a stacked `(layers, d, heads, head_dim)` projection."
        )
    return dims


def _why_not(shape: tuple[int, ...], dims: Dims | None, rank: int) -> str | None:
    """Why a leaf cannot be projected at `rank`, or None if it can."""
    if len(shape) < 2:
        return "a leaf with fewer than 2 dims is no matrix; leave it out of `project=`"
    plan = LeafPlan("project", shape, *(dims or _default_dims(shape)), rank)
    if rank >= min(plan.m, plan.n):
        if min(plan.m, plan.n) == 1:  # a stack of vectors (a `(layers, d)` norm)
            return (
                f"it is {plan.describe()}, vectors, not matrices; leave it out of "
                "`project=`"
            )
        return (
            f"it is {plan.describe()}, whose smaller side {min(plan.m, plan.n)} does "
            f"not exceed `rank={rank}`; use a smaller rank, give `dims=` to view it "
            "as a larger matrix (for layers stacked on another axis than the first, "
            "store them on the first instead), or leave it out of `project=`"
        )
    return None


def make_plan(
    params: PyTree, *, rank: int, project: Filter, rows: Filter, dims: DimsSpec
) -> list[LeafPlan | None]:
    """One entry per array leaf of `params`: a `LeafPlan` or None (through `base`)."""
    paths_leaves = jtu.tree_flatten_with_path(params)[0]
    chosen = mask_flags(project, params, "project")
    row_flags = mask_flags(rows, params, "rows")
    per_leaf_dims = _dims_per_leaf(dims, params)
    plan: list[LeafPlan | None] = []
    for i, (path, leaf) in enumerate(paths_leaves):
        where = f"`{jtu.keystr(path) or 'the root'}`"
        shape = tuple(jnp.shape(leaf))
        leaf_dims = per_leaf_dims[i]
        if leaf_dims is not None:
            leaf_dims = _check_dims(leaf_dims, shape, where)
        if row_flags is not None and row_flags[i]:
            if chosen is not None and chosen[i]:
                raise ValueError(
                    f"Both `project` and `rows` select the leaf {where}; a leaf is "
                    "either projected or updated by rows."
                )
            if len(shape) < 2:
                raise ValueError(
                    f"`rows` selects the leaf {where} of shape {list(shape)}; only "
                    "tables (2 dims or more, rows first) are updated by rows."
                )
            plan.append(LeafPlan("rows", shape))
            continue
        why = _why_not(shape, leaf_dims, rank)
        if chosen is None:
            selected = why is None
        else:
            selected = chosen[i]
            if selected and why is not None:
                raise ValueError(
                    f"`project` selects the leaf {where} of shape {list(shape)}, which "
                    f"cannot be projected at rank {rank}: {why}."
                )
        if selected:
            batch_ndim, row_ndim = leaf_dims or _default_dims(shape)
            plan.append(LeafPlan("project", shape, batch_ndim, row_ndim, rank))
        else:
            plan.append(None)
    return plan


# ---------------------------------------------------------------------------------------
# Projecting one leaf's gradient


def _fresh_projector(grad: Array, plan: LeafPlan) -> Array:
    """Per slice, the top-`rank` singular vectors of the smaller side of a dense
    gradient (in the matrix view)."""
    g = grad.reshape(plan.matrix_shape).astype(jnp.float32)
    u, _, vh = jnp.linalg.svd(g, full_matrices=False)
    if plan.side == "left":
        return u[..., :, : plan.rank].astype(grad.dtype)
    return jnp.swapaxes(vh[..., : plan.rank, :], -1, -2).astype(grad.dtype)


def project_dense(
    grad: Array, projector: Array, refresh: Array, plan: LeafPlan
) -> tuple[Array, Array]:
    """A dense gradient projected after the fact, as GaLore does: the projector is
    replaced on refresh steps. Returns (projector, small factor), per slice."""
    projector = jax.lax.cond(
        refresh, lambda: _fresh_projector(grad, plan), lambda: projector
    )
    g = grad.reshape(plan.matrix_shape)
    if plan.side == "left":
        return projector, jnp.swapaxes(g, -1, -2) @ projector
    return projector, g @ projector


NOT_A_PROJECTION_SUM = (
    "A sum of projected gradients whose projectors are different arrays (summed "
    "over a `vmap` axis or in a loop carry, which copy the projector, or drawn per "
    "microbatch on a refresh step) is not a projection either: accumulate "
    "microbatches with `quax_tangents.optax.accumulate_gradients`."
)


def split_low_rank(grad: LowRank, plan: LeafPlan, where: str) -> tuple[Array, Array]:
    """(projector, small factor) of a projected gradient, after checking that it is
    one: tagged by `projected_cotangent`, on the side and at the rank planned."""
    fix = (
        "Mark the weight inside the loss with `quax_tangents.optax.mark(params, "
        "state)` (or `quax_tangents.projected_cotangent(w, rank, projector=...)` "
        "with `quax_tangents.optax.projectors(state)`), or wrap a dense optimiser in "
        "`quax_tangents.optax.lift`."
    )
    if grad.projector_side is None:
        raise TypeError(
            f"{where}: a LowRank gradient that is not a projection (its "
            "`projector_side` is None, as for `factored_cotangent` or `low_rank`) for "
            f"a projected leaf; its factors are not a projector and a small factor. "
            f"{fix} {NOT_A_PROJECTION_SUM}"
        )
    if plan.side == "left":
        got = (grad.left, grad.right)
    else:
        got = (grad.right, grad.left)
    shapes_ok = (jnp.shape(got[0]), jnp.shape(got[1])) == (
        plan.projector_shape,
        plan.factor_shape,
    )
    if grad.projector_side != plan.side or not shapes_ok:
        raise TypeError(
            f"{where}: a LowRank gradient with factors {list(grad.left.shape)} and "
            f"{list(grad.right.shape)} (projector on the {grad.projector_side}) is "
            f"not the projection of {plan.describe()} at rank {plan.rank}, whose "
            f"projector is the {plan.side} factor {list(plan.projector_shape)} and "
            f"whose small factor is {list(plan.factor_shape)}. {fix}"
        )
    return got


def rebuild(plan: LeafPlan, projector: Array, factor: Array) -> LowRank:
    """The update `projector`-side by side with `factor`, in the matrix view."""
    # Computed from the gradient: a NaN in it flows on, as in a dense optimiser.
    if plan.side == "left":
        return unchecked(LowRank, left=projector, right=factor)
    return unchecked(LowRank, left=factor, right=projector)
