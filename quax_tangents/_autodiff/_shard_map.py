"""`jax.shard_map` inside quaxified functions: the trace hook quax 0.4.6 lacks.

quax 0.4.6's `_QuaxTrace` defines `process_primitive` and `process_custom_jvp_call`
but no `process_shard_map`, so any `jax.shard_map` traced under quax (a cross-entropy
in a `shard_map` inside a loss, say) fails with `AttributeError: '_QuaxTrace' object
has no attribute 'process_shard_map'`, even when no quax value enters it. Upstream
would need a `process_shard_map` on `_QuaxTrace` that (a) flattens quax values into
their array leaves, (b) gives every leaf a `PartitionSpec` derived from the spec of
the value it belongs to, (c) binds `shard_map_p` on the parent trace with a body that
re-enters a quax trace, and (d) rebuilds the values from the output leaves. This
module installs exactly that, for the `FlatTree` protocol of `shard_map_p` (JAX 0.10.2
to 0.12; see `_core._compat`).

How a quax value crosses the boundary (in either direction):

- spec `P()` (every device holds the whole value): every field gets `P()`; any
    type crosses whole.
- `LowRank` with any spec `P(*batch, rows, cols)`: `left` gets `P(*batch, rows,
    None)` and `right` `P(*batch, cols, None)`, exact, because the block of
    `left @ right^T` on the device holding rows `I` and columns `J` is
    `left[I] @ right[J]^T`. Leaving the body, a `LowRank` whose factor varies over an
    axis its spec does not shard (each device's block has its own factor, which
    no global pair of factors holds) is materialised instead, counted.
- anything else (other types with a sharded spec, marked weights): materialised,
    counted as a densification (`quax_tangents.fallback`).

Dense values cross unchanged, and the body always runs under a fresh quax trace, so
that cotangent marks and `compress_cotangent` inside it construct compressed values.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jexc
import jax.numpy as jnp
import jax.tree_util as jtu
import quax
from jax.sharding import PartitionSpec as P

from .._core._compat import (
    DenseArrayValue,
    QuaxTrace,
    QuaxTracer,
    flatten_flat_tree,
    install_trace_method,
    wrap_if_array,
)
from .._core._fallback import record_densification
from .._core._sharding import explicit_axes, spec_entries, varying_axes
from .._types.lowrank import LowRank


# ---------------------------------------------------------------------------------------
# Per-field specs


def _is_replicated(spec: Any) -> bool:
    return (
        isinstance(spec, P)
        and all(part is None for part in spec)
        and not (spec.unreduced or spec.reduced)
    )


def _spec_axes(part: Any) -> tuple:
    if part is None:
        return ()
    return part if isinstance(part, tuple) else (part,)


def _lowrank_specs(x: LowRank, spec: P) -> tuple[P, P] | None:
    """The specs of `left` and `right` for a `LowRank` whose array has `spec`."""
    if spec.unreduced or spec.reduced:
        return None
    parts = tuple(spec) + (None,) * (x.ndim - len(spec))
    *batch, rows, cols = parts
    return P(*batch, rows, None), P(*batch, cols, None)


def _factor_varies_elsewhere(factor: Any, spec: P, axes: frozenset) -> bool:
    """Whether `factor` varies over a manual axis its spec leaves unsharded."""
    varying = varying_axes(factor)
    sharded = {a for part in spec for a in _spec_axes(part)}
    return bool((set(varying) & axes) - sharded)


# ---------------------------------------------------------------------------------------
# Splitting values into leaves and rebuilding them


class _Crossing:
    """How one position crosses: its leaves' specs and how to rebuild the value."""

    def __init__(self, leaves: list, specs: list, rebuild: Callable[[list], Any]):
        self.leaves, self.specs, self.rebuild = leaves, specs, rebuild


def _dense_crossing(x: Any, spec: Any) -> _Crossing:
    return _Crossing([x], [spec], lambda leaves: leaves[0])


def _materialised(x: Any, spec: Any, where: str) -> _Crossing:
    record_densification(
        "shard_map",
        (type(x).__name__,),
        f"a compressed value {where} a shard_map with spec {spec}, which its fields "
        "cannot carry",
    )
    return _dense_crossing(x.materialise(), spec)


def _crossing(x: Any, spec: Any, where: str, check_vma: bool, axes: frozenset):
    if not isinstance(x, quax.Value):
        return _dense_crossing(x, spec)
    if type(x) is LowRank and isinstance(spec, P) and not _is_replicated(spec):
        specs = _lowrank_specs(x, spec)
        # Leaving the body, a factor that varies where its spec does not shard is
        # not one global factor (or, without check_vma, cannot be known to be).
        leaving_unknown = where == "leaving" and (
            not check_vma
            or any(
                _factor_varies_elsewhere(f, s, axes)
                for f, s in zip((x.left, x.right), specs or ())
            )
        )
        if specs is None or leaving_unknown:
            return _materialised(x, spec, where)
        return _Crossing(
            [x.left, x.right],
            list(specs),
            lambda leaves: LowRank(leaves[0], leaves[1]),
        )
    if _is_replicated(spec):
        leaves, treedef = jtu.tree_flatten(x)
        return _Crossing(
            leaves,
            [P()] * len(leaves),
            lambda new: jtu.tree_unflatten(treedef, new),
        )
    return _materialised(x, spec, where)


def _split(crossings: Sequence[_Crossing]) -> tuple[list, list]:
    leaves = [leaf for c in crossings for leaf in c.leaves]
    specs = [spec for c in crossings for spec in c.specs]
    return leaves, specs


def _rebuild(crossings: Sequence[_Crossing], leaves: Sequence[Any]) -> list:
    out, offset = [], 0
    for c in crossings:
        out.append(c.rebuild(list(leaves[offset : offset + len(c.leaves)])))
        offset += len(c.leaves)
    return out


# ---------------------------------------------------------------------------------------
# The trace hook


def _plain(trace: QuaxTrace, tracer: Any) -> Any:
    value = trace.to_value(tracer)
    return value.array if type(value) is DenseArrayValue else value


def _placed(leaf: Any, spec: Any) -> Any:
    """Under explicit mesh axes `shard_map` checks that every input is sharded as
    its spec says: a field (or a materialised value) is resharded to its spec."""
    if not isinstance(spec, P) or not explicit_axes():
        return leaf
    if P(*spec_entries(leaf)) == P(*spec, *(None,) * (jnp.ndim(leaf) - len(spec))):
        return leaf
    return jax.sharding.reshard(leaf, spec)


def _manual_axes(mesh: Any, newly_manual_axes: frozenset) -> frozenset:
    return frozenset(newly_manual_axes) | frozenset(getattr(mesh, "manual_axes", ()))


def _process_shard_map(
    self: QuaxTrace,
    prim: Any,
    fun: Callable,
    tracers: Sequence[Any],
    *,
    mesh: Any,
    in_specs: Sequence[Any],
    check_vma: bool,
    newly_manual_axes: frozenset,
    debug_info: Any,
) -> Any:
    axes = _manual_axes(mesh, newly_manual_axes)
    values = [_plain(self, t) for t in tracers]
    with jexc.set_current_trace(self.parent_trace):
        entering = [
            _crossing(v, s, "entering", check_vma, axes)
            for v, s in zip(values, in_specs)
        ]
    leaves, leaf_specs = _split(entering)
    with jexc.set_current_trace(self.parent_trace):
        leaves = [_placed(leaf, spec) for leaf, spec in zip(leaves, leaf_specs)]
    found: dict[str, Any] = {}

    def body(*body_leaves: Any) -> Any:
        inner_values = _rebuild(entering, body_leaves)

        def run(*args: Any) -> list:
            user_out, out_specs = fun(*args).unpack_aux()
            found["user_out"], found["out_specs"] = user_out, out_specs
            return list(user_out.vals)

        outs = quax.quaxify(run, filter_spec=lambda _: True)(*inner_values)
        leaving = [
            _crossing(v, s, "leaving", check_vma, axes)
            for v, s in zip(outs, found["out_specs"])
        ]
        found["leaving"] = leaving
        out_leaves, out_specs = _split(leaving)
        return flatten_flat_tree(list(out_leaves)).with_aux(tuple(out_specs))

    params = dict(
        subfuns=(body,),
        mesh=mesh,
        in_specs=tuple(leaf_specs),
        check_vma=check_vma,
        newly_manual_axes=newly_manual_axes,
        debug_info=debug_info.with_unknown_names(),
    )
    avals = tuple(jax.typeof(x) for x in leaves)
    with jexc.set_current_trace(self.parent_trace):
        out = prim.bind_with_trace(self.parent_trace, tuple(leaves), avals, params)
        outs = _rebuild(found["leaving"], list(out.vals))
    return found["user_out"].update(QuaxTracer(self, wrap_if_array(v)) for v in outs)


def install() -> None:
    """Gives quax's trace its `process_shard_map` (idempotent)."""
    install_trace_method("process_shard_map", _process_shard_map)


install()
