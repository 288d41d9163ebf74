"""A generic compressor with error feedback (EF, EF21) as an optax transformation."""

import functools as ft
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import Array, PyTree

from .._base import CompressedArray
from .._collective import GatherSum, all_reduce
from ._common import (
    AxisName,
    Filter,
    check_axis_name,
    check_rate,
    compress_plan,
    fields,
    flat_fields,
    materialised,
    mean_over_devices,
    per_device_zeros,
)


ErrorFeedback = Literal["ef", "ef21"] | None


class CompressState(NamedTuple):
    """State of [`quax_tangents.optax.compress`][]. Each field holds one array per
    compressed leaf and `None` for leaves that pass through uncompressed.

    - `error`: with `error_feedback="ef"`, what compression dropped so far, added to
        the next update before compressing. Per device.
    - `estimate`: with `"ef21"`, this device's running estimate of its gradient.
        Per device.
    - `aggregate`: with `"ef21"` and an `axis_name`, the mean of the estimates over
        devices, which every device keeps identically.
    """

    error: PyTree
    estimate: PyTree
    aggregate: PyTree


def compress(
    compressor: Callable[[Array], CompressedArray],
    *,
    error_feedback: ErrorFeedback = "ef",
    min_compression_rate: float = 2.0,
    filter: Filter = None,
    axis_name: AxisName = None,
) -> optax.GradientTransformation:
    """Compresses each update leaf with `compressor`, optionally with error feedback,
    and emits the dense value of the compressed update.

    A leaf is compressed when `filter` selects it, it has at least two dims, and
    compression saves at least `min_compression_rate` (dense bytes / compressed bytes,
    computed from shapes). Leaves that `compressor` rejects (raises `ValueError` for
    their shape) are skipped the same way. Other leaves pass through (averaged over
    devices with `axis_name`).

    Error feedback, per compressed leaf `g` with compressor `C`:

    - `"ef"` (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019): compress
        `v = g + e`, emit `C(v)`, carry `e <- v - C(v)`. The running sum of emitted
        updates equals the running sum of `g` minus the current `e`.
    - `"ef21"` (Richtarik et al. 2021): keep an estimate `h`, compress the change
        `C(g - h)`, set `h <- h + C(g - h)`, emit `h` (with `axis_name`, the mean of
        the devices' estimates, kept incrementally from the compressed changes).
    - `None`: emit `C(g)`; biased compressors then lose what they drop for good.

    With `axis_name`, call `update` inside `jax.shard_map`: each device compresses its
    own gradient and the compressed values are averaged with
    [`quax_tangents.all_reduce`][] (`GatherSum`, an all-gather of the compressed
    fields), so no dense all-reduce of a compressed leaf runs. Call `init` inside the
    body too, and see [`quax_tangents.optax.partition_specs`][].

    **Arguments:**

    - `compressor`: a function from a dense array to a compressed value, e.g.
        `lambda g: qt.top_k(g, 0.01)`, `qt.sign_norm` or
        `functools.partial(qt.quantize, bits=8)`.
    - `error_feedback`: `"ef"`, `"ef21"` or `None`.
    - `min_compression_rate`: the least `dense / compressed` bytes ratio worth
        compressing for.
    - `filter`: which leaves may be compressed: `None` (all), a callable from a leaf to
        a bool, or a pytree of bools (the updates' structure or a prefix).
    - `axis_name`: the mesh axis to average over, or `None` on one device.

    **Returns:**

    An `optax.GradientTransformation` whose state is a
    [`quax_tangents.optax.CompressState`][].
    """
    if error_feedback not in ("ef", "ef21", None):
        raise ValueError(
            f"`error_feedback` must be 'ef', 'ef21' or None, got {error_feedback!r}."
        )
    if not callable(compressor):
        raise TypeError(f"`compressor` must be callable, got {compressor!r}.")
    rate = check_rate(min_compression_rate)
    plan_of = ft.partial(compress_plan, compressor, filter, rate)

    def init(params: PyTree) -> CompressState:
        leaves, treedef = jtu.tree_flatten(params)
        plan = plan_of(params)
        per_device = lambda leaf: per_device_zeros(leaf, axis_name)  # noqa: E731
        replicated = lambda leaf: jnp.zeros(jnp.shape(leaf), leaf.dtype)  # noqa: E731
        error = estimate = aggregate = None
        if error_feedback == "ef":
            error = treedef.unflatten(fields(plan, leaves, per_device))
        if error_feedback == "ef21":
            estimate = treedef.unflatten(fields(plan, leaves, per_device))
            if axis_name is not None:
                aggregate = treedef.unflatten(fields(plan, leaves, replicated))
        return CompressState(error, estimate, aggregate)

    def emitted(c: CompressedArray) -> Array:
        if axis_name is None:
            return c.materialise()
        return materialised(all_reduce(c, axis_name, GatherSum(), mean=True))

    def update_leaf(g, error, estimate, aggregate):
        if error_feedback == "ef":
            v = g + error
            c = compressor(v)
            return _dense(emitted(c), g), (v - c.materialise(), None, None)
        if error_feedback == "ef21":
            c = compressor(g - estimate)
            estimate = estimate + c.materialise()
            if axis_name is None:
                return estimate, (None, estimate, None)
            aggregate = aggregate + emitted(c)
            return aggregate, (None, estimate, aggregate)
        return _dense(emitted(compressor(g)), g), (None, None, None)

    def update(updates, state, params=None):
        del params
        check_axis_name(axis_name)
        leaves, treedef = jtu.tree_flatten(updates)
        plan = plan_of(updates)
        fields = [flat_fields(tree, treedef) for tree in state]
        out, new_fields = [], [[], [], []]
        for i, (chosen, g) in enumerate(zip(plan, leaves)):
            if chosen:
                u, leaf_state = update_leaf(g, *(field[i] for field in fields))
            else:
                u, leaf_state = mean_over_devices(g, axis_name), (None, None, None)
            out.append(u)
            for new, value in zip(new_fields, leaf_state):
                new.append(value)
        new_state = CompressState(
            *(
                None if tree is None else treedef.unflatten(values)
                for tree, values in zip(state, new_fields)
            )
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)


def _dense(x: Any, like: Array) -> Array:
    return jnp.asarray(x).astype(like.dtype)
