"""Checks of a decorated class, its instances and its Tangent, each with an error
that names the field and the fix."""

from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu

from ._fields import (
    DATA,
    DIFFERENTIABLE,
    STATIC,
    FieldKind,
    Spec,
    is_differentiable_instance,
    is_split_leaf,
    spec_of,
    spec_of_instance,
)


# ---------------------------------------------------------------------------------------
# Construction-time checks


def leaf_dtype(x: Any) -> Any:
    if isinstance(x, (bool, int, float, complex)):
        return jnp.result_type(type(x))
    return getattr(x, "dtype", None)


def check_differentiable_value(cls: type, name: str, value: Any) -> None:
    for leaf in jtu.tree_leaves(value, is_leaf=is_split_leaf):
        if is_differentiable_instance(leaf):
            continue  # checked when it was built
        dtype = leaf_dtype(leaf)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            got = f"dtype {dtype}" if dtype is not None else type(leaf).__name__
            raise TypeError(
                f"Field `{cls.__qualname__}.{name}` is differentiable but holds a "
                f"{got} value; differentiable fields hold floating or complex arrays. "
                "Convert it (`jnp.asarray(x, float)`) or mark the field "
                "`NoDerivative` (dynamic data) or `Static`."
            )


def _check_static_value(cls: type, name: str, value: Any) -> None:
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"Static field `{cls.__qualname__}.{name}` holds an unhashable "
            f"{type(value).__name__}; static fields are part of the pytree structure "
            "and must be hashable (use a tuple instead of a list, for example), or "
            "mark the field `NoDerivative` to make it dynamic data."
        ) from None


def _check_data_value(cls: type, name: str, value: Any) -> None:
    for leaf in jtu.tree_leaves(value):
        if isinstance(leaf, (str, bytes)):
            raise TypeError(
                f"Field `{cls.__qualname__}.{name}` is non-differentiable data (a "
                f"pytree child, traced under `jit`) but holds the string {leaf!r}; "
                "annotate it `Static[...]` to make it aux data."
            )


def _check_extra_attributes(spec: Spec, model: Any) -> None:
    """Attributes outside the declared fields would be lost by flatten/unflatten."""
    names = {name for name, _ in spec.fields}
    extra = sorted(set(getattr(model, "__dict__", {})) - names)
    if extra:
        raise TypeError(
            f"`{spec.cls.__qualname__}` instance has attributes {extra} that are not "
            "declared fields, so a pytree round trip would drop them; annotate them in "
            "the class body."
        )


def _check_instance(spec: Spec, model: Any) -> None:
    checks = {
        DIFFERENTIABLE: check_differentiable_value,
        STATIC: _check_static_value,
        # In an equinox Module, string leaves are ordinary (filter_jit handles them).
        DATA: (lambda *_: None) if not spec.registers_pytree else _check_data_value,
    }
    for name, kind in spec.fields:
        try:
            value = getattr(model, name)
        except AttributeError:
            raise TypeError(
                f"`{spec.cls.__qualname__}` field `{name}` was not set by `__init__`."
            ) from None
        if kind == DIFFERENTIABLE and spec.custom_tangent:
            continue  # the user's Tangent decides what moving means
        checks[kind](spec.cls, name, value)
    if spec.registers_pytree:
        _check_extra_attributes(spec, model)


def check_after_init(cls: type, model: Any) -> None:
    """Checks `model` once its own class's `__init__` is done. A parent class's
    `__init__` called through `super()` leaves the checking to the subclass."""
    if type(model) is cls:
        _check_instance(spec_of(cls), model)  # pyright: ignore[reportArgumentType]
    else:
        spec_of_instance(model)  # an undecorated subclass is an error


# ---------------------------------------------------------------------------------------
# Declaration checks


def check_reserved_names(cls: type, fields: tuple[tuple[str, FieldKind], ...]) -> None:
    for name, _ in fields:
        if name in ("move", "Tangent"):
            raise TypeError(
                f"`{cls.__qualname__}` has a field named `{name}`, which "
                "@differentiable reserves for the class; rename the field."
            )


def check_custom_protocol(cls: type, tangent: type) -> None:
    if not isinstance(tangent, type):
        raise TypeError(f"`tangent` must be a class, got {tangent!r}.")
    problems = []
    if not callable(getattr(cls, "move", None)):
        problems.append(
            f"`{cls.__qualname__}.move(self, tangent)` returning a new model"
        )
    if not callable(getattr(tangent, "zero", None)):
        problems.append(
            f"`{tangent.__qualname__}.zero(model)` (a classmethod or staticmethod) "
            "returning the zero tangent at `model`"
        )
    add = getattr(tangent, "__add__", None)
    if add is None or add is tuple.__add__ or add is list.__add__:
        problems.append(
            f"`{tangent.__qualname__}.__add__`, adding two tangents (a NamedTuple's "
            "inherited `+` concatenates)"
        )
    if problems:
        raise TypeError(
            f"`@differentiable(tangent={tangent.__qualname__})` needs: "
            + "; ".join(problems)
            + "."
        )


# ---------------------------------------------------------------------------------------
# Tangent checks


def check_tangent_class(spec: Spec, tangent: Any, where: str) -> None:
    if type(tangent) is not spec.tangent:
        raise TypeError(
            f"`{where}` on a `{spec.cls.__qualname__}` needs a "
            f"`{spec.cls.__qualname__}.Tangent` (`{spec.tangent.__name__}`), got "
            f"{type(tangent).__qualname__}."
        )


def check_custom_zero(spec: Spec, zero: Any) -> None:
    if type(zero) is not spec.tangent:
        raise TypeError(
            f"`{spec.tangent.__qualname__}.zero` must return a "
            f"`{spec.tangent.__qualname__}`, got {type(zero).__qualname__}."
        )
    leaves = jtu.tree_leaves(zero)
    if len(leaves) == 1 and leaves[0] is zero:
        raise TypeError(
            f"`{spec.tangent.__qualname__}` must be a pytree (a NamedTuple, an "
            "`equinox.Module`, or a registered class) so that its leaves can be "
            "differentiated."
        )
