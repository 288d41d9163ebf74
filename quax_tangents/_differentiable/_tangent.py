"""The generated `Model.Tangent`: a vector space over a model's differentiable
fields, elementwise on their leaves."""

import dataclasses
import inspect
import operator
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import quax


# User-declared Tangent classes (`@differentiable(tangent=...)`): the generated
# operations use their own `+`, `-`, `*` rather than mapping over their leaves.
custom_tangents: "weakref.WeakSet[type]" = weakref.WeakSet()


def is_custom_tangent(x: Any) -> bool:
    return type(x) in custom_tangents


def is_generated_tangent(x: Any) -> bool:
    return isinstance(x, GeneratedTangent)


def is_tangent_leaf(x: Any) -> bool:
    return isinstance(x, quax.Value) or is_custom_tangent(x)


# ---------------------------------------------------------------------------------------
# Arithmetic


def _check_scalar(tangent: Any, scalar: Any, op: str) -> None:
    if isinstance(scalar, (GeneratedTangent, quax.Value)) or jnp.ndim(scalar) != 0:
        what = (
            type(scalar).__name__
            if isinstance(scalar, (GeneratedTangent, quax.Value))
            else f"an array of shape {jnp.shape(scalar)}"
        )
        raise TypeError(
            f"`{type(tangent).__name__} {op} x` needs a scalar `x`, got {what}. "
            "For leafwise products use `jax.tree.map`."
        )


def _custom_op(x: Any, name: str, *args: Any) -> Any:
    """`x.<name>(*args)` for a user-declared Tangent, refusing the sequence
    operations a NamedTuple inherits (`+` concatenates, `*` repeats)."""
    method = getattr(type(x), name, None)
    if method is None or method in (getattr(tuple, name, None), getattr(list, name, 0)):
        raise TypeError(
            f"`{type(x).__qualname__}` (a user-declared Tangent) does not define "
            f"`{name}`, which this operation on a tangent holding it needs."
        )
    return method(x, *args)


def _leafwise(op: Callable, name: str, *trees: Any, args: tuple = ()) -> Any:
    """`op(leaf, *other_leaves, *args)` on matching leaves; a user-declared Tangent
    uses its own method `name` instead."""

    def apply(x: Any, *others: Any) -> Any:
        if is_custom_tangent(x):
            return _custom_op(x, name, *others, *args)
        return op(x, *others, *args)

    return jtu.tree_map(apply, *trees, is_leaf=is_tangent_leaf)


# Compressed values dispatch through quax's rules (and the fallback policy).
quax_add = quax.quaxify(operator.add)


_sub = quax.quaxify(operator.sub)


_neg = quax.quaxify(operator.neg)


_mul = quax.quaxify(operator.mul)


def _divide(x: Any, scalar: Any) -> Any:
    # Compressed types have rules for scaling, not for division.
    if isinstance(x, quax.Value):
        return _mul(x, 1 / scalar)
    return x / scalar


def _check_same_class(a: Any, b: Any, op: str) -> None:
    if type(b) is not type(a):
        raise TypeError(
            f"`{type(a).__name__} {op} x` needs `x` to be a `{type(a).__name__}` too, "
            f"got {type(b).__name__}."
        )


class _Verbatim:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _pformat(value: Any) -> str:
    value = jtu.tree_map(
        lambda x: _Verbatim(repr(x)) if is_generated_tangent(x) else x,
        value,
        is_leaf=is_generated_tangent,
    )
    return eqx.tree_pformat(value, short_arrays=False)


class GeneratedTangent(eqx.Module):
    """Base of every generated `Model.Tangent`: a vector space over the differentiable
    fields, elementwise on their leaves. Fields may hold compressed values.

    Only dunder methods live here, so that no field name can clash with a method.
    """

    def __add__(self, other: Any) -> Any:
        _check_same_class(self, other, "+")
        return _leafwise(quax_add, "__add__", self, other)

    def __radd__(self, other: Any) -> Any:
        # `sum(tangents)` starts from the integer 0.
        if isinstance(other, int) and other == 0:
            return self
        return self.__add__(other)

    def __sub__(self, other: Any) -> Any:
        _check_same_class(self, other, "-")
        return _leafwise(_sub, "__sub__", self, other)

    def __neg__(self) -> Any:
        return _leafwise(_neg, "__neg__", self)

    def __mul__(self, scalar: Any) -> Any:
        _check_scalar(self, scalar, "*")
        return _leafwise(_mul, "__mul__", self, args=(scalar,))

    __rmul__ = __mul__

    def __truediv__(self, scalar: Any) -> Any:
        _check_scalar(self, scalar, "/")
        return _leafwise(_divide, "__truediv__", self, args=(scalar,))

    def __repr__(self) -> str:
        # Values in full, as a gradient is read; nested Tangents by their own repr.
        body = ", ".join(
            f"{f.name}={_pformat(getattr(self, f.name))}"
            for f in dataclasses.fields(self)
        )
        return f"{type(self).__name__}({body})"


# ---------------------------------------------------------------------------------------
# Generating a Tangent class


def tangent_from_fields(cls: type, values: dict[str, Any]) -> Any:
    """An instance of a generated Tangent class, built as unflatten builds one."""
    tangent = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(tangent, name, value)
    return tangent


def _tangent_init(cls_name: str, model: type, names: tuple[str, ...]) -> Callable:
    signature = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            for name in names
        ]
    )

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as error:
            raise TypeError(
                f"`{cls_name}` holds exactly the differentiable fields of "
                f"`{model.__qualname__}`, {list(names)}: {error}."
            ) from None
        for name in names:
            setattr(self, name, bound.arguments[name])

    __init__.__signature__ = signature  # pyright: ignore[reportFunctionMemberAccess]
    return __init__


def make_tangent_class(cls: type, names: tuple[str, ...]) -> type:
    name = f"{cls.__name__}Tangent"
    namespace = {
        "__annotations__": dict.fromkeys(names, Any),
        "__init__": _tangent_init(name, cls, names),
        # Pickle finds the class as an attribute of the model class.
        "__module__": cls.__module__,
        "__qualname__": f"{cls.__qualname__}.Tangent",
        "__doc__": (
            f"The tangent of `{cls.__qualname__}`: one entry per differentiable field "
            f"({', '.join(names) or 'none'}). Supports `+`, `-`, unary `-`, and `*` "
            "and `/` by scalars; see `quax_tangents.inner` and `quax_tangents.norm`."
        ),
    }
    return type(name, (GeneratedTangent,), namespace)
