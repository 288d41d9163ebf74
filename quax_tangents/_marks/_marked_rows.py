"""Row reads of a row-marked table (`sparse_rows_cotangent`): a gather of whole rows,
or a `dynamic_slice` of one, whose backward pass emits the rows read (`rows_p`)
instead of scattering them into a dense table."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from .._core._registry import rule
from ._marked import Marked
from ._projection import rows_p


# ---------------------------------------------------------------------------------------
# Row gathers from a marked table


@dataclasses.dataclass(frozen=True)
class _Gather:
    params: tuple

    def bind(self, table: Any, indices: Any) -> Any:
        return jax.lax.gather_p.bind(table, indices, **dict(self.params))


def _row_position(params: dict, shape: tuple[int, ...]) -> int | None:
    """Where the row number sits in a gather's index vectors, when the gather reads
    whole rows of a `(V, d)` table; otherwise `None`."""
    numbers = params["dimension_numbers"]
    whole_rows = tuple(params["slice_sizes"]) == (1, shape[1])
    if (
        not whole_rows
        or numbers.operand_batching_dims
        or 0 not in numbers.start_index_map
    ):
        return None
    return tuple(numbers.start_index_map).index(0)


def _gather_fwd(gather: _Gather, table: Any, indices: Any) -> tuple[Any, tuple]:
    return gather.bind(table, indices), (indices, jnp.shape(table))


def _gather_bwd(gather: _Gather, residuals: tuple, ct: Any) -> tuple:
    indices, (num_rows, row_size) = residuals
    params = dict(gather.params)
    ids = indices[..., _row_position(params, (num_rows, row_size))].reshape(-1)
    offset_dims = params["dimension_numbers"].offset_dims
    rows = jnp.moveaxis(ct, offset_dims, range(ct.ndim - len(offset_dims), ct.ndim))
    rows = rows.reshape(-1, row_size)
    if params["mode"] == jax.lax.GatherScatterMode.CLIP:
        ids = jnp.clip(ids, 0, num_rows - 1)
    else:  # out-of-bounds reads add nothing
        inside = (ids >= 0) & (ids < num_rows)
        rows = jnp.where(inside[:, None], rows, 0)
        ids = jnp.where(inside, ids, 0)
    return rows_p.bind(ids.astype(np.int32), rows, num_rows=num_rows), None


_rows_gather = jax.custom_vjp(_Gather.bind, nondiff_argnums=(0,))
_rows_gather.defvjp(_gather_fwd, _gather_bwd)


def _reads_rows(table: Marked) -> bool:
    """Whether a row read of `table` emits the rows it read as its cotangent: a
    row-marked table, or a projected one (projected from those rows by `finish`)."""
    return (
        table.kind in ("rows", "projected")
        and not table.transposed
        and table.view is None
        and table.ndim == 2
    )


@rule(jax.lax.gather_p, dense_output=True)
def _gather_marked(table: Marked, indices: ArrayLike, **params: Any) -> Array:
    if not _reads_rows(table) or _row_position(params, table.shape) is None:
        return Marked.default(jax.lax.gather_p, (table, indices), params)
    gather = _Gather(tuple(sorted(params.items())))
    return _cast(_rows_gather(gather, table.array, indices), table.compute_dtype)


def _cast(x: Array, dtype: Any) -> Array:
    # Reading rows then casting them equals casting the table then reading it.
    return x if dtype is None else x.astype(dtype)


# A single row read with a scalar index (`table[i]`, `equinox.nn.Embedding` outside
# `vmap`) is a dynamic_slice.


def _slice_row(table: Any, row: Any, column: Any) -> Any:
    return jax.lax.dynamic_slice_p.bind(
        table, row, column, slice_sizes=(1, jnp.shape(table)[1])
    )


def _slice_fwd(table: Any, row: Any, column: Any) -> tuple[Any, tuple]:
    return _slice_row(table, row, column), (row, jnp.shape(table)[0])


def _slice_bwd(residuals: tuple, ct: Any) -> tuple:
    row, num_rows = residuals
    # dynamic_slice clamps its start so that the slice fits.
    ids = jnp.clip(jnp.reshape(row, (1,)), 0, num_rows - 1).astype(np.int32)
    return rows_p.bind(ids, ct, num_rows=num_rows), None, None


_rows_slice = jax.custom_vjp(_slice_row)
_rows_slice.defvjp(_slice_fwd, _slice_bwd)


@rule(jax.lax.dynamic_slice_p, dense_output=True)
def _slice_marked(
    table: Marked, row: ArrayLike, column: ArrayLike, *, slice_sizes: tuple
) -> Array:
    if not _reads_rows(table) or tuple(slice_sizes) != (1, table.shape[1]):
        return Marked.default(
            jax.lax.dynamic_slice_p, (table, row, column), dict(slice_sizes=slice_sizes)
        )
    return _cast(_rows_slice(table.array, row, column), table.compute_dtype)
