"""The one place a compressed value is allowed to become dense.

Every rule that gives up compression, and the shared `default` rule that runs when no
rule matches, calls `record_densification`. It counts the event per (primitive, type)
and applies the active mode. The LowRank rank budget lives here too, since it is the
same kind of decision: keep compressing, or pay for a dense array.
"""

import contextlib
import importlib.util
import os
import sys
import sysconfig
import threading
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Literal

import equinox as eqx

from ._deprecation import strategy_of_name
from ._validate import check_not_a_class


FallbackMode = Literal["warn", "error", "silent"]
_MODES = ("warn", "error", "silent")


class BudgetAction(eqx.Module):
    """What a `LowRank` whose rank goes over the budget becomes (see
    [`quax_tangents.rank_budget`][]): [`quax_tangents.Densify`][] or
    [`quax_tangents.Recompress`][], the two there are; for annotations, not for
    subclassing."""


class Densify(BudgetAction):
    """Over the rank budget, the exact dense array: counted as a densification, and
    subject to the fallback mode ([`quax_tangents.fallback`][]). The default."""


class Recompress(BudgetAction):
    """Over the rank budget, a truncated SVD of the factors to the largest rank
    within the budget: the best approximation of that rank, so lossy. Counted in
    [`quax_tangents.rank_budget_counts`][]."""


_ACTION_OF_NAME = {"densify": Densify, "recompress": Recompress}


class DensificationError(RuntimeError):
    """Raised under `fallback("error")` when a compressed value would become dense."""


class DensificationWarning(UserWarning):
    """Warned (once per primitive and type) under `fallback("warn")`."""


class _Settings(threading.local):
    def __init__(self) -> None:
        self.mode: FallbackMode = "warn"
        self.budget_action: BudgetAction = Densify()
        self.max_rank: int | None = None
        self.dry_run: bool = False


_settings = _Settings()
_densify_counts: Counter = Counter()
_budget_counts: Counter = Counter()
_warned: set = set()


@contextlib.contextmanager
def fallback(mode: FallbackMode) -> Iterator[None]:
    """Sets what happens when a compressed value has to be materialised.

    Counting happens while JAX traces, so under `jax.jit` an event is counted once per
    compilation, not once per call.

    **Arguments:**

    - `mode`: `"warn"` (the default outside this context; warns once per primitive and
        type), `"error"` (raises `DensificationError` naming the primitive and the
        type) or `"silent"` (only counts).

    **Returns:**

    A context manager.
    """
    if mode not in _MODES:
        raise ValueError(f"`mode` must be one of {_MODES}, got {mode!r}.")
    previous = _settings.mode
    _settings.mode = mode
    try:
        yield
    finally:
        _settings.mode = previous


@contextlib.contextmanager
def rank_budget(
    action: BudgetAction | str = Densify(),  # noqa: B008 (immutable)
    *,
    max_rank: int | None = None,
) -> Iterator[None]:
    """Sets what happens when concatenating `LowRank` factors exceeds the budget.

    The budget is exceeded when the factors stop saving memory, `r * (m + n) >= m * n`,
    or when `r > max_rank` if `max_rank` is given.

    **Arguments:**

    - `action`: [`quax_tangents.Densify()`][quax_tangents.Densify] (exact; counted as
        a densification and subject to the fallback mode) or
        [`quax_tangents.Recompress()`][quax_tangents.Recompress] (lossy; a truncated
        SVD of the factors to the largest rank within budget, the best approximation
        of that rank; counted in `rank_budget_counts()`).
    - `max_rank`: an optional hard cap on the rank.

    **Returns:**

    A context manager.
    """
    action = _budget_action(action)
    if max_rank is not None and (
        isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1
    ):
        raise ValueError(
            f"`max_rank` must be a positive int or None, got {max_rank!r}."
        )
    previous = (_settings.budget_action, _settings.max_rank)
    _settings.budget_action, _settings.max_rank = action, max_rank
    try:
        yield
    finally:
        _settings.budget_action, _settings.max_rank = previous


def _budget_action(action: object) -> BudgetAction:
    """`action` as a strategy instance, after a warning for a deprecated name."""
    action = strategy_of_name(
        action,
        _ACTION_OF_NAME,
        old=f"rank_budget({action!r})",
        new="rank_budget(qt.{}())",
        stacklevel=5,  # the user's `with`, through `contextlib` and the generator
    )
    check_not_a_class("action", action, BudgetAction, "quax_tangents.")
    if not isinstance(action, (Densify, Recompress)):
        raise ValueError(
            "`action` must be `quax_tangents.Densify()` or "
            f"`quax_tangents.Recompress()`, got {action!r}."
        )
    return action


@contextlib.contextmanager
def dry_run() -> Iterator[None]:
    """Traces inside this context (shape discovery before the real trace) raise under
    `fallback("error")` but neither count nor warn, so nothing is counted twice."""
    previous = _settings.dry_run
    _settings.dry_run = True
    try:
        yield
    finally:
        _settings.dry_run = previous


def fallback_mode() -> FallbackMode:
    """The active fallback mode."""
    return _settings.mode


def budget_settings() -> tuple[BudgetAction, int | None]:
    """The active rank-budget action and `max_rank`."""
    return _settings.budget_action, _settings.max_rank


def fallback_counts() -> dict[tuple[str, str], int]:
    """How often each (primitive name, type name) pair was densified since the last
    `reset_fallback_counts()`."""
    return dict(_densify_counts)


def rank_budget_counts() -> dict[tuple[str, str], int]:
    """How often each (primitive name, action) hit the LowRank rank budget."""
    return dict(_budget_counts)


def reset_fallback_counts() -> None:
    """Clears the counters (and the warn-once memory) of densifications and budget
    events."""
    _densify_counts.clear()
    _budget_counts.clear()
    _warned.clear()


def saved_counts() -> tuple[Counter, Counter]:
    """A copy of the densification and budget counters, for `restore_counts`."""
    return Counter(_densify_counts), Counter(_budget_counts)


def restore_counts(saved: tuple[Counter, Counter]) -> None:
    """Puts back counters from `saved_counts`: a trace that is thrown away and run
    again must not count its densifications twice."""
    for counter, values in zip((_densify_counts, _budget_counts), saved):
        counter.clear()
        counter.update(values)


def record_densification(
    primitive: str, type_names: tuple[str, ...], reason: str, fix: str | None = None
) -> None:
    """Counts one densification of each named type and applies the fallback mode.
    `fix`, when given, replaces the generic advice (avoid the operation, or register
    a rule for it) in the error: the caller knows what the user can change."""
    for type_name in type_names:
        key = (primitive, type_name)
        if not _settings.dry_run:
            _densify_counts[key] += 1
        message = f"`{primitive}` turns a {type_name} into a dense array ({reason})."
        if fix is not None:
            message += " " + fix
        if _settings.mode == "error":
            advice = (
                " Avoid the operation on compressed values, register a rule "
                f"for `{primitive}` with `quax.register`, or allow"
                if fix is None
                else " Or allow"
            )
            raise DensificationError(
                message + advice + " it with `quax_tangents.fallback('warn')`."
            )
        if _settings.mode == "warn" and key not in _warned and not _settings.dry_run:
            _warned.add(key)
            warnings.warn(
                message + " Counted in `quax_tangents.fallback_counts()`; use "
                "`quax_tangents.fallback('silent')` to hide this warning.",
                DensificationWarning,
                stacklevel=_outside_stacklevel(),
            )


def _package_folders() -> tuple[str, ...]:
    """The folders of this library, of the packages a densification is reached
    through (JAX's tracing, quax's dispatch, Equinox, plum, optax, Flax's layers)
    and of Python's standard library."""
    folders = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    for name in ("jax", "jaxlib", "quax", "equinox", "plum", "optax", "flax"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            folders.extend(spec.submodule_search_locations)
    folders.append(sysconfig.get_paths()["stdlib"])
    return tuple(os.path.join(os.path.abspath(f), "") for f in folders)


_PACKAGE_FOLDERS = _package_folders()


def _outside_stacklevel() -> int:
    """The `stacklevel`, for a `warnings.warn` in `record_densification`, of the
    innermost caller outside `_PACKAGE_FOLDERS`: the line of the user's code whose
    operation densifies, not a rule's."""
    frame, level = sys._getframe(1), 1  # `record_densification`, level 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        _PACKAGE_FOLDERS
    ):
        frame, level = frame.f_back, level + 1
    return level


def is_vector_shape(shape: tuple[int, ...]) -> bool:
    """At most one dimension other than 1: no factorisation or block layout would
    make such an array smaller."""
    return sum(d != 1 for d in shape) <= 1


def record_dense_result(
    primitive: str,
    type_names: tuple[str, ...],
    shape: tuple[int, ...],
    reason: str,
    fix: str | None = None,
) -> None:
    """Records a rule's dense result of `shape` computed from compressed parts,
    unless it is a vector (see `is_vector_shape`), which needs no counting. `fix`:
    as for `record_densification`."""
    if not is_vector_shape(tuple(shape)):
        record_densification(primitive, type_names, reason, fix)


def record_budget_event(primitive: str, action: str) -> None:
    """Counts one rank-budget recompression."""
    if not _settings.dry_run:
        _budget_counts[(primitive, action)] += 1
