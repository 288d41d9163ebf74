"""`SparseRows`: an array of which only some rows are stored, as the gradient of an
embedding table that a batch reads a few rows of.

Every rule this representation registers lives in this file.
"""

import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, ArrayLike, Float, Int

from .._core import _validate
from .._core._base import CompressedArray, densify, install_guard
from .._core._compat import psum_invariant_p, pvary_p, reshard_p
from .._core._devices import axis_size, gather_along, gathered_or_dense_sum, vary_leaf
from .._core._fallback import record_densification
from .._core._lax import add_any_p
from .._core._registry import rule
from .._core._sharding import explicit_axes, spec_entries, unsharded_along, varying_type


_INDEX_DTYPE = jnp.int32


class SparseRows(CompressedArray):
    """The array of shape `(*batch, num_rows, *row_shape)` that is zero except for the
    stored rows: row `indices[..., i]` holds `rows[..., i, :]`. Duplicate indices add
    up.

    Leading dims of `indices` are batch dims (a stacked table's cotangent: one set
    of stored rows per slice); `rows` shares them. Storage is
    `k * (prod(row_shape) * itemsize + 4)` bytes per slice for `k` stored rows,
    instead of `num_rows * prod(row_shape) * itemsize`.

    **Arguments:**

    - `indices`: integer array `(*batch, k)` of row numbers in `[0, num_rows)`;
        stored as int32.
    - `rows`: floating array `(*batch, k, *row_shape)`.
    - `num_rows`: the number of rows of each dense slice.
    """

    indices: Int[Array, "*batch k"]
    rows: Float[Array, "..."]
    num_rows: int = eqx.field(static=True)

    def __init__(
        self,
        indices: Int[ArrayLike, "*batch k"],
        rows: Float[ArrayLike, "..."],
        num_rows: int,
    ):
        raw = np.asarray(indices) if _validate.is_concrete(indices) else None
        indices, rows = jnp.asarray(indices), jnp.asarray(rows)
        if not jnp.issubdtype(indices.dtype, jnp.integer) or indices.ndim < 1:
            raise TypeError(
                f"`indices` must be an integer array (*batch, k) of row numbers, got "
                f"{indices.dtype}{list(indices.shape)}."
            )
        num_rows = _validate.check_positive_int("num_rows", num_rows)
        if raw is not None and raw.size and (raw.min() < 0 or raw.max() >= num_rows):
            raise ValueError(
                f"`indices` range over [{raw.min()}, {raw.max()}], outside [0, "
                f"{num_rows}) for `num_rows`={num_rows}."
            )
        self.indices = indices.astype(_INDEX_DTYPE)
        self.rows = rows
        self.num_rows = num_rows

    def __check_init__(self) -> None:
        _validate.check_floating("rows", self.rows)
        _validate.check_ndim("rows", self.rows, 1)
        if self.rows.shape[: self.indices.ndim] != self.indices.shape:
            raise ValueError(
                f"`rows` has shape {self.rows.shape} but `indices` has shape "
                f"{self.indices.shape}; `rows` must be (*batch, k, *row_shape) for "
                "indices (*batch, k)."
            )
        _validate.check_finite("rows", self.rows)

    @classmethod
    def build(cls, indices: Array, rows: Array, num_rows: int) -> "SparseRows":
        """Unchecked construction for rules: rule outputs may hold non-finite
        values, and checks would sync with the host eagerly."""
        out = object.__new__(cls)
        object.__setattr__(out, "indices", jnp.asarray(indices, _INDEX_DTYPE))
        object.__setattr__(out, "rows", rows)
        object.__setattr__(out, "num_rows", int(num_rows))
        install_guard(out)
        return out

    @property
    def batch_ndim(self) -> int:
        return self.indices.ndim - 1

    @property
    def k(self) -> int:
        """The number of stored rows (per slice)."""
        return self.indices.shape[-1]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.rows.shape[self.indices.ndim :]

    def aval(self) -> jax.core.ShapedArray:
        shape = (*self.indices.shape[:-1], self.num_rows, *self.row_shape)
        # Inside `jax.shard_map`, varying where its rows or row numbers do.
        return varying_type(shape, self.rows.dtype, self.indices, self.rows)

    def materialise(self) -> Array:
        zeros = jnp.zeros(self.shape, self.rows.dtype)
        return add_rows(zeros, self.indices, self.rows)

    @classmethod
    def join_branches(cls, values: Sequence[CompressedArray]) -> Any:
        # Zero rows add nothing: pad every branch to the largest k.
        if len({(v.shape, v.dtype) for v in values}) != 1:
            return None
        k = max(v.k for v in values)  # type: ignore[attr-defined]
        return lambda x: x.pad_k(k)

    def fit_carry(self, like: CompressedArray) -> "SparseRows | None":
        same = isinstance(like, SparseRows) and (like.shape, like.dtype) == (
            self.shape,
            self.dtype,
        )
        if same and self.k <= like.k:  # type: ignore[attr-defined]
            return self.pad_k(like.k)  # type: ignore[attr-defined]
        return None

    def pad_k(self, k: int) -> "SparseRows":
        """The same array with `k` stored rows, the added ones zero (at row 0)."""
        extra = k - self.k
        if extra <= 0:
            return self
        nb = self.batch_ndim
        pad_indices = [(0, 0)] * nb + [(0, extra)]
        pad_rows = pad_indices + [(0, 0)] * len(self.row_shape)
        return SparseRows.build(
            jnp.pad(self.indices, pad_indices),
            jnp.pad(self.rows, pad_rows),
            self.num_rows,
        )

    def all_reduce(self, axis_name: Any, *, mean: bool = False) -> "SparseRows":
        # Exact: every device's rows side by side, `devices * k` of them.
        nb = self.batch_ndim
        indices = gather_along(self.indices, axis_name, axis=nb)
        rows = gather_along(self.rows, axis_name, axis=nb)
        if mean:
            rows = rows / jnp.asarray(axis_size(axis_name), rows.dtype)
        return SparseRows.build(indices, rows, self.num_rows)

    def inner(self, other: Any) -> Array:
        if isinstance(other, SparseRows) and (other.shape, other.dtype) == (
            self.shape,
            self.dtype,
        ):
            return _rows_inner(self, other)
        if isinstance(other, CompressedArray):
            return super().inner(other)
        other = jnp.asarray(other)
        if other.shape != self.shape or self.batch_ndim:
            return super().inner(other)
        # Only the stored rows meet nonzeros.
        return jnp.sum(jnp.conj(self.rows) * other[self.indices])


def _rows_inner(a: SparseRows, b: SparseRows) -> Array:
    """`sum(conj(a) * b)` of two `SparseRows` of one shape, from their stored rows:
    both sets of rows are summed into the slots of their joint distinct indices
    (duplicates add up), then multiplied slot by slot. Memory: the two sets of
    rows once more, never a table."""

    def one(ia: Array, ra: Array, ib: Array, rb: Array) -> Array:
        indices = jnp.concatenate([ia, ib])
        # Rows out of range are dropped, as `materialise` drops them.
        inside = (indices >= 0) & (indices < a.num_rows)
        size = indices.shape[0]
        _, slot = jnp.unique(
            jnp.where(inside, indices, -1), size=size, return_inverse=True
        )
        slot = jnp.where(inside, slot.reshape(-1), size)  # out of range: no slot

        def slots(rows: Array, part: Array) -> Array:
            return jax.ops.segment_sum(rows, part, num_segments=size)

        k = ia.shape[0]
        sa, sb = slots(ra, slot[:k]), slots(rb, slot[k:])
        return jnp.sum(jnp.conj(sa) * sb)

    for _ in range(a.batch_ndim):
        one = jax.vmap(one)
    dtype = jnp.promote_types(a.dtype, b.dtype)
    # Whole on every device: the sort of the row numbers needs them all.
    k_axis = a.batch_ndim
    ia, ib = (unsharded_along(x.indices, k_axis) for x in (a, b))
    ra, rb = (unsharded_along(x.rows.astype(dtype), k_axis) for x in (a, b))
    return jnp.sum(one(ia, ra, ib, rb))


def add_rows(dense: Array, indices: Array, rows: Array) -> Array:
    """`dense` `(*batch, num_rows, ...)` with `rows[..., i, :]` added at row
    `indices[..., i]` of each slice (out-of-range rows dropped)."""

    def one(dense: Array, indices: Array, rows: Array) -> Array:
        if explicit_axes():
            # Rows sharded along the stored rows (a batch's, on the data axis) meet
            # a table laid out otherwise: the result is laid out as the table.
            spec = PartitionSpec(*spec_entries(dense))
            return dense.at[indices].add(rows, mode="drop", out_sharding=spec)
        return dense.at[indices].add(rows, mode="drop")

    for _ in range(indices.ndim - 1):
        one = jax.vmap(one)
    return one(dense, indices, rows)


# ---------------------------------------------------------------------------------------
# Rules


def _row_factor(y: Array, x: SparseRows) -> Array | None:
    """The rows of a dense factor `y` that meet `x`'s stored rows, or `None` when `y`
    does not broadcast against `x` without changing its shape."""
    if jnp.ndim(y) == 0:
        return y
    if jnp.ndim(y) > x.ndim or jnp.broadcast_shapes(y.shape, x.shape) != x.shape:
        return None
    y = jnp.reshape(y, (1,) * (x.ndim - y.ndim) + y.shape)
    return y if y.shape[0] == 1 else y[x.indices]


def _slice_factor(y: Array, x: SparseRows) -> Array | None:
    """`_row_factor` for a stacked `x`: a scalar, or a `y` of `x`'s full shape read
    at each slice's stored rows; `None` otherwise."""
    if jnp.ndim(y) == 0:
        return y
    if y.shape != x.shape:
        return None
    read = lambda y, indices: y[indices]  # noqa: E731
    for _ in range(x.batch_ndim):
        read = jax.vmap(read)
    return read(y, x.indices)


def _scale(x: SparseRows, y: ArrayLike, params: dict) -> SparseRows | Array:
    y = jnp.asarray(y)
    factor = _row_factor(y, x) if x.batch_ndim == 0 else _slice_factor(y, x)
    if factor is None or jnp.result_type(x.rows, y) != x.dtype:
        return densify(jax.lax.mul_p, [x, y], params, reason="the product broadcasts")
    return SparseRows.build(x.indices, x.rows * factor, x.num_rows)


@rule(jax.lax.mul_p)
def _mul_dense_right(x: SparseRows, y: ArrayLike, **params: Any) -> SparseRows | Array:
    return _scale(x, y, params)


@rule(jax.lax.mul_p)
def _mul_dense_left(y: ArrayLike, x: SparseRows, **params: Any) -> SparseRows | Array:
    return _scale(x, y, params)


@rule(jax.lax.div_p)
def _div_dense(x: SparseRows, y: ArrayLike, **params: Any) -> SparseRows | Array:
    """`x / y` for a scalar `y` (as `jnp.mean` divides a sum): the stored rows
    divided. An array divisor is densified: the rows not stored would be `0 / y`,
    which is not zero where `y` is."""
    y = jnp.asarray(y)
    if y.size != 1 or jnp.result_type(x.rows, y) != x.dtype:
        return densify(jax.lax.div_p, [x, y], params, reason="a quotient by an array")
    return SparseRows.build(x.indices, x.rows / y.reshape(()), x.num_rows)


@rule(jax.lax.neg_p)
def _neg(x: SparseRows) -> SparseRows:
    return SparseRows.build(x.indices, -x.rows, x.num_rows)


@rule(jax.lax.copy_p)
def _copy(x: SparseRows) -> SparseRows:
    return x


@rule(jax.lax.convert_element_type_p)
def _convert(x: SparseRows, *, new_dtype: Any, **params: Any) -> SparseRows | Array:
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return densify(
            jax.lax.convert_element_type_p,
            [x],
            dict(new_dtype=new_dtype, **params),
            reason="a non-floating result has no tangent-like row-sparse form",
        )
    return SparseRows.build(x.indices, x.rows.astype(new_dtype), x.num_rows)


def _concat(primitive: Any, x: SparseRows, y: SparseRows, sign: int) -> Any:
    if (x.shape, x.dtype) != (y.shape, y.dtype):
        return densify(primitive, [x, y], {}, reason="shapes or dtypes differ")
    rows = y.rows if sign > 0 else -y.rows
    nb = x.batch_ndim
    return SparseRows.build(
        jnp.concatenate([x.indices, y.indices], axis=nb),
        jnp.concatenate([x.rows, rows], axis=nb),
        x.num_rows,
    )


@rule(add_any_p)
def _add_any(x: SparseRows, y: SparseRows) -> SparseRows | Array:
    return _concat(add_any_p, x, y, 1)


@rule(jax.lax.add_p)
def _add(x: SparseRows, y: SparseRows) -> SparseRows | Array:
    return _concat(jax.lax.add_p, x, y, 1)


@rule(jax.lax.sub_p)
def _sub(x: SparseRows, y: SparseRows) -> SparseRows | Array:
    return _concat(jax.lax.sub_p, x, y, -1)


def _plus_dense(primitive: Any, x: SparseRows, y: ArrayLike, sign: int = 1) -> Array:
    if x.shape != jnp.shape(y) or x.dtype != jnp.result_type(y):
        return densify(primitive, [x, y], {}, reason="shapes or dtypes differ")
    record_densification(primitive.name, ("SparseRows",), "a sum with a dense array")
    rows = x.rows if sign > 0 else -x.rows
    return add_rows(jnp.asarray(y), x.indices, rows)


@rule(add_any_p, dense_output=True)
def _add_any_dense_right(x: SparseRows, y: ArrayLike) -> Array:
    return _plus_dense(add_any_p, x, y)


@rule(add_any_p, dense_output=True)
def _add_any_dense_left(y: ArrayLike, x: SparseRows) -> Array:
    return _plus_dense(add_any_p, x, y)


@rule(jax.lax.add_p, dense_output=True)
def _add_dense_right(x: SparseRows, y: ArrayLike) -> Array:
    return _plus_dense(jax.lax.add_p, x, y)


@rule(jax.lax.add_p, dense_output=True)
def _add_dense_left(y: ArrayLike, x: SparseRows) -> Array:
    return _plus_dense(jax.lax.add_p, x, y)


# ---------------------------------------------------------------------------------------
# Sums over devices and sharding (explicit mesh axes)


def _gather_is_cheaper(x: SparseRows, devices: int) -> bool:
    """Whether each device receives no more gathering every device's stored rows
    (and their row numbers) than a ring all-reduce of the dense table, which
    receives about twice the table."""
    row_bytes = math.prod(x.row_shape) * x.dtype.itemsize
    gathered = devices * x.k * (row_bytes + jnp.dtype(_INDEX_DTYPE).itemsize)
    return gathered <= 2 * x.num_rows * row_bytes


@rule(pvary_p)
def _pvary(x: SparseRows, *, axes: tuple) -> SparseRows:
    """Typed as varying over `axes` (inside `shard_map`: a replicated gradient meeting
    a device-varying value): its row numbers and rows are. The values are
    unchanged."""
    axes = tuple(axes)
    return SparseRows.build(
        vary_leaf(x.indices, axes), vary_leaf(x.rows, axes), x.num_rows
    )


@rule(psum_invariant_p)
def _psum_invariant(x: SparseRows, *, axes: tuple) -> SparseRows | Array:
    """The sum over devices that JAX's AD inserts for the cotangent of a replicated
    table read at device-varying rows inside `shard_map` (an embedding's gradient
    in data parallel): every device's stored rows side by side, exact.

    Where that would receive more than a dense all-reduce of the table (each
    device reads a large share of its rows), the dense tables are summed instead,
    exact and counted."""
    return gathered_or_dense_sum(
        x,
        tuple(axes),
        lambda devices: _gather_is_cheaper(x, devices),
        f"{x.k} stored rows of a table of {x.num_rows} rows",
        " (each device reads a large share of the table's rows)",
    )


@rule(reshard_p, dense_output=True)
def _reshard(x: SparseRows, *, dst_sharding: Any, **params: Any) -> Any:
    """Replicated (a spec naming no mesh axis, as the transpose of a gather's
    `out_sharding=` gives a replicated table): a `SparseRows`, which is typed
    replicated. Sharded: its stored rows cannot follow a split of the table's rows,
    so it becomes dense, counted. Either way its arrays are first retyped
    replicated on the destination's mesh (leaving `auto_axes`, a gather's
    `out_sharding=`, they are typed on another)."""

    def moved(a: Array) -> Array:
        spec = PartitionSpec(*([None] * jnp.ndim(a)))
        return reshard_p.bind(a, dst_sharding=dst_sharding.update(spec=spec), **params)

    retyped = SparseRows.build(moved(x.indices), moved(x.rows), x.num_rows)
    if not any(entry is not None for entry in dst_sharding.spec):
        return retyped
    return densify(
        reshard_p,
        [retyped],
        dict(dst_sharding=dst_sharding, **params),
        reason="a table sharded on a mesh axis; its gradient rows are not",
    )
