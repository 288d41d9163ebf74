"""The `Sparse` type, the helpers its rules share and its compressor `top_k`."""

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

from ..._core import _validate
from ..._core._base import ChunkCompressor, CompressedArray, install_guard
from ..._core._devices import (
    axis_size,
    gather_along,
)
from ..._core._sharding import varying_type
from .. import _flat_index as _ix


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
