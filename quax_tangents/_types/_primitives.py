"""Construction primitives: small JAX primitives with dense semantics whose quax rule
returns a compressed value.

They are how compressed values are created inside traced code that may not return
quax values itself, such as `jax.custom_vjp` backward rules. Outside a quax trace each
one computes its dense semantics, which is exactly the materialised value the quax rule
returns, so code that uses them stays correct without our entry points.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.extend.core as jexc
import jax.numpy as jnp
import jax.tree_util as jtu
import quax
from jax.interpreters import ad, batching, mlir
from jaxtyping import ArrayLike, PyTree

from .._core._base import materialise_values
from .._core._registry import rule
from .._core._sharding import varying_type
from .._core._validate import values_unchecked
from .lowrank import LowRank, within_budget


def _map_leading(fn: Callable, batch_ndim: int) -> Callable:
    for _ in range(batch_ndim):
        fn = jax.vmap(fn)
    return fn


def _move_batch_to_front(x: Any, dim: Any, size: int) -> Any:
    if dim is None:  # not mapped
        return jnp.broadcast_to(x, (size,) + jnp.shape(x))
    return jnp.moveaxis(x, dim, 0)


def define_batched(
    primitive: jexc.Primitive,
    dense: Callable[..., Any],
    abstract: Callable[..., Any],
) -> None:
    """Impl, abstract eval, lowering and batching from one dense function that takes
    a static `batch_ndim`: the number of leading dims that vmap added."""
    primitive.def_impl(lambda *args, **params: dense(*args, **params))
    primitive.def_abstract_eval(abstract)
    mlir.register_lowering(
        primitive,
        mlir.lower_fun(lambda *a, **p: dense(*a, **p), multiple_results=False),
    )

    def batch_rule(args, dims, *, batch_ndim, **params):
        size = next(jnp.shape(a)[d] for a, d in zip(args, dims) if d is not None)
        args = [_move_batch_to_front(a, d, size) for a, d in zip(args, dims)]
        return primitive.bind(*args, batch_ndim=batch_ndim + 1, **params), 0

    batching.primitive_batchers[primitive] = batch_rule


# ---------------------------------------------------------------------------------------
# compress: x -> materialise(compressor(x))

compress_p = jexc.Primitive("compress")


def _compressed(x: Any, compressor: Callable, batch_ndim: int) -> Any:
    # `x` is a value of the traced program (a cotangent, say), not user input: like
    # any JAX operation, compressing it lets a NaN flow on (see `_validate`).
    with values_unchecked():
        return _map_leading(compressor, batch_ndim)(x)


def _compress_dense(x: Any, *, compressor: Callable, batch_ndim: int) -> Any:
    return materialise_values(_compressed(x, compressor, batch_ndim))


def _compress_abstract(x: Any, *, compressor: Callable, batch_ndim: int) -> Any:
    return varying_type(x.shape, x.dtype, x)


define_batched(compress_p, _compress_dense, _compress_abstract)
# A projection: for higher-order AD it is applied to tangents and cotangents alike.
ad.deflinear(compress_p, lambda ct, **params: [compress_p.bind(ct, **params)])


@rule(compress_p)
def _compress_rule(x: ArrayLike, *, compressor: Callable, batch_ndim: int) -> Any:
    return _compressed(x, compressor, batch_ndim)


@rule(compress_p)
def _recompress_rule(
    x: quax.ArrayValue, *, compressor: Callable, batch_ndim: int
) -> Any:
    # Compressing is defined on the dense value; asked for by name, not a fallback.
    return _compressed(x.materialise(), compressor, batch_ndim)


def compress(x: PyTree, compressor: Callable[[Any], Any]) -> PyTree:
    """`compressor(x)` that also works where a quax value cannot be returned.

    Inside traced code that must produce arrays, such as a `jax.custom_jvp` rule or
    a loop body, calling a compressor directly fails or stays dense. This binds a
    primitive instead: under `quax_tangents.jvp`/`grad` (or any quax trace) it
    becomes `compressor(x)`; elsewhere it computes the same values densely.

    **Arguments:**

    - `x`: an array or a pytree of arrays.
    - `compressor`: a hashable function from a dense array to a compressed value.

    **Returns:**

    The compressed value(s), or their dense values outside a quax trace.
    """
    return jtu.tree_map(
        lambda leaf: compress_p.bind(leaf, compressor=compressor, batch_ndim=0), x
    )


# ---------------------------------------------------------------------------------------
# materialise: the identity, which makes a compressed value dense on purpose

materialise_p = jexc.Primitive("materialise")
define_batched(
    materialise_p,
    lambda x, *, batch_ndim: x,
    lambda x, *, batch_ndim: varying_type(x.shape, x.dtype, x),
)
ad.deflinear(materialise_p, lambda ct, **params: [ct])


@rule(materialise_p)
def _materialise_value(x: quax.ArrayValue, *, batch_ndim: int) -> Any:
    # Asked for by name, so not counted as a fallback.
    return x.materialise()


@rule(materialise_p)
def _materialise_dense(x: ArrayLike, *, batch_ndim: int) -> Any:
    return x


def _materialise_leaf(x: Any) -> Any:
    if isinstance(x, quax.Value):
        return x.materialise()
    if isinstance(x, jax.core.Tracer):
        # Possibly a quax tracer holding a compressed value: only a primitive
        # reaches it.
        return materialise_p.bind(x, batch_ndim=0)
    return x


def materialise(tree: PyTree) -> PyTree:
    """Dense arrays for every compressed value in a pytree; other leaves unchanged.

    Works on concrete values and inside traced code (a custom_jvp rule, a jitted or
    quaxified function), where it is an explicit densification: it is not counted
    as a fallback.

    **Arguments:**

    - `tree`: an array, a compressed value, or any pytree of them.

    **Returns:**

    The same pytree with each compressed value replaced by its dense array.
    """
    return jtu.tree_map(
        _materialise_leaf, tree, is_leaf=lambda x: isinstance(x, quax.Value)
    )


# ---------------------------------------------------------------------------------------
# outer: (x, ct) -> x^T ct summed over the leading dims, i.e. the weight gradient of
# `x @ w`. Its rank is at most the number of rows of `x`.

outer_p = jexc.Primitive("outer")


def _flatten_rows(a: Any, batch_ndim: int) -> Any:
    return a.reshape(a.shape[:batch_ndim] + (-1, a.shape[-1]))


def outer_dense(x: Any, ct: Any, *, batch_ndim: int) -> Any:
    x, ct = _flatten_rows(x, batch_ndim), _flatten_rows(ct, batch_ndim)
    return jnp.matmul(jnp.swapaxes(x, -1, -2), ct)


def outer_abstract(x: Any, ct: Any, *, batch_ndim: int) -> Any:
    shape = x.shape[:batch_ndim] + (x.shape[-1], ct.shape[-1])
    # Varying over the mesh axes either operand varies over (inside `shard_map`).
    return varying_type(shape, jnp.result_type(x.dtype, ct.dtype), x, ct)


define_batched(outer_p, outer_dense, outer_abstract)


def _aval_shape(a: Any) -> tuple[int, ...]:
    return a.aval.shape if ad.is_undefined_primal(a) else jnp.shape(a)


def _outer_transpose_x(out_ct: Any, x: Any, ct: Any, *, batch_ndim: int) -> Any:
    rows = _flatten_rows(ct, batch_ndim) @ jnp.swapaxes(out_ct, -1, -2)
    return rows.reshape(_aval_shape(x))


def _outer_transpose_ct(out_ct: Any, x: Any, ct: Any, *, batch_ndim: int) -> Any:
    return (_flatten_rows(x, batch_ndim) @ out_ct).reshape(_aval_shape(ct))


ad.defbilinear(outer_p, _outer_transpose_x, _outer_transpose_ct)


@rule(outer_p)
def _outer_rule(x: ArrayLike, ct: ArrayLike, *, batch_ndim: int) -> LowRank | Any:
    dtype = jnp.result_type(x, ct)
    x = _flatten_rows(jnp.asarray(x, dtype), batch_ndim)
    ct = _flatten_rows(jnp.asarray(ct, dtype), batch_ndim)
    return within_budget(outer_p, jnp.swapaxes(x, -1, -2), jnp.swapaxes(ct, -1, -2))
