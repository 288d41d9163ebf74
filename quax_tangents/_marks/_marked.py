"""`Marked`: a weight marked for a compressed cotangent, as the inner trace sees it,
with the rules that need nothing else.

Where the weight meets `dot_general` (contracting one side of each matrix) the product
runs through a `jax.custom_vjp` whose backward pass gives the weight the `OuterSum` of
the product's input and output cotangent (`outer_sum_p`), never the dense gradient;
a transpose or a floating cast keeps the mark; any other use takes the weight itself
and makes its cotangent dense, counted (`Marked.default`). Row gathers of a row-marked
or projected table, reshaped views and device-varying marks live in `_marked_rows`,
`_marked_views` and `_marked_sharding`, its products and transposes in `_marked_dot`;
`_marks/__init__.py` imports them all, which registers their rules.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jexc
import jax.numpy as jnp
import quax
from jaxtyping import Array

from .._core import _fallback, _sharding
from .._core._registry import rule
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
    # A stacked mark that a scan over the stack should project layer by layer
    # (`accumulate_gradients(by_layer=True)`); static, so that it survives the
    # `jax.jit`s and `jax.checkpoint`s that a scan may sit in, where a scan that
    # cannot project it says so (`_marked_scan.warn_unless_projected`).
    by_layer: bool = eqx.field(static=True, default=False)
    # The token of that mark (`Finish.token`) while `array` is the mark's own output,
    # or its image in a `jax.jit` or `jax.checkpoint` (which rebuild the value from
    # its leaves and statics): how the scan finds the mark it projects
    # (`_cotangents.pushable`). A new `array` (`replace`) and a slice of one
    # (`statics`) do not keep it.
    token: int = eqx.field(static=True, default=0)

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
        dtype = self.compute_dtype or self.array.dtype
        return _sharding.varying_type(shape, dtype, self.array)

    def materialise(self) -> Array:
        return seen(self.array, self.transposed, self.compute_dtype, self.view)

    def replace(self, **changes: Any) -> "Marked":
        fields = dict(
            array=self.array,
            kind=self.kind,
            transposed=self.transposed,
            compute_dtype=self.compute_dtype,
            view=self.view,
            by_layer=self.by_layer,
            token=0 if "array" in changes else self.token,
        )
        return Marked(**{**fields, **changes})

    def statics(self) -> dict[str, Any]:
        """Everything but `array` and `token`: `Marked(array, **statics)` rebuilds
        it for another array (a slice of it, say)."""
        return dict(
            kind=self.kind,
            transposed=self.transposed,
            compute_dtype=self.compute_dtype,
            view=self.view,
            by_layer=self.by_layer,
        )

    @staticmethod
    def default(primitive: jexc.Primitive, values: Any, params: dict) -> Any:
        # The weight itself, exactly; but its cotangent from this use is dense.
        if any(isinstance(v, Marked) for v in values):
            _fallback.record_densification(
                primitive.name, ("Marked",), *_dense_use_advice(primitive, values)
            )
        arrays = [v.materialise() if isinstance(v, Marked) else v for v in values]
        return primitive.bind(*arrays, **params)


# The primitives that `w[i]`, `w[i:j]`, `jnp.split` and `lax.dynamic_index_in_dim`
# bind: on a stack, the usual cause is a Python loop over its layers.
_INDEXING = frozenset({"slice", "dynamic_slice", "gather"})


def _dense_use_advice(primitive: jexc.Primitive, values: Any) -> tuple[str, str]:
    """Why a use of a marked weight makes its cotangent dense, and what to change
    (`record_densification`'s `reason` and `fix`)."""
    if primitive.name in _INDEXING and any(
        isinstance(v, Marked) and v.array.ndim > 2 for v in values
    ):
        return (
            "indexing a stacked marked weight (`w[i]`: one layer of the stack, as a "
            "Python loop over the layers takes it) gives it a dense cotangent; a "
            "stack keeps its mark where a `lax.scan` runs over it or a batched "
            "matmul takes it whole",
            "Run the layers with `jax.lax.scan` over the stack (as a model of "
            "layers stacked with `equinox.filter_vmap` does), or keep each layer's "
            "weight as a leaf of its own, which is then marked by itself.",
        )
    return (
        "a use of a marked weight other than a matmul (or a gather of whole rows of "
        "a 2-D table) gives it a dense cotangent",
        "A table read by gathers of whole rows keeps its mark when it is 2-D, not "
        "transposed and not viewed with `dims=`. A weight viewed with `dims=` keeps "
        "its mark only where a product contracts the view's rows or columns whole: "
        "check that `dims=` groups the dims the model contracts. Any other such "
        "weight, leave it out of `project=` (its gradient is computed whole, then "
        "projected).",
    )


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
