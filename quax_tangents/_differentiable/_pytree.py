"""Pytree registration of decorated classes, and splitting a model into its
Tangent-shaped view (the differentiable part) and the rest, and merging them back."""

from collections.abc import Callable, Sequence
from typing import Any

import jax.tree_util as jtu
from jaxtyping import PyTree

from ._checks import check_differentiable_value, check_tangent_class
from ._fields import (
    DIFFERENTIABLE,
    STATIC,
    Spec,
    is_differentiable_instance,
    is_split_leaf,
    spec_of,
    spec_of_instance,
)
from ._tangent import tangent_from_fields


# ---------------------------------------------------------------------------------------
# Pytree registration (dataclasses and plain classes; equinox registers Modules)


def replace(model: Any, changes: dict[str, Any]) -> Any:
    """A copy of `model` with some fields changed, bypassing `__init__` (as unflatten
    does): the copy may hold tracers, or `None` in place of a field."""
    new = object.__new__(type(model))
    if hasattr(model, "__dict__"):
        new.__dict__.update(model.__dict__)
    else:  # `__slots__`
        for name, _ in spec_of_instance(model).fields:
            object.__setattr__(new, name, getattr(model, name))
    for name, value in changes.items():
        object.__setattr__(new, name, value)
    return new


def register_pytree(cls: type, spec: Spec) -> None:
    dynamic = tuple(name for name, kind in spec.fields if kind != STATIC)
    static = spec.names(STATIC)
    keys = tuple(jtu.GetAttrKey(name) for name in dynamic)

    def flatten_with_keys(model: Any) -> tuple[list, tuple]:
        children = [(key, getattr(model, name)) for key, name in zip(keys, dynamic)]
        return children, tuple(getattr(model, name) for name in static)

    def flatten(model: Any) -> tuple[list, tuple]:
        children = [getattr(model, name) for name in dynamic]
        return children, tuple(getattr(model, name) for name in static)

    def unflatten(aux: tuple, children: Any) -> Any:
        model = object.__new__(cls)
        for name, value in zip(dynamic, children):
            object.__setattr__(model, name, value)
        for name, value in zip(static, aux):
            object.__setattr__(model, name, value)
        return model

    try:
        jtu.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    except ValueError:
        raise TypeError(
            f"`{cls.__qualname__}` is already registered as a pytree; "
            "@differentiable registers it itself, with its static fields as aux data. "
            "Remove the other registration."
        ) from None


# ---------------------------------------------------------------------------------------
# One model: its Tangent-shaped view and the rest


def _split_value(value: Any) -> tuple[Any, Any]:
    """The view and the rest of one differentiable field's value. The rest has `None`
    where the view has an array, and the rest of each nested structure."""
    leaves, treedef = jtu.tree_flatten(value, is_leaf=is_split_leaf)
    views, rests = [], []
    for leaf in leaves:
        if is_differentiable_instance(leaf):
            view, rest = type(leaf).__qt_split__(leaf)
        else:
            view, rest = leaf, None
        views.append(view)
        rests.append(rest)
    return jtu.tree_unflatten(treedef, views), jtu.tree_unflatten(treedef, rests)


def _merge_value(view: Any, rest: Any) -> Any:
    rest_leaves, treedef = jtu.tree_flatten(
        rest, is_leaf=lambda x: x is None or is_differentiable_instance(x)
    )
    view_leaves = treedef.flatten_up_to(view)
    merged = [
        v if r is None else type(r).__qt_merge__(v, r)
        for v, r in zip(view_leaves, rest_leaves)
    ]
    return jtu.tree_unflatten(treedef, merged)


def split_generated(model: Any) -> tuple[Any, Any]:
    spec = spec_of_instance(model)
    views, rests = {}, {}
    for name in spec.names(DIFFERENTIABLE):
        value = getattr(model, name)
        check_differentiable_value(spec.cls, name, value)
        views[name], rests[name] = _split_value(value)
    return tangent_from_fields(spec.tangent, views), replace(model, rests)


def merge_generated(cls: type, view: Any, rest: Any) -> Any:
    spec = spec_of(cls)
    check_tangent_class(spec, view, "__qt_merge__")  # pyright: ignore[reportArgumentType]
    return replace(
        rest,
        {
            name: _merge_value(getattr(view, name), getattr(rest, name))
            for name in spec.names(DIFFERENTIABLE)  # pyright: ignore[reportOptionalMemberAccess]
        },
    )


# ---------------------------------------------------------------------------------------
# Any pytree: `@differentiable` values replaced by their views (for the entry points)


def split_structures(tree: PyTree) -> tuple[PyTree, Any]:
    """Replaces each value whose class defines `__qt_split__` (a `@differentiable`
    class) by its differentiable part, its `Tangent`-shaped view. Returns the view
    tree and what `merge_structures` needs to rebuild the originals."""
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=is_differentiable_instance)
    if not any(map(is_differentiable_instance, leaves)):
        return tree, None
    views, rests = [], []
    for leaf in leaves:
        if is_differentiable_instance(leaf):
            view, rest = type(leaf).__qt_split__(leaf)
            views.append(view)
            rests.append((type(leaf), rest))
        else:
            views.append(leaf)
            rests.append(None)
    return jtu.tree_unflatten(treedef, views), (treedef, rests)


def merge_structures(views: PyTree, split: Any) -> PyTree:
    if split is None:
        return views
    treedef, rests = split
    merged = [
        view if rest is None else rest[0].__qt_merge__(view, rest[1])
        for view, rest in zip(treedef.flatten_up_to(views), rests)
    ]
    return jtu.tree_unflatten(treedef, merged)


def _call_merged(fn: Callable, split: Any, *views: Any) -> Any:
    return fn(*merge_structures(views, split))


def through_views(fn: Callable, primals: Sequence[Any]) -> tuple[Callable, tuple]:
    """`fn` and `primals` rewritten so that `@differentiable` arguments are
    differentiated through their Tangent views."""
    views, split = split_structures(tuple(primals))
    if split is None:
        return fn, views
    return jtu.Partial(_call_merged, fn, split), views
