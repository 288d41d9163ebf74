"""`Sparse`: a k-sparse array of (flat index, value) pairs, and its compressor `top_k`.

A `Sparse` stores `indices` and `values` of shape `(*batch, k)`. Each index is a flat,
row-major index into the trailing "event" dimensions `event_shape`; the represented
dense array has shape `(*batch, *event_shape)`. Duplicate indices add up. Rules keep
the value sparse wherever the exact result is sparse, by remapping indices (reshape,
transpose, reductions), gathering the dense operand at the indices (elementwise
products, `dot_general`) or concatenating along `k` (sums of two `Sparse`).
"""

import functools
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jexc
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from .._core import _validate
from .._core._base import ChunkCompressor, CompressedArray, densify, install_guard
from .._core._compat import psum_invariant_p, pvary_p
from .._core._devices import (
    axis_size,
    dense_all_reduce,
    gather_along,
    vary_leaf,
    varying_alike,
)
from .._core._fallback import record_dense_result, record_densification
from .._core._lax import add_any_p
from .._core._registry import rule
from .._core._sharding import varying_type
from . import _flat_index as _ix


_INDEX_DTYPE = _ix.INDEX_DTYPE
_MAX_SIZE = int(np.iinfo(np.int32).max)
_INDEX_BYTES = jnp.dtype(_INDEX_DTYPE).itemsize


_size = _ix.size
_accumulation_dtype = _ix.accumulation_dtype


def _fits(shape: Sequence[int]) -> bool:
    return _size(shape) <= _MAX_SIZE


class Sparse(CompressedArray):
    """A k-sparse array: `k` (flat index, value) pairs per batch element.

    Duplicate indices add up. The dense array has shape `(*batch, *event_shape)`,
    where `batch = indices.shape[:-1]`; `event_shape` is static and describes the
    trailing dimensions only, so `jax.vmap`/`lax.scan` may stack the leaves.
    Materialising half-precision values accumulates duplicates in float32 and
    rounds once.

    **Arguments:**

    - `indices`: integer array of shape `(*batch, k)`: flat row-major indices into
        the trailing `shape[len(batch):]` dimensions, each in `[0, prod(event))`.
        Stored as int32.
    - `values`: floating array of the same shape as `indices`.
    - `shape`: the full dense shape; its leading `len(batch)` dimensions must equal
        `indices.shape[:-1]` (for 1-D `indices` this is the whole array's shape).
    """

    indices: Int[Array, "*batch k"]  # noqa: F722
    values: Float[Array, "*batch k"]  # noqa: F722
    event_shape: tuple[int, ...] = eqx.field(static=True)

    def __init__(
        self,
        indices: Int[ArrayLike, "*batch k"],  # noqa: F722
        values: Float[ArrayLike, "*batch k"],  # noqa: F722
        shape: Sequence[int],
    ):
        # Range-check concrete indices before any cast to int32 could wrap them.
        raw = None if not _validate.is_concrete(indices) else np.asarray(indices)
        indices = jnp.asarray(indices)
        values = jnp.asarray(values)
        if not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(
                f"`indices` has dtype {indices.dtype}; it must be an integer array of "
                "flat row-major indices, e.g. `jnp.ravel_multi_index(...)`."
            )
        _validate.check_ndim("indices", indices, 1)
        shape = _check_shape(shape, indices.shape[:-1])
        event_shape = shape[indices.ndim - 1 :]
        if not _fits(event_shape):
            raise ValueError(
                f"`shape` {shape} has {_size(event_shape)} event elements, more than "
                f"int32 indices can address ({_MAX_SIZE}); split the array."
            )
        if raw is not None and raw.size:
            low, high = int(np.min(raw)), int(np.max(raw))
            if low < 0 or high >= _size(event_shape):
                raise ValueError(
                    f"`indices` range over [{low}, {high}], outside [0, "
                    f"{_size(event_shape)}) for the event shape {event_shape} of "
                    f"`shape` {shape}. Use flat row-major indices into the trailing "
                    "dimensions."
                )
        self.indices = indices.astype(_INDEX_DTYPE)
        self.values = values
        self.event_shape = event_shape

    def __check_init__(self):
        _validate.check_dtype("indices", self.indices, _INDEX_DTYPE)
        _validate.check_floating("values", self.values)
        if self.indices.shape != self.values.shape:
            raise ValueError(
                f"`indices` has shape {self.indices.shape} but `values` has shape "
                f"{self.values.shape}; they must match, (*batch, k)."
            )
        _validate.check_finite("values", self.values)

    @classmethod
    def _build(
        cls, indices: Array, values: Array, event_shape: Sequence[int]
    ) -> "Sparse":
        """Unchecked construction for rules (as unflattening does): rule outputs
        may legitimately hold non-finite values, and checks would sync eagerly."""
        out = object.__new__(cls)
        object.__setattr__(out, "indices", jnp.asarray(indices, _INDEX_DTYPE))
        object.__setattr__(out, "values", values)
        object.__setattr__(out, "event_shape", tuple(int(d) for d in event_shape))
        install_guard(out)
        return out

    @property
    def k(self) -> int:
        """Number of stored entries per batch element."""
        return self.indices.shape[-1]

    @property
    def batch_ndim(self) -> int:
        return self.indices.ndim - 1

    def aval(self) -> jax.core.ShapedArray:
        shape = self.indices.shape[:-1] + self.event_shape  # varying as its fields
        return varying_type(shape, self.values.dtype, self.indices, self.values)

    def materialise(self) -> Array:
        return _materialise(self)

    @classmethod
    def join_branches(cls, values: Sequence[CompressedArray]) -> Any:
        # Entries with value zero add nothing: pad every branch to the largest k.
        if len({(v.shape, v.dtype, v.batch_ndim) for v in values}) != 1:
            return None
        k = max(v.k for v in values)  # type: ignore[attr-defined]
        return lambda x: x.pad_k(k)

    def fit_carry(self, like: CompressedArray) -> "Sparse | None":
        same = isinstance(like, Sparse) and (
            like.shape,
            like.dtype,
            like.batch_ndim,
        ) == (
            self.shape,
            self.dtype,
            self.batch_ndim,
        )
        if same and self.k <= like.k:  # type: ignore[attr-defined]
            return self.pad_k(like.k)  # type: ignore[attr-defined]
        return None

    def pad_k(self, k: int) -> "Sparse":
        """The same array with `k` entries per batch element, the added ones zero
        (at index 0)."""
        extra = k - self.k
        if extra <= 0:
            return self
        pad = [(0, 0)] * (self.indices.ndim - 1) + [(0, extra)]
        return Sparse._build(
            jnp.pad(self.indices, pad), jnp.pad(self.values, pad), self.event_shape
        )

    def chunk_compressor(self) -> ChunkCompressor | None:
        # The same fraction of entries from every chunk.
        size = _size(self.event_shape)
        if self.batch_ndim or not size:
            return None
        return ChunkCompressor(functools.partial(top_k, k=min(self.k / size, 1.0)))

    def all_reduce(self, axis_name: Any, *, mean: bool = False) -> "Sparse":
        # Exact: every device's entries side by side, `devices * k` of them.
        indices = gather_along(self.indices, axis_name, axis=-1)
        values = gather_along(self.values, axis_name, axis=-1)
        if mean:
            values = values / jnp.asarray(axis_size(axis_name), values.dtype)
        return Sparse._build(indices, values, self.event_shape)


@jax.jit
def _materialise(x: Sparse) -> Array:
    batch = x.indices.shape[:-1]
    acc = _accumulation_dtype(x.values.dtype)
    rows = _size(batch)
    indices = x.indices.reshape(rows, x.k)
    values = x.values.reshape(rows, x.k).astype(acc)
    row = jnp.arange(rows, dtype=_INDEX_DTYPE)[:, None]
    dense = jnp.zeros((rows, _size(x.event_shape)), acc)
    dense = _ix.scatter_add(dense, (row, indices), values)
    return dense.astype(x.values.dtype).reshape(batch + x.event_shape)


def _check_shape(shape: Any, batch: tuple[int, ...]) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
        for d in shape
    ):
        raise TypeError(
            f"`shape` must be a tuple of non-negative ints (the dense shape), got "
            f"{shape!r}."
        )
    shape = tuple(int(d) for d in shape)
    if len(shape) < len(batch) or shape[: len(batch)] != batch:
        raise ValueError(
            f"`shape` {shape} must start with the batch dimensions {batch} of "
            "`indices`/`values` (their shape without the last, `k`, axis). For one "
            "set of k entries over the whole array pass 1-D `indices` and `values`."
        )
    return shape


def _flat(s: Sparse) -> tuple[Array, Array, tuple[int, ...]]:
    """The same entries as 1-D indices into the whole array (batch dims folded in)."""
    batch = s.indices.shape[:-1]
    full = batch + s.event_shape
    if not batch:
        return s.indices, s.values, full
    offsets = jnp.arange(_size(batch), dtype=_INDEX_DTYPE) * _size(s.event_shape)
    indices = s.indices + offsets.reshape(batch + (1,))
    return indices.reshape(-1), s.values.reshape(-1), full


def _out_aval(
    primitive: jexc.Primitive, operands: Sequence[Any], params: dict[str, Any]
) -> jax.ShapeDtypeStruct:
    """Shape and dtype that the dense computation would have."""
    structs = [
        jax.ShapeDtypeStruct(x.shape, x.dtype)
        if isinstance(x, Sparse)
        else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
        for x in operands
    ]
    return jax.eval_shape(lambda *xs: primitive.bind(*xs, **params), *structs)


def _why_dense(s: Sparse, out: jax.ShapeDtypeStruct) -> str | None:
    """Why a product of `s` giving `out` cannot stay sparse, or `None`."""
    if not jnp.issubdtype(out.dtype, jnp.floating):
        return f"{out.dtype} result is not floating"
    if not (_fits(s.shape) and _fits(out.shape)):
        return "too large for int32 indices"
    return None


def _sparse_bytes(nnz: int, dtype: Any) -> int:
    return nnz * (_INDEX_BYTES + jnp.dtype(dtype).itemsize)


def _dense_bytes(shape: Sequence[int], dtype: Any) -> int:
    return _size(shape) * jnp.dtype(dtype).itemsize


# ----------------------------------------------------------------------------------
# Compressor


def _resolve_k(k: Any, size: int) -> int:
    if size == 0:
        raise ValueError("`x` is empty; top-k needs at least one element.")
    if isinstance(k, (float, np.floating)):
        if not 0.0 < k <= 1.0:
            raise ValueError(
                f"`k` as a float is the fraction of entries to keep and must be in "
                f"(0, 1], got {k!r}; pass an int for a count."
            )
        return max(1, round(float(k) * size))
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(
            f"`k` must be an int count in [1, {size}] or a float fraction in (0, 1], "
            f"got {k!r}."
        )
    return _validate.check_positive_int(
        "k", k, upper=size, hint=f", the number of entries of `x`; use k <= {size}"
    )


def top_k(x: Float[ArrayLike, "..."], k: int | float) -> Sparse:
    """Keeps the `k` entries of `x` with the largest magnitudes (over the whole,
    flattened array; ties go to the lower flat index).

    This is the best `k`-sparse approximation of `x` in every l_p norm: the error
    `x - materialise(top_k(x, k))` holds exactly the dropped entries, so its squared
    l2 norm is the sum of the `size - k` smallest squared magnitudes, at most
    `(1 - k/size) * ||x||_2^2`, and no dropped magnitude exceeds a kept one. With
    `k = x.size` it is exact. Deterministic; works under `jax.jit` and `jax.vmap`
    (under `vmap` each batch element keeps its own top `k`).

    **Arguments:**

    - `x`: a floating-point array.
    - `k`: a static Python int in `[1, x.size]`, or a float fraction in `(0, 1]`
        (then `k = max(1, round(k * x.size))`).

    **Returns:**

    A `Sparse` of `x`'s shape and dtype with 1-D `indices` and `values` of length `k`.
    """
    x = _validate.as_array("x", x)
    _validate.check_floating("x", x)
    _validate.check_finite("x", x)
    return _top_k(x, _resolve_k(k, x.size))


@functools.partial(jax.jit, static_argnums=1)
def _top_k(x: Array, k: int) -> Sparse:
    flat = x.reshape(-1)
    _, indices = jax.lax.top_k(jnp.abs(flat), k)
    # Valid by construction (and `x` was checked): no checks that would sync.
    return Sparse._build(indices, _ix.gather(flat, indices), x.shape)


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
    axes = tuple(axes)
    devices = axis_size(axes)
    if devices == 1 or _gather_is_cheaper(x, devices):
        return x.all_reduce(axes)
    total = dense_all_reduce(x.materialise(), axes)
    record_densification(
        psum_invariant_p.name,
        ("Sparse",),
        f"gathering {devices} devices' {x.k} entries of an array of "
        f"{_size(x.shape)} would receive more than a dense all-reduce of it",
        "The dense sum is the cheaper exact one here; hide this with "
        "`quax_tangents.fallback('silent')`.",
    )
    return total
