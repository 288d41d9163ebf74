"""Pieces shared by the compressing transformations: which leaves to compress,
per-device state, and argument checks."""

import math
import numbers
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import quax
from jax.extend import core as jax_core
from jaxtyping import Array, PyTree

from .._core._base import CompressedArray
from .._core._deprecation import warn_deprecated
from .._core._devices import axis_is_bound, device_varying
from .._distributed._collective import all_reduce


Filter = Callable[[Any], bool] | PyTree[bool] | None
AxisName = Hashable | tuple[Hashable, ...] | None


# ---------------------------------------------------------------------------------------
# Choosing the leaves to compress


def split_arrays(params: PyTree) -> tuple[PyTree, PyTree]:
    """`params` split as `equinox.partition(params, equinox.is_array)` splits a
    model: its arrays, and the other leaves (an Equinox layer's activation function,
    a dropout's rate), each tree holding `None` where the other holds a leaf. A
    `jax.ShapeDtypeStruct` (the parameters of `jax.eval_shape(init, key)`) counts
    as an array, which `equinox.is_array` does not."""
    return eqx.partition(params, _is_array_or_shape)


def _is_array_or_shape(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def with_others(loss_fn: Callable, others: PyTree) -> Callable:
    """`loss_fn(params, *args)` of the arrays of `split_arrays`, with the other
    leaves put back first. The arrays may be quax values (marked weights), which
    are pytrees themselves: the two trees are matched at the arrays' leaves."""
    if not jtu.tree_leaves(others):
        return loss_fn

    def leaf(x: Any) -> bool:
        return x is None or isinstance(x, quax.Value)

    def with_all_leaves(arrays: PyTree, *args: Any) -> Any:
        params = jtu.tree_map(
            lambda a, o: o if a is None else a, arrays, others, is_leaf=leaf
        )
        return loss_fn(params, *args)

    return with_all_leaves


def check_rate(min_compression_rate: Any) -> float:
    if isinstance(min_compression_rate, bool) or not isinstance(
        min_compression_rate, (int, float)
    ):
        raise TypeError(
            f"`min_compression_rate` must be a number, got {min_compression_rate!r}."
        )
    if not min_compression_rate > 0:
        raise ValueError(
            f"`min_compression_rate` must be positive, got {min_compression_rate!r}."
        )
    return float(min_compression_rate)


def filter_flags(filter: Filter, tree: PyTree) -> list[bool]:
    """One Python bool per array leaf of `tree`: whether `filter` selects it.

    `filter` takes what `project=` and `split=` take, as `optax.masked`'s mask does:
    None (every leaf), a pytree of bools with `tree`'s structure or a prefix of it, or
    a callable that maps the whole `tree` to one. A callable written per leaf (the
    older form, `lambda leaf: leaf.ndim == 2`) still works for one release, with a
    `DeprecationWarning`: it is recognised by failing on the whole tree, or by
    returning one bool for a tree of several leaves.
    """
    leaves = jtu.tree_leaves(tree)
    if filter is None:
        return [True] * len(leaves)
    if (
        callable(filter)
        and not isinstance(filter, eqx.Module)
        and _per_leaf(filter, tree)
    ):
        warn_deprecated(
            "filter=lambda leaf: ...",
            "filter=lambda updates: jax.tree.map(lambda leaf: ..., updates)",
            stacklevel=5,
        )
        return [bool(filter(leaf)) for leaf in leaves]
    flags = mask_flags(filter, tree, "filter")
    assert flags is not None
    return flags


def _per_leaf(filter: Callable, tree: PyTree) -> bool:
    """Whether `filter` was written for one leaf rather than the whole tree."""
    if len(jtu.tree_leaves(tree)) <= 1:
        return False  # the two readings agree
    try:
        out = filter(tree)
    except (AttributeError, TypeError, IndexError, KeyError):
        return True
    return isinstance(out, (bool, np.bool_))


def mask_flags(mask: Filter, tree: PyTree, name: str) -> list[bool] | None:
    """One Python bool per array leaf of `tree`, for a mask given as `optax.masked`
    takes it: a pytree of bools with `tree`'s structure or a prefix of it (an
    Equinox module included), or a callable that maps the whole `tree` to one.
    None for no mask."""
    if mask is None:
        return None
    hint = (
        "A callable is given the whole parameter tree (as `optax.masked`'s is): to "
        f"decide leaf by leaf, pass `{name}=lambda params: jax.tree.map(lambda x: "
        "x.ndim == 2, params)`."
    )
    if callable(mask) and not isinstance(mask, eqx.Module):
        try:
            mask = mask(tree)
        except (AttributeError, TypeError, IndexError, KeyError) as error:
            raise TypeError(
                f"`{name}` raised {type(error).__name__}: {error}. {hint}"
            ) from error
        if isinstance(mask, (bool, np.bool_)) and len(jtu.tree_leaves(tree)) > 1:
            # Written per leaf (`lambda leaf: leaf.ndim == 2` is False of a module
            # or a dict): it would choose all leaves or none, without a word.
            raise TypeError(
                f"`{name}` returned the single bool {bool(mask)} for the whole "
                f"parameter tree, which would choose all its leaves or none. {hint} "
                f"(`{name}=None` chooses the default leaves.)"
            )
    try:
        expanded = jtu.tree_map(
            lambda flag, subtree: jtu.tree_map(lambda _: flag, subtree), mask, tree
        )
    except ValueError as error:
        raise ValueError(
            f"`{name}` must be a pytree of bools with the structure of the "
            "parameters (or a prefix of it), or a callable that maps the parameters "
            f"to one, as for `optax.masked`: {error}"
        ) from error
    flags = jtu.tree_leaves(expanded)
    if not all(isinstance(flag, (bool, np.bool_)) for flag in flags):
        kinds = sorted({type(flag).__name__ for flag in flags})
        raise TypeError(
            f"`{name}` must hold Python bools, one per parameter leaf, got {kinds}. "
            f"{hint}"
        )
    return [bool(flag) for flag in flags]


def dense_bytes(leaf: Any) -> int:
    return math.prod(jnp.shape(leaf)) * jnp.dtype(leaf.dtype).itemsize


def compressed_bytes(compressor: Callable, leaf: Any) -> int | None:
    """Bytes of `compressor(leaf)`, from shapes only; None if it rejects the shape."""
    struct = jax.ShapeDtypeStruct(jnp.shape(leaf), leaf.dtype)
    try:
        out = jax.eval_shape(compressor, struct)
    except ValueError:
        return None
    if not isinstance(out, CompressedArray):
        raise TypeError(
            "`compressor` must return a compressed value (LowRank, Sparse, Quantized "
            f"or SignNorm), got {type(out).__name__}."
        )
    return out.nbytes


def saves_enough(dense: int, compressed: int | None, rate: float) -> bool:
    return compressed is not None and dense >= rate * max(compressed, 1)


def compress_plan(
    compressor: Callable, filter: Filter, rate: float, tree: PyTree
) -> list[bool]:
    flags = filter_flags(filter, tree)
    return [
        flag
        and jnp.ndim(leaf) >= 2
        and saves_enough(dense_bytes(leaf), compressed_bytes(compressor, leaf), rate)
        for flag, leaf in zip(flags, jtu.tree_leaves(tree))
    ]


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix a leaf is compressed as: every dim but the last becomes rows, as for
    a convolution kernel `(h, w, in, out)` -> `(h * w * in, out)`."""
    return math.prod(shape[:-1]), shape[-1]


def powersgd_plan(rank: int, filter: Filter, rate: float, tree: PyTree) -> list[bool]:
    flags = filter_flags(filter, tree)
    plan = []
    for flag, leaf in zip(flags, jtu.tree_leaves(tree)):
        if not flag or jnp.ndim(leaf) < 2:
            plan.append(False)
            continue
        m, n = matrix_shape(jnp.shape(leaf))
        plan.append(rank <= min(m, n) and m * n >= rate * rank * (m + n))
    return plan


# ---------------------------------------------------------------------------------------
# Shared pieces


def per_device_zeros(leaf: Any, axis_name: AxisName) -> Array:
    """Zeros for a per-device state field; typed as varying when created inside the
    `shard_map` body, so that a `scan` carrying the state keeps one type."""
    zeros = jnp.zeros(jnp.shape(leaf), leaf.dtype)
    if axis_name is not None and axis_is_bound(axis_name):
        zeros = device_varying(zeros, axis_name)
    return zeros


def fields(plan: list[bool], leaves: list[Any], make: Callable) -> list[Any]:
    return [make(leaf) if chosen else None for chosen, leaf in zip(plan, leaves)]


def flat_fields(tree: PyTree, treedef: Any) -> list[Any]:
    """A state field's entries aligned with the update leaves (None where unused)."""
    if tree is None:
        return [None] * treedef.num_leaves
    return treedef.flatten_up_to(tree)


def materialised(x: Any) -> Array:
    return x.materialise() if isinstance(x, CompressedArray) else x


def mean_over_devices(x: Array, axis_name: AxisName) -> Array:
    if axis_name is None:
        return x
    return all_reduce(x, axis_name, mean=True)


def check_axis_name(axis_name: AxisName) -> None:
    if axis_name is not None and not axis_is_bound(axis_name):
        raise NameError(
            f"`axis_name={axis_name!r}` is not bound here: with an `axis_name`, call "
            "`update` inside the body of `jax.shard_map` over that mesh axis."
        )


def check_int(name: str, value: Any, low: int) -> int:
    # Any integer (`np.int64` from a config array too), never a bool or a float.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {value!r}.")
    value = int(value)
    if value < low:
        raise ValueError(f"`{name}` must be at least {low}, got {value}.")
    return value


# optax's error for a transformation that needs `params` and was given none.
_NEEDS_PARAMS = "requires the current value of parameters"


def base_update(
    base: Any, updates: PyTree, state: Any, where: str
) -> tuple[PyTree, Any]:
    """`base.update(updates, state)` for a `base` that runs on gradients' small
    factors, which have no parameters of their shape: one that reads them (weight
    decay) is refused by name."""
    try:
        return base.update(updates, state)
    except ValueError as error:
        if _NEEDS_PARAMS not in str(error):
            raise
        raise ValueError(
            f"{where}: `base` reads the parameters (as `optax.adamw`'s weight decay "
            "and `optax.add_decayed_weights` do), but it runs on the gradients' "
            "small factors, which have no parameters of their shape. Pass a `base` "
            "that takes none, such as `optax.scale_by_adam()` (the default of "
            "`quax_tangents.optax.galore`, with `learning_rate=`), and for "
            "`optax.adamw`'s decoupled weight decay pass `weight_decay=` and "
            "`learning_rate=` to `quax_tangents.optax.galore`."
        ) from error


# ---------------------------------------------------------------------------------------
# Tracing once


def traced(fn: Callable, *args: Any) -> tuple[Callable, Any]:
    """`fn` traced once at `args`: a function that replays its equations on other
    values of the same types (as tracing `fn` again would emit them, without running
    its Python again), and the shapes of its result."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    run, out_tree = jax_core.jaxpr_as_fun(closed), jtu.tree_structure(shapes)

    def replay(*args: Any) -> Any:
        return jtu.tree_unflatten(out_tree, run(*jtu.tree_leaves(args)))

    return replay, shapes
