"""Our own record of every dispatch rule, on top of `quax.register`.

Keeping the list lets the test suite enumerate every (primitive, types) rule and fail
when one has no property test against the dense computation, and `dispatch_log` lets
it check that the rule it tests is the one quax dispatched to.

One `@rule` can register a body for several primitives (a *family*: `add_any`, `add`
and `sub` often differ only in the primitive) and, with `commutative=True`, for both
operand orders. Each registration is its own `RuleEntry`.
"""

import contextlib
import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax.extend.core as jexc
import quax
from jaxtyping import ArrayLike


_F = TypeVar("_F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True, eq=False)
class RuleEntry:
    """One registered rule: the primitive, its operand type labels and the function.

    `fn` is the body as written; `swapped` marks the registration of a commutative
    body with its two operands in the other order. `dense_output` marks rules that
    return a dense array by design (for example `Sparse + dense`); they record a
    densification like the fallback does.
    """

    primitive: jexc.Primitive
    operands: tuple[str, ...]
    fn: Callable[..., Any]
    dense_output: bool
    swapped: bool = False

    @property
    def key(self) -> tuple[str, tuple[str, ...]]:
        return self.primitive.name, self.operands


RULES: list[RuleEntry] = []
# The entries dispatched while a `dispatch_log` is open (the innermost one).
_log: list[list[RuleEntry]] = []


@contextlib.contextmanager
def dispatch_log() -> Iterator[list[RuleEntry]]:
    """Collects every `RuleEntry` that quax dispatches to inside the block (at trace
    time: a cached `jit` trace dispatches nothing)."""
    seen: list[RuleEntry] = []
    _log.append(seen)
    try:
        yield seen
    finally:
        _log.pop()


def type_label(annotation: Any) -> str:
    """A short, stable name for an operand annotation: `dense` for `ArrayLike`."""
    if annotation is ArrayLike:
        return "dense"
    if isinstance(annotation, type):
        return annotation.__name__
    args = set(typing.get_args(annotation))
    dense = set(typing.get_args(ArrayLike))
    if args:
        labels = {type_label(a) for a in args - dense} | (
            {"dense"} if dense <= args else set()
        )
        return "|".join(sorted(labels))
    return str(annotation)


def _operands(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """The positional parameters of `fn` (the operands quax dispatches on), with
    their annotations resolved."""
    hints = typing.get_type_hints(fn)
    return [
        p.replace(annotation=hints.get(p.name, Any))
        for p in inspect.signature(fn).parameters.values()
        if p.kind
        in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.VAR_POSITIONAL,
        )
    ]


def _label(parameter: inspect.Parameter) -> str:
    label = type_label(parameter.annotation)
    return "*" + label if parameter.kind is inspect.Parameter.VAR_POSITIONAL else label


def _takes_primitive(fn: Callable[..., Any]) -> bool:
    parameter = inspect.signature(fn).parameters.get("primitive")
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


def _dispatcher(
    fn: Callable[..., Any], primitive: jexc.Primitive, swapped: bool
) -> tuple[Callable[..., Any], list[inspect.Parameter], list[RuleEntry]]:
    """The function quax registers: `fn` with the operands in dispatch order, plus
    the primitive when `fn` asks for it, logging its entry (appended to the returned
    list once it exists)."""
    operands = _operands(fn)
    extra = {"primitive": primitive} if _takes_primitive(fn) else {}
    if swapped:
        operands = operands[::-1]
    entry: list[RuleEntry] = []  # filled in by `rule` once the entry exists

    def dispatched(*args: Any, **params: Any) -> Any:
        if _log:
            _log[-1].append(entry[0])
        if swapped:
            args = args[::-1]
        return fn(*args, **params, **extra)

    # plum reads the dispatch types from the signature and `__annotations__`.
    names = [f"operand{i}" for i in range(len(operands))]
    parameters = [
        p.replace(name=name, kind=inspect.Parameter.POSITIONAL_ONLY)
        if p.kind is not inspect.Parameter.VAR_POSITIONAL
        else p.replace(name=name)
        for p, name in zip(operands, names, strict=True)
    ]
    parameters.append(inspect.Parameter("params", inspect.Parameter.VAR_KEYWORD))
    dispatched.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    dispatched.__annotations__ = {p.name: p.annotation for p in parameters[:-1]}
    dispatched.__name__ = dispatched.__qualname__ = f"{fn.__name__}[{primitive.name}]"
    dispatched.__module__ = fn.__module__
    return dispatched, operands, entry


def rule(
    *primitives: jexc.Primitive,
    dense_output: bool = False,
    precedence: int = 0,
    commutative: bool = False,
) -> Callable[[_F], _F]:
    """Registers `fn` with quax for each of `primitives` and records every
    registration in `RULES`.

    **Arguments:**

    - `primitives`: one or more primitives that share the body. A body with a
        keyword-only parameter `primitive` receives the primitive it runs for.
    - `dense_output`: the rule returns a dense array by design.
    - `precedence`: passed to `quax.register`.
    - `commutative`: the body has two operands whose order does not change the
        result; it is registered for the swapped order too.

    **Returns:**

    A decorator that returns `fn` unchanged.
    """
    if not primitives:
        raise TypeError("`rule` needs at least one primitive.")

    def register(fn: _F) -> _F:
        orders = (False, True) if commutative else (False,)
        if commutative and len(_operands(fn)) != 2:
            raise TypeError(f"`commutative=True` needs two operands, in {fn.__name__}.")
        for primitive in primitives:
            for swapped in orders:
                dispatched, operands, slot = _dispatcher(fn, primitive, swapped)
                entry = RuleEntry(
                    primitive,
                    tuple(_label(p) for p in operands),
                    fn,
                    dense_output,
                    swapped,
                )
                slot.append(entry)
                quax.register(primitive, precedence=precedence)(dispatched)
                RULES.append(entry)
        return fn

    return register
