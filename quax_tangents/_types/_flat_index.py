"""Row-major flat-index arithmetic on int32 index arrays, and the entries of a
product of flat-indexed entries with a dense array (used by `Sparse`)."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array


INDEX_DTYPE = jnp.int32


def size(shape: Sequence[int]) -> int:
    return math.prod(shape)


def accumulation_dtype(dtype: Any) -> Any:
    """Sums of half-precision values accumulate in float32, as XLA does for dense
    reductions; wider dtypes accumulate in themselves."""
    return jnp.promote_types(dtype, jnp.float32)


def _strides(shape: Sequence[int]) -> list[int]:
    strides = []
    stride = 1
    for side in reversed(shape):
        strides.append(stride)
        stride *= side
    return strides[::-1]


def unravel(flat: Array, shape: Sequence[int]) -> list[Array]:
    """Row-major coordinates of non-negative flat indices (each of `flat`'s shape)."""
    coords = []
    for axis, (stride, side) in enumerate(zip(_strides(shape), shape, strict=True)):
        coord = flat if stride == 1 else jax.lax.div(flat, INDEX_DTYPE(stride))
        if axis > 0:
            coord = jax.lax.rem(coord, INDEX_DTYPE(max(side, 1)))
        coords.append(coord)
    return coords


def ravel(coords: Sequence[Array], shape: Sequence[int], like: Array) -> Array:
    """Row-major flat indices of coordinates; zeros shaped like `like` for `()`."""
    flat = None
    for coord, stride in zip(coords, _strides(shape), strict=True):
        term = coord.astype(INDEX_DTYPE)
        term = term if stride == 1 else term * INDEX_DTYPE(stride)
        flat = term if flat is None else flat + term
    return jnp.zeros(jnp.shape(like), INDEX_DTYPE) if flat is None else flat


def gather(array: Array, *indices: Array) -> Array:
    return array.at[indices].get(mode="promise_in_bounds", wrap_negative_indices=False)


def scatter_add(array: Array, indices: Any, updates: Array) -> Array:
    return array.at[indices].add(updates, mode="drop", wrap_negative_indices=False)


def dot_roles(
    s_ndim: int, d_ndim: int, dimension_numbers: Any, sparse_is_lhs: bool
) -> tuple[tuple[int, ...], ...]:
    """(sparse batch, contracting, free dims; dense batch, contracting, free dims)."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if sparse_is_lhs:
        s_c, d_c, s_b, d_b = lhs_contract, rhs_contract, lhs_batch, rhs_batch
    else:
        s_c, d_c, s_b, d_b = rhs_contract, lhs_contract, rhs_batch, lhs_batch
    s_c, d_c, s_b, d_b = tuple(s_c), tuple(d_c), tuple(s_b), tuple(d_b)
    s_f = tuple(a for a in range(s_ndim) if a not in s_c + s_b)
    d_f = tuple(a for a in range(d_ndim) if a not in d_c + d_b)
    return s_b, s_c, s_f, d_b, d_c, d_f


@dataclasses.dataclass(frozen=True)
class Entries:
    """Flat-indexed products: output index `indices[t]` gets `values[t]` (in the
    accumulation-free compute dtype), or their scatter-added dense array."""

    indices: Array
    values: Array
    accumulated: Array
    out_dtype: Any

    def dense(self, out_shape: tuple[int, ...]) -> Array:
        # Scatter the products straight into the output, accumulating like XLA.
        zeros = jnp.zeros(size(out_shape), self.accumulated.dtype)
        result = scatter_add(zeros, self.indices, self.accumulated)
        return result.astype(self.out_dtype).reshape(out_shape)


def dot_entries(
    indices: Array,
    values: Array,
    full: tuple[int, ...],
    d: Array,
    dimension_numbers: Any,
    sparse_is_lhs: bool,
    out_dtype: Any,
) -> Entries:
    """The entries of `dot_general` of flat-indexed entries (into an array of shape
    `full`) with a dense `d`.

    Entry t, at coordinates x_t, contributes v_t * d[batch(x_t), contract(x_t), j] to
    the output at (batch(x_t), free(x_t), j) for every free position j of `d`.
    """
    s_b, s_c, s_f, d_b, d_c, d_f = dot_roles(
        len(full), d.ndim, dimension_numbers, sparse_is_lhs
    )
    batch_shape = tuple(full[a] for a in s_b)
    contract_shape = tuple(full[a] for a in s_c)
    s_free_shape = tuple(full[a] for a in s_f)
    n_free = size([d.shape[a] for a in d_f])
    n_s_free = size(s_free_shape)
    coords = unravel(indices, full)
    batch_flat = ravel([coords[a] for a in s_b], batch_shape, indices)
    contract_flat = ravel([coords[a] for a in s_c], contract_shape, indices)
    s_free_flat = ravel([coords[a] for a in s_f], s_free_shape, indices)
    d3 = jnp.transpose(d, d_b + d_c + d_f).reshape(
        size(batch_shape), size(contract_shape), n_free
    )
    gathered = gather(d3, batch_flat, contract_flat)  # (nnz, n_free)
    j = jnp.arange(n_free, dtype=INDEX_DTYPE)[None, :]
    if sparse_is_lhs:  # output dims: (batch, sparse free, dense free)
        out_indices = (batch_flat * n_s_free + s_free_flat)[:, None] * n_free + j
    else:  # output dims: (batch, dense free, sparse free)
        out_indices = (batch_flat[:, None] * n_free + j) * n_s_free
        out_indices = out_indices + s_free_flat[:, None]
    out_indices = out_indices.reshape(-1)
    compute = jnp.promote_types(jnp.promote_types(values.dtype, d.dtype), out_dtype)
    acc = accumulation_dtype(compute)
    accumulated = (values.astype(acc)[:, None] * gathered.astype(acc)).reshape(-1)
    product = values.astype(compute)[:, None] * gathered.astype(compute)
    product = product.astype(out_dtype).reshape(-1)
    return Entries(out_indices, product, accumulated, out_dtype)
