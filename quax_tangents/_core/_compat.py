"""Every private JAX or quax name the package uses, in one place.

Supported: JAX 0.10.2 through 0.12.x, quax 0.4.6. Each item below says what it is
for, since which version it has this form, and what breaks without it. Everything
that has a public spelling (`jax.extend.core`, `jax.typeof`, `jax.lax`) is used from
there directly and is not listed here. `tests/core/test_compat.py` checks each item
on the installed version.
"""

from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any

import jax
import jax.core
import jax.extend.core as jexc
from packaging.version import Version


JAX_VERSION = Version(version("jax"))
# JAX 0.11 replaced `scan_p`'s `num_consts` / `num_carry` by `FlatTree` descriptors
# and moved `FlatTree` from `jax._src.tree_util` to `jax._src.flattree`.
JAX_GE_0_11 = JAX_VERSION >= Version("0.11.0")


# ---------------------------------------------------------------------------------------
# Primitives that `jax.extend.core.primitives` does not export (0.10.2 to 0.12.x).
# Without them no rule can be registered for a compressed value crossing a
# `shard_map` boundary (`pvary`), summed over devices (`psum_invariant`, the form a
# `psum` takes under `check_vma=True`) or resharded under explicit axes (`reshard`).

from jax._src.core import pvary_p  # noqa: E402
from jax._src.lax.parallel import psum_invariant_p  # noqa: E402
from jax._src.pjit import reshard_p  # noqa: E402


# ---------------------------------------------------------------------------------------
# Trace-context configuration (0.10.2 to 0.12.x: `jax._src.config.enum_state` with
# `include_in_trace_context`). The marks' trace mode is part of `jit`'s cache key, so
# that `jax.grad` and `quax_tangents.grad` of one jitted function each get their own
# trace. Without it a trace cached by one is still differentiated correctly by the
# other, through `mark_p`'s JVP, but densely; `trace_context_state` then returns None.


def trace_context_state(name: str, values: Sequence[str], default: str) -> Any:
    """A string-valued config state that is part of JAX's trace context, or None
    where this JAX has no such API."""
    try:
        from jax._src import config as jax_config

        return jax_config.enum_state(
            name,
            list(values),
            default,
            f"{name} (private to quax_tangents).",
            include_in_trace_context=True,
        )
    except (ImportError, AttributeError, TypeError):
        return None


def check_vma_enabled() -> bool:
    """Whether the `shard_map` body being traced checks varying manual axes.

    `jax.config.check_vma` reads the same context-local state as
    `jax._src.config._check_vma` (0.10.2 to 0.12.x); without it `device_varying`
    would cast under `check_vma=False`, where casts are refused."""
    return bool(jax.config.check_vma)  # pyright: ignore[reportAttributeAccessIssue]


# ---------------------------------------------------------------------------------------
# `shard_map_p`'s body protocol: the body returns a `FlatTree` of its output leaves
# with the flat out-specs as aux. 0.10.2: `jax._src.tree_util.FlatTree.flatten`;
# 0.11 and later: `jax._src.flattree.flatten`. Without it a `shard_map` inside a
# quaxified function cannot be traced (quax 0.4.6's trace has no
# `process_shard_map`).

if JAX_GE_0_11:
    from jax._src import flattree as _flattree  # pyright: ignore

    flatten_flat_tree = _flattree.flatten
else:
    from jax._src.tree_util import FlatTree as _FlatTree  # pyright: ignore

    flatten_flat_tree = _FlatTree.flatten


def scan_counts(args: Sequence[Any], params: dict[str, Any]) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a `scan_p` equation's operands, on either form
    of its parameters (quax's `unpack_scan_args` reads both)."""
    consts, carry, _ = unpack_scan_args(args, params)
    return len(consts), len(carry)


# ---------------------------------------------------------------------------------------
# The guard's key implementation (`_guard.py`).
# - `register_key_impl`: `jax._src.random.prng.register_prng` (0.10.2 to 0.12.x) puts
#   an implementation in the table that `jax.random.wrap_key_data(data, impl=name)`
#   reads. orbax-checkpoint restores a typed key by its implementation's name, so
#   without it a checkpoint holding a compressed value cannot be restored ("unrecognized
#   PRNG implementation").
# - `explain_key_methods`: JAX's key-array class (`jax._src.random.prng.PRNGKeyArray`,
#   0.10.2 to 0.12.x) answers the array methods it lacks with "Cannot call abstract
#   method" and `numpy.asarray` with a bare refusal; for a guard these get the
#   guard's messages instead. Without it the errors are JAX's own, and correct, but
#   do not name the fix.


def register_key_impl(impl: Any) -> None:
    """Registers a `jax.extend.random.define_prng_impl` result under its name
    (idempotent: a module reloaded in the same process keeps the first)."""
    from jax._src.random import prng  # pyright: ignore

    inner = getattr(impl, "_impl", impl)
    if inner.name not in prng.prngs:
        prng.register_prng(inner)


def _raising(test: Callable[[Any], bool], message: str, original: Any) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if test(self):
            raise TypeError(message)
        return original(self, *args, **kwargs)

    return method


def explain_key_methods(
    is_ours: Callable[[Any], bool], method_message: str, numpy_message: str
) -> None:
    """Makes the abstract methods and `__array__` of JAX's key-array class raise
    `TypeError` with these messages for the key arrays `is_ours` picks."""
    import inspect

    from jax._src.random.prng import PRNGKeyArray  # pyright: ignore

    for name in dir(PRNGKeyArray):
        if name.startswith("_"):
            continue
        attribute = inspect.getattr_static(PRNGKeyArray, name)
        is_property = isinstance(attribute, property)
        function = attribute.fget if is_property else attribute
        if not getattr(function, "__isabstractmethod__", False):
            continue
        message = f"`{name}` does not accept dtype key<{method_message}>."
        wrapped = _raising(is_ours, message, function)
        setattr(PRNGKeyArray, name, property(wrapped) if is_property else wrapped)
    original = PRNGKeyArray.__array__
    if not getattr(original, "_explains", False):
        wrapped = _raising(is_ours, numpy_message, original)
        wrapped._explains = True  # pyright: ignore[reportFunctionMemberAccess]
        PRNGKeyArray.__array__ = wrapped


# ---------------------------------------------------------------------------------------
# quax 0.4.6 internals.
# - `_QuaxTrace`, `_QuaxTracer`: the trace is given the `process_shard_map` and
#   `process_call` it lacks (a `shard_map` or a `closed_call` under quax fails with
#   AttributeError without them).
# - `_DenseArrayValue`, `_wrap_if_array`: how quax wraps a dense array on its trace,
#   needed to unwrap and rewrap leaves across the `shard_map` boundary.
# - `jit_p`, `jit_quax`, `unpack_scan_args`, `scan_bind_params`: quax's own rules for
#   `jit` and `scan`, which the package's rules fall back to or rebind with.

from quax._compat import jit_p, scan_bind_params, unpack_scan_args  # noqa: E402
from quax._dispatch import _wrap_if_array as wrap_if_array  # noqa: E402
from quax._primitives import jit_quax  # noqa: E402
from quax._trace import _QuaxTrace as QuaxTrace, _QuaxTracer as QuaxTracer  # noqa: E402
from quax._values import _DenseArrayValue as DenseArrayValue  # noqa: E402


def install_trace_method(name: str, method: Any) -> None:
    """Gives quax's trace a method it lacks (idempotent; a quax that defines it
    itself keeps its own)."""
    current = getattr(QuaxTrace, name, None)
    if current is None or current is getattr(jax.core.Trace, name, None):
        setattr(QuaxTrace, name, method)


__all__ = [
    "JAX_GE_0_11",
    "JAX_VERSION",
    "Version",
    "DenseArrayValue",
    "QuaxTrace",
    "QuaxTracer",
    "check_vma_enabled",
    "explain_key_methods",
    "flatten_flat_tree",
    "install_trace_method",
    "jexc",
    "jit_p",
    "jit_quax",
    "psum_invariant_p",
    "pvary_p",
    "register_key_impl",
    "reshard_p",
    "scan_bind_params",
    "scan_counts",
    "trace_context_state",
    "unpack_scan_args",
    "wrap_if_array",
]
