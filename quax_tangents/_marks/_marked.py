"""`Marked`: a weight marked for a compressed cotangent, as the inner trace sees it,
with every rule it registers.

Where the weight meets `dot_general` (contracting one side of each matrix) the product
runs through a `jax.custom_vjp` whose backward pass gives the weight the `OuterSum` of
the product's input and output cotangent (`outer_sum_p`), never the dense gradient;
a transpose or a floating cast keeps the mark; any other use takes the weight itself
and makes its cotangent dense, counted (`Marked.default`). Row gathers of a row-marked
table, reshaped views and device-varying marks live in `_marked_rows`,
`_marked_views` and `_marked_sharding`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jexc
import jax.numpy as jnp
import quax
from jaxtyping import Array, ArrayLike

from .._core import _fallback
from .._core._registry import rule
from .._distributed import _sharding
from ._projection import outer_sum_p


class Marked(quax.ArrayValue):
    """A marked weight inside the inner trace: `array` `(*batch, m, n)` (or its
    transpose in the last two dims), seen in `compute_dtype` when a cast was applied
    (`None`: `array`'s own dtype).

    `view`, when set, is `(rows, cols, perm)`: the weight is seen as the array
    `(*batch, *rows, *cols)` that `array` reshapes to (`prod(rows) == m`,
    `prod(cols) == n`), its non-batch dims transposed by `perm` (a reshape that
    splits or merges one
    side, such as `(d, h * k)` to `(d, h, k)`, keeps the mark).

    Its cotangent stays compressed where it meets `dot_general` (and a row gather for
    a row mark); every other use takes the weight itself and makes its cotangent
    dense, counted as a densification of `Marked`.
    """

    array: Array
    kind: str = eqx.field(static=True)
    transposed: bool = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True, default=None)
    view: tuple | None = eqx.field(static=True, default=None)

    def aval(self) -> jax.core.ShapedArray:
        if self.view is None and (not self.transposed or self.array.ndim == 2):
            # The weight's own type, with its sharding and varying mesh axes: JAX's
            # sharding and `check_vma` inference read them from the operands.
            typed = _sharding.transposed_type(jax.typeof(self.array), self.transposed)
            if self.compute_dtype is not None:
                typed = typed.update(dtype=self.compute_dtype, weak_type=False)
            return typed
        shape = jnp.shape(self.array)
        if self.view is not None:
            rows, cols, _ = self.view
            canonical = shape[:-2] + tuple(rows) + tuple(cols)
            shape = tuple(canonical[p] for p in full_perm(self.view, len(shape) - 2))
        elif self.transposed:
            shape = shape[:-2] + shape[-2:][::-1]
        return jax.core.ShapedArray(shape, self.compute_dtype or self.array.dtype)

    def materialise(self) -> Array:
        return seen(self.array, self.transposed, self.compute_dtype, self.view)

    def replace(self, **changes: Any) -> "Marked":
        fields = dict(
            array=self.array,
            kind=self.kind,
            transposed=self.transposed,
            compute_dtype=self.compute_dtype,
            view=self.view,
        )
        return Marked(**{**fields, **changes})

    def statics(self) -> dict[str, Any]:
        """Everything but `array`: `Marked(array, **statics)` rebuilds it."""
        return dict(
            kind=self.kind,
            transposed=self.transposed,
            compute_dtype=self.compute_dtype,
            view=self.view,
        )

    @staticmethod
    def default(primitive: jexc.Primitive, values: Any, params: dict) -> Any:
        # The weight itself, exactly; but its cotangent from this use is dense.
        if any(isinstance(v, Marked) for v in values):
            _fallback.record_densification(
                primitive.name,
                ("Marked",),
                "a use of a marked weight other than a matmul (or a row gather of a "
                "row-marked table) gives it a dense cotangent",
            )
        arrays = [v.materialise() if isinstance(v, Marked) else v for v in values]
        return primitive.bind(*arrays, **params)


def full_perm(view: tuple, batch_ndim: int) -> tuple[int, ...]:
    """A view's permutation of the matrix dims, with the batch dims in front (the
    view stores only the former, so that slicing batch dims leaves it valid)."""
    return tuple(range(batch_ndim)) + tuple(batch_ndim + p for p in view[2])


def seen(array: Array, transposed: bool, cast: Any, view: tuple | None) -> Array:
    """The array a marked weight `array` is seen as (see `Marked`)."""
    if view is not None:
        rows, cols, _ = view
        nb = array.ndim - 2
        array = array.reshape(array.shape[:-2] + tuple(rows) + tuple(cols))
        array = jnp.transpose(array, full_perm(view, nb))
    elif transposed:
        array = jnp.swapaxes(array, -1, -2)
    return array if cast is None else array.astype(cast)


@rule(jax.lax.transpose_p, dense_output=True)
def _transpose_marked(w: Marked, *, permutation: tuple[int, ...]) -> Any:
    if w.view is not None:
        return _marked_views.transpose_view(w, tuple(permutation))
    nb = w.ndim - 2
    batch, matrix = tuple(permutation[:nb]), tuple(permutation[nb:])
    if batch != tuple(range(nb)):
        return Marked.default(jax.lax.transpose_p, (w,), dict(permutation=permutation))
    return w.replace(transposed=w.transposed != (matrix == (nb + 1, nb)))


@rule(jax.lax.convert_element_type_p, dense_output=True)
def _convert_marked(w: Marked, *, new_dtype: Any, **params: Any) -> Any:
    """A floating cast (a bf16 compute copy of an f32 weight) keeps the mark: the
    products use the cast weight, and the gradient's factors are cast back to the
    weight's dtype."""
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return Marked.default(
            jax.lax.convert_element_type_p, (w,), dict(new_dtype=new_dtype, **params)
        )
    same = jnp.dtype(new_dtype) == w.array.dtype
    return w.replace(compute_dtype=None if same else jnp.dtype(new_dtype))


# ---------------------------------------------------------------------------------------
# dot_general with a marked weight


def factored_product(gradient_factors: Callable) -> Callable:
    """`product(dot, x, w) = dot.bind(x, w)`, whose backward pass gives `x` its usual
    cotangent and `w` the `outer_sum_p` of `gradient_factors(dot, x, ct)`: the
    factors `(a, b)` of the weight's gradient `a^T b`, never the product itself."""

    def forward(dot: Any, x: Any, w: Any) -> tuple[Any, tuple]:
        return dot.bind(x, w), (x, w)

    def backward(dot: Any, residuals: tuple, ct: Any) -> tuple:
        x, w = residuals
        _, pullback = jax.vjp(lambda x: dot.bind(x, w), x)
        (ct_x,) = pullback(ct)
        a, b = gradient_factors(dot, x, ct)
        a, b = a.astype(w.dtype), b.astype(w.dtype)
        ct_w = outer_sum_p.bind(a, b, batch_ndim=dot.batch_ndim)
        # Typed as the weight, as a custom_vjp's cotangent must be: under explicit
        # mesh axes the sum over the (sharded) rows has no sharding of its own.
        return ct_x, _sharding.typed_like(ct_w, w)

    product = jax.custom_vjp(lambda dot, x, w: dot.bind(x, w), nondiff_argnums=(0,))
    product.defvjp(forward, backward)
    return product


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
        return _marked_views.dot_view(x, w, w_is_lhs, params)
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
        "forward pass, or compute its gradient with "
        "`quax_tangents.optax.accumulate_gradients` and `projected(dims=...)`, "
        "which mark the matrix view.",
    )


@rule(jax.lax.dot_general_p, dense_output=True)
def _dot_dense_marked(x: ArrayLike, w: Marked, **params: Any) -> Array:
    return _dot_marked(x, w, False, params)


@rule(jax.lax.dot_general_p, dense_output=True)
def _dot_marked_dense(w: Marked, x: ArrayLike, **params: Any) -> Array:
    return _dot_marked(x, w, True, params)


# Row gathers of a row-marked table, reshaped and device-varying views of a marked
# weight; imported last, as they build on `Marked`.
from . import _marked_rows, _marked_sharding, _marked_views  # noqa: E402, F401
