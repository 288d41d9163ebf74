"""Marked weights seen through a reshape: a `(d, h * k)` matrix used as `(d, h, k)`
(attention heads), or `(h * k, d)` as `(h, k, d)`.

A reshape that only splits or merges the rows, or only the columns, of a marked
matrix keeps the mark (`Marked.view`). A `dot_general` that contracts exactly the
row dims (or exactly the column dims) of such a view, with the weight's batch dims as
its batch dims, still gives the matrix's gradient as the factors `X`, `C`: the
contracted dims of the other operand flattened in the matrix's order, and the
output's dims of the weight flattened likewise. Any other reshape, or a contraction
that mixes the two sides, takes the weight itself (counted, as `Marked.default`).
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._core import _fallback
from .._core._registry import rule
from ._marked import Marked, factored_product, full_perm, seen


# ---------------------------------------------------------------------------------------
# Reshape and transpose


def _split(sizes: tuple[int, ...], m: int, n: int) -> int | None:
    """Where `sizes` divides into a rows part of product `m` and a columns part of
    product `n`, if anywhere."""
    for cut in range(1, len(sizes)):
        if math.prod(sizes[:cut]) == m and math.prod(sizes[cut:]) == n:
            return cut
    return None


def _in_order(w: Marked) -> bool:
    """Whether `w` is its matrix reshaped, with no transpose."""
    if w.view is None:
        return not w.transposed
    return tuple(w.view[2]) == tuple(range(len(w.view[2])))


@rule(jax.lax.reshape_p, dense_output=True)
def _reshape_marked(w: Marked, *, new_sizes: tuple[int, ...], **params: Any) -> Any:
    new_sizes = tuple(new_sizes)
    *batch, m, n = jnp.shape(w.array)
    nb = len(batch)
    cut = _split(new_sizes[nb:], m, n) if new_sizes[:nb] == tuple(batch) else None
    usable = w.kind != "rows" and _in_order(w) and params.get("dimensions") is None
    if cut is None or not usable:
        return Marked.default(
            jax.lax.reshape_p, (w,), dict(new_sizes=new_sizes, **params)
        )
    rows, cols = new_sizes[nb : nb + cut], new_sizes[nb + cut :]
    if (rows, cols) == ((m,), (n,)):
        return w.replace(transposed=False, view=None)
    view = (rows, cols, tuple(range(len(rows) + len(cols))))
    return w.replace(transposed=False, view=view)


def transpose_view(w: Marked, permutation: tuple[int, ...]) -> Any:
    """`transpose` of a viewed weight: the view's permutation, composed; batch dims
    must stay in place."""
    rows, cols, _ = w.view  # type: ignore[misc]
    nb = w.ndim - len(rows) - len(cols)
    full = full_perm(w.view, nb)  # type: ignore[arg-type]
    new_full = tuple(full[q] for q in permutation)
    if new_full[:nb] != tuple(range(nb)):
        return transpose_moving_stack(w, permutation, nb)
    return w.replace(view=(rows, cols, tuple(p - nb for p in new_full[nb:])))


def transpose_moving_stack(
    w: Marked, permutation: tuple[int, ...], batch_ndim: int
) -> Array:
    """A `transpose` that moves the stack dims of a marked weight: the weight
    itself, its cotangent dense (counted), with what to change. The usual cause is
    a Flax `nn.scan` over parameters stacked on another axis than the first, which
    moves that axis to the front before the scan."""
    shape = tuple(w.aval().shape)
    _fallback.record_densification(
        "transpose",
        ("Marked",),
        f"a transpose {list(permutation)} of a marked weight of shape {list(shape)} "
        f"that moves its stack dims {list(range(batch_ndim))}: the mark sees it as a "
        f"stack {list(shape[:batch_ndim])} of {shape[batch_ndim:]} matrices, and "
        "keeps its cotangent compressed only while the stack dims lead",
        "Store the layers on the first axis: a Flax `nn.scan` over parameters "
        "stacked on another (`variable_axes={'params': 1}`, MaxText's "
        "`param_scan_axis=1`) moves it to the front; use `variable_axes={'params': "
        "0}` (`param_scan_axis=0`). A weight whose leading dims are not layers (a "
        "`(d, heads, head_dim)` kernel) is one matrix to view with `dims=` "
        "(`quax_tangents.optax.galore(..., dims=...)`).",
    )
    return jax.lax.transpose_p.bind(w.materialise(), permutation=permutation)


# ---------------------------------------------------------------------------------------
# dot_general


@dataclasses.dataclass(frozen=True)
class _ViewDot:
    """A `dot_general` of a viewed weight (operand `w_is_lhs`) with `x`."""

    params: tuple
    w_is_lhs: bool
    view: tuple
    cast: Any
    batch_ndim: int

    def bind(self, x: Any, w: Any) -> Any:
        w = seen(w, False, self.cast, self.view)
        lhs, rhs = (w, x) if self.w_is_lhs else (x, w)
        return jax.lax.dot_general_p.bind(lhs, rhs, **dict(self.params))


def _numbers(dot: _ViewDot) -> tuple[tuple, tuple, tuple, tuple]:
    """`(x's contracting, w's contracting, x's batch, w's batch)` dims."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dict(dot.params)["dimension_numbers"]
    if dot.w_is_lhs:
        return tuple(rhs_c), tuple(lhs_c), tuple(rhs_b), tuple(lhs_b)
    return tuple(lhs_c), tuple(rhs_c), tuple(lhs_b), tuple(rhs_b)


def _plan(dot: _ViewDot, x_ndim: int) -> tuple | None:
    """How `x` and the output cotangent become the factors, or `None` when the dot
    does not contract exactly one side of the matrix (with the batch dims as dot
    batch dims)."""
    rows, cols, _ = dot.view
    nb = dot.batch_ndim
    perm = full_perm(dot.view, nb)
    w_ndim = len(perm)
    x_c, w_c, x_b, w_b = _numbers(dot)
    if w_b != tuple(range(nb)):
        return None
    row_axes = set(range(nb, nb + len(rows)))
    canonical = [perm[a] for a in w_c]
    if set(canonical) == row_axes and len(canonical) == len(rows):
        contracted = "rows"
    elif set(canonical) == set(range(nb + len(rows), w_ndim)) and len(canonical) == len(
        cols
    ):
        contracted = "cols"
    else:
        return None
    # x's contracted dims in the order of the matrix's dims they meet.
    x_contracted = tuple(
        x_c[i] for i in sorted(range(len(w_c)), key=canonical.__getitem__)
    )
    x_free = tuple(a for a in range(x_ndim) if a not in x_c and a not in x_b)
    w_free = [a for a in range(w_ndim) if a not in w_c and a not in w_b]
    # The output is (*batch, lhs free, rhs free).
    first = nb + (0 if dot.w_is_lhs else len(x_free))
    out_x = tuple(
        nb + (len(w_free) if dot.w_is_lhs else 0) + j for j in range(len(x_free))
    )
    order = sorted(range(len(w_free)), key=lambda i: perm[w_free[i]])
    out_w = tuple(first + i for i in order)
    return contracted, tuple(x_b), x_free, x_contracted, out_x, out_w


def _factors(dot: _ViewDot, x: Array, ct: Array) -> tuple[Array, Array]:
    """`(a, b)` with the matrix's gradient `a^T b`, `(*batch, R, .)` each."""
    contracted, x_b, x_free, x_contracted, out_x, out_w = _plan(dot, x.ndim)  # type: ignore[misc]
    nb = len(x_b)

    def flatten(array: Array, batch: tuple, free: tuple, group: tuple) -> Array:
        moved = jnp.transpose(array, (*batch, *free, *group))
        shape, split = moved.shape, nb + len(free)
        rows, size = math.prod(shape[nb:split]), math.prod(shape[split:])
        return moved.reshape(shape[:nb] + (rows, size))

    a = flatten(x, x_b, x_free, x_contracted)
    b = flatten(ct, tuple(range(nb)), out_x, out_w)
    return (a, b) if contracted == "rows" else (b, a)


_factored_view_dot = factored_product(_factors)


def dot_view(x: ArrayLike, w: Marked, w_is_lhs: bool, params: dict) -> Any:
    """`dot_general` of a dense `x` and a viewed marked weight."""
    dot = _ViewDot(
        tuple(sorted(params.items())),
        w_is_lhs,
        w.view,  # type: ignore[arg-type]
        w.compute_dtype,
        jnp.ndim(w.array) - 2,
    )
    if w.kind == "rows" or _plan(dot, jnp.ndim(x)) is None:
        operands = (w, x) if w_is_lhs else (x, w)
        return Marked.default(jax.lax.dot_general_p, operands, params)
    return _factored_view_dot(dot, x, w.array)
