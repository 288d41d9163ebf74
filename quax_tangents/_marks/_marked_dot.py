"""`dot_general` and `transpose` of a marked weight: a product that contracts one side
of each matrix of the marked stack runs through `factored_product`, so the weight's
cotangent is the `OuterSum` of the product's input and output cotangent; a transpose
keeps the mark. Marks with a matrix view go to `_marked_views`."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._core import _fallback
from .._core._registry import rule
from ._marked import Marked, factored_product
from ._marked_views import dot_view, transpose_moving_stack, transpose_view


@rule(jax.lax.transpose_p, dense_output=True)
def _transpose_marked(w: Marked, *, permutation: tuple[int, ...]) -> Any:
    if w.view is not None:
        return transpose_view(w, tuple(permutation))
    nb = w.ndim - 2
    batch, matrix = tuple(permutation[:nb]), tuple(permutation[nb:])
    if batch != tuple(range(nb)):
        return transpose_moving_stack(w, tuple(permutation), nb)
    return w.replace(transposed=w.transposed != (matrix == (nb + 1, nb)))


@dataclasses.dataclass(frozen=True)
class _Dot:
    """A `dot_general` whose operand `w_is_lhs` is the (maybe transposed, maybe cast)
    weight with `batch_ndim` leading batch dims."""

    params: tuple
    w_is_lhs: bool
    transposed: bool
    batch_ndim: int = 0
    cast: Any = None

    def bind(self, x: Any, w: Any) -> Any:
        w = jnp.swapaxes(w, -1, -2) if self.transposed else w
        w = w if self.cast is None else w.astype(self.cast)
        lhs, rhs = (w, x) if self.w_is_lhs else (x, w)
        return jax.lax.dot_general_p.bind(lhs, rhs, **dict(self.params))


def _dims(dot: _Dot) -> tuple[tuple, tuple, tuple, tuple]:
    """`(x's contracting, w's contracting, x's batch, w's batch)` dims."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dict(dot.params)["dimension_numbers"]
    if dot.w_is_lhs:
        return tuple(rhs_c), tuple(lhs_c), tuple(rhs_b), tuple(lhs_b)
    return tuple(lhs_c), tuple(rhs_c), tuple(lhs_b), tuple(rhs_b)


def _contraction(dot: _Dot) -> tuple[int, int] | None:
    """`(x's contracting dim, w's contracting dim)` when the dot contracts exactly
    one matrix dim of the weight and its batch dims are exactly the weight's batch
    dims, in order; otherwise `None`."""
    x_c, w_c, _, w_b = _dims(dot)
    nb = dot.batch_ndim
    if w_b != tuple(range(nb)) or len(w_c) != 1 or w_c[0] < nb:
        return None
    return x_c[0], w_c[0]


def _gradient_factors(dot: _Dot, x: Array, ct: Array) -> tuple[Array, Array]:
    """`(a, b)` `(*batch, R, .)` with the weight's gradient `a^T b` per batch
    element: `x` and `ct` flattened over the rows that the product sums over."""
    contraction = _contraction(dot)
    assert contraction is not None
    x_c, w_c = contraction
    _, _, x_b, _ = _dims(dot)
    nb = dot.batch_ndim
    rows_x = jnp.moveaxis(x, (*x_b, x_c), (*range(nb), x.ndim - 1))
    rows_x = rows_x.reshape(rows_x.shape[:nb] + (-1, rows_x.shape[-1]))
    # The output is (*batch, lhs free, rhs free); the weight's one free dim comes
    # first among the free dims (w on the left) or last.
    rows_ct = jnp.moveaxis(ct, nb, -1) if dot.w_is_lhs else ct
    rows_ct = rows_ct.reshape(rows_ct.shape[:nb] + (-1, rows_ct.shape[-1]))
    # The gradient of the operand (w or w.T) is x^T ct if its contracting dim comes
    # first, ct^T x otherwise; transposing the operand swaps them again.
    x_first = (w_c == nb) != dot.transposed
    return (rows_x, rows_ct) if x_first else (rows_ct, rows_x)


_factored_dot = factored_product(_gradient_factors)


def _dot_marked(x: Any, w: Marked, w_is_lhs: bool, params: dict) -> Any:
    if w.view is not None:
        return dot_view(x, w, w_is_lhs, params)
    dot = _Dot(
        tuple(sorted(params.items())),
        w_is_lhs,
        w.transposed,
        w.ndim - 2,
        w.compute_dtype,
    )
    if w.kind != "rows" and _contraction(dot) is None:
        _record_other_contraction(w, dot)
        operands = (w.materialise(), x) if w_is_lhs else (x, w.materialise())
        return jax.lax.dot_general_p.bind(*operands, **params)
    if w.kind == "rows":
        return Marked.default(
            jax.lax.dot_general_p, (w, x) if w_is_lhs else (x, w), params
        )
    return _factored_dot(dot, x, w.array)


def _record_other_contraction(w: Marked, dot: _Dot) -> None:
    """Counts a product that does not contract exactly one side of each matrix of
    the marked stack, and says why: a `(d, heads, head_dim)` weight marked in its
    own dims is a stack of `d` matrices `(heads, head_dim)`, and contracting `d`
    contracts its stack dim."""
    _, w_c, _, w_b = _dims(dot)
    nb = dot.batch_ndim
    shape = tuple(w.aval().shape)
    _fallback.record_densification(
        "dot_general",
        ("Marked",),
        f"a product that contracts dims {list(w_c)} and batches dims {list(w_b)} of "
        f"a marked weight of shape {list(shape)}, which the mark sees as a stack "
        f"{list(shape[:nb])} of {shape[nb:]} matrices: its cotangent stays "
        "compressed only for a product that contracts one side of each matrix, "
        "with the stack dims as batch dims",
        "Store such a weight as the matrix the product uses (a `(d, heads, "
        "head_dim)` weight as `(d, heads * head_dim)`) and reshape it in the "
        "forward pass, or pass the matrix view to the optimiser: "
        "`quax_tangents.optax.galore(..., dims=...)` (or `projected(dims=...)` "
        "with `quax_tangents.optax.accumulate_gradients`), which marks it.",
    )


@rule(jax.lax.dot_general_p, dense_output=True)
def _dot_dense_marked(x: ArrayLike, w: Marked, **params: Any) -> Array:
    return _dot_marked(x, w, False, params)


@rule(jax.lax.dot_general_p, dense_output=True)
def _dot_marked_dense(w: Marked, x: ArrayLike, **params: Any) -> Array:
    return _dot_marked(x, w, True, params)
