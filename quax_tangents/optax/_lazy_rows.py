"""Row-sparse leaves of `projected`: lazy updates (as TensorFlow's `LazyAdam`), where
only the rows a `SparseRows` gradient stores are gathered from `base`'s state,
updated and written back."""

from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import Array, PyTree

from .._core._sharding import unsharded_along
from .._types.rows import SparseRows
from ._common import base_update


def distinct_rows(grad: SparseRows) -> tuple[Array, Array]:
    """The distinct rows read (sorted; unused slots hold `num_rows`, out of range)
    and each one's summed gradient row. There are at most `min(k, num_rows)`."""
    size = min(grad.k, grad.num_rows)
    # Whole on every device: the sort of the row numbers needs them all.
    indices = unsharded_along(grad.indices, 0)
    rows = jnp.unique(indices, size=size, fill_value=grad.num_rows)
    position = jnp.searchsorted(rows, indices)
    summed = jnp.zeros((size, *grad.row_shape), grad.dtype)
    summed = summed.at[position].add(unsharded_along(grad.rows, 0))
    return rows, summed


def _gather(state_leaf: Array, rows: Array | None) -> Array:
    if rows is None:
        return state_leaf
    return state_leaf.at[rows].get(mode="fill", fill_value=0)


def _scatter(old: Any, new: Any, rows: Any) -> Any:
    if rows is None:
        return new
    return old.at[rows].set(new, mode="drop")


def _param_slots(base: optax.GradientTransformation, state: Any, tree: PyTree) -> Any:
    """`state`'s structure with each copy of the parameter tree replaced by `tree`,
    and `None` in the other fields."""
    return optax.tree_map_params(
        base,
        lambda _, value: value,
        state,
        tree,
        transform_non_params=lambda _: None,
        is_leaf=lambda x: x is None,
    )


def lazy_base_update(
    base: optax.GradientTransformation,
    proxies: list[Any],
    rows: list[Array | None],
    state: Any,
    treedef: Any,
) -> tuple[list[Any], Any]:
    """Runs `base` once on every leaf, with the state of row-sparse leaves cut down
    to the rows read and written back afterwards."""
    rows_tree = jtu.tree_unflatten(treedef, rows)
    cut = optax.tree_map_params(
        base,
        _gather,
        state,
        rows_tree,
        is_leaf=lambda x: x is None,
    )
    updates, new_cut = base_update(
        base,
        jtu.tree_unflatten(treedef, proxies),
        cut,
        "`quax_tangents.optax.projected`",
    )
    slots = _param_slots(base, state, rows_tree)
    new_state = jtu.tree_map(
        _scatter, state, new_cut, slots, is_leaf=lambda x: x is None
    )
    return treedef.flatten_up_to(updates), new_state


def rows_update(grad: SparseRows, rows: Array, update: Array) -> SparseRows:
    unused = rows == grad.num_rows
    per_row = unused.reshape(-1, *(1,) * len(grad.row_shape))
    update = jnp.where(per_row, 0, update).astype(grad.dtype)
    return SparseRows.build(jnp.where(unused, 0, rows), update, grad.num_rows)
