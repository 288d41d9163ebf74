"""Decoupled weight decay for compressed updates: `Decayed`, an update that also
shrinks its parameter, and `decayed_weights`, which wraps a projected pipeline's
updates in it.

`optax.adamw` adds `-learning_rate * weight_decay * param` to each update: a dense
array of the parameter's shape, which a projected update (`P R^T`, a `LowRank`) must
not become. The shrinking is a scalar per step, so it travels beside the update and
`apply_updates` applies both in the one pass that writes the parameter:
`param * (1 - decay) + update`.
"""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import Array, Float, PyTree

from .._core._validate import is_concrete


_NOT_ADDED = (
    "A `Decayed` update (an update with weight decay) shrinks its parameter too, so "
    "it is not added like an array: apply it with `quax_tangents.optax.apply_updates"
    "(params, updates)` (or the pipeline's `apply`), not `optax.apply_updates` or `+`."
)


class Decayed(eqx.Module):
    """An update that also shrinks its parameter (decoupled weight decay, as
    `optax.adamw`'s): [`quax_tangents.optax.apply_updates`][] applies it as
    `param * (1 - decay) + update`, in the same pass as `update` alone (for a
    `LowRank` update, one matrix of a stack at a time, into the donated parameter).

    **Fields:**

    - `update`: the update, an array or a compressed value (`LowRank`,
        `SparseRows`...) of the parameter's shape.
    - `decay`: the fraction of the parameter taken off, a float32 scalar
        (`learning_rate * weight_decay` at that step).
    """

    update: Any
    decay: Float[Array, ""]

    def __add__(self, other: Any) -> Any:
        raise TypeError(_NOT_ADDED)

    __radd__ = __add__


def check_weight_decay(weight_decay: Any) -> float:
    """`weight_decay` as a float, or a clear error naming it."""
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)):
        raise TypeError(
            "`weight_decay` must be a non-negative number (e.g. 0.1, the fraction "
            f"of each weight taken off per unit of learning rate), got {weight_decay!r}."
        )
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(
            f"`weight_decay` must be a finite number >= 0 (0 turns it off), got "
            f"{weight_decay!r}."
        )
    return float(weight_decay)


def _masks(mask: Any, params: PyTree) -> list[bool]:
    """One bool per leaf of `params`: which parameters decay."""
    treedef = jtu.tree_structure(params, is_leaf=lambda x: x is None)
    if mask is None:
        return [True] * treedef.num_leaves
    tree = _called(mask, params) if callable(mask) else mask
    try:
        flat = treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as error:
        raise ValueError(
            "`weight_decay_mask` must be a tree of bools with the structure of the "
            "parameters (or a callable given the parameters that returns one), "
            "True where a weight decays, e.g. `lambda p: jax.tree.map(lambda x: "
            f"x.ndim >= 2, p)`: {error}"
        ) from None
    return [_decays(leaf) for leaf in flat]


def _called(mask: Callable, params: PyTree) -> Any:
    """A callable mask given the whole parameter tree, as `optax.adamw`'s is; one
    written for a leaf fails on the tree, and is named."""
    try:
        return mask(params)
    except (AttributeError, TypeError, IndexError, KeyError) as error:
        raise TypeError(
            f"`weight_decay_mask` raised {type(error).__name__}: {error}. A callable "
            "is given the whole parameter tree (as `optax.adamw`'s mask is): to decide "
            "leaf by leaf, pass `weight_decay_mask=lambda p: jax.tree.map(lambda x: "
            "x.ndim >= 2, p)`."
        ) from error


def _decays(leaf: Any) -> bool:
    """A mask's leaf as a Python bool: None (where a parameter is None, an Equinox
    model's non-array fields, which `jax.tree.map` keeps) does not decay."""
    if leaf is None:
        return False
    if isinstance(leaf, (bool, np.bool_)):
        return bool(leaf)
    concrete_bool = (
        is_concrete(leaf)
        and jnp.shape(leaf) == ()
        and jnp.result_type(leaf) == jnp.bool_
    )
    if concrete_bool:
        return bool(leaf)
    raise TypeError(
        "`weight_decay_mask` must hold bools known when the step is traced (True "
        f"where a weight decays, e.g. `x.ndim >= 2`), got {leaf!r}."
    )


def decayed_weights(
    tx: optax.GradientTransformation,
    *,
    decay: Callable[[Any], Array],
    mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """`tx` whose updates shrink their parameters: each update that `mask` chooses
    becomes a `Decayed` by `decay(state)`, read from the state before the update
    (the pipeline's `learning_rate * weight_decay` at the step count that the update
    scales by, as `optax.adamw` does). `update` needs `params` (for their
    structure and the mask)."""

    def update(
        updates: PyTree, state: Any, params: PyTree = None, **extra: Any
    ) -> tuple[PyTree, Any]:
        if params is None:
            raise ValueError(
                "Weight decay needs the parameters: call `update(grads, state, "
                "params)`."
            )
        fraction = jnp.asarray(decay(state), jnp.float32)
        updates, state = tx.update(updates, state, params, **extra)
        treedef = jtu.tree_structure(params, is_leaf=lambda x: x is None)
        flat = treedef.flatten_up_to(updates)
        wrapped = [
            Decayed(u, fraction) if keep and u is not None else u
            for u, keep in zip(flat, _masks(mask, params))
        ]
        return jtu.tree_unflatten(treedef, wrapped), state

    return optax.GradientTransformationExtraArgs(tx.init, update)


def keep_factor(update: Any) -> tuple[Any, Array | None]:
    """`(update, 1 - decay)` for a `Decayed`, `(update, None)` otherwise."""
    if isinstance(update, Decayed):
        return update.update, 1 - jnp.asarray(update.decay, jnp.float32)
    return update, None


def scaled(param: Array, keep: Array | None) -> Array:
    """`param * keep` in float32 at least (or `param` without a `keep`)."""
    if keep is None:
        return param
    dtype = jnp.promote_types(jnp.result_type(param), jnp.float32)
    return jnp.asarray(param).astype(dtype) * keep.astype(dtype)
