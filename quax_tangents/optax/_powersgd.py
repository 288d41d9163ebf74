"""PowerSGD as an optax transformation."""

import functools as ft
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jax import lax
from jaxtyping import Array, PyTree

from .._core._devices import dense_all_reduce
from .._distributed._collective import orthonormalise, start_q
from ._common import (
    AxisName,
    Filter,
    check_axis_name,
    check_int,
    check_rate,
    fields,
    flat_fields,
    matrix_shape,
    powersgd_plan,
)
from ._errors import (
    ErrorDtype,
    check_error_dtype,
    load_error,
    store_error,
    zero_error,
)


class PowerSGDState(NamedTuple):
    """State of [`quax_tangents.optax.powersgd`][].

    - `count`: int32 number of updates so far.
    - `q`: with `warm_start`, the `Q` factor `(n, r)` of each compressed leaf (the
        same on every device), which starts the next step's power iteration.
    - `error`: with `error_feedback`, the carried error of each compressed leaf: an
        array of the gradient's dtype, or with `error_dtype="int8"` a
        [`quax_tangents.Quantized`][]. Per device.
    """

    count: Array  # pyright: ignore[reportIncompatibleMethodOverride]
    q: PyTree
    error: PyTree


# ---------------------------------------------------------------------------------------
# One all-reduce for many arrays


def reduce_together(
    arrays: list[Array], axis_name: AxisName, *, mean: bool
) -> list[Array]:
    """The sum (or mean) over devices of each array, with one all-reduce per dtype:
    the arrays of a dtype are flattened and concatenated, reduced, and split again.

    The reduction is elementwise, so each result equals that array's own all-reduce;
    only the number of collectives the program asks for changes (one instead of one
    per array, which matters when each has its own latency).
    """
    if axis_name is None or not arrays:
        return list(arrays)
    out = list(arrays)
    by_dtype: dict[Any, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(jnp.result_type(a), []).append(i)
    for indices in by_dtype.values():
        if len(indices) == 1:
            (i,) = indices
            out[i] = dense_all_reduce(arrays[i], axis_name, mean=mean)
            continue
        flat = jnp.concatenate([jnp.ravel(arrays[i]) for i in indices])
        reduced = dense_all_reduce(flat, axis_name, mean=mean)
        offset = 0
        for i in indices:
            size = math.prod(jnp.shape(arrays[i]))
            out[i] = reduced[offset : offset + size].reshape(jnp.shape(arrays[i]))
            offset += size
    return out


# ---------------------------------------------------------------------------------------
# Power rounds on many matrices at once


def batched_power_rounds(
    matrices: list[Array],
    qs: list[Array],
    iters: int,
    reduce: Callable[[list[Array]], list[Array]],
) -> tuple[list[Array], list[Array]]:
    """`iters` PowerSGD rounds on every matrix (as `power_rounds` does for one), with
    one `reduce` of all the `P`s and one of all the `Q`s per round. The products and
    the orthonormalisation stay per matrix."""
    ps: list[Array] = []
    for _ in range(iters):
        ps = [orthonormalise(p) for p in reduce([m @ q for m, q in zip(matrices, qs)])]
        qs = reduce([m.T @ p for m, p in zip(matrices, ps)])
    return ps, qs


# ---------------------------------------------------------------------------------------
# The transformation


def powersgd(
    rank: int,
    *,
    iters: int = 1,
    warm_start: bool = True,
    start_iter: int = 0,
    error_feedback: bool = True,
    error_dtype: ErrorDtype = None,
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

    The communication is batched: each round sends the `P`s of all compressed leaves
    in one all-reduce and their `Q`s in another (one pair per gradient dtype), and the
    leaves averaged densely share one all-reduce, so a step asks for `2 * iters + 1`
    all-reduces whatever the number of layers. The arithmetic stays per matrix: the
    results equal those of one all-reduce per matrix.

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
    - `error_dtype`: how the carried error is stored: `None` in the gradient's dtype,
        or `"int8"` as a [`quax_tangents.Quantized`][] of int8 codes with one float32
        scale per block of at most 256 elements (nearest rounding), about 0.26x the
        bytes of a float32 error. Each element then is within `max|block| / 254` of
        the exact error; that rounding is dropped, not carried. Suited to batches
        drawn alike on every device: where each device's gradient differs from the
        mean for good (a fixed shard of data per device), its error grows with the
        step count and the rounding of it stalls convergence.
    - `min_compression_rate`: the least `m n / (r (m + n))` worth compressing for.
    - `filter`: which leaves may be compressed, in any form `optax.masked` takes
        (as `projected`'s `project=`): `None` (all), a pytree of bools with the
        updates' structure or a prefix of it, or a callable that maps the updates to
        one, e.g. `lambda u: jax.tree.map(lambda g: g.ndim == 2, u)`.
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
    error_dtype = check_error_dtype(error_dtype)
    if error_dtype is not None and not error_feedback:
        raise ValueError(
            "`error_dtype` says how the carried error is stored, and with "
            "`error_feedback=False` there is none: drop `error_dtype`."
        )
    rate = check_rate(min_compression_rate)
    plan_of = ft.partial(powersgd_plan, rank, filter, rate)
    reduce = ft.partial(reduce_together, axis_name=axis_name, mean=True)

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
                fields(
                    plan, leaves, lambda leaf: zero_error(leaf, axis_name, error_dtype)
                )
            )
        return PowerSGDState(jnp.zeros((), jnp.int32), q, error)

    def compressed_step(plan, leaves, qs, errors, count):
        chosen = [i for i, c in enumerate(plan) if c]
        dense = [i for i, c in enumerate(plan) if not c]
        dtypes = [leaves[i].dtype for i in chosen]
        matrices = []
        for i in chosen:
            g = leaves[i]
            work = jnp.promote_types(g.dtype, jnp.float32)
            m = g.reshape(matrix_shape(jnp.shape(g))).astype(work)
            if error_feedback:
                m = m + load_error(errors[i]).reshape(m.shape).astype(work)
            matrices.append(m)
        starts = [qs[i] if warm_start else fresh_q(i, leaves[i], count) for i in chosen]

        def reduce_sent(arrays: list[Array]) -> list[Array]:
            # Computed in float32, sent in the gradient's own dtype.
            sent = reduce([a.astype(d) for a, d in zip(arrays, dtypes)])
            return [s.astype(a.dtype) for s, a in zip(sent, arrays)]

        ps, new_qs = batched_power_rounds(matrices, starts, iters, reduce_sent)
        out, qs, errors = list(leaves), list(qs), list(errors)
        for i, m, p, q in zip(chosen, matrices, ps, new_qs):
            shape, dtype = jnp.shape(leaves[i]), leaves[i].dtype
            approx = p @ q.T
            out[i] = approx.reshape(shape).astype(dtype)
            qs[i] = q if warm_start else None
            if error_feedback:
                errors[i] = store_error((m - approx).reshape(shape), dtype, error_dtype)
        for i, u in zip(dense, reduce([leaves[i] for i in dense])):
            out[i] = u
        return out, qs, errors

    def dense_step(leaves, qs, errors):
        return reduce(list(leaves)), qs, errors

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
                lambda args: compressed_step(plan, *args, count),  # pyright: ignore[reportCallIssue]
                lambda args: dense_step(*args),
                (leaves, qs, errors),
            )
        new_state = PowerSGDState(
            # Saturates instead of wrapping negative, which would turn compression
            # off after `start_iter` in a long run.
            jnp.asarray(optax.safe_int32_increment(count)),
            None if state.q is None else treedef.unflatten(qs),
            None if state.error is None else treedef.unflatten(errors),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)
