"""Old public names, kept for one release: each use warns and names its replacement."""

import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple


def deprecation_message(old: str, new: str) -> str:
    """The warning for a use of `old`. pyproject.toml's pytest settings turn it into
    an error by its wording, so that the docs and tests use current names only."""
    return (
        f"`{old}` is deprecated and will be removed in the next release of "
        f"quax_tangents; use `{new}` instead."
    )


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warns that `old` is deprecated in favour of `new`.

    **Arguments:**

    - `old`: the deprecated spelling, as a user writes it (`qt.collectives`).
    - `new`: what to write instead (`qt.hlo.collectives`).
    - `stacklevel`: as for `warnings.warn`; the default points at the caller of the
        function that calls this one.
    """
    warnings.warn(
        deprecation_message(old, new), DeprecationWarning, stacklevel=stacklevel
    )


def strategy_of_name(
    value: Any, strategies: Mapping[str, type], *, old: str, new: str, stacklevel: int
) -> Any:
    """The strategy that a deprecated name in `strategies` stands for, as an
    instance, after a warning that `old` is deprecated for `new` (in which `{}` is
    the strategy's class name); any other `value` unchanged.

    `stacklevel` is as for `warn_deprecated`, counted from the caller of this
    function."""
    if not isinstance(value, str) or value not in strategies:
        return value
    strategy = strategies[value]
    warn_deprecated(old, new.format(strategy.__name__), stacklevel=stacklevel + 1)
    return strategy()


class Alias(NamedTuple):
    """A deprecated public name: how users spell it, what to write instead, and a
    function that returns the replacement (called on use only, so the replacement's
    module is imported only then)."""

    old: str
    new: str
    get: Callable[[], Any]


def resolve_alias(alias: Alias) -> Any:
    """A module `__getattr__`'s answer for a deprecated name: the replacement, after
    a `DeprecationWarning` that names it."""
    warn_deprecated(alias.old, alias.new, stacklevel=4)
    return alias.get()
