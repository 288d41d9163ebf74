"""The arguments of the autodiff entry points: callables made into pytrees (refusing
closures over quax values), and checks whose errors name the argument and the fix."""

import functools as ft
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import quax


# ---------------------------------------------------------------------------------------
# Values


def is_value(x: Any) -> bool:
    return isinstance(x, quax.Value)


def dtype_of(x: Any) -> Any:
    return x.dtype if is_value(x) else jnp.result_type(x)


def describe(x: Any) -> str:
    """`x` as an error message shows it: type, and dtype and shape for arrays."""
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} entries"
    if is_value(x) or hasattr(x, "shape") and hasattr(x, "dtype"):
        kind = type(x).__name__ if is_value(x) else "an array"
        return f"{kind} {dtype_of(x)}{list(jnp.shape(x))}"
    name = type(x).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


# ---------------------------------------------------------------------------------------
# Making callables into pytrees, and refusing closures over quax values


def _values_in(obj: Any, depth: int = 0) -> bool:
    """Whether `obj` holds a quax value, looking into closures of nested functions."""
    if depth > 4:
        return False
    if isinstance(obj, types.FunctionType):
        cells = obj.__closure__ or ()
        return any(_values_in(_cell_contents(c), depth + 1) for c in cells)
    try:
        leaves = jtu.tree_leaves(obj, is_leaf=is_value)
    except Exception:  # noqa: BLE001 - an unflattenable object holds no leaves we see
        return False
    return any(is_value(leaf) for leaf in leaves)


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _captured(fn: types.FunctionType) -> list[tuple[str, Any]]:
    """The closure cells and the module globals that `fn`'s code refers to."""
    captured = [
        (var, _cell_contents(cell))
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())
    ]
    captured += [
        (var, fn.__globals__[var])
        for var in fn.__code__.co_names
        if var in fn.__globals__
    ]
    return captured


def _check_no_captured_values(fn: Callable, name: str) -> None:
    if not isinstance(fn, types.FunctionType):
        return
    for var, value in _captured(fn):
        if not isinstance(value, types.ModuleType) and _values_in(value):
            raise TypeError(
                f"`{name}` captures the quax value `{var}` (in a closure or as a "
                "global). A captured value cannot enter the trace, so it would be "
                "treated as a constant of the wrong type. Pass it as an argument "
                "instead, for example "
                f"`functools.partial(f, {var})`, `equinox.Partial(f, {var})` or "
                f"`jax.tree_util.Partial(f, {var})`, or make it a field of an "
                "`equinox.Module`."
            )


def as_pytree_callable(fn: Callable, name: str = "fn") -> Callable:
    """Turns `fn` into a callable whose quax values are pytree leaves.

    `functools.partial` and bound methods of plain objects become
    `jax.tree_util.Partial`s; `jax.tree_util.Partial`, `equinox.Partial`, bound methods
    of Modules and Modules themselves are pytrees already. Plain closures over quax
    values are refused.
    """
    if isinstance(fn, ft.partial) and not isinstance(fn, jtu.Partial):
        inner = as_pytree_callable(fn.func, name)
        return jtu.Partial(inner, *fn.args, **fn.keywords)
    if isinstance(fn, types.MethodType):
        _check_no_captured_values(fn.__func__, name)
        return jtu.Partial(fn.__func__, fn.__self__)
    if isinstance(fn, jtu.Partial):
        _check_no_captured_values(fn.func, name)
        return fn
    if not callable(fn):
        raise TypeError(f"`{name}` must be callable, got {type(fn).__name__}.")
    _check_no_captured_values(fn, name)
    return fn


# ---------------------------------------------------------------------------------------
# Checks


def check_sequence(entry: str, name: str, value: Any) -> None:
    if not isinstance(value, (tuple, list)):
        raise TypeError(
            f"`{entry}` takes `{name}` as a tuple or list with one entry per argument "
            f"of `fn`, got {describe(value)}. For a single argument `x` with "
            f"tangent `t`, write `{entry}(fn, (x,), (t,))`."
        )


def returning_pair(fn: Callable, entry: str) -> Callable:
    """`fn`, checked to return `(output, aux)` as `has_aux=True` promises."""

    def checked(*args: Any) -> Any:
        out = fn(*args)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(
                f"`{entry}` was given `has_aux=True`, so `fn` must return a pair "
                f"`(output, aux)`, but it returned {describe(out)}. Return "
                "`(output, aux)`, or drop `has_aux=True`."
            )
        return out

    return checked


def _is_jax_input(x: Any) -> bool:
    """Whether JAX traces `x` as an input: an array, a scalar or a quax value."""
    scalars = (bool, int, float, complex, np.generic)
    return is_value(x) or isinstance(x, (jax.Array, np.ndarray, *scalars))


def check_inexact_inputs(entry: str, positions: tuple, selected: tuple) -> None:
    """Like `jax.grad`, refuse integer arrays rather than return `float0` zeros.

    Python bools and ints stay allowed: in a Module they are settings (a dropout's
    `inference` flag, say), and their gradient is a `float0` zero as in JAX's
    `allow_int=True`."""
    for position, arg in zip(positions, selected):
        for path, leaf in jtu.tree_leaves_with_path(arg, is_leaf=is_value):
            which = f"its leaf {jtu.keystr(path)}" if path else "it"
            if not _is_jax_input(leaf):
                raise TypeError(
                    f"`{entry}` differentiates argument {position} (selected by "
                    f"`argnums`), but {which} is {describe(leaf)}, which JAX cannot "
                    "trace (an Equinox layer's activation function, say). Split the "
                    "model first, `arrays, static = eqx.partition(model, "
                    "eqx.is_inexact_array)`, and differentiate `lambda arrays: "
                    "loss(eqx.combine(arrays, static))`; `qto.galore(...)"
                    ".value_and_grad` takes a whole Equinox model."
                )
            if isinstance(leaf, (bool, int)) or jnp.issubdtype(
                dtype_of(leaf), jnp.inexact
            ):
                continue
            raise TypeError(
                f"`{entry}` differentiates argument {position} (selected by "
                f"`argnums`), but {which} has dtype {dtype_of(leaf)}; gradients need "
                "floating or complex inputs. Cast it (e.g. `jnp.asarray(x, jnp.float32)`), or pass integer "
                "data (labels, step counts) in an argument that `argnums` does not "
                "select, or in a `NoDerivative` field of a `@differentiable` model."
            )


def argnums_positions(argnums: Any) -> tuple[int, ...]:
    """`argnums` as a tuple of positions: an int, or a sequence of ints."""
    is_int = lambda a: isinstance(a, (int, np.integer)) and not isinstance(a, bool)  # noqa: E731
    if is_int(argnums):
        return (int(argnums),)
    if isinstance(argnums, (tuple, list)) and argnums and all(map(is_int, argnums)):
        return tuple(int(a) for a in argnums)
    raise TypeError(
        "`argnums` must be an int or a non-empty tuple of ints (the positions of the "
        f"differentiated arguments), got {argnums!r}."
    )


def check_scalar_output(entry: str, out: Any) -> None:
    if isinstance(out, (tuple, list)):
        # Before `jnp.ndim`, which would read a tuple of traced values as an array.
        raise TypeError(
            f"`{entry}` needs a function with a real scalar output, got a "
            f"{type(out).__name__} of {len(out)}. For a function that returns "
            "`(loss, aux)`, pass `has_aux=True`."
        )
    if not (jnp.ndim(out) == 0 and jnp.issubdtype(jnp.result_type(out), jnp.floating)):
        raise TypeError(
            f"`{entry}` needs a function with a real scalar output, got "
            f"{jnp.result_type(out)}{list(jnp.shape(out))}. Use `vjp` for other outputs."
        )


def check_compressor_output(compressor: Callable, x: Any) -> None:
    """The cotangent of `x` has its shape and dtype, and so must the compressed
    value: checked by evaluating `compressor` abstractly when `compress_cotangent` is
    called, rather than deep in the backward pass."""
    dense = jax.ShapeDtypeStruct(jnp.shape(x), dtype_of(x))
    try:
        out = jax.eval_shape(compressor, dense)
    except Exception as error:
        error.add_note(
            f"(raised by `compressor` given a dense {dense.dtype}{list(dense.shape)} "
            "array, as the cotangent of `x` will be)"
        )
        raise
    expected = f"{dense.dtype}{list(dense.shape)}"
    if not is_value(out):
        raise TypeError(
            f"`compressor` must return a compressed value (such as a `LowRank`) for "
            f"the cotangent of `x`, {expected}, but returned {describe(out)}. A "
            "dense result would change the gradient without compressing it."
        )
    got = f"{out.dtype}{list(out.shape)}"
    if got != expected:
        raise ValueError(
            f"`compressor` must return a value of the cotangent's shape and dtype: "
            f"expected {expected} (those of `x`), got a {type(out).__name__} of "
            f"{got}."
        )
