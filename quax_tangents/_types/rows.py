"""`SparseRows`: an array of which only some rows are stored, as the gradient of an
embedding table that a batch reads a few rows of.

Every rule this representation registers lives in this file.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from .. import _validate
from .._base import CompressedArray
from .._devices import axis_size, gather_along


_INDEX_DTYPE = jnp.int32


class SparseRows(CompressedArray):
    """The array of shape `(num_rows, *row_shape)` that is zero except for the stored
    rows: row `indices[i]` holds `rows[i]`. Duplicate indices add up.

    Storage is `k * (prod(row_shape) * itemsize + 4)` bytes for `k` stored rows,
    instead of `num_rows * prod(row_shape) * itemsize`.

    **Arguments:**

    - `indices`: integer array `(k,)` of row numbers in `[0, num_rows)`; stored as
        int32.
    - `rows`: floating array `(k, *row_shape)`.
    - `num_rows`: the number of rows of the dense array.
    """

    indices: Int[Array, " k"]
    rows: Float[Array, "k *row_shape"]
    num_rows: int = eqx.field(static=True)

    def __init__(
        self,
        indices: Int[ArrayLike, " k"],
        rows: Float[ArrayLike, "k *row_shape"],
        num_rows: int,
    ):
        raw = np.asarray(indices) if _validate.is_concrete(indices) else None
        indices, rows = jnp.asarray(indices), jnp.asarray(rows)
        if not jnp.issubdtype(indices.dtype, jnp.integer) or indices.ndim != 1:
            raise TypeError(
                f"`indices` must be a 1-d integer array of row numbers, got "
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
        if self.rows.shape[:1] != self.indices.shape:
            raise ValueError(
                f"`rows` has shape {self.rows.shape} but `indices` has shape "
                f"{self.indices.shape}; `rows` must be (k, *row_shape) for k indices."
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
        return out

    @property
    def k(self) -> int:
        """The number of stored rows."""
        return self.indices.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.rows.shape[1:]

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray((self.num_rows, *self.row_shape), self.rows.dtype)

    def materialise(self) -> Array:
        zeros = jnp.zeros((self.num_rows, *self.row_shape), self.rows.dtype)
        return zeros.at[self.indices].add(self.rows, mode="drop")

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
        pad_rows = [(0, extra)] + [(0, 0)] * len(self.row_shape)
        return SparseRows.build(
            jnp.pad(self.indices, (0, extra)),
            jnp.pad(self.rows, pad_rows),
            self.num_rows,
        )

    def all_reduce(self, axis_name: Any, *, mean: bool = False) -> "SparseRows":
        # Exact: every device's rows stacked, `devices * k` of them.
        indices = gather_along(self.indices, axis_name, axis=0)
        rows = gather_along(self.rows, axis_name, axis=0)
        if mean:
            rows = rows / jnp.asarray(axis_size(axis_name), rows.dtype)
        return SparseRows.build(indices, rows, self.num_rows)

    def inner(self, other: Any) -> Array:
        if isinstance(other, CompressedArray):
            return super().inner(other)
        other = jnp.asarray(other)
        if other.shape != self.shape:
            return super().inner(other)
        # Only the stored rows meet nonzeros.
        return jnp.sum(jnp.conj(self.rows) * other[self.indices])
