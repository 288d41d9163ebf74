"""Optax gradient transformations that compress updates: a generic compressor with
error feedback (EF, EF21), and PowerSGD.

Each transformation emits *dense* updates: the materialised compressed value, or the
mean over devices of the compressed values. Generic optax transformations (`adam`,
`sgd`, `apply_updates`) map over array leaves, and handed a compressed value they would
scale its factors or indices instead of the array it represents. The bytes that
compression saves are those on the wire: give `axis_name` and call the transformation
inside a `jax.shard_map` body, and the only collectives it runs move compressed fields.

With `axis_name`, part of the state differs per device (the carried errors). Call
`init` inside the `shard_map` body, and pass the state in and out of `shard_map` with
the specs of [`quax_tangents.optax.partition_specs`][]:

```python
tx = optax.chain(qto.powersgd(4, axis_name="data"), optax.adam(1e-3))
state_specs = qto.partition_specs(jax.eval_shape(tx.init, params), "data")
init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_specs)

def step(params, state, batch):  # runs on each device
    grads = jax.grad(loss)(qt.device_varying(params, "data"), batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
```
"""

import functools as ft
import math
from collections.abc import Callable, Hashable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jax import lax
from jax.sharding import PartitionSpec
from jaxtyping import Array, PyTree

from ._base import CompressedArray
from ._collective import (
    GatherSum,
    all_reduce,
    axis_is_bound,
    device_varying,
    power_rounds,
    start_q,
)


__all__ = [
    "CompressState",
    "PowerSGDState",
    "compress",
    "partition_specs",
    "powersgd",
]

ErrorFeedback = Literal["ef", "ef21"] | None
Filter = Callable[[Any], bool] | PyTree[bool] | None
AxisName = Hashable | tuple[Hashable, ...] | None


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


class PowerSGDState(NamedTuple):
    """State of [`quax_tangents.optax.powersgd`][].

    - `count`: int32 number of updates so far.
    - `q`: with `warm_start`, the `Q` factor `(n, r)` of each compressed leaf (the
        same on every device), which starts the next step's power iteration.
    - `error`: with `error_feedback`, the carried error of each compressed leaf.
        Per device.
    """

    count: Array
    q: PyTree
    error: PyTree


# ---------------------------------------------------------------------------------------
# Choosing the leaves to compress


def _check_rate(min_compression_rate: Any) -> float:
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


def _filter_flags(filter: Filter, tree: PyTree) -> list[bool]:
    """One Python bool per array leaf of `tree`: whether `filter` selects it.

    `filter` is None (every leaf), a callable from a leaf to a bool, or a pytree of
    bools that is `tree`'s structure or a prefix of it.
    """
    leaves = jtu.tree_leaves(tree)
    if filter is None:
        return [True] * len(leaves)
    if callable(filter):
        return [bool(filter(leaf)) for leaf in leaves]
    try:
        expanded = jtu.tree_map(
            lambda flag, subtree: jtu.tree_map(lambda _: flag, subtree),
            filter,
            tree,
        )
    except ValueError as error:
        raise ValueError(
            "`filter` must be a callable or a pytree of bools with the structure of "
            "the updates (or a prefix of it)."
        ) from error
    flags = jtu.tree_leaves(expanded)
    if not all(isinstance(flag, bool) for flag in flags):
        raise TypeError("A pytree `filter` must hold Python bools.")
    return flags


def _dense_bytes(leaf: Any) -> int:
    return math.prod(jnp.shape(leaf)) * jnp.dtype(leaf.dtype).itemsize


def _compressed_bytes(compressor: Callable, leaf: Any) -> int | None:
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
    return sum(_dense_bytes(field) for field in jtu.tree_leaves(out))


def _saves_enough(dense: int, compressed: int | None, rate: float) -> bool:
    return compressed is not None and dense >= rate * max(compressed, 1)


def _compress_plan(
    compressor: Callable, filter: Filter, rate: float, tree: PyTree
) -> list[bool]:
    flags = _filter_flags(filter, tree)
    return [
        flag
        and jnp.ndim(leaf) >= 2
        and _saves_enough(_dense_bytes(leaf), _compressed_bytes(compressor, leaf), rate)
        for flag, leaf in zip(flags, jtu.tree_leaves(tree))
    ]


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix a leaf is compressed as: every dim but the last becomes rows, as for
    a convolution kernel `(h, w, in, out)` -> `(h * w * in, out)`."""
    return math.prod(shape[:-1]), shape[-1]


def _powersgd_plan(rank: int, filter: Filter, rate: float, tree: PyTree) -> list[bool]:
    flags = _filter_flags(filter, tree)
    plan = []
    for flag, leaf in zip(flags, jtu.tree_leaves(tree)):
        if not flag or jnp.ndim(leaf) < 2:
            plan.append(False)
            continue
        m, n = _matrix_shape(jnp.shape(leaf))
        plan.append(rank <= min(m, n) and m * n >= rate * rank * (m + n))
    return plan


# ---------------------------------------------------------------------------------------
# Shared pieces


def _per_device_zeros(leaf: Any, axis_name: AxisName) -> Array:
    """Zeros for a per-device state field; typed as varying when created inside the
    `shard_map` body, so that a `scan` carrying the state keeps one type."""
    zeros = jnp.zeros(jnp.shape(leaf), leaf.dtype)
    if axis_name is not None and axis_is_bound(axis_name):
        zeros = device_varying(zeros, axis_name)
    return zeros


def _fields(plan: list[bool], leaves: list[Any], make: Callable) -> list[Any]:
    return [make(leaf) if chosen else None for chosen, leaf in zip(plan, leaves)]


def _flat_fields(tree: PyTree, treedef: Any) -> list[Any]:
    """A state field's entries aligned with the update leaves (None where unused)."""
    if tree is None:
        return [None] * treedef.num_leaves
    return treedef.flatten_up_to(tree)


def _materialised(x: Any) -> Array:
    return x.materialise() if isinstance(x, CompressedArray) else x


def _mean_over_devices(x: Array, axis_name: AxisName) -> Array:
    if axis_name is None:
        return x
    return all_reduce(x, axis_name, mean=True)


def _check_axis_name(axis_name: AxisName) -> None:
    if axis_name is not None and not axis_is_bound(axis_name):
        raise NameError(
            f"`axis_name={axis_name!r}` is not bound here: with an `axis_name`, call "
            "`update` inside the body of `jax.shard_map` over that mesh axis."
        )


# ---------------------------------------------------------------------------------------
# compress


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
    rate = _check_rate(min_compression_rate)
    plan_of = ft.partial(_compress_plan, compressor, filter, rate)

    def init(params: PyTree) -> CompressState:
        leaves, treedef = jtu.tree_flatten(params)
        plan = plan_of(params)
        per_device = lambda leaf: _per_device_zeros(leaf, axis_name)  # noqa: E731
        replicated = lambda leaf: jnp.zeros(jnp.shape(leaf), leaf.dtype)  # noqa: E731
        error = estimate = aggregate = None
        if error_feedback == "ef":
            error = treedef.unflatten(_fields(plan, leaves, per_device))
        if error_feedback == "ef21":
            estimate = treedef.unflatten(_fields(plan, leaves, per_device))
            if axis_name is not None:
                aggregate = treedef.unflatten(_fields(plan, leaves, replicated))
        return CompressState(error, estimate, aggregate)

    def emitted(c: CompressedArray) -> Array:
        if axis_name is None:
            return c.materialise()
        return _materialised(all_reduce(c, axis_name, GatherSum(), mean=True))

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
        _check_axis_name(axis_name)
        leaves, treedef = jtu.tree_flatten(updates)
        plan = plan_of(updates)
        fields = [_flat_fields(tree, treedef) for tree in state]
        out, new_fields = [], [[], [], []]
        for i, (chosen, g) in enumerate(zip(plan, leaves)):
            if chosen:
                u, leaf_state = update_leaf(g, *(field[i] for field in fields))
            else:
                u, leaf_state = _mean_over_devices(g, axis_name), (None, None, None)
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


# ---------------------------------------------------------------------------------------
# PowerSGD


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {value!r}.")
    if value < low:
        raise ValueError(f"`{name}` must be at least {low}, got {value}.")
    return value


def powersgd(
    rank: int,
    *,
    iters: int = 1,
    warm_start: bool = True,
    start_iter: int = 0,
    error_feedback: bool = True,
    min_compression_rate: float = 2.0,
    filter: Filter = None,
    axis_name: AxisName = None,
    seed: int = 0,
) -> optax.GradientTransformation:
    """PowerSGD (Vogels et al., 2019): a rank-`rank` approximation of each matrix
    update by power iteration, with error feedback and a warm-started `Q`.

    Each compressed leaf is viewed as a matrix `M` (every dim but the last as rows; a
    matrix stays as it is). With error feedback `M = g + e`. Each of `iters` rounds
    computes `P = M Q`, averages it over devices, orthonormalises it (Gram-Schmidt
    that leaves zero columns zero, so rank 1 and 2 and zero gradients are safe),
    computes `Q = M^T P` and averages that. The update is `P Q^T`; the new error is
    `M - P Q^T`. Per matrix and round only `rank * (m + n)` elements of the gradient's
    dtype cross the wire (the products run in at least float32).

    `Q` starts as a standard normal matrix drawn from `seed` (and the leaf's position),
    so it is identical on every device without communication. With `warm_start` the
    last `Q` starts the next step; without it a new `Q` is drawn each step.

    Leaves with fewer than two dims, and matrices where `m * n < min_compression_rate *
    rank * (m + n)` (or `rank > min(m, n)`), are averaged densely, as in PyTorch's
    PowerSGD hook. For the first `start_iter` updates every leaf is averaged densely
    (and the error stays zero).

    **Arguments:**

    - `rank`: the rank `r` of each compressed update.
    - `iters`: power-iteration rounds per step.
    - `warm_start`: reuse the last `Q`.
    - `start_iter`: dense updates before compression starts.
    - `error_feedback`: carry the compression error into the next step.
    - `min_compression_rate`: the least `m n / (r (m + n))` worth compressing for.
    - `filter`: which leaves may be compressed: `None` (all), a callable from a leaf to
        a bool, or a pytree of bools.
    - `axis_name`: the mesh axis to average over inside `jax.shard_map`, or `None`.
    - `seed`: seed of the starting `Q`.

    **Returns:**

    An `optax.GradientTransformation` whose state is a
    [`quax_tangents.optax.PowerSGDState`][].
    """
    rank = _check_int("rank", rank, 1)
    iters = _check_int("iters", iters, 1)
    start_iter = _check_int("start_iter", start_iter, 0)
    seed = _check_int("seed", seed, 0)
    rate = _check_rate(min_compression_rate)
    plan_of = ft.partial(_powersgd_plan, rank, filter, rate)

    def fresh_q(index: int, leaf: Any, count: Array | None) -> Array:
        key = jax.random.fold_in(jax.random.key(seed), index)
        if count is not None:
            key = jax.random.fold_in(key, count)
        _, n = _matrix_shape(jnp.shape(leaf))
        return start_q(key, (n, rank), jnp.promote_types(leaf.dtype, jnp.float32))

    def init(params: PyTree) -> PowerSGDState:
        leaves, treedef = jtu.tree_flatten(params)
        plan = plan_of(params)
        q = error = None
        if warm_start:
            q = treedef.unflatten(
                [
                    fresh_q(i, leaf, None) if chosen else None
                    for i, (chosen, leaf) in enumerate(zip(plan, leaves))
                ]
            )
        if error_feedback:
            error = treedef.unflatten(
                _fields(plan, leaves, lambda leaf: _per_device_zeros(leaf, axis_name))
            )
        return PowerSGDState(jnp.zeros((), jnp.int32), q, error)

    def reduce(x: Array) -> Array:
        return x if axis_name is None else all_reduce(x, axis_name, mean=True)

    def compress_leaf(index, g, q, error, count):
        shape = jnp.shape(g)
        work = jnp.promote_types(g.dtype, jnp.float32)
        matrix = g.reshape(_matrix_shape(shape)).astype(work)
        if error_feedback:
            matrix = matrix + error.reshape(matrix.shape).astype(work)
        start = q if warm_start else fresh_q(index, g, count)
        # Computed in float32, sent in the gradient's own dtype.
        p, q_new = power_rounds(
            lambda q: matrix @ q,
            lambda p: matrix.T @ p,
            start,
            iters,
            lambda a: reduce(a.astype(g.dtype)).astype(work),
        )
        approx = p @ q_new.T
        new_error = None
        if error_feedback:
            new_error = (matrix - approx).reshape(shape).astype(g.dtype)
        return (
            approx.reshape(shape).astype(g.dtype),
            (q_new if warm_start else None),
            new_error,
        )

    def compressed_step(plan, leaves, qs, errors, count):
        out, new_qs, new_errors = [], [], []
        for i, (chosen, g) in enumerate(zip(plan, leaves)):
            if chosen:
                u, q, e = compress_leaf(i, g, qs[i], errors[i], count)
            else:
                u, q, e = reduce(g), None, None
            out.append(u)
            new_qs.append(q)
            new_errors.append(e)
        return out, new_qs, new_errors

    def dense_step(leaves, qs, errors):
        return [reduce(g) for g in leaves], qs, errors

    def update(updates, state, params=None):
        del params
        _check_axis_name(axis_name)
        leaves, treedef = jtu.tree_flatten(updates)
        plan = plan_of(updates)
        qs = _flat_fields(state.q, treedef)
        errors = _flat_fields(state.error, treedef)
        count = state.count
        if start_iter == 0:
            out, qs, errors = compressed_step(plan, leaves, qs, errors, count)
        else:
            out, qs, errors = lax.cond(
                count >= start_iter,
                lambda args: compressed_step(plan, *args, count),
                lambda args: dense_step(*args),
                (leaves, qs, errors),
            )
        new_state = PowerSGDState(
            count + 1,
            None if state.q is None else treedef.unflatten(qs),
            None if state.error is None else treedef.unflatten(errors),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------
# Passing state through shard_map


def _specs(tree: PyTree, spec: PartitionSpec) -> PyTree:
    return jtu.tree_map(lambda _: spec, tree)


def partition_specs(state: PyTree, axis_name: Hashable) -> PyTree:
    """`shard_map` specs for an optimiser state that contains this module's states.

    Per-device fields (carried errors and EF21 estimates) get `P(axis_name)`: each
    device's array is one block of a global array concatenated along the first
    axis, so the state can leave `shard_map` and come back to the same device.
    Everything else gets `P()` (replicated), including the states of other optax
    transformations.

    **Arguments:**

    - `state`: the optimiser state, or its shapes (`jax.eval_shape(tx.init, params)`).
    - `axis_name`: the mesh axis of the compressing transformations.

    **Returns:**

    A pytree of `PartitionSpec`s with `state`'s structure.
    """
    varying, replicated = PartitionSpec(axis_name), PartitionSpec()

    def specs(node: Any) -> Any:
        if isinstance(node, CompressState):
            return CompressState(
                _specs(node.error, varying),
                _specs(node.estimate, varying),
                _specs(node.aggregate, replicated),
            )
        if isinstance(node, PowerSGDState):
            return PowerSGDState(
                replicated, _specs(node.q, replicated), _specs(node.error, varying)
            )
        return replicated

    return jtu.tree_map(
        specs,
        state,
        is_leaf=lambda x: isinstance(x, (CompressState, PowerSGDState)),
    )
