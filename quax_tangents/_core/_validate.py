"""Input checks shared by every representation and compressor.

Each error names the argument and says how to fix it. Value checks (finiteness) only
run on concrete arrays: under `jit` the values are not known at trace time. They
check what a user passes in, never what the library computes: inside
`values_unchecked()` (a compressor applied to a cotangent in a backward pass, a
collective's decoding) a NaN or Inf flows on as it does in dense JAX, where
`jax_debug_nans` finds the operation that made it.
"""

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np


class _Checks(threading.local):
    def __init__(self) -> None:
        self.off = 0


_checks = _Checks()


@contextlib.contextmanager
def values_unchecked() -> Iterator[None]:
    """Within it, value checks pass: for library-internal calls of public
    compressors and constructors on values the library computed."""
    _checks.off += 1
    try:
        yield
    finally:
        _checks.off -= 1


def is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def checks_values(x: Any) -> bool:
    """Whether to check the values of `x`: concrete, and not inside
    `values_unchecked()`."""
    return not _checks.off and is_concrete(x)


def check_floating(name: str, x: Any) -> None:
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"`{name}` has dtype {dtype}; compressed tangents must be floating point "
            "(integer primals have no tangent). Cast it, e.g. `x.astype(jnp.float32)`."
        )


def check_same_dtype(**arrays: Any) -> None:
    dtypes = {name: jnp.result_type(x) for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"`{n}` is {d}" for n, d in dtypes.items())
        raise TypeError(f"Mixed dtypes: {listing}. Cast them to one dtype first.")


def check_dtype(name: str, x: Any, expected: Any) -> None:
    dtype = jnp.result_type(x)
    if dtype != jnp.dtype(expected):
        raise TypeError(f"`{name}` must have dtype {jnp.dtype(expected)}, got {dtype}.")


def check_finite(name: str, x: Any) -> None:
    if checks_values(x) and not bool(np.all(np.isfinite(np.asarray(x, np.float32)))):
        raise ValueError(
            f"`{name}` contains NaN or Inf. Compress finite values only; check the "
            "computation that produced it (e.g. with `jax.debug_nans`)."
        )


def check_positive_int(
    name: str, value: Any, *, upper: int | None = None, hint: str = ""
) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be a Python int, got {value!r}.")
    value = int(value)
    if value < 1:
        raise ValueError(f"`{name}` must be at least 1, got {value}.")
    if upper is not None and value > upper:
        raise ValueError(f"`{name}`={value} is larger than {upper}{hint}.")
    return value


def check_non_negative_int(name: str, value: Any) -> int:
    """`value`, or a `ValueError` naming `name` unless it is an int of 0 or more."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative int, got {value!r}.")
    return value


def check_not_a_class(
    name: str, value: Any, strategies: type | tuple[type, ...], prefix: str
) -> None:
    """A `TypeError` naming the instance to pass, where the class of a strategy was
    passed for `name` (`qt.Recompress` for `qt.Recompress()`); `prefix` is how the
    message spells its module (`"qt."`)."""
    if isinstance(value, type) and issubclass(value, strategies):
        raise TypeError(
            f"`{name}` must be an instance: `{prefix}{value.__name__}()`, not the "
            "class."
        )


def check_ndim(name: str, x: Any, minimum: int) -> None:
    if jnp.ndim(x) < minimum:
        raise ValueError(
            f"`{name}` must have at least {minimum} dimensions, got shape {jnp.shape(x)}."
        )


def as_array(name: str, x: Any) -> jax.Array:
    """`x` as a JAX array: arrays, NumPy arrays, scalars and (nested) lists."""
    if isinstance(x, jax.Array):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"`{name}` must be an array or array-like (a NumPy array, a scalar or a "
            f"nested list of numbers), got {type(x).__name__}: {error}"
        ) from None


def check_key(name: str, key: Any, *, none_means: str = "") -> None:
    """A typed key (`jax.random.key`) or a raw uint32 key (`jax.random.PRNGKey`)."""
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return
    if dtype == jnp.uint32 and jnp.shape(key)[-1:] == (2,):
        return
    got = f"{key!r}" if dtype is None else f"an array of {dtype}{list(jnp.shape(key))}"
    raise TypeError(
        f"`{name}` must be a PRNG key such as `jax.random.key(0)`, got {got}"
        + (f"; pass None {none_means}" if none_means else "")
        + "."
    )
