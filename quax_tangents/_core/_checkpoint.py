"""Saving and restoring trees that hold compressed values with equinox.

equinox's default filter specs save every `jax.Array` leaf with `numpy.save`, which
no typed key array allows, and so no compressed value (whose guard leaf is one, see
`_guard.py`). The guard carries no information: these functions save every other
leaf as equinox does, skip the guard, and give the restored value a fresh guard of
the `like` value's batch shape. orbax-checkpoint needs none of this.
"""

import pathlib
from collections.abc import Callable
from typing import Any, BinaryIO

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._guard import guard, is_guard


def _guards_apart(filter_spec: Callable, on_guard: Callable[[Any], Any]) -> Callable:
    """`filter_spec` for every leaf but a guard, `on_guard(guard)` for a guard."""

    def spec(f: BinaryIO, x: Any) -> Any:
        return on_guard(x) if is_guard(x) else filter_spec(f, x)

    return spec


def _concrete_guards(like: PyTree) -> PyTree:
    # A `like` from `eqx.filter_eval_shape` holds guards as `jax.ShapeDtypeStruct`s;
    # equinox checks that each restored leaf has the type of its `like` leaf, and a
    # key array is not of the type it assumes for a shape-only leaf.
    return jtu.tree_map(
        lambda x: guard(tuple(x.shape[:-2])) if is_guard(x) else x, like
    )


def tree_serialise_leaves(
    path_or_file: str | pathlib.Path | BinaryIO,
    pytree: PyTree,
    filter_spec: Callable = eqx.default_serialise_filter_spec,
    is_leaf: Callable[[Any], bool] | None = None,
) -> None:
    """`equinox.tree_serialise_leaves` for trees that hold compressed values (the
    state of `quax_tangents.optax.powersgd`, `compress` with error feedback, or any
    `LowRank`, `Sparse`, `Quantized`, `SignNorm` or `SparseRows`).

    Every leaf is saved as equinox saves it, except each compressed value's guard
    leaf, which holds no information and is skipped. Restore with
    `quax_tangents.tree_deserialise_leaves`. Trees without compressed values give
    the same file as equinox's own function.

    **Arguments:**

    - `path_or_file`: the file to write, as for equinox.
    - `pytree`: the tree whose leaves are saved.
    - `filter_spec`: how to save each other leaf (equinox's default unless given); a
        function, or a tree of functions that is a prefix of `pytree`.
    - `is_leaf`: as for equinox.

    **Returns:**

    Nothing.
    """
    spec = jtu.tree_map(lambda fs: _guards_apart(fs, lambda _: None), filter_spec)
    eqx.tree_serialise_leaves(path_or_file, pytree, filter_spec=spec, is_leaf=is_leaf)


def tree_deserialise_leaves(
    path_or_file: str | pathlib.Path | BinaryIO,
    like: PyTree,
    filter_spec: Callable = eqx.default_deserialise_filter_spec,
    is_leaf: Callable[[Any], bool] | None = None,
) -> PyTree:
    """`equinox.tree_deserialise_leaves` for files written by
    `quax_tangents.tree_serialise_leaves`.

    **Arguments:**

    - `path_or_file`: the file to read, as for equinox.
    - `like`: a tree of the saved structure: concrete, or shape-only from
        `equinox.filter_eval_shape` (for example of the optimiser's `init`).
    - `filter_spec`: how to load each leaf other than a guard (equinox's default
        unless given).
    - `is_leaf`: as for equinox.

    **Returns:**

    The restored tree, with a fresh guard in each compressed value.
    """
    spec = jtu.tree_map(lambda fs: _guards_apart(fs, lambda x: x), filter_spec)
    return eqx.tree_deserialise_leaves(
        path_or_file, _concrete_guards(like), filter_spec=spec, is_leaf=is_leaf
    )
