"""Rules for JAX's higher-order primitives: `jit`, `checkpoint`, `cond` and `scan`.

Two things go wrong with quax's own handling of these for compressed tangents:

- quax skips its trace inside a body when no quax value enters it, so a construction
  primitive (`compress_cotangent`, `factored_matmul`) in a jitted, checkpointed,
  branched or scanned backward pass would run densely. These rules enter the trace
  whenever the body holds one.
- Branches and loop carries that disagree in type or rank fail late (a lowering error,
  or a carry-type error). Here branches are joined, and a growing carry is either
  truncated back (under `rank_budget(qt.Recompress())`) or rejected with an error that
  names the carry.
"""

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jexc
import jax.numpy as jnp
import jax.tree_util as jtu
import quax
from jax.extend.core.primitives import remat_p
from jaxtyping import ArrayLike

from .._core._base import CompressedArray
from .._core._compat import (
    install_trace_method,
    jit_p,
    jit_quax,
    scan_bind_params,
    scan_counts,
    unpack_scan_args,
)
from .._core._fallback import dry_run, record_densification
from .._core._registry import rule
from .._core._sharding import sliced_struct
from .._marks import _marked_scan
from .._marks._cotangents import mark_p
from .._marks._projection import finish_p, outer_sum_p, rows_p
from .._marks._slices import projected_factor_p, projected_pair_p, projection_p
from .._types._primitives import compress_p, outer_p
from .._types.lowrank import LowRank


_CONSTRUCTION = (
    compress_p,
    outer_p,
    mark_p,
    outer_sum_p,
    rows_p,
    finish_p,
    projected_factor_p,
    projected_pair_p,
    projection_p,
)
_construction_cache: dict[int, tuple[Any, bool]] = {}


def _is_value(x: Any) -> bool:
    return isinstance(x, quax.Value)


def _enter_trace(fn: Callable) -> Callable:
    return quax.quaxify(fn, filter_spec=lambda _: True)


def has_construction(jaxpr: Any) -> bool:
    """Whether a (closed) jaxpr, or any jaxpr nested in it, binds a construction
    primitive. Cached per jaxpr object."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    key = id(jaxpr)
    cached = _construction_cache.get(key)
    if cached is not None and cached[0]() is jaxpr:
        return cached[1]
    found = any(
        eqn.primitive in _CONSTRUCTION
        or any(has_construction(sub) for sub in jexc.jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )
    _construction_cache[key] = (
        weakref.ref(jaxpr, lambda _, key=key: _construction_cache.pop(key, None)),
        found,
    )
    return found


def _needs_trace(args: Sequence[Any], *jaxprs: Any) -> bool:
    return any(map(_is_value, args)) or any(map(has_construction, jaxprs))


# ---------------------------------------------------------------------------------------
# jit


@rule(jit_p, precedence=1)
def _jit_dense(*args: ArrayLike, jaxpr: Any, **params: Any) -> Any:
    """All operands dense: inline the body under the trace only if it constructs
    compressed values; otherwise leave the call to quax unchanged."""
    if has_construction(jaxpr):
        return _enter_trace(jexc.jaxpr_as_fun(jaxpr))(*args)
    return jit_quax(*args, jaxpr=jaxpr, **params)


@rule(jit_p, precedence=1)
def _jit_values(*args: ArrayLike | quax.ArrayValue, jaxpr: Any, **params: Any) -> Any:
    """A jitted function (`jnp.take`, say) given compressed values: its body is
    inlined under the trace. quax would run it as a `jax.jit` of the quaxified body,
    cached per jaxpr, whose later calls skip this library's rules, and with them
    the densifications they count: a second trace of the same step counted none,
    and `fallback("error")` could not raise there."""
    del params
    return _enter_trace(jexc.jaxpr_as_fun(jaxpr))(*args)


# ---------------------------------------------------------------------------------------
# Call primitives (`closed_call`, which JAX's partial evaluation of a checkpointed body
# nested in a scan binds on the trace below it) are inlined: quax 0.4's trace has
# no `process_call`.


def _inline_call(trace: Any, primitive: Any, fun: Any, tracers: Any, params: Any):
    with jexc.set_current_trace(trace):
        return fun.call_wrapped(*tracers)


install_trace_method("process_call", _inline_call)


# ---------------------------------------------------------------------------------------
# checkpoint


@rule(remat_p)
def _remat(
    *args: ArrayLike | quax.ArrayValue,
    jaxpr: Any,
    prevent_cse: bool,
    differentiated: bool,
    policy: Any,
) -> Any:
    """Keeps compressed values compressed through `jax.checkpoint`: the body is
    checkpointed again, now on the quaxified function."""
    if not _needs_trace(args, jaxpr):
        return remat_p.bind(
            *args,
            jaxpr=jaxpr,
            prevent_cse=prevent_cse,
            differentiated=differentiated,
            policy=policy,
        )
    body = jexc.jaxpr_as_fun(jexc.ClosedJaxpr(jaxpr, ()))  # pyright: ignore[reportPrivateImportUsage]
    checkpointed = jax.checkpoint(
        _enter_trace(lambda *a: body(*a)), prevent_cse=prevent_cse, policy=policy
    )
    return checkpointed(*args)


# ---------------------------------------------------------------------------------------
# Joining values of different types or ranks


def _leaf_kind(x: Any) -> Any:
    """A value's type, static fields and field shapes (a rank is a shape)."""
    if not _is_value(x):
        return "dense"
    leaves, treedef = jtu.tree_flatten(x)
    return treedef, tuple((jnp.shape(leaf), jnp.result_type(leaf)) for leaf in leaves)


def _densify_for(primitive: str, reason: str) -> Callable[[Any], Any]:
    def densify(x: Any) -> Any:
        if isinstance(x, CompressedArray):
            record_densification(primitive, (type(x).__name__,), reason)
        return x.materialise() if _is_value(x) else x

    return densify


def _join_plan(candidates: Sequence[Any], primitive: str) -> Callable[[Any], Any]:
    """How to bring one output position of several branches to a common structure:
    nothing, the type's own `join_branches`, or densifying (counted)."""
    kinds = {_leaf_kind(c) for c in candidates}
    if len(kinds) == 1:
        return lambda x: x
    types = {type(c) for c in candidates}
    if len(types) == 1 and issubclass(cls := types.pop(), CompressedArray):
        join = cls.join_branches(candidates)
        if join is not None:
            return join
    return _densify_for(primitive, "branches return different types or sizes")


def _joined(fn: Callable, plans: Sequence[Callable]) -> Callable:
    def run(*args: Any) -> list[Any]:
        outs = fn(*args)
        return [plan(out) for plan, out in zip(plans, outs)]

    return run


# ---------------------------------------------------------------------------------------
# cond


@rule(jax.lax.cond_p, precedence=1)
def _cond(
    index: ArrayLike, *args: ArrayLike | quax.ArrayValue, branches: Any, **params
):
    if not _needs_trace(args, *branches):
        return jax.lax.cond_p.bind(index, *args, branches=branches, **params)
    flat_args, in_tree = jtu.tree_flatten(args)

    def branch_fn(closed: Any) -> Callable:
        body = _enter_trace(jexc.jaxpr_as_fun(closed))

        def run(*flat: Any) -> list[Any]:
            return list(body(*jtu.tree_unflatten(in_tree, flat)))

        return run

    fns = [branch_fn(b) for b in branches]
    with dry_run():
        shapes = [jax.eval_shape(f, *flat_args) for f in fns]
    plans = [_join_plan(column, "cond") for column in zip(*shapes)]
    traced = [
        jax.make_jaxpr(_joined(f, plans), return_shape=True)(*flat_args) for f in fns
    ]
    new_branches = tuple(jaxpr for jaxpr, _ in traced)
    out_tree = jtu.tree_structure(traced[0][1])
    out = jax.lax.cond_p.bind(index, *flat_args, branches=new_branches, **params)
    return jtu.tree_unflatten(out_tree, out)


# ---------------------------------------------------------------------------------------
# Loops: scan and while


def _fit_carry(primitive: str, index: int, before: Any, after: Any) -> Any:
    try:
        return after.fit_carry(before)
    except TypeError as error:
        raise TypeError(
            f"`lax.{primitive}` carry {index} does not fit: {error}"
        ) from None


def _carry_plan(
    primitive: str, index: int, before: Any, after: Any
) -> Callable[[Any], Any] | None:
    """How the body's output carry is brought back to the input carry's structure
    (the type's own `fit_carry`), or None when the input carry must be densified
    first."""
    if _leaf_kind(before) == _leaf_kind(after):
        return lambda x: x
    if type(before) is type(after) and isinstance(after, CompressedArray):
        # Decided once from shapes; applied to the traced carry in every trace.
        with dry_run():
            fitted = jax.eval_shape(
                lambda a: _fit_carry(primitive, index, before, a), after
            )
        if fitted is not None and _leaf_kind(fitted) == _leaf_kind(before):
            return lambda x: _fit_carry(primitive, index, before, x)
    if _is_value(before):
        return None
    raise TypeError(
        f"`lax.{primitive}` carry {index} enters the body dense and leaves it as a "
        f"{type(after).__name__}; make the initial carry compressed too (for example "
        "with the same compressor), or materialise it inside the body."
    )


class _Body:
    """A loop body over flat leaves: `(consts, carry, xs) -> (carry, ys)`."""

    def __init__(
        self, jaxpr: Any, consts: Sequence[Any], carry: Sequence[Any], xs: Any
    ):
        self.fn = _enter_trace(jexc.jaxpr_as_fun(jaxpr))
        self.consts_flat, self.consts_tree = jtu.tree_flatten(list(consts))
        self.carry_flat, self.carry_tree = jtu.tree_flatten(list(carry))
        self.xs_flat, self.xs_tree = jtu.tree_flatten(list(xs))
        self.n_carry = len(carry)

    def __call__(self, *flat: Any) -> list[Any]:
        n_consts, n_carry = len(self.consts_flat), len(self.carry_flat)
        consts = jtu.tree_unflatten(self.consts_tree, flat[:n_consts])
        carry = jtu.tree_unflatten(self.carry_tree, flat[n_consts : n_consts + n_carry])
        xs = jtu.tree_unflatten(self.xs_tree, flat[n_consts + n_carry :])
        return list(self.fn(*consts, *carry, *xs))


def _settle_carry(
    primitive: str,
    jaxpr: Any,
    consts: Sequence[Any],
    carry: Sequence[Any],
    xs: Sequence[Any],
    xs_avals: Sequence[Any],
) -> tuple[_Body, list[Any], Any]:
    """Traces the body once (twice if a compressed carry must start dense) and
    returns it with the plan that keeps each carry's type fixed, and its output
    shapes."""
    carry = list(carry)
    for _ in range(3):
        body = _Body(jaxpr, consts, carry, xs)
        with dry_run():
            out_shape = jax.eval_shape(
                body, *body.consts_flat, *body.carry_flat, *xs_avals
            )
        plans = [
            _carry_plan(primitive, i, before, after)
            for i, (before, after) in enumerate(zip(carry, out_shape[: len(carry)]))
        ]
        if all(plan is not None for plan in plans):
            return body, plans, out_shape
        # A carry whose body drops its projection tag re-enters untagged; any
        # other carry that does not fit enters dense (counted).
        untagged = [
            _without_projector_side(c) if p is None else c for c, p in zip(carry, plans)
        ]
        for name in {type(c).__name__ for c, u in zip(carry, untagged) if u is None}:
            record_densification(
                primitive, (name,), "the body returns this carry dense"
            )
        carry = [c.materialise() if u is None else u for c, u in zip(carry, untagged)]
    raise TypeError(
        f"`lax.{primitive}` carry types did not settle."
    )  # pragma: no cover


def _without_projector_side(carry: Any) -> Any:
    """A tagged `LowRank` carry without its tag (the body does not keep the
    projection), or `None` when dropping a tag does not help."""
    if isinstance(carry, LowRank) and carry.projector_side is not None:
        return carry.with_projector_side(None)
    return None


def _settled_fn(body: _Body, plans: Sequence[Callable]) -> Callable:
    def run(*flat: Any) -> list[Any]:
        outs = body(*flat)
        carry = [plan(o) for plan, o in zip(plans, outs[: body.n_carry])]
        return jtu.tree_leaves(carry) + jtu.tree_leaves(outs[body.n_carry :])

    return run


def _sliceable(x: Any) -> Any:
    """A scanned-over value whose leading dim is not a batch dim of its fields (the
    rows of one LowRank matrix, say) cannot be sliced field by field: make it
    dense, counted."""
    if isinstance(x, CompressedArray) and x.batch_ndim == 0:
        record_densification(
            "scan", (type(x).__name__,), "scanning over a dim that is not a batch dim"
        )
        return x.materialise()
    return _marked_scan.sliceable(x)


@rule(jax.lax.scan_p, precedence=1)
def _scan(*args: ArrayLike | quax.ArrayValue, jaxpr: Any, **params: Any) -> Any:
    if not _needs_trace(args, jaxpr):
        return jax.lax.scan_p.bind(*args, jaxpr=jaxpr, **params)
    num_consts, num_carry = scan_counts(args, params)
    if _marked_scan.applies_projected(args, num_consts, num_carry):
        return _marked_scan.scan_with_projected_xs(args, jaxpr, params)
    _marked_scan.warn_unless_projected(args)
    if _marked_scan.applies(args, num_consts, num_carry):
        return _marked_scan.scan_with_marked_consts(args, jaxpr, params)
    consts, carry, xs = unpack_scan_args(args, params)
    xs = [_sliceable(x) for x in xs]
    xs_avals = [sliced_struct(x) for x in jtu.tree_leaves(list(xs))]
    body, plans, out_shape = _settle_carry("scan", jaxpr, consts, carry, xs, xs_avals)
    trace_in = (*body.consts_flat, *body.carry_flat, *xs_avals)
    new_jaxpr = jax.make_jaxpr(_settled_fn(body, plans))(*trace_in)
    n_carry_flat = len(body.carry_flat)
    out_flat = jax.lax.scan_p.bind(
        *body.consts_flat,
        *body.carry_flat,
        *body.xs_flat,
        jaxpr=new_jaxpr,
        **scan_bind_params(
            params,
            num_consts=len(body.consts_flat),
            num_carry=n_carry_flat,
            num_xs=len(body.xs_flat),
            num_ys=len(new_jaxpr.out_avals) - n_carry_flat,
        ),
    )
    # ys come out stacked: a compressed y stacks into fields with a leading scan dim,
    # which static metadata about trailing dims allows.
    carry_out = jtu.tree_unflatten(body.carry_tree, out_flat[:n_carry_flat])
    ys = jtu.tree_unflatten(
        jtu.tree_structure(out_shape[body.n_carry :]), out_flat[n_carry_flat:]
    )
    return [*carry_out, *ys]


@rule(jax.lax.while_p, precedence=1)
def _while(
    *args: ArrayLike | quax.ArrayValue,
    cond_nconsts: int,
    cond_jaxpr: Any,
    body_nconsts: int,
    body_jaxpr: Any,
) -> Any:
    params = dict(
        cond_nconsts=cond_nconsts,
        cond_jaxpr=cond_jaxpr,
        body_nconsts=body_nconsts,
        body_jaxpr=body_jaxpr,
    )
    if not _needs_trace(args, cond_jaxpr, body_jaxpr):
        return jax.lax.while_p.bind(*args, **params)
    cond_consts = list(args[:cond_nconsts])
    body_consts = list(args[cond_nconsts : cond_nconsts + body_nconsts])
    carry = list(args[cond_nconsts + body_nconsts :])
    body, plans, _ = _settle_carry("while_loop", body_jaxpr, body_consts, carry, [], [])
    new_body = jax.make_jaxpr(_settled_fn(body, plans))(
        *body.consts_flat, *body.carry_flat
    )
    cond = _Body(cond_jaxpr, cond_consts, [], [])
    cond_flat_in = (*cond.consts_flat, *body.carry_flat)

    def cond_fn(*flat: Any) -> Any:
        consts = jtu.tree_unflatten(cond.consts_tree, flat[: len(cond.consts_flat)])
        carry = jtu.tree_unflatten(body.carry_tree, flat[len(cond.consts_flat) :])
        return cond.fn(*consts, *carry)[0]

    new_cond = jax.make_jaxpr(cond_fn)(*cond_flat_in)
    out_flat = jax.lax.while_p.bind(
        *cond.consts_flat,
        *body.consts_flat,
        *body.carry_flat,
        cond_nconsts=len(cond.consts_flat),
        cond_jaxpr=new_cond,
        body_nconsts=len(body.consts_flat),
        body_jaxpr=new_body,
    )
    return list(jtu.tree_unflatten(body.carry_tree, out_flat))
