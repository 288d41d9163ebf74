"""The `@differentiable` decorator."""

import functools as ft
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx

from ._checks import check_after_init, check_custom_protocol, check_reserved_names
from ._fields import DIFFERENTIABLE, Differentiable, Spec, classify, spec_of
from ._ops import merge_custom, move, split_custom
from ._pytree import merge_generated, register_pytree, split_generated
from ._tangent import custom_tangents, make_tangent_class


_T = TypeVar("_T", bound=type)


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
    spec = spec_of(type(self))
    names = [name for name, _ in spec.fields] if spec else []
    body = ", ".join(f"{name}={getattr(self, name, '?')!r}" for name in names)
    return f"{type(self).__qualname__}({body})"


def install_checks(cls: type, spec: Spec) -> None:
    if issubclass(cls, eqx.Module):
        # Equinox calls each class's own `__check_init__` after `__init__`.
        own = cls.__dict__.get("__check_init__")

        def __check_init__(self: Any) -> None:
            check_after_init(cls, self)
            if own is not None:
                own(self)

        cls.__check_init__ = __check_init__  # pyright: ignore[reportAttributeAccessIssue]
        return
    if cls.__init__ is object.__init__:
        cls.__init__ = _plain_init(cls, [name for name, _ in spec.fields])
    original = cls.__init__

    @ft.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        check_after_init(cls, self)

    cls.__init__ = __init__
    if cls.__repr__ is object.__repr__:
        cls.__repr__ = _plain_repr  # pyright: ignore[reportAttributeAccessIssue]


# ---------------------------------------------------------------------------------------
# The decorator


def _generated_move(self: Any, tangent: Any) -> Any:
    """A copy of this model with its differentiable fields moved by `tangent` (a
    `Tangent` of this class); see `quax_tangents.move`."""
    return move(self, tangent)


def _decorate(cls: _T, tangent: type | None) -> _T:
    if not isinstance(cls, type):
        raise TypeError(
            f"@differentiable decorates classes, got {type(cls).__name__}. "
            "(For arguments use `@differentiable(tangent=...)`.)"
        )
    if spec_of(cls) is not None:
        raise TypeError(
            f"`{cls.__qualname__}` is already @differentiable; apply the decorator once."
        )
    fields = classify(cls)
    check_reserved_names(cls, fields)
    is_module = issubclass(cls, eqx.Module)
    if tangent is None:
        if getattr(cls, "move", _generated_move) is not _generated_move:
            raise TypeError(
                f"`{cls.__qualname__}` defines `move` itself, but its Tangent is "
                "generated and comes with a generated `move`. Remove it, or declare "
                "your own Tangent with `@differentiable(tangent=...)`."
            )
        names = tuple(name for name, kind in fields if kind == DIFFERENTIABLE)
        tangent_cls = make_tangent_class(cls, names)
    else:
        check_custom_protocol(cls, tangent)
        tangent_cls = tangent
        custom_tangents.add(tangent)
    spec = Spec(cls, fields, tangent_cls, tangent is not None, not is_module)
    if not is_module:
        register_pytree(cls, spec)  # first: it may fail, leaving `cls` untouched
    cls.__qt_spec__ = spec
    cls.Tangent = tangent_cls
    if tangent is None:
        cls.__qt_split__ = split_generated
        cls.__qt_merge__ = classmethod(merge_generated)
        cls.move = _generated_move
    else:
        cls.__qt_split__ = split_custom
        cls.__qt_merge__ = classmethod(merge_custom)
    install_checks(cls, spec)
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


# `x: differentiable` in a class body reads as `x: Differentiable`.
differentiable.__qt_marker__ = Differentiable  # pyright: ignore[reportFunctionMemberAccess]
