"""`lax.scan` over a body that closes over a marked weight.

JAX's transpose of `scan` accumulates the cotangent of a closed-over value (a scan
*const*) in a carry that starts as dense zeros, so the `OuterSum` each iteration
emits would be added to a dense array and densified: a loss computed in chunks of
the batch, or a scan over microbatches, would lose every mark.

Here such a scan, inside the inner trace, runs as a `jax.custom_vjp` whose backward
pass is a scan of its own: for each iteration (in reverse) it recomputes the body
from the stored input carry, as `jax.checkpoint` on the body would, and takes its
VJP with the marked weights as `Marked` values again. Each iteration's weight
cotangent comes out as a scanned *output* (stacked, `(T, *batch, m, B)` factors),
never a carry, and the iterations are summed at the end by concatenating their
factors: exact, with no dense weight-shaped array, whatever the projector.

Cost: the body runs twice (as under `jax.checkpoint`), and the input carry of every
iteration is stored.
"""

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jexc
import jax.numpy as jnp
import numpy as np
import quax

from .._core import _fallback
from .._core._compat import scan_counts
from .._core._devices import axes_of, dense_all_reduce, device_varying
from .._core._layout import constrain, drop_leading, explicit_sharding
from .._core._sharding import varying_axes
from . import _cotangents
from ._marked import Marked
from ._projection import typed_as
from ._slices import projected_factor, projected_pair, projection, summed_over
from ._sources import Fresh, Given


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _meta(x: Any) -> dict | None:
    return x.statics() if isinstance(x, Marked) else None


def _dense_view(array: Any, meta: dict | None) -> Any:
    """What the body sees of an input in the forward pass."""
    if meta is None:
        return array
    return Marked(array, **meta).materialise()


def applies(args: Sequence[Any], num_consts: int, num_carry: int) -> bool:
    """Whether a scan's operands call for this path: a marked const, and no quax
    value other than marked consts and marked xs."""
    consts = args[:num_consts]
    carry = args[num_consts : num_consts + num_carry]
    if not any(isinstance(c, Marked) for c in consts):
        return False
    if any(isinstance(c, quax.Value) for c in carry):
        return False
    return all(isinstance(a, Marked) or not isinstance(a, quax.Value) for a in args)


def scan_with_marked_consts(
    args: Sequence[Any], jaxpr: Any, params: dict[str, Any]
) -> list[Any]:
    """`scan_p.bind(*args, jaxpr=jaxpr, **params)` for operands that `applies`."""
    nc, nk = scan_counts(args, params)
    metas = [_meta(a) for a in args]
    arrays = [a.array if isinstance(a, Marked) else a for a in args]
    body = jexc.jaxpr_as_fun(jaxpr)
    options = dict(
        length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
    )

    def forward(arrays: Sequence[Any], keep_carries: bool) -> Any:
        dense = [_dense_view(a, m) for a, m in zip(arrays, metas)]
        consts, carry, xs = dense[:nc], dense[nc : nc + nk], dense[nc + nk :]

        def step(carry: list, x: list) -> tuple:
            outs = body(*consts, *carry, *x)
            ys = list(outs[nk:])
            return list(outs[:nk]), (ys, carry) if keep_carries else ys

        return jax.lax.scan(step, carry, xs, **options)

    @jax.custom_vjp
    def scanned(*arrays: Any) -> list[Any]:
        carry, ys = forward(arrays, False)
        return [*carry, *ys]

    def scanned_fwd(*arrays: Any) -> tuple[list[Any], tuple]:
        carry, (ys, carries) = forward(arrays, True)
        return [*carry, *ys], (arrays, carries)

    def scanned_bwd(residuals: tuple, cts: list[Any]) -> tuple:
        arrays, carries = residuals
        return tuple(_backward(body, metas, nc, nk, options, arrays, carries, cts))

    scanned.defvjp(scanned_fwd, scanned_bwd)
    return scanned(*arrays)


def _iteration_cotangents(
    body: Callable,
    metas: Sequence[dict | None],
    float_positions: Sequence[int],
    inputs: list[Any],
    nk: int,
    ct_carry: Sequence[Any],
    ct_ys: Sequence[Any],
) -> dict[int, Any]:
    """One iteration of a backward scan: the VJP of the body at `inputs` (the
    marked operands seen as `Marked`, so that their cotangents stay factored),
    pulled back from the output carry's and ys' cotangents; the cotangent of each
    floating operand, by position."""

    def of_floats(*floats: Any) -> list[Any]:
        full = list(inputs)
        for i, f in zip(float_positions, floats):
            full[i] = f
        values = [Marked(a, **m) if m else a for a, m in zip(full, metas)]
        return list(quax.quaxify(body, filter_spec=lambda _: True)(*values))

    outs, pullback = jax.vjp(of_floats, *[inputs[i] for i in float_positions])
    out_cts = []
    k_iter, y_iter = iter(ct_carry), iter(ct_ys)
    for j, out in enumerate(outs):
        if not _is_float(out):
            out_cts.append(np.zeros(jnp.shape(out), jax.dtypes.float0))
        else:
            out_cts.append(next(k_iter) if j < nk else next(y_iter))
    return dict(zip(float_positions, pullback(out_cts)))


def _backward(
    body: Callable,
    metas: Sequence[dict | None],
    nc: int,
    nk: int,
    options: dict[str, Any],
    arrays: Sequence[Any],
    carries: Sequence[Any],
    cts: Sequence[Any],
    projected: dict[int, tuple[Any, tuple]] | None = None,
) -> list[Any]:
    """The cotangents of every operand: a reverse scan whose iterations take the
    VJP of the body with the marked operands as `Marked` values.

    `projected` maps the position of a scanned-over marked stack to its `(spec,
    operands)`: each iteration projects its layer's cotangent `G_l`. For a mark
    into a running sum (the projector `P` first, the sum `S` last) it writes
    `S_l + G_l^T P_l` over that slice of `S`, and the stack's cotangent is the
    stacked `LowRank(P, S)`; for any other it writes its projector over that slice
    of the given stack of projectors (in place: a keep step writes what it read)
    and gives its factor as the iteration's output (see `scan_with_projected_xs`)."""
    projected = projected or {}
    consts, xs = list(arrays[:nc]), list(arrays[nc + nk :])
    ct_carry, ct_ys = list(cts[:nk]), list(cts[nk:])
    diff = [_is_float(a) for a in arrays]
    const_dense = [i for i in range(nc) if diff[i] and metas[i] is None]
    const_marked = [i for i in range(nc) if diff[i] and metas[i] is not None]
    carry_diff = [i for i in range(nk) if diff[nc + i]]
    xs_diff = [
        i for i in range(len(xs)) if diff[nc + nk + i] and nc + nk + i not in projected
    ]
    pushed = sorted(i for i in projected if projected[i][0].source.into)
    paired = sorted(i for i in projected if not projected[i][0].source.into)
    float_positions = [i for i, d in enumerate(diff) if d]

    def back_step(acc: tuple, inp: tuple) -> tuple:
        ct_k, ct_c, running, bases = acc
        index, carry_t, x_t, ct_y_t = inp
        inputs = [*consts, *carry_t, *x_t]
        in_cts = _iteration_cotangents(
            body, metas, float_positions, inputs, nk, ct_k, ct_y_t
        )
        new_sums = [
            _add_projected_slice(in_cts[i], index, total, *projected[i])
            for i, total in zip(pushed, running)
        ]
        pairs = [
            _projected_slice(in_cts[i], index, *_reading(projected[i], base))
            for i, base in zip(paired, bases)
        ]
        new_bases = [_write_slice(b, p, index) for b, (p, _) in zip(bases, pairs)]
        factors = [f for _, f in pairs]
        new_ct_k = [in_cts[nc + i] for i in carry_diff]
        new_ct_c = [c + in_cts[i] for c, i in zip(ct_c, const_dense)]
        per_iteration = [in_cts[i] for i in const_marked]
        ct_x = [in_cts[nc + nk + i] for i in xs_diff]
        return (new_ct_k, new_ct_c, new_sums, new_bases), (per_iteration, ct_x, factors)

    float_ct_ys = [c for c in ct_ys if jnp.result_type(c) != jax.dtypes.float0]
    # Inside `jax.shard_map`: the mesh axes a layer's cotangent, and so a projector
    # found from it, may vary over.
    varying = frozenset().union(*map(varying_axes, [*arrays, *cts]))
    init = (
        [ct_carry[i] for i in carry_diff],
        [jnp.zeros_like(arrays[i]) for i in const_dense],
        [projected[i][1][-1] for i in pushed],
        [_given_projectors(arrays[i], *projected[i], varying) for i in paired],
    )
    (ct_k, ct_c, running, bases), (ct_marked, ct_xs, factors) = jax.lax.scan(
        back_step,
        init,
        (jnp.arange(options["length"]), list(carries), xs, float_ct_ys),
        length=options["length"],
        reverse=not options["reverse"],
        unroll=options["unroll"],
    )
    result: list[Any] = [None] * len(arrays)
    for i, ct in zip(const_dense, ct_c):
        result[i] = ct
    for i, ct in zip(const_marked, ct_marked):
        # The iterations' factors side by side: their exact sum.
        result[i] = jnp.sum(ct, axis=0)
    for i, total in zip(pushed, running):
        result[i] = _stacked_projection(projected[i][1][0], total, arrays[i])
    for i, basis, factor in zip(paired, bases, factors):
        summed = projected[i][0].axis_name
        axes = frozenset(axes_of(summed) if summed is not None else ())
        axes = (axes & varying_axes(factor)) - varying_axes(arrays[i])
        if axes:
            # A replicated stack's gradient: the layers' factors summed over the
            # devices, with the projectors they share (`_summed_over_data_axes`).
            factor = dense_all_reduce(factor, tuple(sorted(axes, key=str)))
        result[i] = _stacked_projection(basis, factor, arrays[i])
    for i, ct in zip(carry_diff, ct_k):
        result[nc + i] = ct
    for i, ct in zip(xs_diff, ct_xs):
        result[nc + nk + i] = ct
    return result


def _add_projected_slice(
    ct: Any, index: Any, running: Any, spec: Any, operands: tuple
) -> Any:
    """`running` with its slice `index` replaced by `S_l + G_l^T P_l` (the factor
    the mark's source gives), from the layer's cotangent `ct` (`G_l`), its slice of
    the mark's `operands` (the stacked sum last, in place of which `running` is
    read) and its slice of the sum."""
    take = lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False)  # noqa: E731
    per_slice = spec.source.per_slice[:-1]
    sliced = tuple(take(o) if cut else o for o, cut in zip(operands[:-1], per_slice))
    factor = projected_factor(ct, sliced, take(running), spec)
    new = constrain(factor.astype(running.dtype), drop_leading(spec.layout, 1))
    return jax.lax.dynamic_update_index_in_dim(running, new, index, 0)


def _projected_slice(ct: Any, index: Any, spec: Any, operands: tuple) -> list[Any]:
    """The projector and factor of slice `index` of a stacked mark whose projector
    is not a running sum's, from the layer's cotangent `ct` (`G_l`) and its slice
    of the mark's `operands` (a `Switch`'s refresh flag is shared)."""
    take = lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False)  # noqa: E731
    sliced = tuple(
        take(o) if cut else o for o, cut in zip(operands, spec.source.per_slice)
    )
    return projected_pair(ct, sliced, spec)


def _reading(projected: tuple[Any, tuple], stack: Any) -> tuple[Any, tuple]:
    """`(spec, operands)` of a mark not into a sum, its given projectors read from
    the `stack` that the backward scan writes over (each slice is read before its
    own iteration writes it).

    Read from the operand instead, the given stack stays alive beside the one the
    scan writes (XLA copies it into the scan's carry): on a refresh, every layer's
    old and new projectors at once. The step of one microbatch with marks in the
    loss (`benchmarks/bench_scale.py --arms marks-8bit --accumulation 1`) held, at
    7B, 24.03 GiB before against 22.28 now on CPU and 23.39 against 22.12 for a
    v5p chip; at 1B, 5.07 against 4.75 on CPU and, with the MLP width 5504, 4.94
    against 4.58 for a v5e chip. With the width 5461 the v5e compile holds more
    (6.07 GiB against 5.37): it then copies the MLP weight stacks whole into the
    layout its loops read, as it does for `accumulate_gradients`' step (JAX
    0.12.1, libtpu 0.0.52)."""
    spec, operands = projected
    if isinstance(spec.source, Fresh):
        return projected  # the stack starts as zeros, not as an operand
    return spec, (stack, *operands[1:])


def _write_slice(stack: Any, value: Any, index: Any) -> Any:
    """`stack` with its slice `index` replaced by `value`, laid out as a slice of
    `stack` where mesh axes are explicit (they are part of the types, which an
    update must match)."""
    value = constrain(
        value.astype(stack.dtype), drop_leading(explicit_sharding(stack), 1)
    )
    return jax.lax.dynamic_update_index_in_dim(stack, value, index, 0)


def _given_projectors(w: Any, spec: Any, operands: tuple, varying: frozenset) -> Any:
    """The stack of projectors that a backward scan writes each layer's over: the
    given one (`Given`, `Switch`), or zeros for a `Fresh` mark's. Unless given,
    typed as varying over the mesh axes `varying` (inside `jax.shard_map`), as the
    projectors found from the cotangents are, so that the scan's carry keeps one
    type."""
    if isinstance(spec.source, Fresh):
        *batch, m, n = jnp.shape(w)
        stack = jnp.zeros((*batch, min(m, n), spec.rank), jnp.result_type(w))
    else:
        stack = operands[0]
    # A mark whose fresh projectors are found from the gradient summed over the
    # devices (`Finish.axis_name`) gives the same projector on every device.
    if isinstance(spec.source, Given) or not varying or summed_over(varying, spec):
        return stack
    return device_varying(stack, tuple(varying))


def _stacked_projection(projector: Any, total: Any, w: Any) -> Any:
    """The stacked `LowRank(P, S)` of the weight `w` whose slices of `S` (and of
    `P`, for a mark not into a sum) the backward scan wrote, typed as `w`'s
    cotangent."""
    out = projection(projector.astype(total.dtype), total, _projector_left(w))
    return typed_as(out, jax.typeof(w))


# ---------------------------------------------------------------------------------------
# A scan over the stack of a marked weight, projected layer by layer
#
# When a scan slices a stacked weight marked for a projection layer by layer (a
# given projector `P` and a running sum `S`, as `accumulate_gradients` marks it, or
# a given, fresh or switched projector, as `quax_tangents.optax.mark` does), JAX's
# transpose of the scan would emit every layer's cotangent factors as a stacked
# output, kept until the mark projects them after the scan. Here the scan runs as a
# `jax.custom_vjp` whose backward pass, layer by layer (in reverse), recomputes the
# body from its stored input carry, takes its VJP with the layer's weight as a
# `Marked` value, projects that layer's cotangent and writes `S_l + G_l^T P_l` over
# the slice of the sum, in place (or gives the layer's `P_l` and `G_l^T P_l` as the
# scan's outputs). The weight's cotangent is the stacked `LowRank(P, S)`: the same
# numbers as the mark's own finish, slice by slice, with one layer's factors alive
# at a time.


def applies_projected(args: Sequence[Any], num_consts: int, num_carry: int) -> bool:
    """Whether a scan's operands call for `scan_with_projected_xs`: a scanned-over
    stack marked for a projection layer by layer, and no other quax value."""
    xs = args[num_consts + num_carry :]
    if not any(_cotangents.pushable(x) is not None for x in xs):
        return False
    return all(
        not isinstance(a, quax.Value)
        or (i >= num_consts + num_carry and _cotangents.pushable(a) is not None)
        for i, a in enumerate(args)
    )


def warn_unless_projected(args: Sequence[Any]) -> None:
    """Warns for each stacked mark among a scan's operands that the scan is not
    projecting layer by layer (`Marked.by_layer`)."""
    for x in args:
        if isinstance(x, Marked) and x.by_layer:
            warnings.warn(
                "`accumulate_gradients` / `mark` (`by_layer=True`): a `lax.scan` uses "
                "the stacked "
                f"projected weight of shape {x.shape} but cannot project its gradient "
                "layer by layer, so every layer's factors are kept until the scan "
                "ends (the same result, more memory). That needs the scan to take "
                "the marked stack itself as its `xs` (cast or viewed by `dims=`, "
                "not transposed), not closed over by an outer scan. Pass "
                "`by_layer=False` to `accumulate_gradients` (or `mark`) if this is "
                "intended. "
                "(Through `qto.galore(...).value_and_grad`, which always projects "
                "layer by layer: check which leaves `project=` chose; a stacked "
                "`(layers, d)` norm or bias is a matrix by shape only.)",
                _cotangents.LayerByLayerWarning,
                stacklevel=2,
            )


def sliceable(x: Any) -> Any:
    """A marked weight that a scan slices along a dim of its matrix (one with no
    stack dims, viewed or transposed so that a row or column dim leads): the
    weight itself, its cotangent dense (counted), with what to change. Slicing its
    stored array instead would cut the wrong dim."""
    if not isinstance(x, Marked) or jnp.ndim(x.array) > 2:
        return x
    shape = list(x.aval().shape)
    _fallback.record_densification(
        "scan",
        ("Marked",),
        f"a scan over the leading dim of a marked weight of shape {shape} that is "
        f"one matrix (of stored shape {list(jnp.shape(x.array))}), not a stack: "
        "the mark keeps its cotangent compressed only for a scan over stack dims",
        "Store the layers on the first axis: a Flax `nn.scan` over parameters "
        "stacked on another (`variable_axes={'params': 1}`, MaxText's "
        "`param_scan_axis=1`) moves it to the front; use `variable_axes={'params': "
        "0}` (`param_scan_axis=0`), and `dims=` only for the dims after the layers.",
    )
    return x.materialise()


def _slice_meta(meta: dict | None) -> dict | None:
    return None if meta is None else {**meta, "by_layer": False}


def scan_with_projected_xs(
    args: Sequence[Any], jaxpr: Any, params: dict[str, Any]
) -> list[Any]:
    """`scan_p.bind(*args, jaxpr=jaxpr, **params)` for operands that
    `applies_projected`."""
    nc, nk = scan_counts(args, params)
    entries = [_cotangents.pushable(a) for a in args]
    for entry in entries:
        if entry is not None:
            _cotangents.projected_by_scan(entry)
    # Each layer's slice is this scan's to project: a scan inside the body over the
    # slice (a stack with two batch dims) has nothing more to project, nor to warn.
    metas = [
        _slice_meta(_meta(a)) if e is not None else None for a, e in zip(args, entries)
    ]
    # The weight before the mark: its cotangent is what the backward pass gives.
    arrays = [a if e is None else e.weight for a, e in zip(args, entries)]
    pushed = [i for i, e in enumerate(entries) if e is not None]
    found = [e for e in entries if e is not None]
    extras = [x for e in found for x in e.operands]
    body = jexc.jaxpr_as_fun(jaxpr)
    options = dict(
        length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
    )

    def forward(arrays: Sequence[Any], keep_carries: bool) -> Any:
        # A stack that `dims=` views as other matrices is the body's stored shape.
        dense = [_dense_view(a, m) for a, m in zip(arrays, metas)]
        consts, carry, xs = dense[:nc], dense[nc : nc + nk], dense[nc + nk :]

        def step(carry: list, x: list) -> tuple:
            outs = body(*consts, *carry, *x)
            ys = list(outs[nk:])
            return list(outs[:nk]), (ys, carry) if keep_carries else ys

        return jax.lax.scan(step, list(carry), list(xs), **options)

    n = len(arrays)

    @jax.custom_vjp
    def scanned(*flat: Any) -> list[Any]:
        carry, ys = forward(flat[:n], False)
        return [*carry, *ys]

    def scanned_fwd(*flat: Any) -> tuple[list[Any], tuple]:
        carry, (ys, carries) = forward(flat[:n], True)
        return [*carry, *ys], (flat, carries)

    def scanned_bwd(residuals: tuple, cts: list[Any]) -> tuple:
        flat, carries = residuals
        arrays, extra = list(flat[:n]), list(flat[n:])
        projected, start = {}, 0
        for i, e in zip(pushed, found):
            count = len(e.operands)
            projected[i] = (e.spec, tuple(extra[start : start + count]))
            start += count
        projected = _summed_over_data_axes(projected, arrays, cts)
        result = _backward(
            body, metas, nc, nk, options, arrays, carries, cts, projected
        )
        return (*result, *(None for _ in extra))

    scanned.defvjp(scanned_fwd, scanned_bwd)
    return scanned(*arrays, *extras)


def _summed_over_data_axes(projected: dict, arrays: list, cts: list) -> dict:
    """Inside `shard_map`, a replicated stack whose layers' cotangents vary over
    mesh axes (the devices' own data): JAX's gradient of it is their sum over those
    axes. A projection given or kept is the same either side of the sum; a fresh
    projector is found from the summed gradient when its range finder's products
    are summed (`Finish.axis_name`), and the layers' factors are summed after the
    scan (`_backward`). Marks into a running sum are left as they are."""
    varying = frozenset().union(*map(varying_axes, [*arrays, *cts]))
    out = dict(projected)
    for i, (spec, operands) in projected.items():
        extra = varying - varying_axes(arrays[i])
        if extra and not spec.source.into and spec.axis_name is None:
            axes = tuple(sorted(extra, key=str))
            out[i] = (dataclasses.replace(spec, axis_name=axes), operands)
    return out


def _projector_left(w: Any) -> bool:
    """Whether a projection of `w` `(*batch, m, n)` keeps its projector on the left
    (`m <= n`: the rows' side is the smaller)."""
    m, n = jnp.shape(w)[-2:]
    return m <= n
