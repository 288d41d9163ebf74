"""Construction primitives of one slice of a stacked projection, for a loop over
the slices (the backward pass of a `lax.scan` over a marked stack, see
`quax_tangents._marks._marked_scan`), and of the stacked result put back together.

- `projected_factor_p(ct, *operands, total, spec=)`: a `Phased` slice's factor added
    into its running sum;
- `projected_pair_p(ct, *operands, spec=)`: any other slice's projector and factor;
- `projection_p(projector, factor, left=)`: the stacked `LowRank` of the factors.

Outside a quax trace each one computes its dense semantics, as those of
`quax_tangents._marks._projection` do.
"""

from typing import Any

import jax.extend.core as jexc
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.interpreters import mlir
from jaxtyping import Array, ArrayLike

from .._core._devices import axes_of, device_varying
from .._core._fallback import record_densification
from .._core._registry import rule
from .._core._sharding import varying_axes, varying_type
from .._core._unchecked import unchecked
from .._types.lowrank import LowRank
from .._types.outer import OuterSum
from ._projection import Finish, define_primitive, project_dense, project_outer
from ._sources import Given


# ---------------------------------------------------------------------------------------
# One slice of a `Phased` projection, inside a loop over the slices, and the
# stacked result put back together (see `quax_tangents._marks._marked_scan`)

projected_factor_p = jexc.Primitive("projected_factor")


def _factor(result: LowRank) -> Array:
    """The factor of a projection that is not the projector."""
    return result.right if result.projector_side == "left" else result.left


def _projected_factor_dense(ct: Array, *operands: Array, spec: Finish) -> Array:
    return _factor(project_dense(spec, ct, operands))


def _projected_factor_abstract(ct: Any, *operands: Any, spec: Finish) -> Any:
    return varying_type(operands[-1].shape, operands[-1].dtype, ct, *operands)


define_primitive(
    projected_factor_p, _projected_factor_dense, _projected_factor_abstract
)


def projected_factor(ct: Any, operands: tuple, total: Any, spec: Finish) -> Any:
    """The factor that a `Phased` finish of one matrix's cotangent `ct` (`G`)
    gives with its `operands` and the sum `total` (`S + G^T P` for a given
    projector, `S + G Q` for a tall matrix; a sketch in its phases that sketch),
    with `ct`'s factors kept apart under quax."""
    return projected_factor_p.bind(ct, *operands, total, spec=spec)


def _varying_as(x: Array, *sources: Any) -> Array:
    """`x` typed as varying over every mesh axis that an array of `sources` varies
    over (inside `jax.shard_map`), as the primitive's abstract result is: a jaxpr
    traced with that type runs with the value a rule computes, which may vary over
    fewer (a given projector, a sum of factors that are the same everywhere)."""
    axes = frozenset().union(*map(varying_axes, jtu.tree_leaves(sources)))
    missing = axes - varying_axes(x)
    return device_varying(x, tuple(missing)) if missing else x


@rule(projected_factor_p)
def _projected_factor_outer(ct: OuterSum, *operands: ArrayLike, spec: Finish) -> Array:
    return _varying_as(_factor(project_outer(spec, ct, operands)), ct, operands)


def _projected_dense_slice(
    primitive: jexc.Primitive, ct: ArrayLike, operands: tuple, spec: Finish
) -> LowRank:
    """The projection of one slice's dense cotangent, counted as a densification."""
    record_densification(
        primitive.name,
        ("Marked",),
        "the marked weight's cotangent in one iteration of the scan is dense",
    )
    return project_dense(spec, jnp.asarray(ct), operands)


@rule(projected_factor_p, dense_output=True)
def _projected_factor_array(ct: ArrayLike, *operands: ArrayLike, spec: Finish) -> Array:
    factor = _factor(_projected_dense_slice(projected_factor_p, ct, operands, spec))
    return _varying_as(factor, ct, operands)


# ---------------------------------------------------------------------------------------
# One slice of a projection whose projector is not a running sum's (`Given`, `Fresh`,
# `Switch`): its projector and its factor, as two arrays, for a scan over the stack
# to write as its outputs (see `quax_tangents._marks._marked_scan`)

projected_pair_p = jexc.Primitive("projected_pair")
projected_pair_p.multiple_results = True


def projector_sources(ct: Any, operands: tuple, spec: Finish) -> tuple:
    """What a slice's projector varies over the devices as (inside `shard_map`): a
    given one as it went in; a fresh one as the cotangent `ct` it is found from,
    unless `ct` varies only over the axes its products are summed over
    (`Finish.axis_name`), where every device finds the same one."""
    typed = ct.aval() if isinstance(ct, OuterSum) else ct
    if isinstance(spec.source, Given) or summed_over(varying_axes(typed), spec):
        return tuple(operands)
    return (ct, *operands)


def summed_over(varying: frozenset, spec: Finish) -> bool:
    """Whether every axis of `varying` is one that a fresh projector's products
    are summed over."""
    return bool(spec.axis_name) and varying <= frozenset(axes_of(spec.axis_name))


def _pair(result: LowRank, ct: Any, operands: tuple, spec: Finish) -> list[Array]:
    """`[projector, factor]` of a projection, typed as `_projected_pair_abstract`
    types them."""
    projector = result.left if result.projector_side == "left" else result.right
    sources = projector_sources(ct, operands, spec)
    return [
        _varying_as(projector, *sources),
        _varying_as(_factor(result), ct, operands),
    ]


def _projected_pair_dense(ct: Array, *operands: Array, spec: Finish) -> list[Array]:
    return _pair(project_dense(spec, ct, operands), ct, operands, spec)


def _projected_pair_abstract(ct: Any, *operands: Any, spec: Finish) -> list[Any]:
    *batch, m, n = ct.shape
    small, large = min(m, n), max(m, n)
    sources = projector_sources(ct, operands, spec)
    return [
        varying_type((*batch, small, spec.rank), ct.dtype, *sources),
        varying_type((*batch, large, spec.rank), ct.dtype, ct, *operands),
    ]


projected_pair_p.def_impl(_projected_pair_dense)
projected_pair_p.def_abstract_eval(_projected_pair_abstract)
mlir.register_lowering(
    projected_pair_p, mlir.lower_fun(_projected_pair_dense, multiple_results=True)
)


def projected_pair(ct: Any, operands: tuple, spec: Finish) -> list[Any]:
    """The projector and the factor that the finish of one matrix's cotangent `ct`
    (`G`) gives with its `operands` (`P` and `G^T P` for a wide matrix, `Q` and
    `G Q` for a tall one), with `ct`'s factors kept apart under quax."""
    return projected_pair_p.bind(ct, *operands, spec=spec)


@rule(projected_pair_p)
def _projected_pair_outer(ct: OuterSum, *operands: ArrayLike, spec: Finish) -> list:
    return _pair(project_outer(spec, ct, operands), ct, operands, spec)


@rule(projected_pair_p, dense_output=True)
def _projected_pair_array(ct: ArrayLike, *operands: ArrayLike, spec: Finish) -> list:
    result = _projected_dense_slice(projected_pair_p, ct, operands, spec)
    return _pair(result, ct, operands, spec)


projection_p = jexc.Primitive("projection")


def _projection_dense(projector: Array, factor: Array, *, left: bool) -> Array:
    product = jnp.matmul(projector, jnp.swapaxes(factor, -1, -2))
    return product if left else jnp.swapaxes(product, -1, -2)


def _projection_abstract(projector: Any, factor: Any, *, left: bool) -> Any:
    *batch, side, _ = projector.shape
    other = factor.shape[-2]
    shape = (*batch, side, other) if left else (*batch, other, side)
    return varying_type(tuple(shape), factor.dtype, projector, factor)


define_primitive(projection_p, _projection_dense, _projection_abstract)


def projection(projector: Any, factor: Any, left: bool) -> Any:
    """`P F^T` (`left`) or `F P^T`, a `LowRank` with `projector_side` under quax:
    the stacked projection whose factors a loop over the slices wrote."""
    return projection_p.bind(projector, factor, left=left)


@rule(projection_p)
def _projection_rule(projector: ArrayLike, factor: ArrayLike, *, left: bool) -> LowRank:
    projector, factor = jnp.asarray(projector), jnp.asarray(factor)
    if left:
        return unchecked(LowRank, left=projector, right=factor, projector_side="left")
    return unchecked(LowRank, left=factor, right=projector, projector_side="right")
