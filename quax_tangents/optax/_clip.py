"""Gradient clipping by the global norm of the arrays the gradients represent, compressed
or not: `optax.clip_by_global_norm` for `LowRank`, `SparseRows` and dense leaves alike,
without forming a dense gradient."""

from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import quax
from jaxtyping import Array, PyTree, Scalar

from .._core._base import CompressedArray
from .._types.lowrank import LowRank
from .._types.rows import SparseRows
from ._apply import is_compressed


def check_max_norm(max_norm: Any, name: str = "max_norm") -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(
            f"`{name}` must be a positive number (the global norm to clip to, "
            f"e.g. 1.0), got {max_norm!r}."
        )
    if not max_norm > 0:
        raise ValueError(
            f"`{name}` must be positive (the global norm to clip to, e.g. 1.0), "
            f"got {max_norm!r}."
        )
    return float(max_norm)


def _squared_norm(leaf: Any) -> Array:
    if isinstance(leaf, LowRank):
        if leaf.projector_side is not None:
            # A projection `P R^T` whose projector has orthonormal columns (the
            # projector of a projected gradient, whose orthonormality is checked):
            # its norm is its small factor's, a sum of squares that XLA fuses with
            # no copy. The Gram form below made the 1B step compiled for CPU hold
            # 1.4 GiB more (XLA:CPU multiplies bfloat16 stacks as float32 copies),
            # and, one matrix at a time, the step of 4 microbatches compiled for a
            # TPU v5e chip 0.25 GiB more (the step compiled both ways).
            other = leaf.right if leaf.projector_side == "left" else leaf.left
            return _sum_of_squares(other)
        # |L R^T|^2 = sum((L^H L) * conj(R^H R)): rank x rank products per matrix.
        grams = _gram(leaf.left) * jnp.conj(_gram(leaf.right))
        return jnp.real(jnp.sum(grams)).astype(jnp.float32)
    if isinstance(leaf, SparseRows):  # its stored rows, duplicates added first
        rows = leaf.rows.astype(jnp.promote_types(leaf.rows.dtype, jnp.float32))
        wide = SparseRows.build(leaf.indices, rows, leaf.num_rows)
        return jnp.real(wide.inner(wide)).astype(jnp.float32)
    if isinstance(leaf, CompressedArray):  # its rules and the fallback policy
        return jnp.real(leaf.inner(leaf)).astype(jnp.float32)
    return _sum_of_squares(jnp.asarray(leaf))


def _sum_of_squares(x: Array) -> Array:
    # In float32: a bfloat16 gradient's squares, added in bfloat16, would round at
    # each term.
    magnitude = jnp.abs(x) if jnp.iscomplexobj(x) else x
    return jnp.sum(jnp.square(magnitude.astype(jnp.float32)))


def _gram(factor: Array) -> Array:
    """`F^H F` in float32 per matrix of a stack `(*batch, m, r)`."""
    return jnp.einsum(
        "...mr,...ms->...rs",
        jnp.conj(factor),
        factor,
        preferred_element_type=jnp.promote_types(factor.dtype, jnp.float32),
    )


def global_norm(updates: PyTree) -> Scalar:
    """The Euclidean norm of all the leaves of `updates` together, each leaf the array
    it represents: `optax.global_norm` of the materialised tree, computed without
    materialising (float32).

    **Arguments:**

    - `updates`: a pytree of arrays and compressed values.

    **Returns:**

    A float32 scalar.
    """
    leaves = jtu.tree_leaves(updates, is_leaf=is_compressed)
    total = sum((_squared_norm(x) for x in leaves), start=jnp.zeros((), jnp.float32))
    return jnp.sqrt(total)


def clip_factor(updates: PyTree, max_norm: float) -> Scalar:
    """What `updates` are multiplied by to clip their global norm to `max_norm`: as
    optax, 1 below the limit and `max_norm / norm` above it."""
    norm = global_norm(updates)
    return jnp.where(norm < max_norm, 1.0, max_norm / norm).astype(jnp.float32)


def _scaled_leaf(leaf: Any, factor: Array) -> Any:
    if isinstance(leaf, CompressedArray):
        # The type's own product with a scalar: a `LowRank` scales the factor that is
        # not its projector, `SparseRows` its rows.
        return quax.quaxify(lambda x, c: x * c.astype(x.dtype))(leaf, factor)
    return leaf * factor.astype(jnp.result_type(leaf))


def scaled(updates: PyTree, factor: Array) -> PyTree:
    """Every leaf of `updates` times the scalar `factor`, compressed leaves by their
    own rules."""
    return jax.tree.map(
        lambda x: _scaled_leaf(x, factor), updates, is_leaf=is_compressed
    )


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` for gradients that may be compressed: when the global
    norm of the arrays the gradients represent exceeds `max_norm`, every leaf is
    scaled by `max_norm / norm`.

    The norm of a `LowRank` leaf is computed from its factors (of a projection,
    `projector_side` set, from the factor that is not its projector, whose columns
    are orthonormal as the tag promises), and that of a `SparseRows` leaf from its
    stored rows (rows stored twice add up first), so nothing dense is formed; the
    scaled `LowRank` keeps its projector. The result is that of
    `optax.clip_by_global_norm` on the materialised gradients. Of a projected
    gradient that is the norm of the projection, `P P^T G`, which is at most the
    norm of the whole gradient `G`: a step is clipped no more often than it would be
    on the dense gradients.

    **Arguments:**

    - `max_norm`: the largest global norm let through, e.g. 1.0.

    **Returns:**

    A stateless `optax.GradientTransformation`.
    """
    max_norm = check_max_norm(max_norm)

    def update(updates: PyTree, state: Any, params: PyTree = None) -> tuple[Any, Any]:
        del params
        return scaled(updates, clip_factor(updates, max_norm)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# The extra argument that carries the clip's factor from `clipping` to
# `scaled_by_clip`, through `layerwise`, which hands extra arguments to every slice.
_CLIP_FACTOR = "clip_factor"


def scaled_by_clip(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` on its gradients times the factor `clipping` computed of the whole
    gradients. Inside `layerwise` it scales one layer's slice at a time, so no
    scaled copy of every layer's gradients is made: scaled before the loop, they
    made the 1B step compiled for a TPU v5e chip hold 6.45 GiB instead of 6.11 (one
    microbatch) and 6.45 instead of 6.20 (four), and 6.06 instead of 4.86 for CPU
    (the step compiled both ways; `benchmarks/bench_scale.py --arms
    projected-8bit-clip` gives this form's figures)."""
    tx = optax.with_extra_args_support(tx)

    def update(
        updates: PyTree, state: Any, params: PyTree = None, **extra: Any
    ) -> tuple[Any, Any]:
        factor = extra.pop(_CLIP_FACTOR)
        return tx.update(scaled(updates, factor), state, params, **extra)

    return optax.GradientTransformationExtraArgs(tx.init, update)


def clipping(
    max_norm: float, tx: optax.GradientTransformation
) -> optax.GradientTransformationExtraArgs:
    """`tx`, which applies `scaled_by_clip` somewhere inside, handed the factor that
    clips the whole gradients to the global norm `max_norm`; `tx`'s state."""
    tx = optax.with_extra_args_support(tx)

    def update(
        updates: PyTree, state: Any, params: PyTree = None, **extra: Any
    ) -> tuple[Any, Any]:
        factor = clip_factor(updates, max_norm)
        return tx.update(updates, state, params, **extra, **{_CLIP_FACTOR: factor})

    return optax.GradientTransformationExtraArgs(tx.init, update)
