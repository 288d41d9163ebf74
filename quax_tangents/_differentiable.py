"""`@differentiable` classes: structures that differentiate some of their fields.

After Swift for TensorFlow's `Differentiable` protocol. A decorated class has three
kinds of field:

- *differentiable* fields, which `quax_tangents.grad` and `quax_tangents.jvp`
  differentiate, and which make up the generated `Model.Tangent`;
- *non-differentiable data* (S4TF's `@noDerivative`): pytree children that stay
  dynamic under `jit` (running statistics, step counters) and never get a tangent;
- *static* fields: hashable aux data of the pytree (names, hyperparameters).

The class stays a pytree of its own type: flatten then unflatten gives a `Model` back,
so `scan`, `cond`, `jit`, `vmap` and friends work on it. Differentiation goes through
the hook that `quax_tangents.grad`/`jvp` look for: `__qt_split__` splits a model into
its differentiable part (a `Model.Tangent` holding the fields' values) and the rest,
and `__qt_merge__` puts them back together.
"""

import dataclasses
import enum
import functools as ft
import inspect
import operator
import types
import typing
import weakref
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import quax
from jaxtyping import Array, PyTree, Scalar

from ._primitives import materialise
from ._types.lowrank import LowRank


_T = TypeVar("_T", bound=type)


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


_DIFFERENTIABLE: Literal["differentiable"] = "differentiable"
_DATA: Literal["data"] = "data"
_STATIC: Literal["static"] = "static"
FieldKind = Literal["differentiable", "data", "static"]


# Annotations whose values can never be a JAX array: an unmarked field of one of these
# types is static. `bool` is here because a flag is configuration that Python code
# branches on; mark it `NoDerivative[bool]` to make it dynamic.
_NEVER_ARRAY_TYPES = (str, bytes, bool, type(None), type)
_TRANSPARENT_ORIGINS = (tuple, frozenset, typing.Union, types.UnionType)


# ---------------------------------------------------------------------------------------
# What a decorated class knows about itself


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Stored on a decorated class as `__qt_spec__`."""

    cls: type
    fields: tuple[tuple[str, FieldKind], ...]
    tangent: type
    custom_tangent: bool
    registers_pytree: bool  # False for equinox Modules, which equinox registers

    def names(self, kind: FieldKind) -> tuple[str, ...]:
        return tuple(name for name, k in self.fields if k == kind)


# User-declared Tangent classes (`@differentiable(tangent=...)`): the generated
# operations use their own `+`, `-`, `*` rather than mapping over their leaves.
_custom_tangents: "weakref.WeakSet[type]" = weakref.WeakSet()


def _spec_of(cls: type) -> _Spec | None:
    return cls.__dict__.get("__qt_spec__")


def _is_differentiable_class(x: Any) -> bool:
    return isinstance(x, type) and _spec_of(x) is not None


def _is_differentiable_instance(x: Any) -> bool:
    return hasattr(type(x), "__qt_split__")


def _is_generated_tangent(x: Any) -> bool:
    return isinstance(x, _GeneratedTangent)


def _is_custom_tangent(x: Any) -> bool:
    return type(x) in _custom_tangents


def _spec_of_instance(model: Any, name: str = "model") -> _Spec:
    """The spec of `model`'s exact class, with an error naming what went wrong."""
    cls = type(model)
    spec = _spec_of(cls)
    if spec is not None:
        return spec
    if _is_differentiable_instance(model):
        parent = next(k for k in cls.__mro__ if _spec_of(k) is not None)
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
    # The decorator itself may be used as the annotation, as in the original request.
    aliases = (marker, differentiable) if marker is Differentiable else (marker,)
    return any(any(node is alias for alias in aliases) for node in nodes)


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
        return _DIFFERENTIABLE
    if is_static:
        return _STATIC
    if is_data:
        return _DATA
    if any(_is_differentiable_class(node) for node in nodes):
        return _DIFFERENTIABLE
    if not is_module and _is_never_array(annotation):
        return _STATIC
    return _DATA


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


def _classify(cls: type) -> tuple[tuple[str, FieldKind], ...]:
    is_module = issubclass(cls, eqx.Module)
    return tuple(
        (name, _field_kind(cls, name, annotation, static, is_module))
        for name, annotation, static in _declared_fields(cls)
    )


# ---------------------------------------------------------------------------------------
# Construction-time checks


def _leaf_dtype(x: Any) -> Any:
    if isinstance(x, (bool, int, float, complex)):
        return jnp.result_type(type(x))
    return getattr(x, "dtype", None)


def _is_split_leaf(x: Any) -> bool:
    """Leaves for walking a differentiable field: nested structures and quax values
    are taken whole."""
    return _is_differentiable_instance(x) or isinstance(x, quax.Value)


def _check_differentiable_value(cls: type, name: str, value: Any) -> None:
    for leaf in jtu.tree_leaves(value, is_leaf=_is_split_leaf):
        if _is_differentiable_instance(leaf):
            continue  # checked when it was built
        dtype = _leaf_dtype(leaf)
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


def _check_extra_attributes(spec: _Spec, model: Any) -> None:
    """Attributes outside the declared fields would be lost by flatten/unflatten."""
    names = {name for name, _ in spec.fields}
    extra = sorted(set(getattr(model, "__dict__", {})) - names)
    if extra:
        raise TypeError(
            f"`{spec.cls.__qualname__}` instance has attributes {extra} that are not "
            "declared fields, so a pytree round trip would drop them; annotate them in "
            "the class body."
        )


def _check_instance(spec: _Spec, model: Any) -> None:
    checks = {
        _DIFFERENTIABLE: _check_differentiable_value,
        _STATIC: _check_static_value,
        # In an equinox Module, string leaves are ordinary (filter_jit handles them).
        _DATA: (lambda *_: None) if not spec.registers_pytree else _check_data_value,
    }
    for name, kind in spec.fields:
        try:
            value = getattr(model, name)
        except AttributeError:
            raise TypeError(
                f"`{spec.cls.__qualname__}` field `{name}` was not set by `__init__`."
            ) from None
        if kind == _DIFFERENTIABLE and spec.custom_tangent:
            continue  # the user's Tangent decides what moving means
        checks[kind](spec.cls, name, value)
    if spec.registers_pytree:
        _check_extra_attributes(spec, model)


def _check_after_init(cls: type, model: Any) -> None:
    """Checks `model` once its own class's `__init__` is done. A parent class's
    `__init__` called through `super()` leaves the checking to the subclass."""
    if type(model) is cls:
        _check_instance(_spec_of(cls), model)  # pyright: ignore[reportArgumentType]
    else:
        _spec_of_instance(model)  # an undecorated subclass is an error


# ---------------------------------------------------------------------------------------
# Pytree registration (dataclasses and plain classes; equinox registers Modules)


def _replace(model: Any, changes: dict[str, Any]) -> Any:
    """A copy of `model` with some fields changed, bypassing `__init__` (as unflatten
    does): the copy may hold tracers, or `None` in place of a field."""
    new = object.__new__(type(model))
    if hasattr(model, "__dict__"):
        new.__dict__.update(model.__dict__)
    else:  # `__slots__`
        for name, _ in _spec_of_instance(model).fields:
            object.__setattr__(new, name, getattr(model, name))
    for name, value in changes.items():
        object.__setattr__(new, name, value)
    return new


def _register_pytree(cls: type, spec: _Spec) -> None:
    dynamic = tuple(name for name, kind in spec.fields if kind != _STATIC)
    static = spec.names(_STATIC)
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
# Construction: a generated `__init__` for plain classes, and the checks


def _plain_init(cls: type, names: list[str]) -> Callable:
    missing = object()
    defaults = {name: getattr(cls, name, missing) for name in names}
    ordered = all(
        defaults[a] is missing or defaults[b] is not missing
        for a, b in zip(names, names[1:])
    )
    kind = (
        inspect.Parameter.POSITIONAL_OR_KEYWORD
        if ordered
        else inspect.Parameter.KEYWORD_ONLY
    )
    signature = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [
            inspect.Parameter(
                name,
                kind,
                default=inspect.Parameter.empty
                if defaults[name] is missing
                else defaults[name],
            )
            for name in names
        ]
    )

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as error:
            raise TypeError(
                f"`{cls.__qualname__}` takes the fields {names}: {error}."
            ) from None
        bound.apply_defaults()
        for name in names:
            object.__setattr__(self, name, bound.arguments[name])

    __init__.__signature__ = signature  # pyright: ignore[reportFunctionMemberAccess]
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


def _plain_repr(self: Any) -> str:
    spec = _spec_of(type(self))
    names = [name for name, _ in spec.fields] if spec else []
    body = ", ".join(f"{name}={getattr(self, name, '?')!r}" for name in names)
    return f"{type(self).__qualname__}({body})"


def _install_checks(cls: type, spec: _Spec) -> None:
    if issubclass(cls, eqx.Module):
        # Equinox calls each class's own `__check_init__` after `__init__`.
        own = cls.__dict__.get("__check_init__")

        def __check_init__(self: Any) -> None:
            _check_after_init(cls, self)
            if own is not None:
                own(self)

        cls.__check_init__ = __check_init__
        return
    if cls.__init__ is object.__init__:
        cls.__init__ = _plain_init(cls, [name for name, _ in spec.fields])
    original = cls.__init__

    @ft.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _check_after_init(cls, self)

    cls.__init__ = __init__
    if cls.__repr__ is object.__repr__:
        cls.__repr__ = _plain_repr


# ---------------------------------------------------------------------------------------
# Splitting a model into its Tangent-shaped view and the rest, and merging back


def _split_value(value: Any) -> tuple[Any, Any]:
    """The view and the rest of one differentiable field's value. The rest has `None`
    where the view has an array, and the rest of each nested structure."""
    leaves, treedef = jtu.tree_flatten(value, is_leaf=_is_split_leaf)
    views, rests = [], []
    for leaf in leaves:
        if _is_differentiable_instance(leaf):
            view, rest = type(leaf).__qt_split__(leaf)
        else:
            view, rest = leaf, None
        views.append(view)
        rests.append(rest)
    return jtu.tree_unflatten(treedef, views), jtu.tree_unflatten(treedef, rests)


def _merge_value(view: Any, rest: Any) -> Any:
    rest_leaves, treedef = jtu.tree_flatten(
        rest, is_leaf=lambda x: x is None or _is_differentiable_instance(x)
    )
    view_leaves = treedef.flatten_up_to(view)
    merged = [
        v if r is None else type(r).__qt_merge__(v, r)
        for v, r in zip(view_leaves, rest_leaves)
    ]
    return jtu.tree_unflatten(treedef, merged)


def _split_generated(model: Any) -> tuple[Any, Any]:
    spec = _spec_of_instance(model)
    views, rests = {}, {}
    for name in spec.names(_DIFFERENTIABLE):
        value = getattr(model, name)
        _check_differentiable_value(spec.cls, name, value)
        views[name], rests[name] = _split_value(value)
    return _tangent_from_fields(spec.tangent, views), _replace(model, rests)


def _merge_generated(cls: type, view: Any, rest: Any) -> Any:
    spec = _spec_of(cls)
    _check_tangent_class(spec, view, "__qt_merge__")  # pyright: ignore[reportArgumentType]
    return _replace(
        rest,
        {
            name: _merge_value(getattr(view, name), getattr(rest, name))
            for name in spec.names(_DIFFERENTIABLE)  # pyright: ignore[reportOptionalMemberAccess]
        },
    )


def _split_custom(model: Any) -> tuple[Any, Any]:
    # Differentiating `t -> f(move(model, t))` at `t = zero`: the derivative lives in
    # the user's Tangent coordinates, whatever its structure.
    return zero_tangent(model), model


def _merge_custom(cls: type, view: Any, rest: Any) -> Any:
    return move(rest, view)


# ---------------------------------------------------------------------------------------
# The generated Tangent


def _check_scalar(tangent: Any, scalar: Any, op: str) -> None:
    if isinstance(scalar, (_GeneratedTangent, quax.Value)) or jnp.ndim(scalar) != 0:
        what = (
            type(scalar).__name__
            if isinstance(scalar, (_GeneratedTangent, quax.Value))
            else f"an array of shape {jnp.shape(scalar)}"
        )
        raise TypeError(
            f"`{type(tangent).__name__} {op} x` needs a scalar `x`, got {what}. "
            "For leafwise products use `jax.tree.map`."
        )


def _is_tangent_leaf(x: Any) -> bool:
    return isinstance(x, quax.Value) or _is_custom_tangent(x)


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
        if _is_custom_tangent(x):
            return _custom_op(x, name, *others, *args)
        return op(x, *others, *args)

    return jtu.tree_map(apply, *trees, is_leaf=_is_tangent_leaf)


# Compressed values dispatch through quax's rules (and the fallback policy).
_add = quax.quaxify(operator.add)
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
        lambda x: _Verbatim(repr(x)) if _is_generated_tangent(x) else x,
        value,
        is_leaf=_is_generated_tangent,
    )
    return eqx.tree_pformat(value, short_arrays=False)


class _GeneratedTangent(eqx.Module):
    """Base of every generated `Model.Tangent`: a vector space over the differentiable
    fields, elementwise on their leaves. Fields may hold compressed values.

    Only dunder methods live here, so that no field name can clash with a method.
    """

    def __add__(self, other: Any) -> Any:
        _check_same_class(self, other, "+")
        return _leafwise(_add, "__add__", self, other)

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


def _tangent_from_fields(cls: type, values: dict[str, Any]) -> Any:
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


def _make_tangent_class(cls: type, names: tuple[str, ...]) -> type:
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
    return type(name, (_GeneratedTangent,), namespace)


def _check_tangent_class(spec: _Spec, tangent: Any, where: str) -> None:
    if type(tangent) is not spec.tangent:
        raise TypeError(
            f"`{where}` on a `{spec.cls.__qualname__}` needs a "
            f"`{spec.cls.__qualname__}.Tangent` (`{spec.tangent.__name__}`), got "
            f"{type(tangent).__qualname__}."
        )


# ---------------------------------------------------------------------------------------
# A user-declared Tangent


def _check_custom_protocol(cls: type, tangent: type) -> None:
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


def _check_custom_zero(spec: _Spec, zero: Any) -> None:
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


# ---------------------------------------------------------------------------------------
# The decorator


def _generated_move(self: Any, tangent: Any) -> Any:
    """A copy of this model with its differentiable fields moved by `tangent` (a
    `Tangent` of this class); see `quax_tangents.move`."""
    return move(self, tangent)


def _check_reserved_names(cls: type, fields: tuple[tuple[str, FieldKind], ...]) -> None:
    for name, _ in fields:
        if name in ("move", "Tangent"):
            raise TypeError(
                f"`{cls.__qualname__}` has a field named `{name}`, which "
                "@differentiable reserves for the class; rename the field."
            )


def _decorate(cls: _T, tangent: type | None) -> _T:
    if not isinstance(cls, type):
        raise TypeError(
            f"@differentiable decorates classes, got {type(cls).__name__}. "
            "(For arguments use `@differentiable(tangent=...)`.)"
        )
    if _spec_of(cls) is not None:
        raise TypeError(
            f"`{cls.__qualname__}` is already @differentiable; apply the decorator once."
        )
    fields = _classify(cls)
    _check_reserved_names(cls, fields)
    is_module = issubclass(cls, eqx.Module)
    if tangent is None:
        if getattr(cls, "move", _generated_move) is not _generated_move:
            raise TypeError(
                f"`{cls.__qualname__}` defines `move` itself, but its Tangent is "
                "generated and comes with a generated `move`. Remove it, or declare "
                "your own Tangent with `@differentiable(tangent=...)`."
            )
        names = tuple(name for name, kind in fields if kind == _DIFFERENTIABLE)
        tangent_cls = _make_tangent_class(cls, names)
    else:
        _check_custom_protocol(cls, tangent)
        tangent_cls = tangent
        _custom_tangents.add(tangent)
    spec = _Spec(cls, fields, tangent_cls, tangent is not None, not is_module)
    if not is_module:
        _register_pytree(cls, spec)  # first: it may fail, leaving `cls` untouched
    cls.__qt_spec__ = spec
    cls.Tangent = tangent_cls
    if tangent is None:
        cls.__qt_split__ = _split_generated
        cls.__qt_merge__ = classmethod(_merge_generated)
        cls.move = _generated_move
    else:
        cls.__qt_split__ = _split_custom
        cls.__qt_merge__ = classmethod(_merge_custom)
    _install_checks(cls, spec)
    return cls


@typing.overload
def differentiable(cls: _T, /) -> _T: ...


@typing.overload
def differentiable(*, tangent: type | None = None) -> Callable[[_T], _T]: ...


def differentiable(cls: Any = None, /, *, tangent: type | None = None) -> Any:
    """Makes a class differentiable with respect to some of its fields.

    Works on dataclasses (apply it above `@dataclass`), plain annotated classes and
    `equinox.Module`s. Each field (each annotated name) has one kind:

    - **differentiable**: annotated `Differentiable`, `Differentiable[T]`,
        `Annotated[T, Differentiable]` (or `differentiable` itself), or of a type
        that is itself `@differentiable` (also inside `list[...]`, `X | None`, ...).
        It must hold floating or complex arrays, or nested differentiable values.
    - **non-differentiable data**: annotated `NoDerivative[T]`. A pytree child:
        dynamic under `jit`, carried by `scan`, never given a tangent.
    - **static**: annotated `Static[T]`, or declared with
        `dataclasses.field(metadata={"static": True})` or
        `equinox.field(static=True)`. Hashable aux data of the pytree.

    **A field without a marker** is non-differentiable data, except when its
    annotation only allows values that can never be JAX arrays -- `str`, `bytes`,
    `bool`, `None`, enums, `Literal`s, callables, classes, and tuples or unions of
    those -- in which case it is static. So `step: int` and `running_mean: jax.Array`
    are data, `name: str` and `training: bool` are static, and `size: int` is data
    unless written `Static[int]`. In an `equinox.Module` equinox decides what is
    static, so there only `equinox.field(static=True)` makes a field static and an
    unmarked field is always data. Instance attributes that are not annotated in the
    class body are an error, since a pytree round trip would lose them.

    Construction checks the fields: differentiable ones hold floating values, static
    ones are hashable, data holds no strings. Rebuilding by JAX (unflatten) skips the
    checks, so build pytrees of `None`s or axis numbers (e.g. `vmap`'s `in_axes`)
    with `jax.tree.map` rather than through the constructor.

    The decorated class gets:

    - `Model.Tangent`: a generated, registered pytree class (`ModelTangent`)
        holding exactly the differentiable fields (nested classes get nested
        Tangents). It supports `+`, `-`, unary `-`, `*` and `/` by a scalar, and
        `quax_tangents.inner`/`norm`; its fields may hold compressed values.
    - `model.move(tangent)`: see `quax_tangents.move`.
    - pytree registration with key paths (equinox Modules keep equinox's): flatten
        then unflatten gives a `Model`, so `jit`, `vmap`, `scan`, `cond`,
        `while_loop`, `checkpoint`, serialisation and pickling work.

    `quax_tangents.grad`/`value_and_grad` of a function of a `Model` return a
    `Model.Tangent`, and `quax_tangents.jvp` accepts one. Plain `jax.grad` instead
    sees an ordinary pytree: it returns a `Model` with a cotangent in *every*
    dynamic leaf, non-differentiable data included, and rejects integer data unless
    given `allow_int=True` (which gives `float0` zeros there).

    **Arguments:**

    - `cls`: the class.
    - `tangent`: a Tangent class of your own, of any structure. `Model` must then
        define `move(self, tangent)`, and `tangent` must be a pytree class with
        `zero(model)` (a class- or staticmethod) and `+`. Derivatives are taken in
        its coordinates: `grad` returns the gradient of `t -> f(model.move(t))` at
        `t = tangent.zero(model)`, as a `tangent` instance.

    **Returns:**

    `cls` itself (decorated in place), or a decorator when called with `tangent=`.
    """
    if cls is None:
        return lambda klass: _decorate(klass, tangent)
    return _decorate(cls, tangent)


# ---------------------------------------------------------------------------------------
# Operations on models and Tangents


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, quax.Value) else jnp.shape(x)


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
        return _add(x, t)
    # `optax.apply_updates` semantics: the field keeps its dtype, so moved models are
    # valid `scan` carries.
    return jnp.asarray(x + t).astype(jnp.result_type(x))


def _move_value(value: Any, tangent: Any, where: str) -> Any:
    leaves, treedef = jtu.tree_flatten(value, is_leaf=_is_split_leaf)
    try:
        tangent_leaves = treedef.flatten_up_to(tangent)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{where}: the tangent's structure does not match the field's: {error}"
        ) from None
    moved = [
        (move(x, t) if t is not None else x)
        if _is_differentiable_instance(x)
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
    spec = _spec_of_instance(model)
    if spec.custom_tangent:
        if not isinstance(tangent, spec.tangent):
            _check_tangent_class(spec, tangent, "move")
        moved = type(model).move(model, tangent)
        if type(moved) is not type(model):
            raise TypeError(
                f"`{spec.cls.__qualname__}.move` must return a "
                f"`{spec.cls.__qualname__}`, got {type(moved).__qualname__}."
            )
        return moved
    _check_tangent_class(spec, tangent, "move")
    return _replace(
        model,
        {
            name: _move_value(
                getattr(model, name),
                getattr(tangent, name),
                f"move of `{spec.cls.__qualname__}.{name}`",
            )
            for name in spec.names(_DIFFERENTIABLE)
        },
    )


def _zero_like(x: Any) -> Any:
    if _is_custom_tangent(x):
        return x  # the view of a user-declared Tangent is its zero already
    return jnp.zeros(_shape(x), _leaf_dtype(x))


def zero_tangent(model: Any) -> Any:
    """The zero tangent at a `@differentiable` model.

    **Arguments:**

    - `model`: an instance of a `@differentiable` class.

    **Returns:**

    A `type(model).Tangent`: dense zeros of each differentiable field's shape and
    dtype, or, for a user-declared Tangent, `Tangent.zero(model)`.
    """
    spec = _spec_of_instance(model)
    if spec.custom_tangent:
        zero = spec.tangent.zero(model)
        _check_custom_zero(spec, zero)
        return zero
    view, _ = _split_generated(model)
    return jtu.tree_map(_zero_like, view, is_leaf=_is_tangent_leaf)


def differentiable_part(model: Any) -> Any:
    """The values of a model's differentiable fields, as a `type(model).Tangent`.

    This is the "params" pytree for an optax optimizer driving a `@differentiable`
    model (`optimizer.init(differentiable_part(model))`); see
    `apply_tangent_updates`.

    **Arguments:**

    - `model`: an instance of a `@differentiable` class with a generated Tangent
        (nested models included).

    **Returns:**

    A `type(model).Tangent` whose leaves are the model's differentiable leaves.
    """
    spec = _spec_of_instance(model)
    if spec.custom_tangent:
        raise TypeError(
            f"`{spec.cls.__qualname__}` declares its own Tangent, whose entries are "
            "coordinates rather than the model's values, so it has no differentiable "
            "part of that type; pass `params=None` to the optimizer's `update`."
        )

    def part(value: Any) -> Any:
        return jtu.tree_map(
            lambda x: differentiable_part(x) if _is_differentiable_instance(x) else x,
            value,
            is_leaf=_is_split_leaf,
        )

    return _tangent_from_fields(
        spec.tangent,
        {name: part(getattr(model, name)) for name in spec.names(_DIFFERENTIABLE)},
    )


def apply_tangent_updates(model: Any, updates: Any) -> Any:
    """`optax.apply_updates` for a `@differentiable` model.

    With `params = differentiable_part(model)`, any optax optimizer drives the model:

    ```python
    state = optimizer.init(qt.differentiable_part(model))
    grads = qt.grad(loss)(model)                      # a Model.Tangent
    updates, state = optimizer.update(grads, state, qt.differentiable_part(model))
    model = qt.apply_tangent_updates(model, updates)
    ```

    optax maps over the Tangent's leaves, so its updates are a `Model.Tangent` too.
    Materialise compressed gradients before `optimizer.update`
    (`quax_tangents.materialise(grads)`): optax would otherwise map over a
    compressed value's fields (scaling both factors of a `LowRank`, say), which is
    wrong for every transform, `sgd` included.

    **Arguments:**

    - `model`: an instance of a `@differentiable` class.
    - `updates`: a `type(model).Tangent`; `None` entries leave their fields alone.

    **Returns:**

    `move(model, updates)`: each field `p` becomes `p + u` cast to `p`'s dtype.
    """
    return move(model, updates)


def _leaf_inner(a: Any, b: Any) -> Array:
    """`sum(conj(a) * b)`, from the factors when one side is low-rank."""
    if isinstance(a, LowRank) and isinstance(b, LowRank):
        left = jnp.matmul(jnp.swapaxes(jnp.conj(a.left), -1, -2), b.left)
        right = jnp.matmul(jnp.swapaxes(jnp.conj(a.right), -1, -2), b.right)
        return jnp.sum(left * right)
    if isinstance(b, LowRank) and not isinstance(a, quax.Value):
        # sum_ij conj(a_ij) u_ik v_jk
        return jnp.sum(b.left * jnp.matmul(jnp.conj(a), b.right))
    if isinstance(a, LowRank) and not isinstance(b, quax.Value):
        return jnp.conj(_leaf_inner(b, a))
    return quax.quaxify(lambda x, y: jnp.sum(jnp.conj(x) * y))(a, b)


def inner(a: PyTree, b: PyTree) -> Scalar:
    """The inner product `sum(conj(a) * b)` of two tangents of the same class.

    **Arguments:**

    - `a`, `b`: two `Model.Tangent`s (or any two pytrees of arrays of one structure).
        Low-rank leaves are paired through their factors; other compressed values
        go through their rules (or the fallback policy).

    **Returns:**

    A scalar.
    """
    if _is_generated_tangent(a) and type(a) is not type(b):
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
