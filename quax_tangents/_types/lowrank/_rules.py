"""`LowRank`: an array stored as two thin factors, `left @ swapaxes(right, -1, -2)`.

Every rule `LowRank` registers lives in this file. Where a result has no
low-rank form the rule computes it from the factors (never by materialising first when
a cheaper route exists) and records the densification with the fallback policy, unless
the result has at most one dimension other than 1, which no matrix factorisation could
hold anyway (`_fallback.record_dense_result`). Rules build their outputs unchecked.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, ArrayLike

from ..._core import _validate
from ..._core._base import densify
from ..._core._compat import psum_invariant_p, pvary_p, reshard_p
from ..._core._devices import (
    axis_size,
    dense_all_reduce,
    gather_along,
    shared_factor,
    vary_leaf,
)
from ..._core._fallback import (
    Recompress,
    budget_settings,
    is_vector_shape,
    record_dense_result,
    record_densification,
)
from ..._core._lax import add_any_p
from ..._core._registry import rule
from ..._core._sharding import varying_axes
from ._array import (
    LowRank,
    _broadcast_factors,
    _dense_from_factors,
    _dot_dtype,
    _lowrank,
    _projections_hint,
    _scale_other,
    within_budget,
)


# ---------------------------------------------------------------------------------------
# Elementwise rules


@rule(jax.lax.neg_p)
def _neg(x: LowRank) -> LowRank:
    return _scale_other(x, jnp.negative)


@rule(jax.lax.copy_p)
def _copy(x: LowRank) -> LowRank:
    return x


@rule(jax.lax.convert_element_type_p)
def _convert(x: LowRank, *, new_dtype: Any, **params: Any) -> LowRank | Array:
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return densify(
            jax.lax.convert_element_type_p,
            [x],
            dict(new_dtype=new_dtype, **params),
            reason="a non-floating result has no tangent-like low-rank form",
        )
    return _lowrank(
        x.left.astype(new_dtype), x.right.astype(new_dtype), x.projector_side
    )


@rule(jax.lax.mul_p, commutative=True)
def _mul_dense(x: LowRank, y: ArrayLike, **params: Any) -> LowRank | Array:
    """`x * y` for a dense `y` that is a scalar, a row vector or a column vector.

    lax.mul broadcasts size-1 dims, so `x * v` reaches us as shape (..., 1, n) or
    (..., m, 1). A full (..., m, n) operand has no low-rank product.
    """
    return _scaled(jax.lax.mul_p, jnp.multiply, x, y, params)


@rule(jax.lax.div_p)
def _div_dense(x: LowRank, y: ArrayLike, **params: Any) -> LowRank | Array:
    """`x / y` for a dense scalar, row or column vector `y` (as `jnp.mean` divides a
    sum): one factor divided, as for `mul`."""
    return _scaled(jax.lax.div_p, jnp.divide, x, y, params)


_OP_NAMES = {jax.lax.mul_p: "product with", jax.lax.div_p: "quotient by"}


def _scaled(
    primitive: Any, op: Any, x: LowRank, y: ArrayLike, params: dict
) -> LowRank | Array:
    """`op(x, y)` (a product or a quotient) for a dense scalar, row or column `y`,
    applied to one factor; a full matrix `y` is densified."""
    y = jnp.asarray(y)
    if y.ndim == 0:
        y = y.astype(x.dtype)
        if x.projector_side is not None:
            return _scale_other(x, lambda f: op(f, y))
        # Scale the factor that already varies over the mesh axes `y` varies over
        # (inside `shard_map`), so that the other keeps its narrower type.
        extra = varying_axes(y)
        if extra - varying_axes(x.left) and not extra - varying_axes(x.right):
            return _lowrank(x.left, op(x.right, y))
        return _lowrank(op(x.left, y), x.right)
    out_shape = jnp.broadcast_shapes(x.shape, y.shape)
    rows, cols = y.shape[-2:] if y.ndim >= 2 else (1, y.shape[-1])
    if rows != 1 and cols != 1:
        return densify(
            primitive,
            [x, y],
            params,
            reason=f"elementwise {_OP_NAMES[primitive]} a full matrix",
        )
    left, right = _broadcast_factors(x, out_shape)
    y = jnp.broadcast_to(y, (*out_shape[:-2], rows, cols)).astype(x.dtype)
    if cols == 1:
        left = op(left, y)
    else:
        right = op(right, jnp.swapaxes(y, -1, -2))
    return _lowrank(left, right)


def _shared_factor_sum(x: LowRank, y: LowRank, primitive: Any) -> LowRank | None:
    """`LowRank(P, A) + LowRank(P, B) = LowRank(P, A + B)`, exact at the same rank,
    when both operands hold the same factor object `P` (the same traced array: one
    projector shared by both, as in gradient accumulation). No values compared."""
    if x.shape != y.shape or x.rank != y.rank:
        return None
    sign = -1 if primitive is jax.lax.sub_p else 1
    side = x.projector_side if x.projector_side == y.projector_side else None
    if x.left is y.left:
        kept = "left" if side == "left" else None
        return _lowrank(x.left, x.right + sign * y.right, kept)
    if x.right is y.right:
        kept = "right" if side == "right" else None
        return _lowrank(x.left + sign * y.left, x.right, kept)
    if side is not None and _same_factor_shapes(x, y):
        return _projection_sum(x, y, side, sign)
    return None


def _same_factor_shapes(x: LowRank, y: LowRank) -> bool:
    return x.left.shape == y.left.shape and x.right.shape == y.right.shape


_DIFFERENT_PROJECTORS = (
    "A sum of two projected gradients (LowRank with projector_side={side!r}) whose "
    "projectors differ: their sum is no projection onto either, and keeping the "
    "rank would be wrong. This happens where a loop adds the gradients of a step "
    "that refreshes its projectors (each microbatch then draws its own): sum "
    "microbatches with `quax_tangents.optax.accumulate_gradients`, which keeps one "
    "projector per step; or drop the tags first (`g.with_projector_side(None)`) for "
    "the exact sum at twice the rank."
)


def _projection_sum(x: LowRank, y: LowRank, side: str, sign: int) -> LowRank:
    """`LowRank(P, A) + LowRank(P', B)` for two projections tagged on one side, held
    as different arrays (a loop carry and a new gradient, say): `LowRank(P, A + B)`,
    at the same rank, checked to have `P' == P`, eagerly when both are concrete and
    in the program otherwise (it raises there when they differ). Accumulating
    projected gradients in any loop form keeps the rank."""
    (p, a), (q, b) = (
        ((x.left, x.right), (y.left, y.right))
        if side == "left"
        else ((x.right, x.left), (y.right, y.left))
    )
    message = _DIFFERENT_PROJECTORS.format(side=side)
    differ = jnp.any(p != q)
    if _validate.is_concrete(differ):
        if bool(differ):
            raise ValueError(message)
    else:
        p = eqx.error_if(p, differ, message)
    total = a + sign * b
    if side == "left":
        return _lowrank(p, total, side)
    return _lowrank(total, p, side)


@rule(add_any_p, jax.lax.add_p, jax.lax.sub_p)
def _sum(x: LowRank, y: LowRank, *, primitive: Any) -> LowRank | Array:
    """Concatenates the factors; broadcasting size-1 dims first (`lax.add` allows
    them) is exact on the factors."""
    if x.dtype != y.dtype:
        raise TypeError(
            f"`{primitive.name}` of LowRank {x.dtype}{list(x.shape)} and LowRank "
            f"{y.dtype}{list(y.shape)}: dtypes must match; cast one first."
        )
    shared = _shared_factor_sum(x, y, primitive)
    if shared is not None:
        return shared
    shape = jnp.broadcast_shapes(x.shape, y.shape)
    (x_left, x_right), (y_left, y_right) = (
        _broadcast_factors(x, shape),
        _broadcast_factors(y, shape),
    )
    y_left = -y_left if primitive is jax.lax.sub_p else y_left
    left = jnp.concatenate([x_left, y_left], axis=-1)
    right = jnp.concatenate([x_right, y_right], axis=-1)
    return within_budget(primitive, left, right, _projections_hint(x, y))


# The usual way to reach `_plus_dense` with a whole weight: `optax.apply_updates`.
_ADD_INTO_WEIGHT = (
    "If this adds an optimiser's low-rank update into its weight, "
    "`quax_tangents.optax.apply_updates(params, updates)` (or `opt.apply` of "
    "`quax_tangents.optax.galore`) adds it as a matrix product, a stack one matrix at "
    "a time; `optax.apply_updates` and `param + update` make it a dense update first."
)


@rule(add_any_p, jax.lax.add_p, dense_output=True, commutative=True)
def _plus_dense(x: LowRank, y: ArrayLike, *, primitive: Any) -> Array:
    """A LowRank plus a dense array is dense, by design. `lax.add` broadcasts size-1
    dims of either operand: the LowRank's are broadcast in its factors, and the sum
    is recorded as a densification unless it is a vector (`record_dense_result`)."""
    y = jnp.asarray(y)
    if x.dtype != y.dtype or x.ndim != y.ndim:
        return densify(
            primitive, [x, y], {}, reason="dtypes or ranks differ", fix=_ADD_INTO_WEIGHT
        )
    shape = jnp.broadcast_shapes(x.shape, y.shape)
    record_dense_result(
        primitive.name,
        ("LowRank",),
        shape,
        "a sum with a dense array",
        _ADD_INTO_WEIGHT,
    )
    left, right = _broadcast_factors(x, shape)
    return y + jnp.matmul(left, jnp.swapaxes(right, -1, -2))


# ---------------------------------------------------------------------------------------
# Structural rules


@rule(jax.lax.transpose_p)
def _transpose(x: LowRank, *, permutation: tuple[int, ...]) -> LowRank | Array:
    nb = x.ndim - 2
    batch_perm, matrix_perm = tuple(permutation[:nb]), tuple(permutation[nb:])
    if sorted(batch_perm) != list(range(nb)):
        return densify(
            jax.lax.transpose_p,
            [x],
            dict(permutation=permutation),
            reason="the permutation mixes batch and matrix dims",
        )
    factor_perm = batch_perm + (nb, nb + 1)
    left = jnp.transpose(x.left, factor_perm)
    right = jnp.transpose(x.right, factor_perm)
    side = x.projector_side
    if matrix_perm == (nb, nb + 1):
        return _lowrank(left, right, side)
    swapped = {"left": "right", "right": "left"}.get(side) if side else None
    return _lowrank(right, left, swapped)


@rule(jax.lax.reshape_p)
def _reshape(
    x: LowRank, *, new_sizes: tuple[int, ...], **params: Any
) -> LowRank | Array:
    new_sizes = tuple(new_sizes)
    if params.get("dimensions") is None:
        if len(new_sizes) >= 2 and new_sizes[-2:] == x.shape[-2:]:
            lead = new_sizes[:-2]
            left = jnp.reshape(x.left, lead + x.left.shape[-2:])
            right = jnp.reshape(x.right, lead + x.right.shape[-2:])
            return _lowrank(left, right)
        if is_vector_shape(new_sizes):
            vector = jnp.reshape(x.materialise(), new_sizes)
            if math.prod(x.shape[-2:]) > 1:
                # A unit matrix dim squeezed away: JAX's JVP of a broadcasting
                # `add` or `sub` (a `(3, 1)` tangent against a `(3, 4)` primal) does
                # this, then broadcasts the vector to a dense matrix, outside any
                # rule. Counted here, where the factors are lost.
                record_densification(
                    jax.lax.reshape_p.name,
                    ("LowRank",),
                    f"a {list(x.shape)} LowRank squeezed to a vector "
                    f"{list(new_sizes)}, as JAX's JVP of an `add` or `sub` that "
                    "broadcasts a unit dim does before broadcasting it densely",
                    "Broadcast the operand to the full shape first (`jnp.broadcast_"
                    "to`, which keeps the factors), so that the sum is of equal "
                    "shapes.",
                )
                return vector
            return _dense_from_factors(jax.lax.reshape_p, vector, "a vector")
    return densify(
        jax.lax.reshape_p,
        [x],
        dict(new_sizes=new_sizes, **params),
        reason="the reshape changes the matrix dims",
    )


@rule(jax.lax.broadcast_in_dim_p)
def _broadcast(
    x: LowRank,
    *,
    shape: tuple[int, ...],
    broadcast_dimensions: tuple[int, ...],
    **params,
) -> LowRank | Array:
    """Keeps the factors when the matrix dims stay the last two (each may grow from
    size 1) and the batch dims keep their order."""
    dims, out_nd = tuple(broadcast_dimensions), len(shape)
    nb = x.ndim - 2
    if dims[nb:] == (out_nd - 2, out_nd - 1) and list(dims[:nb]) == sorted(dims[:nb]):
        lead = tuple(shape[:-2])
        factor_dims = dims[:nb] + (out_nd - 2, out_nd - 1)
        left = jax.lax.broadcast_in_dim(x.left, lead + (shape[-2], x.rank), factor_dims)
        right = jax.lax.broadcast_in_dim(
            x.right, lead + (shape[-1], x.rank), factor_dims
        )
        return _lowrank(left, right)
    params = dict(shape=shape, broadcast_dimensions=broadcast_dimensions, **params)
    if is_vector_shape(tuple(shape)):
        result = jax.lax.broadcast_in_dim_p.bind(x.materialise(), **params)
        return _dense_from_factors(jax.lax.broadcast_in_dim_p, result, "a vector")
    return densify(
        jax.lax.broadcast_in_dim_p,
        [x],
        params,
        reason="the matrix dims move",
    )


@rule(jax.lax.reduce_sum_p)
def _reduce_sum(x: LowRank, *, axes: tuple[int, ...], **params: Any) -> LowRank | Array:
    nb = x.ndim - 2
    axes = tuple(sorted(a % x.ndim for a in axes))
    if not axes:
        return x
    batch_axes = tuple(a for a in axes if a < nb)
    matrix_axes = tuple(a for a in axes if a >= nb)
    left, right = x.left, x.right
    if batch_axes:
        # A sum over batch matrices is one matrix whose factors hold every term.
        keep = tuple(a for a in range(nb) if a not in batch_axes)
        order = keep + batch_axes + (nb, nb + 1)
        lead = tuple(x.shape[a] for a in keep)
        rank = x.rank * math.prod(x.shape[a] for a in batch_axes)

        def gather(factor: Array) -> Array:
            moved = jnp.transpose(factor, order)
            moved = jnp.moveaxis(
                moved.reshape(lead + (-1,) + factor.shape[-2:]), -3, -2
            )
            return moved.reshape(lead + (factor.shape[-2], rank))

        left, right = gather(left), gather(right)
        if not matrix_axes:
            return within_budget(
                jax.lax.reduce_sum_p, left, right, _projections_hint(x)
            )
    if matrix_axes == (x.ndim - 2, x.ndim - 1):
        result = jnp.einsum("...mr,...nr->...", left, right)
    elif matrix_axes == (x.ndim - 1,):
        result = jnp.einsum("...mr,...r->...m", left, right.sum(-2))
    else:
        result = jnp.einsum("...r,...nr->...n", left.sum(-2), right)
    return _dense_from_factors(
        jax.lax.reduce_sum_p, result.astype(x.dtype), "a sum over a matrix dim"
    )


# ---------------------------------------------------------------------------------------
# dot_general


def _dot(x: LowRank, d: Array, x_is_lhs: bool, params: dict) -> LowRank | Array:
    """`dot_general` of a LowRank `x` with a dense `d`, from the factors.

    Supported: `x` contracts exactly one of its two matrix dims, and its dot batch dims
    are all of its leading dims, in order. Other forms are densified.
    """
    (lhs_c, rhs_c), (lhs_b, rhs_b) = params["dimension_numbers"]
    x_c, d_c = (lhs_c, rhs_c) if x_is_lhs else (rhs_c, lhs_c)
    x_b, d_b = (lhs_b, rhs_b) if x_is_lhs else (rhs_b, lhs_b)
    nb = x.ndim - 2
    operands = [x, d] if x_is_lhs else [d, x]
    if tuple(x_b) != tuple(range(nb)) or len(x_c) != 1:
        return densify(
            jax.lax.dot_general_p,
            operands,
            params,
            reason="a contraction over batch or both matrix dims",
        )
    out_dtype = _dot_dtype(params, x, d)
    # Contracting n keeps `left`; contracting m keeps `right`.
    contracted, kept = (x.right, x.left) if x_c[0] == nb + 1 else (x.left, x.right)
    # (*batch, r, *d_free): the contracted factor applied to `d`.
    applied = jax.lax.dot_general(
        contracted,
        d,
        (((nb,), tuple(d_c)), (tuple(range(nb)), tuple(d_b))),
        precision=params.get("precision"),
        preferred_element_type=params.get("preferred_element_type"),
    )
    applied = jnp.moveaxis(applied, nb, -1).astype(out_dtype)
    kept = kept.astype(out_dtype)
    d_free = applied.shape[nb:-1]
    if x_is_lhs and len(d_free) == 1:
        return _lowrank(kept, applied)
    if not x_is_lhs and len(d_free) >= 1:
        # Extra free dims of `d` become leading dims of the result.
        lead = applied.shape[:-2]
        kept = jnp.expand_dims(kept, tuple(range(nb, nb + len(d_free) - 1)))
        return _lowrank(applied, jnp.broadcast_to(kept, lead + kept.shape[-2:]))
    if x_is_lhs:
        result = jnp.einsum(
            "...pr,...Fr->...pF",
            kept,
            applied.reshape(applied.shape[:nb] + (-1, applied.shape[-1])),
        )
        result = result.reshape(kept.shape[:-1] + d_free)
    else:
        result = jnp.einsum("...r,...pr->...p", applied, kept)
    return _dense_from_factors(
        jax.lax.dot_general_p, result, "the product has no two-dim low-rank form"
    )


@rule(jax.lax.dot_general_p)
def _dot_lowrank_dense(x: LowRank, d: ArrayLike, **params: Any) -> LowRank | Array:
    return _dot(x, jnp.asarray(d), True, params)


@rule(jax.lax.dot_general_p)
def _dot_dense_lowrank(d: ArrayLike, x: LowRank, **params: Any) -> LowRank | Array:
    return _dot(x, jnp.asarray(d), False, params)


# ---------------------------------------------------------------------------------------
# Sharding (explicit mesh axes)


@rule(reshard_p)
def _reshard(x: LowRank, *, dst_sharding: Any, **params: Any) -> LowRank:
    """Each factor takes the spec of its side: for the array's `P(*batch, rows,
    cols)`, `left` gets `P(*batch, rows, None)` and `right` `P(*batch, cols, None)`
    (the block of `left @ right^T` on a device is its blocks' product)."""
    entries = tuple(dst_sharding.spec) + (None,) * (x.ndim - len(dst_sharding.spec))
    *batch, rows, cols = entries

    def moved(factor: Array, side: Any) -> Array:
        sharding = dst_sharding.update(spec=PartitionSpec(*batch, side, None))
        return reshard_p.bind(factor, dst_sharding=sharding, **params)

    return _lowrank(moved(x.left, rows), moved(x.right, cols))


@rule(psum_invariant_p)
def _psum_invariant(x: LowRank, *, axes: tuple) -> LowRank | Array:
    """The sum over devices that JAX's AD inserts for the cotangent of a value made
    device-varying inside `shard_map` (the transpose of `pvary`): the exact
    `all_reduce`, which moves one factor when the other is the same everywhere, and
    otherwise gathers every device's factors, a concatenation under the rank budget
    (`quax_tangents.rank_budget`). Over it, the default sums the dense values
    instead (exact, counted): the gathered factors would be larger than the matrix,
    as every token's factors of a marked weight's gradient are when the devices'
    batches are large."""
    axes = tuple(axes)
    if shared_factor(x, axes) is not None or axis_size(axes) == 1:
        return x.all_reduce(axes)
    (m, n), rank = x.shape[-2:], x.rank * axis_size(axes)
    action, max_rank = budget_settings()
    if rank * (m + n) < m * n and (max_rank is None or rank <= max_rank):
        return x.all_reduce(axes)
    if isinstance(action, Recompress):
        left = gather_along(x.left, axes, axis=-1)
        return within_budget(
            psum_invariant_p, left, gather_along(x.right, axes, axis=-1)
        )
    total = dense_all_reduce(x.materialise(), axes)
    record_dense_result(
        psum_invariant_p.name,
        ("LowRank",),
        total.shape,
        f"the sum over {axis_size(axes)} devices of rank-{x.rank} factors has rank "
        f"{rank}, over the budget for {m}x{n}",
        "`quax_tangents.all_reduce(x, axis_name, method=quax_tangents.GatherSum())` "
        "keeps the factors whatever their rank; for a marked weight's gradient in "
        "data-parallel `shard_map`, pass the mesh axis to "
        "`quax_tangents.optax.mark(..., axis_name=...)`, so that each device "
        "projects its own gradient and the sum moves the projected factor only.",
    )
    return total


@rule(pvary_p)
def _pvary(x: LowRank, *, axes: tuple) -> LowRank:
    """Typed as varying over `axes` (inside `shard_map`): every factor is, as
    `device_varying` makes every field of a value varying. The values are
    unchanged."""
    return _lowrank(vary_leaf(x.left, tuple(axes)), vary_leaf(x.right, tuple(axes)))
