"""Autodiff entry points that accept and return compressed tangents and cotangents.

Each entry point opens exactly one quax trace around the JAX transformation. Quax
values reach it only as pytree leaves (arguments, `Partial`s, Modules), never through
closures, and inputs that are not differentiated are closed over inside the trace so
that JAX gives them symbolic zero tangents instead of dense zeros.
"""

import functools as ft
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._core._trace import enter_trace
from .._differentiable import merge_structures, split_structures, through_views
from .._marks import _cotangents
from .._marks._matrix_view import unwrap_stored_views
from .._types._primitives import compress_p, outer_p
from ._arguments import (
    argnums_positions,
    as_pytree_callable,
    check_compressor_output,
    check_inexact_inputs,
    check_scalar_output,
    check_sequence,
    describe,
    dtype_of,
    is_value,
    returning_pair,
)


# ---------------------------------------------------------------------------------------
# Which inputs are differentiated


def _is_integer(x: Any) -> bool:
    return not jnp.issubdtype(dtype_of(x), jnp.inexact)


def _is_float0_zero(t: Any) -> bool:
    return isinstance(t, np.ndarray) and t.dtype == jax.dtypes.float0


class _Group:
    """The tangents of one primal subtree; deliberately not a pytree."""

    def __init__(self, tangents: list[Any]) -> None:
        self.tangents = tangents


def _tangent_leaves(primals: tuple, tangents: tuple) -> list[Any]:
    """One entry per primal leaf: its tangent, or `None` where it is not
    differentiated. A `None` in `tangents` may stand for a whole subtree."""
    if len(primals) != len(tangents):
        raise ValueError(
            f"`tangents` has {len(tangents)} entries but `primals` has {len(primals)}: "
            "give one tangent (or None) per primal."
        )
    none_or_value = lambda x: x is None or is_value(x)  # noqa: E731
    try:
        per_subtree = jtu.tree_map(
            lambda t, p: _Group([t] * len(jtu.tree_leaves(p, is_leaf=is_value))),
            tangents,
            primals,
            is_leaf=none_or_value,
        )
    except ValueError as error:
        raise ValueError(
            "`tangents` must have the pytree structure of `primals`, with `None` "
            f"for inputs that are not differentiated: {error}"
        ) from None
    groups = jtu.tree_leaves(per_subtree, is_leaf=lambda x: isinstance(x, _Group))
    return [t for group in groups for t in group.tangents]


def _check_tangent(index: int, primal: Any, tangent: Any) -> None:
    if _is_integer(primal):
        raise TypeError(
            f"Primal leaf {index} has integer dtype {dtype_of(primal)} and is a "
            "constant: "
            "pass `None` as its tangent."
        )
    p_shape, t_shape = jnp.shape(primal), jnp.shape(tangent)
    p_dtype, t_dtype = dtype_of(primal), dtype_of(tangent)
    if p_shape != t_shape or p_dtype != t_dtype:
        raise ValueError(
            f"Tangent leaf {index} is {t_dtype}{list(t_shape)} but its primal is "
            f"{p_dtype}{list(p_shape)}; a tangent must match its primal's shape and "
            "dtype (a compressed tangent through `.shape` and `.dtype`)."
        )


def _split(primals: tuple, tangents: tuple):
    leaves, treedef = jtu.tree_flatten(primals, is_leaf=is_value)
    tangent_leaves = _tangent_leaves(primals, tangents)
    active = []
    for index, (primal, tangent) in enumerate(zip(leaves, tangent_leaves)):
        if tangent is None or _is_float0_zero(tangent):
            continue
        _check_tangent(index, primal, tangent)
        active.append(index)
    return leaves, treedef, active, [tangent_leaves[i] for i in active]


def _with_active(fn, leaves, treedef, active):
    """`fn` as a function of the differentiated leaves only; the rest are closed
    over, so JAX gives them symbolic zero tangents."""

    def at(*active_leaves):
        full = list(leaves)
        for index, leaf in zip(active, active_leaves):
            full[index] = leaf
        return fn(*jtu.tree_unflatten(treedef, full))

    return at


# ---------------------------------------------------------------------------------------
# Forward mode


def jvp(
    fn: Callable,
    primals: Sequence[PyTree],
    tangents: Sequence[PyTree | None],
    *,
    has_aux: bool = False,
) -> tuple[PyTree, PyTree] | tuple[PyTree, PyTree, PyTree]:
    """Like `jax.jvp`, with compressed tangents in and out.

    **Arguments:**

    - `fn`: the function. It may be a `functools.partial`, `jax.tree_util.Partial`,
        `equinox.Partial`, a bound method or an `equinox.Module`; quax values it holds
        enter the trace as pytree leaves. A plain closure that captures a quax value
        is an error.
    - `primals`: a sequence of the positional arguments.
    - `tangents`: a sequence of the same structure. Each leaf is a dense array or a
        compressed value matching its primal's shape and dtype; `None` (for a leaf
        or a whole argument) means "not differentiated", and that input gets a
        symbolic zero tangent. Integer primals are constants: give them `None`.
    - `has_aux`: `fn` returns `(output, aux)`; aux is returned unchanged.

    **Returns:**

    `(primal_out, tangent_out)`, or `(primal_out, tangent_out, aux)`. Output tangents
    stay compressed wherever the rules of their type allow.
    """
    check_sequence("jvp", "primals", primals)
    check_sequence("jvp", "tangents", tangents)
    fn, primals = through_views(as_pytree_callable(fn), primals)
    leaves, treedef, active, active_tangents = _split(tuple(primals), tuple(tangents))

    def run(fn, leaves, active_tangents):
        if has_aux:
            fn = returning_pair(fn, "jvp")
        at = _with_active(fn, leaves, treedef, active)
        return jax.jvp(
            at, [leaves[i] for i in active], active_tangents, has_aux=has_aux
        )

    return enter_trace(run)(fn, leaves, active_tangents)


def partial_jvp(
    fn: Callable,
    primals: Sequence[PyTree],
    tangents: Sequence[PyTree | None],
    *,
    argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
) -> tuple[PyTree, PyTree] | tuple[PyTree, PyTree, PyTree]:
    """A JVP with respect to some arguments only.

    Either partially apply `fn` (with `functools.partial`, `jax.tree_util.Partial`,
    `equinox.Partial`, a bound method or a Module holding the fixed arguments; quax
    values among them stay single-wrapped) and pass the remaining arguments, or pass
    every argument in `primals` and select the differentiated ones with `argnums`.

    **Arguments:**

    - `fn`: the function, possibly partially applied.
    - `primals`: the positional arguments still to be passed.
    - `tangents`: with `argnums=None`, one per primal (or `None`); otherwise one per
        entry of `argnums`, in that order.
    - `argnums`: which positions of `primals` are differentiated.
    - `has_aux`: as in `jvp`.

    **Returns:**

    As `jvp`.
    """
    check_sequence("partial_jvp", "primals", primals)
    check_sequence("partial_jvp", "tangents", tangents)
    primals = tuple(primals)
    tangents = tuple(tangents)
    if argnums is not None:
        positions = argnums_positions(argnums)
        for position in positions:
            if not -len(primals) <= position < len(primals):
                raise ValueError(
                    f"`argnums` entry {position} is out of range for {len(primals)} "
                    "primals."
                )
        positions = tuple(p % len(primals) for p in positions)
        if len(set(positions)) != len(positions):
            raise ValueError(f"`argnums` has repeated entries: {argnums}.")
        if len(tangents) != len(positions):
            raise ValueError(
                f"`tangents` has {len(tangents)} entries but `argnums` selects "
                f"{len(positions)}: give one tangent per selected argument."
            )
        expanded: list[Any] = [None] * len(primals)
        for position, tangent in zip(positions, tangents):
            expanded[position] = tangent
        tangents = tuple(expanded)
    return jvp(fn, primals, tangents, has_aux=has_aux)


def linearize(fn: Callable, *primals: PyTree) -> tuple[PyTree, Callable]:
    """Like `jax.linearize`; the returned linear function accepts compressed tangents.

    **Arguments:**

    - `fn`: the function (as in `jvp`).
    - `*primals`: its arguments, all differentiated.

    **Returns:**

    `(primal_out, f_jvp)`, where `f_jvp(*tangents)` is the JVP at `primals`.
    """
    fn, primals = through_views(as_pytree_callable(fn), primals)
    out, linear = enter_trace(jax.linearize)(fn, *primals)
    return out, _apply_linear(linear, "tangents")


def _apply_linear(
    linear: Callable, what: str, finish: Callable[[PyTree], PyTree] = lambda x: x
) -> Callable:
    def apply(*args: PyTree) -> PyTree:
        return finish(enter_trace(linear)(*args))

    apply.__doc__ = f"Applies the linear map to {what}, which may be compressed."
    return apply


# ---------------------------------------------------------------------------------------
# Reverse mode


def vjp(fn: Callable, *primals: PyTree, has_aux: bool = False):
    """Like `jax.vjp`; the pullback accepts compressed cotangents and returns the
    cotangents that `compress_cotangent` marked as compressed values (and, for a
    weight marked through its matrix view by `quax_tangents.optax.mark`, the
    `LowRank` of that view, `(*batch, m, n)`, not of the weight's shape).

    **Arguments:**

    - `fn`: the function (as in `jvp`).
    - `*primals`: its arguments.
    - `has_aux`: as in `jax.vjp`.

    **Returns:**

    `(primal_out, pullback)` or `(primal_out, pullback, aux)`.
    """
    fn, primals = through_views(as_pytree_callable(fn), primals)

    def run(fn: Callable, *primals: Any) -> Any:
        if has_aux:
            fn = returning_pair(fn, "vjp")
        return jax.vjp(_cotangents.inner_layer(fn), *primals, has_aux=has_aux)

    result = _cotangents.traced_with_marks(lambda: enter_trace(run)(fn, *primals))
    pullback = _apply_linear(result[1], "cotangents", unwrap_stored_views)
    return (result[0], pullback, *result[2:])


def value_and_grad(
    fn: Callable, argnums: int | Sequence[int] = 0, *, has_aux: bool = False
) -> Callable:
    """Like `jax.value_and_grad`; gradients are compressed where `compress_cotangent`
    (or a rule) makes them so.

    **Arguments:**

    - `fn`: a function with a real scalar output (or `(output, aux)`).
    - `argnums`: which positional arguments to differentiate.
    - `has_aux`: as in `jax.value_and_grad`.

    **Returns:**

    A function returning `(value, grads)` or `((value, aux), grads)`, the gradients
    as `grad` returns them (the gradient of a weight marked through its matrix view
    is the `LowRank` of that view).
    """
    return _value_and_grad(fn, argnums, has_aux, "value_and_grad")


def _value_and_grad(
    fn: Callable, argnums: int | Sequence[int], has_aux: bool, entry: str
) -> Callable:
    positions = argnums_positions(argnums)
    single = not isinstance(argnums, (tuple, list))

    def value_and_grad_fn(*args: Any) -> Any:
        pytree_fn = as_pytree_callable(fn)
        for position in positions:
            if not -len(args) <= position < len(args):
                raise ValueError(
                    f"`argnums` {position} is out of range for {len(args)} arguments."
                )

        def run(pytree_fn, args):
            # A @differentiable argument is differentiated through its Tangent view.
            selected, split = split_structures(tuple(args[p] for p in positions))
            check_inexact_inputs(entry, positions, selected)

            def of_selected(*views):
                full = list(args)
                merged = merge_structures(views, split)
                for position, value in zip(positions, merged):
                    full[position] = value
                return pytree_fn(*full)

            if has_aux:
                of_selected = returning_pair(of_selected, entry)
            out, pullback, *aux = jax.vjp(
                _cotangents.inner_layer(of_selected), *selected, has_aux=has_aux
            )
            check_scalar_output(entry, out)
            grads = pullback(jnp.ones_like(out))
            value = (out, aux[0]) if has_aux else out
            return value, (grads[0] if single else tuple(grads))

        value, grads = _cotangents.traced_with_marks(
            lambda: enter_trace(run)(pytree_fn, args)
        )
        return value, unwrap_stored_views(grads)

    return value_and_grad_fn


def grad(
    fn: Callable, argnums: int | Sequence[int] = 0, *, has_aux: bool = False
) -> Callable:
    """Like `jax.grad`, with gradients that come back compressed where marked.

    The gradient of an argument is compressed where a mark on the way makes it so
    (`compress_cotangent`, `factored_matmul`, `projected_cotangent`,
    `factored_cotangent`, `sparse_rows_cotangent`, or a rule of a compressed type),
    and dense elsewhere. Under plain `jax.grad` the same function gives the same
    numbers as dense arrays.

    **Arguments:**

    - `fn`: a function whose output is a real (floating) scalar; with
        `has_aux=True`, a pair of that scalar and any auxiliary output. It may be a
        `functools.partial`, `jax.tree_util.Partial`, `equinox.Partial`, a bound
        method or an `equinox.Module`; quax values it holds enter the trace as pytree
        leaves. A plain closure that captures a quax value is a `TypeError`.
    - `argnums`: which positional arguments to differentiate: an `int` (default 0)
        or a sequence of `int`s. A differentiated argument is a pytree of floating
        arrays (an integer leaf is a `TypeError` naming it), or an instance of a
        `@differentiable` class, differentiated through its `Tangent` view.
    - `has_aux`: `fn` returns `(output, aux)`; `aux` is returned unchanged and not
        differentiated.

    **Returns:**

    A function taking the arguments of `fn` and returning the gradients: for an
    `int` `argnums`, the gradient of that argument, of its structure (a `Tangent`
    for a `@differentiable` class); for a sequence, a tuple with one per entry. Each
    leaf has its argument's shape, except the gradient of a weight that
    `quax_tangents.optax.mark` marked through its matrix view (`projected(dims=...)`):
    the `LowRank` of that view, `(*batch, m, n)`. With
    `has_aux=True` it returns `(gradients, aux)`. An output that is not a real scalar
    is a `TypeError` that points to `vjp`.
    """
    value_and_grad_fn = _value_and_grad(fn, argnums, has_aux, "grad")

    def grad_fn(*args: Any) -> Any:
        value, grads = value_and_grad_fn(*args)
        return (grads, value[1]) if has_aux else grads

    return grad_fn


# ---------------------------------------------------------------------------------------
# Marking where cotangents are compressed


@ft.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _compress_cotangent(x: Any, compressor: Callable) -> Any:
    return x


def _compress_cotangent_fwd(x: Any, compressor: Callable) -> tuple[Any, None]:
    return x, None


def _compress_cotangent_bwd(compressor: Callable, _: None, ct: Any) -> tuple[Any]:
    # A bwd rule may not return a quax value; a primitive whose quax rule builds one
    # can, because under the trace its output is a tracer.
    return (compress_p.bind(ct, compressor=compressor, batch_ndim=0),)


_compress_cotangent.defvjp(_compress_cotangent_fwd, _compress_cotangent_bwd)


def compress_cotangent(x: PyTree, compressor: Callable[[Any], Any]) -> PyTree:
    """The identity on `x`, whose cotangent is compressed on the way back.

    Under `quax_tangents.grad`, `value_and_grad` and `vjp`, the cotangent reaching
    `x` comes back as `compressor(cotangent)`, a compressed value. Anywhere else
    (for example plain `jax.grad`) it is the same value, materialised: dense code
    computes the same numbers.

    The dense cotangent is still formed before it is compressed: this saves memory
    and bytes downstream of `x` (accumulation, optimizer state, communication), not
    in the backward pass itself. For `x @ w`, `factored_matmul` never forms the
    dense weight gradient.

    **Arguments:**

    - `x`: an array or a pytree of arrays.
    - `compressor`: a function from a dense array to a compressed value, e.g.
        `functools.partial(quax_tangents.low_rank, rank=4)`. It must be hashable
        (functions and `functools.partial` of hashable arguments are).

    **Returns:**

    `x`, unchanged.
    """
    if not callable(compressor):
        raise TypeError(
            f"`compressor` must be a function from a dense array to a compressed "
            f"value, such as `functools.partial(quax_tangents.low_rank, rank=4)`; got "
            f"{describe(compressor)}."
        )
    try:
        hash(compressor)
    except TypeError:
        raise TypeError(
            "`compressor` must be hashable; use a function or `functools.partial` of "
            "one with hashable arguments."
        ) from None

    def mark(leaf: Any) -> Any:
        check_compressor_output(compressor, leaf)
        return _compress_cotangent(leaf, compressor)

    return jtu.tree_map(mark, x)


@jax.custom_vjp
def factored_matmul(x: Any, w: Any) -> Any:
    """`x @ w` whose weight cotangent is the exact low-rank `x^T ct`.

    For `x` of shape `(..., m)` and `w` of shape `(m, n)`, the cotangent of `w` is
    a sum of one outer product per row of `x`. Under `quax_tangents.grad` it comes
    back as a `LowRank` of rank `prod(x.shape[:-1])` (subject to the rank budget),
    and the `m x n` gradient is never formed. Elsewhere it is the dense gradient.

    **Arguments:**

    - `x`: floating array of shape `(..., m)`.
    - `w`: floating array of shape `(m, n)`.

    **Returns:**

    `x @ w`.
    """
    return jnp.matmul(x, w)


def _factored_matmul_fwd(x: Any, w: Any) -> tuple[Any, tuple[Any, Any]]:
    if jnp.ndim(w) != 2 or jnp.shape(x)[-1:] != jnp.shape(w)[:1]:
        raise ValueError(
            f"`factored_matmul` needs `x` of shape (..., m) and `w` of shape (m, n), "
            f"got {jnp.shape(x)} and {jnp.shape(w)}."
        )
    return jnp.matmul(x, w), (x, w)


def _factored_matmul_bwd(residuals: tuple[Any, Any], ct: Any) -> tuple[Any, Any]:
    x, w = residuals
    return jnp.matmul(ct, jnp.swapaxes(w, -1, -2)), outer_p.bind(x, ct, batch_ndim=0)


factored_matmul.defvjp(_factored_matmul_fwd, _factored_matmul_bwd)
