"""Compressed updates meet optax: `apply_updates` for compressed updates, `lift` for
transformations that only take arrays, and the check behind their errors."""

from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jax import lax
from jaxtyping import Array, PyTree

from .._core._base import CompressedArray
from .._core._fallback import record_densification
from .._core._sharding import factors_like, matmul, on_current_mesh
from .._differentiable import is_differentiable_instance, move
from .._types.lowrank import LowRank
from .._types.rows import SparseRows, add_rows
from ._decay import keep_factor, scaled


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


def _apply_low_rank(param: Array, update: LowRank, keep: Array | None) -> Array:
    # `param * keep + left @ right.T` (`keep` only with weight decay), a matrix
    # product summed in float32 (a bfloat16 sum over hundreds of terms would round
    # at each one). A stack of matrices `(*batch, m, n)` is updated one matrix at a
    # time, each written over its slice of the (donated) parameter, so that one
    # matrix's float32 product is alive at a time rather than the stack's. Measured
    # at 1B (`benchmarks/bench_scale.py --parts`), this is the smallest of the forms
    # tried on both compilers: 0.63 GiB of temporaries for TPU v5e and 0.08 GiB for
    # CPU, against 2.51 and 0.17 GiB for a multiply-reduce over the rank fused with
    # the addition. The loop is XLA:CPU's saving, not a TPU's: one batched matmul
    # over the stack, added in float32, tried in place of the loop with the same
    # commands (`--parts`, and the step's), held the same bytes for a v5e chip (the
    # apply alone 0.54 GiB either way; the 1B step of one microbatch, `--arms
    # projected-8bit-all --accumulation 1`, 5.75 GiB either way; JAX 0.12.1 with
    # libtpu 0.0.52), and the CPU step 8.51 GiB instead of 4.71. No GPU figure yet,
    # so every backend keeps the loop.
    view = param.reshape(update.shape)  # a matrix view (`projected(dims=...)`)
    if view.ndim == 2:
        new = _add_product(view, update.left, update.right, keep)
        return new.reshape(param.shape)
    # The loop writes each product into its slice: both typed on the same mesh.
    matrices = on_current_mesh(view.reshape(-1, *view.shape[-2:]))
    lefts = update.left.reshape(-1, *update.left.shape[-2:])
    rights = update.right.reshape(-1, *update.right.shape[-2:])

    def body(i: Any, stack: Array) -> Array:
        def take(x: Array) -> Array:
            return lax.dynamic_index_in_dim(x, i, keepdims=False)

        new = _add_product(take(stack), take(lefts), take(rights), keep)
        return lax.dynamic_update_index_in_dim(stack, new, i, 0)

    return lax.fori_loop(0, matrices.shape[0], body, matrices).reshape(param.shape)


def _add_product(
    matrix: Array, left: Array, right: Array, keep: Array | None = None
) -> Array:
    dtype = jnp.promote_types(matrix.dtype, jnp.float32)
    # Under explicit mesh axes, each factor laid out on its side of the matrix (a
    # gather of the small factors), so that each device forms its own block of
    # the product: no matrix-sized reduction or reshard.
    left, right = factors_like(left, right, jax.typeof(matrix))
    product = matmul(left.astype(dtype), right.astype(dtype).T)
    return (scaled(matrix, keep).astype(dtype) + product).astype(matrix.dtype)


def _apply_rows(param: Array, update: SparseRows, keep: Array | None) -> Array:
    shrunk = scaled(param, keep).astype(param.dtype)
    return add_rows(shrunk, update.indices, update.rows.astype(param.dtype))


def _apply_leaf(param: Any, update: Any) -> Any:
    if param is None or update is None:  # as `equinox.apply_updates`
        return param
    update, keep = keep_factor(update)  # a `Decayed` update shrinks `param` too
    if isinstance(update, LowRank):
        _check_shape(param, update, views=True)
        return _apply_low_rank(param, update, keep)
    if isinstance(update, SparseRows):
        _check_shape(param, update)
        return _apply_rows(param, update, keep)
    if isinstance(update, CompressedArray):
        _check_shape(param, update)
        record_densification(
            "apply_updates",
            (type(update).__name__,),
            "no in-place form for this type",
        )
        update = update.materialise()
    dtype = jnp.asarray(param).dtype
    return jnp.asarray(scaled(param, keep) + update).astype(dtype)


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
    """`optax.apply_updates` for updates that may be compressed, and for
    `@differentiable` models: the one way to apply an optimiser's updates.

    A `LowRank` update is added as `param + left @ right.T`, a matrix product in
    float32 (reshaped to the parameter's shape when it is a matrix view of it, as
    `projected(dims=...)` returns it). A stacked leaf `(*batch, m, n)` is updated
    one matrix at a time, in a loop that writes each into its slice: with the
    parameter donated, the compiled function holds one matrix's float32 product
    beside it, not a weight-sized buffer. A `SparseRows` update is a scatter-add
    into the stored rows. Dense updates are added as `optax.apply_updates` adds
    them. A [`quax_tangents.optax.Decayed`][] update (weight decay) also scales its
    parameter by `1 - decay`, in the same pass. Every result is cast to its
    parameter's dtype. Other compressed types are materialised, counted as a
    densification.

    A `@differentiable` model is moved along its updates, a `type(model).Tangent`
    (what optax returns for `qt.differentiable_part(model)`): this is
    [`quax_tangents.move`][], the tangent-space step of the `@differentiable`
    protocol, which also runs a user-declared Tangent's own `move`.

    **Arguments:**

    - `params`: the parameters, a pytree of arrays (leaves may be `None`), or a
        `@differentiable` model.
    - `updates`: the updates, with the structure of `params`; each leaf an array, a
        compressed value of the parameter's shape, or `None`. For a model, a
        `type(params).Tangent`.

    **Returns:**

    The updated parameters, with the structure of `params`.
    """
    if is_differentiable_instance(params):
        return move(params, updates)
    flat_params, treedef = jtu.tree_flatten(params, is_leaf=lambda x: x is None)
    flat_updates = treedef.flatten_up_to(updates)
    new = [_apply_leaf(p, u) for p, u in zip(flat_params, flat_updates)]
    return jtu.tree_unflatten(treedef, new)


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
