"""A weight stored with more dims than its matrix, marked through its matrix view.

An attention weight stored as `(d, heads, head_dim)` (stacked: `(layers, d, heads,
head_dim)`) is the `(d, heads * head_dim)` matrix to a projection. JAX requires the
cotangent of an input to have the input's shape, and a `LowRank` is `(*batch, m, n)`,
so the mark goes on the matrix view, in three steps:

1. `to_matrix(w, matrix_shape)` reshapes the stored weight to its matrix view, through
    a `jax.custom_vjp` whose backward pass binds `matrix_view_p` on the view's
    cotangent;
2. the view is marked (`projected_cotangent`, ...), and reshaped back to the stored
    shape for the loss to use: a reshape that splits one side of a marked matrix
    keeps the mark (`_marked_views`);
3. in the backward pass, the mark finishes the view's cotangent as a `LowRank` of the
    matrix, and `matrix_view_p`'s rule wraps it as a `StoredView`, a value of the
    stored shape, which JAX hands back as the input's cotangent. The entry points
    (`grad`, `value_and_grad`, `vjp`) then return the `LowRank` inside
    (`unwrap_stored_views`): the gradient of such a weight comes back in its matrix
    view, as `quax_tangents.optax.projected(dims=...)` takes it.

Outside a quax trace (plain `jax.grad`) `matrix_view_p` is a reshape, and the
gradient has the stored shape. Any other use of a `StoredView` (added to a dense
cotangent of another use of the weight, say) materialises it, counted.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jexc
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array, ArrayLike, PyTree

from .._core._base import CompressedArray
from .._core._registry import rule
from .._core._sharding import varying_type
from .._core._unchecked import unchecked
from .._types._primitives import define_batched
from .._types.lowrank import LowRank
from . import _cotangents


class StoredView(CompressedArray):
    """The `LowRank` cotangent of a weight's matrix view `(*batch, m, n)`, seen in
    the weight's stored shape (`(*batch, *row dims, *column dims)`, the same elements
    in the same order). It lives only between the mark's backward pass and the
    entry point's return, which unwraps it."""

    matrix: LowRank
    stored: tuple[int, ...] = eqx.field(static=True)

    def aval(self) -> jax.core.ShapedArray:
        # Inside `jax.shard_map`, varying where the matrix does.
        return varying_type(self.stored, self.matrix.dtype, self.matrix.aval())

    def materialise(self) -> Array:
        return self.matrix.materialise().reshape(self.stored)


# ---------------------------------------------------------------------------------------
# matrix_view: the cotangent of the matrix view -> the cotangent of the stored weight


matrix_view_p = jexc.Primitive("matrix_view")


def _stored_shape(ct: Any, stored: tuple[int, ...], batch_ndim: int) -> tuple:
    return tuple(jnp.shape(ct)[:batch_ndim]) + tuple(stored)


def _matrix_view_dense(ct: Array, *, stored: tuple[int, ...], batch_ndim: int) -> Array:
    return jnp.reshape(ct, _stored_shape(ct, stored, batch_ndim))


def reshaped_type(aval: Any, shape: tuple[int, ...]) -> Any:
    """The type of `aval` reshaped to `shape`, as `lax.reshape` gives it: with its
    sharding and varying mesh axes (which `shard_map`'s `check_vma` reads)."""
    out, _ = jax.lax.reshape_p.abstract_eval(
        aval, new_sizes=tuple(shape), dimensions=None, sharding=None
    )
    return out


def _matrix_view_abstract(ct: Any, *, stored: tuple[int, ...], batch_ndim: int) -> Any:
    return reshaped_type(ct, _stored_shape(ct, stored, batch_ndim))


define_batched(matrix_view_p, _matrix_view_dense, _matrix_view_abstract)


def _matrix_view_transpose(ct: Any, x: Any, *, stored: tuple, batch_ndim: int):
    # A reshape: its transpose reshapes back (forward-over-reverse differentiation).
    return [jnp.reshape(ct, x.aval.shape)]


ad.deflinear2(matrix_view_p, _matrix_view_transpose)


@rule(matrix_view_p)
def _matrix_view(ct: LowRank, *, stored: tuple[int, ...], batch_ndim: int) -> Any:
    if batch_ndim:  # vmapped over the mark: no compressed form, counted
        return CompressedArray.default(
            matrix_view_p, (ct,), dict(stored=stored, batch_ndim=batch_ndim)
        )
    return unchecked(StoredView, matrix=ct, stored=tuple(stored))


def _to_matrix_fwd(stored: tuple, matrix: tuple, w: Array) -> tuple[Array, None]:
    return jnp.reshape(w, matrix), None


def _to_matrix_bwd(stored: tuple, matrix: tuple, _: None, ct: Any) -> tuple[Any]:
    # A bwd rule may not return a quax value; a primitive whose quax rule builds one
    # can, because under the trace its output is a tracer.
    return (matrix_view_p.bind(ct, stored=stored, batch_ndim=0),)


# The reshape of `w` from its stored shape to `matrix`; the shapes parameterise it.
_to_matrix = jax.custom_vjp(
    lambda stored, matrix, w: jnp.reshape(w, matrix), nondiff_argnums=(0, 1)
)
_to_matrix.defvjp(_to_matrix_fwd, _to_matrix_bwd)


# Inside the inner trace of an entry point (see `_cotangents`), the custom_vjp runs
# in a rule, below that trace, as the mark's own custom_vjp does: quax's trace does
# not process custom_vjp calls itself.
to_matrix_p = jexc.Primitive("to_matrix")


def _to_matrix_plain(w: Array, *, stored: tuple, matrix: tuple) -> Array:
    return jnp.reshape(w, matrix)


to_matrix_p.def_impl(_to_matrix_plain)
to_matrix_p.def_abstract_eval(lambda w, *, stored, matrix: reshaped_type(w, matrix))
mlir.register_lowering(
    to_matrix_p, mlir.lower_fun(_to_matrix_plain, multiple_results=False)
)


def _to_matrix_jvp(primals: tuple, tangents: tuple, *, stored: tuple, matrix: tuple):
    # A trace cached with the primitive in it and differentiated by plain JAX.
    (w,), (tangent,) = primals, tangents
    tangent = ad.instantiate_zeros(tangent)
    return jax.jvp(lambda w: _to_matrix(stored, matrix, w), (w,), (tangent,))


def _to_matrix_batch(args: tuple, dims: tuple, *, stored: tuple, matrix: tuple):
    (w,), (dim,) = args, dims
    w = jnp.moveaxis(w, dim, 0)
    mapped = jax.vmap(lambda w: _to_matrix(stored, matrix, w))
    return mapped(w), 0


ad.primitive_jvps[to_matrix_p] = _to_matrix_jvp
batching.primitive_batchers[to_matrix_p] = _to_matrix_batch


@rule(to_matrix_p)
def _to_matrix_rule(w: ArrayLike, *, stored: tuple, matrix: tuple) -> Array:
    return _to_matrix(stored, matrix, w)


def to_matrix(w: Array, matrix_shape: tuple[int, ...]) -> Array:
    """`w` reshaped to its matrix view `matrix_shape` (`(*batch, m, n)`, grouping
    consecutive dims of `w` in order), whose cotangent reaches `w` as a `StoredView`
    when it is a `LowRank` (see the module's docstring)."""
    stored, matrix_shape = tuple(jnp.shape(w)), tuple(matrix_shape)
    if math.prod(stored) != math.prod(matrix_shape):
        raise ValueError(
            f"A weight of shape {list(stored)} has no matrix view {list(matrix_shape)}."
        )
    if _cotangents.tracing_inner_layer():
        return to_matrix_p.bind(w, stored=stored, matrix=matrix_shape)
    return _to_matrix(stored, matrix_shape, w)


def unwrap_stored_views(tree: PyTree) -> PyTree:
    """`tree` with every `StoredView` replaced by the `LowRank` of its matrix view."""
    is_view = lambda x: isinstance(x, StoredView)  # noqa: E731
    return jtu.tree_map(lambda x: x.matrix if is_view(x) else x, tree, is_leaf=is_view)
