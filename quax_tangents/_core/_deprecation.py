"""Old public names, kept for one release: each use warns and names its replacement."""

import warnings
from collections.abc import Callable
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
