"""Compressed updates meet optax: `apply_updates` for compressed updates, `lift` for
transformations that only take arrays, and the check behind their errors."""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import Array, PyTree

from .._core._base import CompressedArray
from .._core._fallback import record_densification
from .._core._inplace import as_bits, corner, from_bits
from .._types.lowrank import LowRank
from .._types.rows import SparseRows, add_rows


def is_compressed(x: Any) -> bool:
    return isinstance(x, CompressedArray)


def reject_compressed(tree: PyTree, where: str, fix: str) -> None:
    """Raises a `TypeError` naming the first compressed leaf of `tree`: generic optax
    code maps over a compressed value's fields, not over the array it represents."""
    leaves = jtu.tree_leaves_with_path(tree, is_leaf=is_compressed)
    for path, leaf in leaves:
        if is_compressed(leaf):
            raise TypeError(
                f"{where} was handed a {type(leaf).__name__} at "
                f"`{jtu.keystr(path) or 'the root'}`, which it cannot take: {fix}"
            )


# ---------------------------------------------------------------------------------------
# apply_updates


def _apply_low_rank(param: Array, update: LowRank) -> Array:
    # `param + left @ right.T` written as a broadcast multiply-reduce over the rank,
    # at every rank: XLA fuses it with the addition into one loop over the parameter
    # (with the parameter donated, into its own buffer), where a matrix product
    # would hold a weight-sized result first (a stack of them for a stacked leaf).
    # The sum is taken in float32: a bfloat16 sum over hundreds of terms would round
    # at each one.
    dtype = jnp.promote_types(param.dtype, jnp.float32)
    left, right = update.left.astype(dtype), update.right.astype(dtype)
    product = jnp.sum(left[..., :, None, :] * right[..., None, :, :], axis=-1)
    # A matrix view of the parameter (`projected(dims=...)`): a reshape, in order.
    return (param + product.reshape(jnp.shape(param))).astype(param.dtype)


def _apply_rows(param: Array, update: SparseRows) -> Array:
    return add_rows(param, update.indices, update.rows.astype(param.dtype))


def _apply_leaf(param: Any, update: Any) -> Any:
    if param is None or update is None:  # as `equinox.apply_updates`
        return param
    if isinstance(update, LowRank):
        _check_shape(param, update, views=True)
        return _apply_low_rank(param, update)
    if isinstance(update, SparseRows):
        _check_shape(param, update)
        return _apply_rows(param, update)
    if isinstance(update, CompressedArray):
        _check_shape(param, update)
        record_densification(
            "apply_updates",
            (type(update).__name__,),
            "no in-place form for this type",
        )
        update = update.materialise()
    return jnp.asarray(param + update).astype(jnp.asarray(param).dtype)


def _check_shape(param: Any, update: CompressedArray, views: bool = False) -> None:
    same = tuple(jnp.shape(param)) == tuple(update.shape)
    if views and _is_matrix_view(tuple(jnp.shape(param)), tuple(update.shape)):
        return
    if not same:
        raise ValueError(
            f"An update of shape {list(update.shape)} ({type(update).__name__}) "
            f"cannot be applied to a parameter of shape {list(jnp.shape(param))}."
        )


def _is_matrix_view(shape: tuple[int, ...], view: tuple[int, ...]) -> bool:
    """Whether `view` groups consecutive dims of `shape`, as `projected(dims=...)`
    views a parameter as a stack of matrices."""
    i = 0
    for size in view:
        group = 1
        start = i
        while i < len(shape) and (group < size or i == start):
            group *= shape[i]
            i += 1
        if group != size:
            return False
    return i == len(shape)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """`optax.apply_updates` for updates that may be compressed.

    A `LowRank` update is added as `param + left @ right.T` in one pass over the
    parameter (reshaped to the parameter's shape when it is a matrix view of it, as
    `projected(dims=...)` returns it): at any rank, and for stacked leaves
    `(*batch, m, n)` too, the product is written as a multiply-reduce over the rank
    in float32 that XLA fuses with the addition, so the compiled function holds no
    weight-sized buffer besides the result (with the parameter donated, none at
    all). It costs `m n r` multiply-adds outside a matrix unit, once per step. A
    `SparseRows` update is a scatter-add into the stored rows. Dense updates are
    added as `optax.apply_updates` adds them. Every result is cast to its
    parameter's dtype. Other compressed types are materialised, counted as a
    densification.

    **Arguments:**

    - `params`: the parameters, a pytree of arrays (leaves may be `None`).
    - `updates`: the updates, with the structure of `params`; each leaf an array, a
        compressed value of the parameter's shape, or `None`.

    **Returns:**

    The updated parameters, with the structure of `params`.
    """
    flat_params, treedef = jtu.tree_flatten(params, is_leaf=lambda x: x is None)
    flat_updates = treedef.flatten_up_to(updates)
    # With several low-rank leaves, the first waits for every low-rank factor: its
    # projector exists from the start of the update (from before the gradient pass,
    # on a step that keeps it), and XLA would otherwise gather it under FSDP and
    # hold it in float32 from then on, beside every other leaf's.
    low_rank = [u for u in flat_updates if isinstance(u, LowRank)]
    previous = None
    if len(low_rank) > 1:
        corners = [corner(x) for u in low_rank for x in (u.left, u.right)]
        previous = jnp.sum(jnp.stack([c.astype(jnp.float32) for c in corners]))
    new = []
    for param, update in zip(flat_params, flat_updates):
        if isinstance(update, LowRank) and previous is not None:
            update = _after(update, previous)
        new.append(_apply_leaf(param, update))
        if isinstance(update, LowRank):
            previous = new[-1]
    return jtu.tree_unflatten(treedef, new)


def _after(update: LowRank, previous: Array) -> LowRank:
    """`update`, whose factors XLA cannot read before `previous` (the last low-rank
    leaf's new value) exists: so that one leaf's float32 factors (under FSDP, its
    gathered projector) are alive at a time, not every leaf's at once."""
    left, right = _tied(update.left, previous), _tied(update.right, previous)
    return eqx.tree_at(lambda u: (u.left, u.right), update, (left, right))


def _tied(x: Array, after: Array) -> Array:
    """`x`, which XLA cannot read before `after` exists."""
    return from_bits(as_bits(x, after=after), x.dtype)


# ---------------------------------------------------------------------------------------
# lift


def _densified(tree: PyTree) -> PyTree:
    def dense(x: Any) -> Any:
        if not is_compressed(x):
            return x
        record_densification(
            "lift", (type(x).__name__,), "the lifted transformation takes arrays"
        )
        return x.materialise()

    return jtu.tree_map(dense, tree, is_leaf=is_compressed)


def lift(
    tx: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """Makes any optax transformation accept compressed gradients, by handing it the
    arrays they represent: the same numbers as with dense gradients.

    Each compressed leaf is materialised, and counted as a densification through the
    fallback policy (see [`quax_tangents.fallback`][]), so the memory a compressed
    gradient saves is spent here. It is the way to use a transformation that has
    no compressed form: handed a compressed value directly, an optax transformation
    would map over its fields (`optax.sgd` would scale both factors of a
    `LowRank`), and the value's guard leaf makes it raise a `TypeError` instead.

    **Arguments:**

    - `tx`: an optax transformation.

    **Returns:**

    A transformation with `tx`'s state; its `update` takes gradients whose leaves may
    be compressed and returns `tx`'s (dense) updates.
    """
    tx = optax.with_extra_args_support(tx)

    def update(
        updates: PyTree, state: Any, params: PyTree = None, **extra: Any
    ) -> tuple[PyTree, Any]:
        return tx.update(_densified(updates), state, params, **extra)

    return optax.GradientTransformationExtraArgs(tx.init, update)
