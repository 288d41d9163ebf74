"""Field markers, and reading a class's annotations into one kind per field."""

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

import equinox as eqx
import quax


# ---------------------------------------------------------------------------------------
# Field markers


class _Marker:
    """A field annotation: bare (`b: Differentiable`) or around a type
    (`b: Differentiable[jax.Array]`, same as `Annotated[jax.Array, Differentiable]`)."""

    def __init_subclass__(cls) -> None:
        cls.__class_getitem__ = classmethod(  # pyright: ignore[reportAttributeAccessIssue]
            lambda marker, item: Annotated[item, marker]
        )

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"`{cls.__name__}` is a field annotation, not a value: write "
            f"`x: {cls.__name__}[jax.Array]`."
        )


class Differentiable(_Marker):
    """Marks a field of a `@differentiable` class as differentiable.

    Write `x: Differentiable`, `x: Differentiable[jax.Array]` or
    `x: Annotated[jax.Array, Differentiable]`. The field must hold floating (or
    complex) arrays, or a pytree of them; `quax_tangents.grad` returns its gradient
    in the matching field of `Model.Tangent`.
    """


class NoDerivative(_Marker):
    """Marks a field as non-differentiable data (S4TF's `@noDerivative`).

    Write `x: NoDerivative[jax.Array]`. The field is a pytree child, so it stays
    dynamic under `jit` and is carried through `scan`, but it is never differentiated
    and has no place in `Model.Tangent`. Use it for running statistics, step counters
    and random keys.
    """


class Static(_Marker):
    """Marks a field as static: part of the pytree structure (aux data).

    Write `x: Static[str]`, `x: Static[int]` (a hyperparameter), or use
    `dataclasses.field(metadata={"static": True})` / `equinox.field(static=True)`.
    The value must be hashable; changing it makes `jit` recompile. In an
    `equinox.Module` use `equinox.field(static=True)`, which equinox needs to know.
    """


DIFFERENTIABLE: Literal["differentiable"] = "differentiable"


DATA: Literal["data"] = "data"


STATIC: Literal["static"] = "static"


FieldKind = Literal["differentiable", "data", "static"]


# Annotations whose values can never be a JAX array: an unmarked field of one of these
# types is static. `bool` is here because a flag is configuration that Python code
# branches on; mark it `NoDerivative[bool]` to make it dynamic.
_NEVER_ARRAY_TYPES = (str, bytes, bool, type(None), type)


_TRANSPARENT_ORIGINS = (tuple, frozenset, typing.Union, types.UnionType)


# ---------------------------------------------------------------------------------------
# What a decorated class knows about itself


@dataclasses.dataclass(frozen=True)
class Spec:
    """Stored on a decorated class as `__qt_spec__`."""

    cls: type
    fields: tuple[tuple[str, FieldKind], ...]
    tangent: type
    custom_tangent: bool
    registers_pytree: bool  # False for equinox Modules, which equinox registers

    def names(self, kind: FieldKind) -> tuple[str, ...]:
        return tuple(name for name, k in self.fields if k == kind)


def spec_of(cls: type) -> Spec | None:
    return cls.__dict__.get("__qt_spec__")


def _is_differentiable_class(x: Any) -> bool:
    return isinstance(x, type) and spec_of(x) is not None


def is_differentiable_instance(x: Any) -> bool:
    return hasattr(type(x), "__qt_split__")


def spec_of_instance(model: Any, name: str = "model") -> Spec:
    """The spec of `model`'s exact class, with an error naming what went wrong."""
    cls = type(model)
    spec = spec_of(cls)
    if spec is not None:
        return spec
    if is_differentiable_instance(model):
        parent = next(k for k in cls.__mro__ if spec_of(k) is not None)
        raise TypeError(
            f"`{cls.__qualname__}` subclasses the @differentiable class "
            f"`{parent.__qualname__}` but is not decorated itself; apply "
            "`@quax_tangents.differentiable` to the subclass too, so that its fields "
            "and its Tangent are known."
        )
    raise TypeError(
        f"`{name}` must be an instance of a `@quax_tangents.differentiable` class, "
        f"got {cls.__qualname__}."
    )


def is_split_leaf(x: Any) -> bool:
    """Leaves for walking a differentiable field: nested structures and quax values
    are taken whole."""
    return is_differentiable_instance(x) or isinstance(x, quax.Value)


# ---------------------------------------------------------------------------------------
# Reading annotations


def _annotation_nodes(annotation: Any) -> list[Any]:
    """Every type and `Annotated` metadata item inside an annotation."""
    nodes = [annotation]
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        inner, *metadata = typing.get_args(annotation)
        return nodes + list(metadata) + _annotation_nodes(inner)
    if origin is Literal:
        return nodes
    for arg in typing.get_args(annotation):
        if isinstance(arg, list):  # Callable[[A, B], C]
            continue
        nodes += _annotation_nodes(arg)
    return nodes


def _strip_annotated(annotation: Any) -> Any:
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _is_never_array(annotation: Any) -> bool:
    """Whether every value this annotation allows is hashable Python data that cannot
    be a JAX array: `str`, `bool`, `None`, callables, enums, literals and tuples or
    unions of those."""
    annotation = _strip_annotated(annotation)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return True
    if origin in (type, Callable) or annotation is Callable:
        return True
    if origin in _TRANSPARENT_ORIGINS:
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return bool(args) and all(_is_never_array(a) for a in args)
    if not isinstance(annotation, type):
        return False
    if annotation is int or annotation is float or annotation is complex:
        return False
    return issubclass(annotation, _NEVER_ARRAY_TYPES) or issubclass(
        annotation, enum.Enum
    )


def _has_marker(nodes: list[Any], marker: type) -> bool:
    # The decorator itself may be used as the annotation (`x: differentiable`); it
    # names the marker it stands for in `__qt_marker__`.
    return any(
        node is marker or getattr(node, "__qt_marker__", None) is marker
        for node in nodes
    )


def _field_kind(
    cls: type, name: str, annotation: Any, static_by_field: bool, is_module: bool
) -> FieldKind:
    """The kind of one field: markers first, then nesting, then the unmarked rule."""
    nodes = _annotation_nodes(annotation)
    is_diff = _has_marker(nodes, Differentiable)
    is_static = _has_marker(nodes, Static) or static_by_field
    is_data = _has_marker(nodes, NoDerivative)
    chosen = [
        label
        for label, flag in (
            ("Differentiable", is_diff),
            ("Static", is_static),
            ("NoDerivative", is_data),
        )
        if flag
    ]
    if len(chosen) > 1:
        raise TypeError(
            f"Field `{cls.__qualname__}.{name}` is marked both {' and '.join(chosen)}; "
            "a field has exactly one kind: remove one of the markers."
        )
    if is_module and _has_marker(nodes, Static) and not static_by_field:
        raise TypeError(
            f"Field `{cls.__qualname__}.{name}` of the equinox Module is annotated "
            "`Static`, but equinox decides what is static: declare it with "
            "`equinox.field(static=True)` instead."
        )
    if is_diff:
        return DIFFERENTIABLE
    if is_static:
        return STATIC
    if is_data:
        return DATA
    if any(_is_differentiable_class(node) for node in nodes):
        return DIFFERENTIABLE
    if not is_module and _is_never_array(annotation):
        return STATIC
    return DATA


def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except NameError as error:
        raise TypeError(
            f"Cannot resolve the annotations of `{cls.__qualname__}` ({error}); "
            "@differentiable reads them to find each field's kind. Define the names "
            "they use at module level, or annotate with the objects themselves."
        ) from None


def _declared_fields(cls: type) -> list[tuple[str, Any, bool]]:
    """`(name, annotation, static_by_field)` for each field, in definition order."""
    hints = _type_hints(cls)
    if dataclasses.is_dataclass(cls):
        return [
            (f.name, hints.get(f.name, f.type), bool(f.metadata.get("static", False)))
            for f in dataclasses.fields(cls)
        ]
    names: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        for name in klass.__dict__.get("__annotations__", {}):
            names[name] = None
    return [
        (name, hints[name], False)
        for name in names
        if name in hints
        and typing.get_origin(hints[name]) is not ClassVar
        and hints[name] is not ClassVar
    ]


def classify(cls: type) -> tuple[tuple[str, FieldKind], ...]:
    is_module = issubclass(cls, eqx.Module)
    return tuple(
        (name, _field_kind(cls, name, annotation, static, is_module))
        for name, annotation, static in _declared_fields(cls)
    )
