"""Operations on models and Tangents: moving, zeros, the optimizer helpers, inner
products and norms."""

from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
import quax
from jaxtyping import Array, PyTree, Scalar

from .._core._base import CompressedArray
from .._types._primitives import materialise
from ._checks import check_custom_zero, check_tangent_class, leaf_dtype
from ._fields import (
    DIFFERENTIABLE,
    is_differentiable_instance,
    is_split_leaf,
    spec_of_instance,
)
from ._pytree import replace, split_generated
from ._tangent import (
    is_custom_tangent,
    is_generated_tangent,
    is_tangent_leaf,
    quax_add,
    tangent_from_fields,
)


# ---------------------------------------------------------------------------------------
# Moving a model along a tangent


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, quax.ArrayValue) else jnp.shape(x)


def _move_leaf(x: Any, t: Any, where: str) -> Any:
    if t is None:
        return x
    if _shape(t) != _shape(x):
        raise ValueError(
            f"{where}: the tangent has shape {_shape(t)} but the field has shape "
            f"{_shape(x)}; a tangent must match its primal's shape."
        )
    t = materialise(t)
    if isinstance(x, quax.Value):
        return quax_add(x, t)
    # `optax.apply_updates` semantics: the field keeps its dtype, so moved models are
    # valid `scan` carries.
    return jnp.asarray(x + t).astype(jnp.result_type(x))


def _move_value(value: Any, tangent: Any, where: str) -> Any:
    leaves, treedef = jtu.tree_flatten(value, is_leaf=is_split_leaf)
    try:
        tangent_leaves = treedef.flatten_up_to(tangent)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{where}: the tangent's structure does not match the field's: {error}"
        ) from None
    moved = [
        (move(x, t) if t is not None else x)
        if is_differentiable_instance(x)
        else _move_leaf(x, t, where)
        for x, t in zip(leaves, tangent_leaves)
    ]
    return jtu.tree_unflatten(treedef, moved)


def move(model: Any, tangent: Any) -> Any:
    """Moves a `@differentiable` model along a tangent, like S4TF's `move(by:)`.

    For a generated Tangent, each differentiable field becomes `field + tangent`
    (compressed tangent values are materialised; each field keeps its dtype, as with
    `optax.apply_updates`; a `None` entry leaves its field unchanged); nested models
    are moved recursively. Non-differentiable data and static fields are unchanged.
    For a user-declared Tangent, this calls the class's own `move`.

    **Arguments:**

    - `model`: an instance of a `@differentiable` class.
    - `tangent`: a `type(model).Tangent`, e.g. `-learning_rate * grads`.

    **Returns:**

    A new model of the same class.
    """
    spec = spec_of_instance(model)
    if spec.custom_tangent:
        if not isinstance(tangent, spec.tangent):
            check_tangent_class(spec, tangent, "move")
        moved = type(model).move(model, tangent)
        if type(moved) is not type(model):
            raise TypeError(
                f"`{spec.cls.__qualname__}.move` must return a "
                f"`{spec.cls.__qualname__}`, got {type(moved).__qualname__}."
            )
        return moved
    check_tangent_class(spec, tangent, "move")
    return replace(
        model,
        {
            name: _move_value(
                getattr(model, name),
                getattr(tangent, name),
                f"move of `{spec.cls.__qualname__}.{name}`",
            )
            for name in spec.names(DIFFERENTIABLE)
        },
    )


def _zero_like(x: Any) -> Any:
    if is_custom_tangent(x):
        return x  # the view of a user-declared Tangent is its zero already
    return jnp.zeros(_shape(x), leaf_dtype(x))


def zero_tangent(model: Any) -> Any:
    """The zero tangent at a `@differentiable` model.

    **Arguments:**

    - `model`: an instance of a `@differentiable` class.

    **Returns:**

    A `type(model).Tangent`: dense zeros of each differentiable field's shape and
    dtype, or, for a user-declared Tangent, `Tangent.zero(model)`.
    """
    spec = spec_of_instance(model)
    if spec.custom_tangent:
        zero = spec.tangent.zero(model)
        check_custom_zero(spec, zero)
        return zero
    view, _ = split_generated(model)
    return jtu.tree_map(_zero_like, view, is_leaf=is_tangent_leaf)


# ---------------------------------------------------------------------------------------
# A user-declared Tangent: derivatives in its own coordinates


def split_custom(model: Any) -> tuple[Any, Any]:
    # Differentiating `t -> f(move(model, t))` at `t = zero`: the derivative lives in
    # the user's Tangent coordinates, whatever its structure.
    return zero_tangent(model), model


def merge_custom(cls: type, view: Any, rest: Any) -> Any:
    return move(rest, view)


# ---------------------------------------------------------------------------------------
# Driving a model with optax


def differentiable_part(model: Any) -> Any:
    """The values of a model's differentiable fields, as a `type(model).Tangent`.

    This is the "params" pytree for an optax optimizer driving a `@differentiable`
    model (`optimizer.init(differentiable_part(model))`); apply its updates with
    `quax_tangents.optax.apply_updates(model, updates)`.

    **Arguments:**

    - `model`: an instance of a `@differentiable` class with a generated Tangent
        (nested models included).

    **Returns:**

    A `type(model).Tangent` whose leaves are the model's differentiable leaves.
    """
    spec = spec_of_instance(model)
    if spec.custom_tangent:
        raise TypeError(
            f"`{spec.cls.__qualname__}` declares its own Tangent, whose entries are "
            "coordinates rather than the model's values, so it has no differentiable "
            "part of that type; pass `params=None` to the optimizer's `update`."
        )

    def part(value: Any) -> Any:
        return jtu.tree_map(
            lambda x: differentiable_part(x) if is_differentiable_instance(x) else x,
            value,
            is_leaf=is_split_leaf,
        )

    return tangent_from_fields(
        spec.tangent,
        {name: part(getattr(model, name)) for name in spec.names(DIFFERENTIABLE)},
    )


# ---------------------------------------------------------------------------------------
# Inner products


def _leaf_inner(a: Any, b: Any) -> Array:
    """`sum(conj(a) * b)`; a compressed value computes it itself (a `LowRank` from
    its factors)."""
    if isinstance(a, CompressedArray):
        return a.inner(b)
    if isinstance(b, CompressedArray):
        return jnp.conj(b.inner(a))
    return quax.quaxify(lambda x, y: jnp.sum(jnp.conj(x) * y))(a, b)


def inner(a: PyTree, b: PyTree) -> Scalar:
    """The inner product `sum(conj(a) * b)` of two tangents of the same class.

    **Arguments:**

    - `a`, `b`: two `Model.Tangent`s (or any two pytrees of arrays of one structure).
        A compressed leaf computes its product itself (`CompressedArray.inner`):
        a `LowRank` from its factors, other types through their rules (or the
        fallback policy).

    **Returns:**

    A scalar.
    """
    if is_generated_tangent(a) and type(a) is not type(b):
        raise TypeError(
            f"`inner` needs two tangents of one class, got {type(a).__name__} and "
            f"{type(b).__name__}."
        )
    leaves_a, treedef = jtu.tree_flatten(a, is_leaf=lambda x: isinstance(x, quax.Value))
    leaves_b = treedef.flatten_up_to(b)
    return sum(
        (_leaf_inner(x, y) for x, y in zip(leaves_a, leaves_b)),
        start=jnp.zeros((), jnp.float32),
    )


def norm(tangent: PyTree) -> Scalar:
    """The Euclidean norm `sqrt(inner(t, t))` of a tangent.

    **Arguments:**

    - `tangent`: a `Model.Tangent` (or any pytree of arrays).

    **Returns:**

    A non-negative real scalar.
    """
    return jnp.sqrt(jnp.real(inner(tangent, tangent)))
