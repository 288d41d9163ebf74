"""Every rule `Sparse` registers: the ones that keep it sparse, sums with dense
arrays, and sums over devices."""

import functools
from typing import Any

import jax
import jax.extend.core as jexc
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from ..._core._base import densify
from ..._core._compat import psum_invariant_p, pvary_p
from ..._core._devices import gathered_or_dense_sum, vary_leaf, varying_alike
from ..._core._fallback import record_dense_result, record_densification
from ..._core._lax import add_any_p
from ..._core._registry import rule
from .. import _flat_index as _ix
from ._array import (
    _INDEX_DTYPE,
    Sparse,
    _accumulation_dtype,
    _dense_bytes,
    _fits,
    _flat,
    _out_aval,
    _size,
    _sparse_bytes,
    _why_dense,
)


# ----------------------------------------------------------------------------------
# Rules that keep Sparse. Each decides in Python (shapes, bytes, fallback) and runs
# its index arithmetic as one jitted kernel, so eager use compiles once per shape.


@rule(jax.lax.neg_p)
def _neg(x: Sparse) -> Sparse:
    return Sparse._build(x.indices, jax.lax.neg(x.values), x.event_shape)


@rule(jax.lax.copy_p)
def _copy(x: Sparse) -> Sparse:
    copy = jax.lax.copy_p.bind
    return Sparse._build(copy(x.indices), copy(x.values), x.event_shape)


@rule(jax.lax.convert_element_type_p)
def _convert_element_type(x: Sparse, **params: Any) -> Sparse | Array:
    new_dtype = params["new_dtype"]
    if not jnp.issubdtype(new_dtype, jnp.floating):
        why = f"a Sparse holds floating values, not {jnp.dtype(new_dtype)}"
        return densify(jax.lax.convert_element_type_p, [x], params, reason=why)
    values = jax.lax.convert_element_type_p.bind(
        x.values, **{**params, "sharding": None}
    )
    return Sparse._build(x.indices, values, x.event_shape)


@functools.partial(jax.jit, static_argnums=2)
def _concatenate(x: Sparse, y: Sparse, negate_y: bool) -> Sparse:
    y_values = -y.values if negate_y else y.values
    if x.indices.shape[:-1] == y.indices.shape[:-1] and x.event_shape == y.event_shape:
        return Sparse._build(
            jnp.concatenate([x.indices, y.indices], axis=-1),
            jnp.concatenate([x.values, y_values], axis=-1),
            x.event_shape,
        )
    x_indices, x_values, shape = _flat(x)
    y_indices, _, _ = _flat(y)
    return Sparse._build(
        jnp.concatenate([x_indices, y_indices]),
        jnp.concatenate([x_values, y_values.reshape(-1)]),
        shape,
    )


@rule(add_any_p, jax.lax.add_p, jax.lax.sub_p)
def _sum(x: Sparse, y: Sparse, *, primitive: jexc.Primitive) -> Sparse | Array:
    if x.dtype != y.dtype:
        return densify(primitive, [x, y], {}, reason="operands of different dtypes")
    shape = jnp.broadcast_shapes(x.shape, y.shape)
    if not _fits(shape):
        return densify(primitive, [x, y], {}, reason="too large for int32 indices")
    # `lax.add` broadcasts size-1 dims: spread the entries first (exact).
    wide_x, wide_y = _broadcast_to(x, shape), _broadcast_to(y, shape)
    if not (isinstance(wide_x, Sparse) and isinstance(wide_y, Sparse)):
        why = "broadcasting made one dense"
        return densify(primitive, [wide_x, wide_y], {}, reason=why)
    return _concatenate(wide_x, wide_y, primitive is jax.lax.sub_p)


def _broadcast_to(x: Sparse, shape: tuple[int, ...]) -> Sparse | Array:
    """`x` broadcast over its size-1 dims to `shape`, as a product with ones."""
    if x.shape == shape:
        return x
    return _mul_dense(x, jnp.ones(shape, x.dtype))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _mul_kernel(
    s: Sparse,
    d: Array,
    out_shape: tuple[int, ...],
    params: tuple[tuple[str, Any], ...],
) -> Sparse:
    def multiply(values: Array, gathered: Array) -> Array:
        return jax.lax.mul_p.bind(values, gathered, **dict(params))

    s_shape = s.shape if s.ndim else (1,) * d.ndim
    # Dims along which the sparse operand is broadcast: each entry spreads over them.
    expand = [a for a in range(d.ndim) if s_shape[a] == 1 and d.shape[a] != 1]
    d_flat = d.reshape(-1)

    def dense_index(coords: list[Array], like: Array) -> Array:
        coords = [c if d.shape[a] != 1 else c * 0 for a, c in enumerate(coords)]
        return _ix.ravel(coords, d.shape, like)

    if not expand:
        # Same positions; the values times the (broadcast) dense entries there.
        indices, _, _ = _flat(s)
        coords = _ix.unravel(indices.reshape(s.indices.shape), s_shape)
        gathered = _ix.gather(d_flat, dense_index(coords, s.indices))
        event_shape = out_shape[s.indices.ndim - 1 :]
        return Sparse._build(s.indices, multiply(s.values, gathered), event_shape)
    spread = _size([d.shape[a] for a in expand])
    indices, values, _ = _flat(s)
    grid_shape = (indices.size, spread)
    coords = [
        jnp.broadcast_to(c[:, None], grid_shape) for c in _ix.unravel(indices, s_shape)
    ]
    grid = _ix.unravel(
        jnp.arange(spread, dtype=_INDEX_DTYPE), [d.shape[a] for a in expand]
    )
    for a, g in zip(expand, grid, strict=True):
        coords[a] = jnp.broadcast_to(g[None, :], grid_shape)
    like = coords[0]
    gathered = _ix.gather(d_flat, dense_index(coords, like))
    product = multiply(jnp.broadcast_to(values[:, None], grid_shape), gathered)
    out_indices = _ix.ravel(coords, out_shape, like)
    return Sparse._build(out_indices.reshape(-1), product.reshape(-1), out_shape)


@rule(jax.lax.mul_p, commutative=True)
def _mul_dense(s: Sparse, d: ArrayLike, **params: Any) -> Sparse | Array:
    operands = [s, d]
    out = _out_aval(jax.lax.mul_p, operands, params)
    if (why := _why_dense(s, out)) is not None:
        return densify(jax.lax.mul_p, operands, params, reason=why)
    d = jnp.asarray(d)
    if d.ndim == 0:
        values = jax.lax.mul_p.bind(*varying_alike(s.values, d), **params)
        return Sparse._build(s.indices, values, s.event_shape)
    s_shape = s.shape if s.ndim else (1,) * d.ndim
    spread = _size([d.shape[a] for a in range(d.ndim) if s_shape[a] == 1])
    nnz = s.indices.size * spread
    if spread > 1 and _sparse_bytes(nnz, out.dtype) > _dense_bytes(
        out.shape, out.dtype
    ):
        why = f"broadcasting gives {nnz} entries, more bytes than dense"
        return densify(jax.lax.mul_p, operands, params, reason=why)
    static_params = tuple(sorted(params.items()))
    return _mul_kernel(s, d, tuple(out.shape), static_params)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _dot_kernel(
    s: Sparse,
    d: Array,
    dimension_numbers: Any,
    sparse_is_lhs: bool,
    out_dtype: Any,
    out_shape: tuple[int, ...],
    dense: bool,
) -> Sparse | Array:
    indices, values, full = _flat(s)
    out = _ix.dot_entries(
        indices, values, full, d, dimension_numbers, sparse_is_lhs, out_dtype
    )
    if dense:
        return out.dense(out_shape)
    return Sparse._build(out.indices, out.values, out_shape)


def _dot_general(
    s: Sparse, d: ArrayLike, sparse_is_lhs: bool, params: dict[str, Any]
) -> Sparse | Array:
    operands = [s, d] if sparse_is_lhs else [d, s]
    out = _out_aval(jax.lax.dot_general_p, operands, params)
    if (why := _why_dense(s, out)) is not None:
        return densify(jax.lax.dot_general_p, operands, params, reason=why)
    d = jnp.asarray(d)
    numbers = params["dimension_numbers"]
    *_, d_free = _ix.dot_roles(s.ndim, d.ndim, numbers, sparse_is_lhs)
    nnz = s.indices.size * _size([d.shape[a] for a in d_free])
    dense = _sparse_bytes(nnz, out.dtype) > _dense_bytes(out.shape, out.dtype)
    if dense:
        record_dense_result(
            jax.lax.dot_general_p.name,
            ("Sparse",),
            tuple(out.shape),
            f"the exact sparse result has {nnz} entries, more bytes than the dense "
            f"{out.dtype}{list(out.shape)} result; computed by a scatter-add",
        )
    numbers = tuple(tuple(tuple(dims) for dims in pair) for pair in numbers)
    return _dot_kernel(
        s, d, numbers, sparse_is_lhs, jnp.dtype(out.dtype), tuple(out.shape), dense
    )


@rule(jax.lax.dot_general_p)
def _dot_general_sparse_dense(x: Sparse, y: ArrayLike, **params: Any) -> Sparse | Array:
    return _dot_general(x, y, True, params)


@rule(jax.lax.dot_general_p)
def _dot_general_dense_sparse(x: ArrayLike, y: Sparse, **params: Any) -> Sparse | Array:
    return _dot_general(y, x, False, params)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _remap(
    x: Sparse, axes: tuple[int, ...] | None, shape: tuple[int, ...], fold_batch: bool
) -> Sparse:
    """The entries of `x` (its batch dims folded into the events if `fold_batch`)
    keeping the event axes `axes` in that order: a transpose for a permutation, a sum
    over the others otherwise; `axes=None` relabels the events as `shape` (reshape)."""
    if fold_batch:
        indices, values, event = _flat(x)
    else:
        indices, values, event = x.indices, x.values, x.event_shape
    if axes is not None:
        coords = _ix.unravel(indices, event)
        indices = _ix.ravel([coords[a] for a in axes], shape, indices)
    return Sparse._build(indices, values, shape)


def _relayout(
    primitive: jexc.Primitive,
    x: Sparse,
    params: dict[str, Any],
    axes: tuple[int, ...] | None,
    shape: tuple[int, ...],
) -> Sparse | Array:
    """`_remap` of the events when `axes` (whole-array axes) keep the batch dims in
    place, else of the folded array (densified if int32 cannot index it)."""
    n_batch = x.indices.ndim - 1
    keeps_batch = axes is None or axes[:n_batch] == tuple(range(n_batch))
    if keeps_batch and tuple(shape[:n_batch]) == x.shape[:n_batch]:
        events = None if axes is None else tuple(a - n_batch for a in axes[n_batch:])
        return _remap(x, events, tuple(shape[n_batch:]), False)
    if not _fits(x.shape):
        return densify(primitive, [x], params, reason="too large for int32 indices")
    return _remap(x, axes, tuple(shape), True)


@rule(jax.lax.transpose_p)
def _transpose(x: Sparse, **params: Any) -> Sparse | Array:
    axes = tuple(int(p) for p in params["permutation"])
    shape = tuple(x.shape[a] for a in axes)
    return _relayout(jax.lax.transpose_p, x, params, axes, shape)


@rule(jax.lax.reshape_p)
def _reshape(x: Sparse, **params: Any) -> Sparse | Array:
    if params.get("dimensions") is not None:
        return densify(
            jax.lax.reshape_p, [x], params, reason="reshape with `dimensions`"
        )
    shape = tuple(int(d) for d in params["new_sizes"])
    return _relayout(jax.lax.reshape_p, x, params, None, shape)


@rule(jax.lax.reduce_sum_p)
def _reduce_sum(x: Sparse, **params: Any) -> Sparse | Array:
    summed = {int(a) % max(x.ndim, 1) for a in params["axes"]}
    if not summed:
        return x
    axes = tuple(a for a in range(x.ndim) if a not in summed)
    shape = tuple(x.shape[a] for a in axes)
    return _relayout(jax.lax.reduce_sum_p, x, params, axes, shape)


# ----------------------------------------------------------------------------------
# Sparse + dense: dense by design (a scatter-add into the dense operand)


@jax.jit
def _add_into_dense_kernel(s: Sparse, d: Array) -> Array:
    indices, values, shape = _flat(s)
    acc = _accumulation_dtype(d.dtype)
    out = _ix.scatter_add(d.reshape(-1).astype(acc), indices, values.astype(acc))
    return out.astype(d.dtype).reshape(shape)


@rule(add_any_p, jax.lax.add_p, dense_output=True, commutative=True)
def _add_into_dense(s: Sparse, d: ArrayLike, *, primitive: jexc.Primitive) -> Array:
    d = jnp.asarray(d)
    if d.shape != s.shape or d.dtype != s.dtype or not _fits(s.shape):
        return densify(primitive, [s, d], {}, reason="broadcast or mixed operands")
    record_densification(
        primitive.name,
        ("Sparse",),
        reason="the sum of a Sparse and a dense array is dense; it is a scatter-add "
        "into the dense operand",
    )
    return _add_into_dense_kernel(s, d)


# ---------------------------------------------------------------------------------------
# Sums over devices (inside `jax.shard_map`)


@rule(pvary_p)
def _pvary(x: Sparse, *, axes: tuple) -> Sparse:
    """Typed as varying over `axes` (a replicated value meeting a device-varying
    one): its indices and values are. The values are unchanged."""
    axes = tuple(axes)
    return Sparse._build(
        vary_leaf(x.indices, axes), vary_leaf(x.values, axes), x.event_shape
    )


def _gather_is_cheaper(x: Sparse, devices: int) -> bool:
    """Whether each device receives no more gathering every device's entries (and
    their indices) than a ring all-reduce of the dense array, which receives about
    twice the array."""
    gathered = devices * _sparse_bytes(x.indices.size, x.dtype)
    return gathered <= 2 * _dense_bytes(x.shape, x.dtype)


@rule(psum_invariant_p)
def _psum_invariant(x: Sparse, *, axes: tuple) -> Sparse | Array:
    """The sum over devices that `lax.psum` of a device-varying `Sparse` binds
    inside `shard_map`: every device's entries side by side (`devices * k` of
    them, a repeated index adding up), exact.

    Where that would receive more than a dense all-reduce of the array (a large
    `k`, or many devices), the dense arrays are summed instead, exact and
    counted."""
    return gathered_or_dense_sum(
        x,
        tuple(axes),
        lambda devices: _gather_is_cheaper(x, devices),
        f"{x.k} entries of an array of {_size(x.shape)}",
    )
