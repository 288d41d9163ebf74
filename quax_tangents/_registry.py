"""Our own record of every dispatch rule, on top of `quax.register`.

Keeping the list lets the test suite enumerate every (primitive, types) rule and fail
when one has no property test against the dense computation.
"""

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import jax.extend.core as jexc
import quax
from jaxtyping import ArrayLike


_F = TypeVar("_F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class RuleEntry:
    """One registered rule: the primitive, its operand type labels and the function.

    `dense_output` marks rules that return a dense array by design (for example
    `Sparse + dense`); they record a densification like the fallback does.
    """

    primitive: jexc.Primitive
    operands: tuple[str, ...]
    fn: Callable[..., Any]
    dense_output: bool

    @property
    def key(self) -> tuple[str, tuple[str, ...]]:
        return self.primitive.name, self.operands


RULES: list[RuleEntry] = []


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


def _operand_labels(fn: Callable[..., Any]) -> tuple[str, ...]:
    hints = typing.get_type_hints(fn)
    labels = []
    for parameter in inspect.signature(fn).parameters.values():
        label = type_label(hints.get(parameter.name, Any))
        if parameter.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.POSITIONAL_ONLY,
        ):
            labels.append(label)
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            labels.append("*" + label)
    return tuple(labels)


def rule(
    primitive: jexc.Primitive, *, dense_output: bool = False, precedence: int = 0
) -> Callable[[_F], _F]:
    """Registers `fn` with quax for `primitive` and records it in `RULES`."""

    def register(fn: _F) -> _F:
        quax.register(primitive, precedence=precedence)(fn)
        RULES.append(RuleEntry(primitive, _operand_labels(fn), fn, dense_output))
        return fn

    return register
