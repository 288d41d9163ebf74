"""PowerSGD as an optax transformation."""

import functools as ft
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jax import lax
from jaxtyping import Array, PyTree

from .._collective import all_reduce, power_rounds, start_q
from ._common import (
    AxisName,
    Filter,
    check_axis_name,
    check_int,
    check_rate,
    fields,
    flat_fields,
    matrix_shape,
    per_device_zeros,
    powersgd_plan,
)


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
    rank = check_int("rank", rank, 1)
    iters = check_int("iters", iters, 1)
    start_iter = check_int("start_iter", start_iter, 0)
    seed = check_int("seed", seed, 0)
    rate = check_rate(min_compression_rate)
    plan_of = ft.partial(powersgd_plan, rank, filter, rate)

    def fresh_q(index: int, leaf: Any, count: Array | None) -> Array:
        key = jax.random.fold_in(jax.random.key(seed), index)
        if count is not None:
            key = jax.random.fold_in(key, count)
        _, n = matrix_shape(jnp.shape(leaf))
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
                fields(plan, leaves, lambda leaf: per_device_zeros(leaf, axis_name))
            )
        return PowerSGDState(jnp.zeros((), jnp.int32), q, error)

    def reduce(x: Array) -> Array:
        return x if axis_name is None else all_reduce(x, axis_name, mean=True)

    def compress_leaf(index, g, q, error, count):
        shape = jnp.shape(g)
        work = jnp.promote_types(g.dtype, jnp.float32)
        matrix = g.reshape(matrix_shape(shape)).astype(work)
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
        check_axis_name(axis_name)
        leaves, treedef = jtu.tree_flatten(updates)
        plan = plan_of(updates)
        qs = flat_fields(state.q, treedef)
        errors = flat_fields(state.error, treedef)
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
            # Saturates instead of wrapping negative, which would turn compression
            # off after `start_iter` in a long run.
            optax.safe_int32_increment(count),
            None if state.q is None else treedef.unflatten(qs),
            None if state.error is None else treedef.unflatten(errors),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)
