"""The `LowRank` type, and the helpers its rules share: outputs built unchecked, the
rank budget, and densifications recorded with their reason."""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..._core import _validate
from ..._core._base import CompressedArray
from ..._core._devices import (
    axis_size,
    dense_all_reduce,
    gather_along,
    shared_factor,
)
from ..._core._fallback import (
    Recompress,
    budget_settings,
    record_budget_event,
    record_dense_result,
)
from ..._core._sharding import factored_type
from ..._core._unchecked import unchecked


class LowRank(CompressedArray):
    """The array `left @ swapaxes(right, -1, -2)` of shape `(..., m, n)`.

    Leading dimensions are batch dimensions shared by both factors. Storage is
    `r * (m + n)` elements per matrix instead of `m * n`.

    **Arguments:**

    - `left`: floating array of shape `(..., m, r)`.
    - `right`: floating array of shape `(..., n, r)`, same dtype and leading dims.
    - `projector_side`: `"left"` when `left` is an orthonormal projector (the
        `LowRank(P, G^T P)` of `projected_cotangent`), `"right"` when `right` is, or
        `None` (the default). Static. Rules that keep the projection (a scalar
        multiple, `neg`, a cast, the sum of two values with the same projector)
        keep it; every other rule drops it.
    """

    left: Float[Array, "*batch m r"]
    right: Float[Array, "*batch n r"]
    projector_side: str | None = eqx.field(static=True, default=None)

    def __check_init__(self) -> None:
        _validate.check_ndim("left", self.left, 2)
        _validate.check_ndim("right", self.right, 2)
        _validate.check_floating("left", self.left)
        _validate.check_floating("right", self.right)
        _validate.check_same_dtype(left=self.left, right=self.right)
        left_shape, right_shape = jnp.shape(self.left), jnp.shape(self.right)
        if left_shape[:-2] != right_shape[:-2] or left_shape[-1] != right_shape[-1]:
            raise ValueError(
                f"`left` has shape {left_shape} and `right` has shape {right_shape}; "
                "they must be (..., m, r) and (..., n, r) with the same leading dims "
                "and the same rank r."
            )
        if left_shape[-1] < 1:
            raise ValueError("`left` and `right` must have rank r >= 1.")
        if self.projector_side not in (None, "left", "right"):
            raise ValueError(
                "`projector_side` must be None, 'left' or 'right', got "
                f"{self.projector_side!r}."
            )
        _validate.check_finite("left", self.left)
        _validate.check_finite("right", self.right)

    @property
    def rank(self) -> int:
        """The number of columns of each factor."""
        return self.left.shape[-1]

    @property
    def batch_ndim(self) -> int:
        return self.left.ndim - 2

    def aval(self) -> jax.core.ShapedArray:
        shape = self.left.shape[:-1] + self.right.shape[-2:-1]
        return factored_type(shape, self.left.dtype, self.left, self.right)

    def materialise(self) -> Array:
        return jnp.matmul(self.left, jnp.swapaxes(self.right, -1, -2))

    @classmethod
    def join_branches(cls, values: Sequence[CompressedArray]) -> Any:
        # Zero columns add nothing: pad every branch to the largest rank.
        if len({(v.shape, v.dtype) for v in values}) != 1:
            return None
        rank = max(v.rank for v in values)  # type: ignore[attr-defined]
        sides = {v.projector_side for v in values}  # type: ignore[attr-defined]
        side = sides.pop() if len(sides) == 1 else None
        # A zero-padded projector is no longer orthonormal.
        side = side if all(v.rank == rank for v in values) else None  # type: ignore[attr-defined]
        return lambda x: x.pad_rank(rank).with_projector_side(side)

    def fit_carry(self, like: CompressedArray) -> "LowRank | None":
        if not isinstance(like, LowRank) or (like.shape, like.dtype) != (
            self.shape,
            self.dtype,
        ):
            return None
        if self.projector_side != like.projector_side:
            if like.projector_side is not None:
                return None  # the carry that enters must drop its side first
            return self.with_projector_side(None).fit_carry(like)
        if self.rank <= like.rank:
            return self.pad_rank(like.rank)
        action, _ = budget_settings()
        if not isinstance(action, Recompress):
            raise TypeError(
                f"the carry enters the body as a LowRank of rank {like.rank} and "
                f"leaves it with rank {self.rank}, so its rank would grow every "
                "step. Truncate it back each step with "
                "`quax_tangents.rank_budget(quax_tangents.Recompress())`, or "
                "materialise it before the loop."
            )
        record_budget_event("loop carry", "recompress")
        return _lowrank(*truncate(self.left, self.right, like.rank))

    def pad_rank(self, rank: int) -> "LowRank":
        """The same array with factors zero-padded to `rank` columns (no longer a
        projection: `projector_side` is dropped when columns are added)."""
        extra = rank - self.rank
        if extra <= 0:
            return self
        pad = [(0, 0)] * (self.left.ndim - 1) + [(0, extra)]
        return _lowrank(jnp.pad(self.left, pad), jnp.pad(self.right, pad))

    def with_projector_side(self, side: str | None) -> "LowRank":
        """The same factors with `projector_side` set to `side`."""
        if side == self.projector_side:
            return self
        return _lowrank(self.left, self.right, side)

    def all_reduce(self, axis_name: Any, *, mean: bool = False) -> "LowRank":
        # Results are built unchecked: their factors are sums or copies of checked
        # ones. A factor that JAX types as the same on every device (a projector passed
        # in replicated) factors out of the sum: all-reduce only the other one.
        shared = shared_factor(self, axis_name)
        # A projection summed over its shared projector is still one.
        side = self.projector_side if self.projector_side == shared else None
        if shared == "left":
            return _lowrank(
                self.left, dense_all_reduce(self.right, axis_name, mean=mean), side
            )
        if shared == "right":
            return _lowrank(
                dense_all_reduce(self.left, axis_name, mean=mean), self.right, side
            )
        # Exact: every device's factors side by side, rank `devices * r`.
        left = gather_along(self.left, axis_name, axis=-1)
        right = gather_along(self.right, axis_name, axis=-1)
        if mean:
            left = left / jnp.asarray(axis_size(axis_name), left.dtype)
        return _lowrank(left, right)

    def inner(self, other: Any) -> Array:
        # sum_ij conj(a_ij) b_ij from the factors: never the m x n product.
        if isinstance(other, LowRank):
            left = jnp.matmul(jnp.swapaxes(jnp.conj(self.left), -1, -2), other.left)
            right = jnp.matmul(jnp.swapaxes(jnp.conj(self.right), -1, -2), other.right)
            return jnp.sum(left * right)
        if isinstance(other, CompressedArray):
            return jnp.conj(other.inner(self))
        other = jnp.asarray(other)
        if other.shape != self.shape:
            return super().inner(other)
        return jnp.conj(jnp.sum(self.left * jnp.matmul(jnp.conj(other), self.right)))


# ---------------------------------------------------------------------------------------
# Helpers shared by the rules


def _lowrank(left: Array, right: Array, projector_side: str | None = None) -> LowRank:
    """A rule's output, built without value checks (see `_unchecked`)."""
    return unchecked(LowRank, left=left, right=right, projector_side=projector_side)


def _scale_other(x: LowRank, fn: Any) -> LowRank:
    """`fn` applied to the factor that is not the projector (`left` when there is
    none): the same linear map of the array, keeping `projector_side`."""
    if x.projector_side == "left":
        return _lowrank(x.left, fn(x.right), "left")
    return _lowrank(fn(x.left), x.right, x.projector_side)


def _dense_from_factors(primitive: Any, result: Array, reason: str) -> Array:
    record_dense_result(primitive.name, ("LowRank",), result.shape, reason)
    return result


def _dot_dtype(params: dict, x: LowRank, d: Array) -> Any:
    """The dtype `dot_general` gives, without tracing it again."""
    preferred = params.get("preferred_element_type")
    return jnp.promote_types(x.dtype, d.dtype) if preferred is None else preferred


def _budget_rank(m: int, n: int) -> int:
    """The largest rank whose factors are still smaller than the dense matrix."""
    return max((m * n - 1) // (m + n), 1)


def truncate(left: Array, right: Array, rank: int) -> tuple[Array, Array]:
    """The best rank-`rank` approximation of `left @ right.T`, from the factors only."""
    dtype = left.dtype
    work = jnp.promote_types(dtype, jnp.float32)
    q_left, r_left = jnp.linalg.qr(left.astype(work))
    q_right, r_right = jnp.linalg.qr(right.astype(work))
    u, s, vt = jnp.linalg.svd(r_left @ jnp.swapaxes(r_right, -1, -2))
    new_left = (q_left @ u[..., :rank]) * s[..., None, :rank]
    new_right = q_right @ jnp.swapaxes(vt[..., :rank, :], -1, -2)
    return new_left.astype(dtype), new_right.astype(dtype)


# Projected gradients meet in a sum of different projector arrays where a loop carry
# or a `vmap` axis copies the projector, or where each microbatch drew its own.
_PROJECTIONS_HINT = (
    "; these are projected gradients whose projectors are different arrays (a "
    "`vmap` axis or a loop carry copies the projector, and on refresh steps each "
    "microbatch draws its own), so their sum is no longer a projection: sum "
    "microbatches with `quax_tangents.optax.accumulate_gradients`, which keeps one "
    "projector per step and adds the small factors"
)


def _projections_hint(*values: LowRank) -> str:
    """The hint for sums of projections, when every operand is one."""
    if all(v.projector_side is not None for v in values):
        return _PROJECTIONS_HINT
    return ""


def within_budget(
    primitive: Any, left: Array, right: Array, hint: str = ""
) -> LowRank | Array:
    """Builds the LowRank of concatenated factors, applying the rank budget. `hint`
    ends the densification's reason."""
    rank, (m, n) = left.shape[-1], (left.shape[-2], right.shape[-2])
    action, max_rank = budget_settings()
    limit = (
        _budget_rank(m, n) if max_rank is None else min(_budget_rank(m, n), max_rank)
    )
    if rank * (m + n) < m * n and (max_rank is None or rank <= max_rank):
        return _lowrank(left, right)
    if isinstance(action, Recompress):
        record_budget_event(primitive.name, "recompress")
        return _lowrank(*truncate(left, right, min(limit, rank)))
    product = jnp.matmul(left, jnp.swapaxes(right, -1, -2))
    return _dense_from_factors(
        primitive,
        product,
        f"rank {rank} is over the budget for {m}x{n}; see `quax_tangents.rank_budget`"
        + hint,
    )


def _broadcast_factors(x: LowRank, shape: tuple[int, ...]) -> tuple[Array, Array]:
    """The factors of `x` broadcast (numpy-style, size-1 dims) to `shape`; exact, since
    a size-1 matrix dim of the product is a size-1 dim of one factor."""
    lead, (m, n), r = tuple(shape[:-2]), shape[-2:], x.rank
    return (
        jnp.broadcast_to(x.left, (*lead, m, r)),
        jnp.broadcast_to(x.right, (*lead, n, r)),
    )
