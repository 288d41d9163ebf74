"""A generic compressor with error feedback (EF, EF21) as an optax transformation."""

import functools as ft
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jaxtyping import Array, PyTree

from .._core._base import ChunkCompressor, CompressedArray
from .._core._deprecation import strategy_of_name, warn_deprecated
from .._core._devices import axis_is_bound, axis_size, device_varying
from .._core._validate import check_not_a_class, values_unchecked
from .._distributed._collective import GatherSum, PowerSum, all_reduce
from .._distributed._scatter import (
    TwoPhase,
    chunk_elems,
    compressed_reduce_scatter,
    reduce_scatter,
    two_phase_sum,
)
from .._distributed._schedule import (
    Cheapest,
    Schedule,
    cheapest_schedule,
    dense_sum,
)
from .._types.quantized import Quantized
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
from ._errors import (
    ErrorDtype,
    block_size,
    check_error_dtype,
    load_error,
    store_error,
    zero_error,
)


ScheduleName = Literal["auto", "gather", "two_phase"]


class ErrorFeedback(eqx.Module):
    """Error feedback (EF; Seide et al. 2014, Stich et al. 2018, Karimireddy et al.
    2019), a strategy for [`quax_tangents.optax.compress_updates`][]: compress
    `v = g + e`, emit `C(v)`, carry `e <- v - C(v)`.

    The running sum of the emitted updates equals the running sum of the gradients
    minus the current error, so a biased compressor (top-k, sign) loses nothing for
    good. The error is per device and of the update's size (`error_dtype="int8"`
    stores it as int8 codes).
    """


class EF21(eqx.Module):
    """EF21 (Richtarik et al. 2021), a strategy for
    [`quax_tangents.optax.compress_updates`][]: keep an estimate `h` of the
    gradient, compress the change `C(g - h)`, set `h <- h + C(g - h)` and emit `h`
    (with an `axis_name`, the mean of the devices' estimates, kept incrementally
    from the compressed changes, which the devices exchange).

    The estimate converges to a fixed gradient, and the state holds the estimate
    (per device) and, across devices, its mean.
    """


Feedback = ErrorFeedback | EF21 | None
_FEEDBACKS = "`qto.ErrorFeedback()`, `qto.EF21()` or None"
_FEEDBACK_OF_NAME = {"ef": ErrorFeedback, "ef21": EF21}


class CompressState(NamedTuple):
    """State of [`quax_tangents.optax.compress_updates`][]. Each field holds one
    entry per compressed leaf and `None` for leaves that pass through uncompressed.

    - `error`: with `qto.ErrorFeedback()`, what compression dropped so far, added to
        the next update before compressing: an array of the update's shape and dtype,
        or with `error_dtype="int8"` a `Quantized` of it. Per device.
    - `estimate`: with `qto.EF21()`, this device's running estimate of its gradient.
        Per device.
    - `aggregate`: with `qto.EF21()` and an `axis_name`, the mean of the estimates over
        devices, which every device keeps identically.
    - `server_error`: with `method=qt.TwoPhase()` (or `qt.Cheapest()`) and
        `qto.ErrorFeedback()`, what the second compression dropped from this device's
        chunk of the mean: float32 `(chunk,)`, about `1/n` of the leaf. Per device.
    """

    error: PyTree
    estimate: PyTree
    aggregate: PyTree
    server_error: PyTree = None


def compress_updates(
    compressor: Callable[[Array], CompressedArray],
    *,
    error_feedback: Feedback | str = ErrorFeedback(),  # noqa: B008 (immutable)
    min_compression_rate: float = 2.0,
    filter: Filter = None,
    axis_name: AxisName = None,
    method: Cheapest | GatherSum | TwoPhase | None = None,
    sharded: bool | PyTree[bool] = False,
    error_dtype: ErrorDtype = None,
    schedule: Any = None,
    two_phase: Any = None,
) -> optax.GradientTransformation:
    """Compresses each update leaf with `compressor`, optionally with error feedback,
    and emits the dense value of the compressed update.

    A leaf is compressed when `filter` selects it, it has at least two dims, and
    compression saves at least `min_compression_rate` (dense bytes / compressed bytes,
    computed from shapes). Leaves that `compressor` rejects (raises `ValueError` for
    their shape) are skipped the same way. Other leaves pass through (averaged over
    devices with `axis_name`).

    Error feedback (`error_feedback`), per compressed leaf `g` with compressor `C`:

    - [`quax_tangents.optax.ErrorFeedback`][]`()`, the default (Seide et al. 2014;
        Stich et al. 2018; Karimireddy et al. 2019): compress `v = g + e`, emit
        `C(v)`, carry `e <- v - C(v)`. The running sum of emitted updates equals the
        running sum of `g` minus the current `e`.
    - [`quax_tangents.optax.EF21`][]`()` (Richtarik et al. 2021): keep an estimate
        `h`, compress the change `C(g - h)`, set `h <- h + C(g - h)`, emit `h` (with
        `axis_name`, the mean of the devices' estimates, kept incrementally from the
        compressed changes).
    - `None`: emit `C(g)`; biased compressors then lose what they drop for good.

    With `axis_name`, call `update` inside `jax.shard_map`: each device compresses its
    own gradient and only compressed fields cross the wire. How the devices' values
    are combined (`method`, the methods of [`quax_tangents.all_reduce`][]):

    - `qt.GatherSum()`: an all-gather of the compressed fields, exact: each device
        receives `n - 1` compressed leaves.
    - `qt.TwoPhase()`: the two-phase all-reduce of
        [`quax_tangents.TwoPhase`][] for `Quantized`, `SignNorm` and `Sparse`
        compressors (others use `GatherSum`): each device receives about
        `2 (n - 1) / n` compressed leaves. With `ErrorFeedback()`, the error of the
        first compression is carried per device (`error`, the leaf's size) and that
        of the second per chunk (`server_error`, `1/n` of the leaf).
    - `qt.Cheapest()` (the default): per leaf, whichever of the two and the dense ring
        all-reduce of the compressed leaf's dense value receives the fewest bytes
        per device at the axis size in use (`quax_tangents.hlo.schedule_bytes`; ties
        go to the gather). The dense all-reduce sums the same compressed values
        exactly, so it emits what the gather would. With `ErrorFeedback()` and a
        compressor that has chunks, the state holds a `server_error` for the
        two-phase schedule whichever is chosen (its structure may not depend on the
        device count). With `EF21()` or `sharded`, the two-phase schedule is not a
        candidate.
    - `sharded=True` (ZeRO / FSDP style): the parameters (and the states of the
        transformations that follow) are sharded along their first dim over
        `axis_name`. `update` takes each device's gradient of the *whole* parameters
        and returns the update of *this device's shard*, by
        [`quax_tangents.reduce_scatter`][] (an `all_to_all` of compressed chunks, each
        device receiving `(n - 1) / n` of one compressed leaf). A pytree of bools (the
        updates' structure or a prefix) says which leaves are sharded; the others are
        averaged whole. The first dim of a sharded leaf must be a multiple of the
        number of devices.

    `error_dtype="int8"` stores `ErrorFeedback()`'s error as int8 codes with one
    float32 scale per block of at most 256 elements (nearest rounding), about 0.26x
    the bytes of a float32 error. What that rounding drops (at most
    `max|block| / 254` per element) is not fed back.

    Call `init` inside the `shard_map` body too (with `sharded`, on the shards), and
    see [`quax_tangents.optax.partition_specs`][].

    **Arguments:**

    - `compressor`: a function from a dense array to a compressed value, e.g.
        `lambda g: qt.top_k(g, 0.01)`, `qt.sign_norm` or
        `functools.partial(qt.quantize, bits=8)`.
    - `error_feedback`: `qto.ErrorFeedback()`, `qto.EF21()` or `None`. The strings
        `"ef"` and `"ef21"` are their deprecated spellings; each use warns.
    - `min_compression_rate`: the least `dense / compressed` bytes ratio worth
        compressing for.
    - `filter`: which leaves may be compressed, in any form `optax.masked` takes
        (as `projected`'s `project=`): `None` (all), a pytree of bools with the
        updates' structure or a prefix of it, or a callable that maps the updates to
        one, e.g. `lambda u: jax.tree.map(lambda g: g.ndim == 2, u)`.
    - `axis_name`: the mesh axis to average over, or `None` on one device.
    - `method`: `qt.Cheapest()`, `qt.GatherSum()` or `qt.TwoPhase()`; `None` means
        `qt.Cheapest()`.
    - `sharded`: `True`, `False`, or a pytree of bools: the leaves whose parameters
        are sharded along their first dim.
    - `error_dtype`: `None` (the update's dtype) or `"int8"`.
    - `schedule`, `two_phase`: deprecated spellings of `method` (`"auto"`,
        `"gather"`, `"two_phase"`; `True`, `False`); each use warns.

    **Returns:**

    An `optax.GradientTransformation` whose state is a
    [`quax_tangents.optax.CompressState`][].
    """
    error_feedback = _feedback(error_feedback)
    if not callable(compressor):
        raise TypeError(f"`compressor` must be callable, got {compressor!r}.")
    rate = check_rate(min_compression_rate)
    error_dtype = check_error_dtype(error_dtype)
    schedule = _resolve_schedule(method, schedule, two_phase)
    two_phase = schedule == "two_phase"
    _check_modes(axis_name, two_phase, sharded, error_feedback, error_dtype)
    # The schedules `"auto"` may choose from.
    candidates: tuple[Schedule, ...] = ("gather", "dense")
    if not isinstance(error_feedback, EF21) and sharded is False:
        candidates = ("gather", "two_phase", "dense")
    keeps_server_error = two_phase or (schedule == "auto" and "two_phase" in candidates)
    plan_of = ft.partial(compress_plan, compressor, filter, rate)
    shard_flags_of = ft.partial(_shard_flags, sharded)

    def devices() -> int:
        # Outside `shard_map` (`jax.eval_shape` for the specs) only the structure of
        # the state matters.
        bound = axis_name is not None and axis_is_bound(axis_name)
        return axis_size(axis_name) if bound else 1

    def server_zeros(leaf: Any, n: int) -> Array | None:
        """A zero server error for one chunk of `leaf`; None where the compressor's
        type has no chunks (it is then summed by `GatherSum`)."""
        struct = jax.ShapeDtypeStruct(jnp.shape(leaf), leaf.dtype)
        codec = _chunk_codec(jax.eval_shape(compressor, struct))
        if codec is None:
            return None
        chunk = chunk_elems(struct.size, n, codec.multiple)
        chunk_struct = jax.ShapeDtypeStruct((chunk,), jnp.float32)
        return per_device_zeros(chunk_struct, axis_name)

    def init(params: PyTree) -> CompressState:
        leaves, treedef = jtu.tree_flatten(params)
        n = devices()
        # With `sharded`, `params` are the shards; the updates are whole.
        whole = [
            _whole(leaf, n) if flag else leaf
            for flag, leaf in zip(shard_flags_of(params), leaves)
        ]
        plan = plan_of(treedef.unflatten(whole))
        per_device = lambda leaf: per_device_zeros(leaf, axis_name)  # noqa: E731
        replicated = lambda leaf: jnp.zeros(jnp.shape(leaf), leaf.dtype)  # noqa: E731
        zero_error_of = ft.partial(_zero_error, error_dtype=error_dtype, axis=axis_name)
        error = estimate = aggregate = server_error = None
        if isinstance(error_feedback, ErrorFeedback):
            error = treedef.unflatten(fields(plan, whole, zero_error_of))
            if keeps_server_error and axis_name is not None:
                server = ft.partial(server_zeros, n=n)
                server_error = treedef.unflatten(fields(plan, whole, server))
        if isinstance(error_feedback, EF21):
            estimate = treedef.unflatten(fields(plan, whole, per_device))
            if axis_name is not None:
                aggregate = treedef.unflatten(fields(plan, whole, replicated))
        return CompressState(error, estimate, aggregate, server_error)

    def leaf_schedule(v: Array) -> Schedule:
        """How this leaf's compressed values are combined over devices."""
        struct = jax.eval_shape(compressor, jax.ShapeDtypeStruct(v.shape, v.dtype))
        has_chunks = _chunk_codec(struct) is not None
        if axis_name is None or schedule == "gather":
            return "gather"
        if schedule == "two_phase":
            return "two_phase" if has_chunks else "gather"
        return cheapest_schedule(struct, devices(), candidates)

    def emitted(c: CompressedArray, how: Schedule = "gather") -> Array:
        if axis_name is None:
            return c.materialise()
        if how == "dense":
            return dense_sum(c, axis_name, mean=True)
        return materialised(all_reduce(c, axis_name, GatherSum(), mean=True))

    def combine(v: Array, shard: bool, server_error: Any) -> tuple[Array, Array, Any]:
        """The combined update of `v`, what the other devices decoded of it, and the
        new server error."""
        if shard:
            out = compressed_reduce_scatter(v, compressor, axis_name, mean=True)
            return out.shard, out.sent, None
        how = leaf_schedule(v)
        if how != "two_phase":
            c = compressor(v)
            return _dense(emitted(c, how), v), c.materialise(), server_error
        struct = jax.ShapeDtypeStruct(v.shape, v.dtype)
        codec = _chunk_codec(jax.eval_shape(compressor, struct))
        assert codec is not None  # "two_phase" is chosen for chunked values only
        out = two_phase_sum(v, codec, axis_name, mean=True, server_error=server_error)
        return out.total, out.sent, out.server_error

    def update_leaf(g, shard, error, estimate, aggregate, server_error):
        if isinstance(error_feedback, ErrorFeedback):
            v = g + load_error(error)
            u, sent, server_error = combine(v, shard, server_error)
            error = store_error(v - sent, g.dtype, error_dtype)
            return u, (error, None, None, server_error)
        if isinstance(error_feedback, EF21):
            c = compressor(g - estimate)
            estimate = estimate + c.materialise()
            if axis_name is None:
                return estimate, (None, estimate, None, None)
            aggregate = aggregate + emitted(c, leaf_schedule(g))
            return aggregate, (None, estimate, aggregate, None)
        u, _, _ = combine(g, shard, None)
        return u, (None, None, None, None)

    def pass_through(g: Array, shard: bool) -> Array:
        if shard:
            return reduce_scatter(g, None, axis_name, mean=True)
        return mean_over_devices(g, axis_name)

    def update(updates, state, params=None):
        del params
        check_axis_name(axis_name)
        # A NaN in the updates flows on, as through a dense optimiser (see
        # `_validate`); `jax_debug_nans` finds where it started.
        with values_unchecked():
            return update_unchecked(updates, state)

    def update_unchecked(updates, state):
        leaves, treedef = jtu.tree_flatten(updates)
        plan = plan_of(updates)
        shards = shard_flags_of(updates)
        fields = [flat_fields(tree, treedef) for tree in state]
        out, new_fields = [], [[], [], [], []]
        for i, (chosen, shard, g) in enumerate(zip(plan, shards, leaves)):
            if chosen:
                leaf_fields = (field[i] for field in fields)
                u, leaf_state = update_leaf(g, shard, *leaf_fields)
            else:
                u, leaf_state = pass_through(g, shard), (None, None, None, None)
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


_SCHEDULE_OF_METHOD: dict[type, ScheduleName] = {
    Cheapest: "auto",
    GatherSum: "gather",
    TwoPhase: "two_phase",
}
_METHODS = "`qt.Cheapest()`, `qt.GatherSum()` or `qt.TwoPhase()`"


def _method_schedule(method: Any) -> ScheduleName:
    if method is None:
        return "auto"
    if isinstance(method, type) and method in _SCHEDULE_OF_METHOD:
        raise TypeError(
            f"`method` must be an instance: `{method.__name__}()`, not the class."
        )
    if type(method) not in _SCHEDULE_OF_METHOD:
        hint = (
            " PowerSGD is its own transformation: `qto.powersgd(rank, axis_name=...)`."
            if isinstance(method, PowerSum)
            else ""
        )
        raise TypeError(f"`method` must be {_METHODS}, got {method!r}.{hint}")
    return _SCHEDULE_OF_METHOD[type(method)]


def _deprecated_schedule(schedule: Any, two_phase: Any) -> ScheduleName | None:
    """The schedule that the deprecated `schedule=` / `two_phase=` ask for."""
    if two_phase is not None and not isinstance(two_phase, bool):
        raise TypeError(f"`two_phase` must be a bool, got {two_phase!r}.")
    if schedule not in (None, "auto", "gather", "two_phase"):
        raise ValueError(
            f"`schedule` must be 'auto', 'gather' or 'two_phase', got {schedule!r}; "
            f"it is deprecated: pass `method=` ({_METHODS})."
        )
    new = {"auto": "qt.Cheapest()", "gather": "qt.GatherSum()"}
    if schedule is not None:
        warn_deprecated(
            f"compress_updates(schedule={schedule!r})",
            f"compress_updates(method={new.get(schedule, 'qt.TwoPhase()')})",
            stacklevel=4,
        )
    if two_phase is not None:
        implied = "two_phase" if two_phase else "gather"
        warn_deprecated(
            f"compress_updates(two_phase={two_phase})",
            f"compress_updates(method={new.get(implied, 'qt.TwoPhase()')})",
            stacklevel=4,
        )
        if schedule is not None and schedule != implied:
            raise ValueError(
                f"`two_phase={two_phase}` asks for schedule {implied!r}, but "
                f"`schedule={schedule!r}`; pass only `method=` ({_METHODS})."
            )
        return implied
    return schedule


def _resolve_schedule(method: Any, schedule: Any, two_phase: Any) -> ScheduleName:
    from_method = _method_schedule(method)
    deprecated = _deprecated_schedule(schedule, two_phase)
    if deprecated is None:
        return from_method
    if method is not None and deprecated != from_method:
        raise ValueError(
            f"`method={method!r}` and the deprecated `schedule`/`two_phase` ask for "
            "different schedules; pass only `method`."
        )
    return deprecated


def _check_modes(axis_name, two_phase, sharded, error_feedback, error_dtype) -> None:
    if callable(sharded):
        raise TypeError(
            "`sharded` must be a bool or a pytree of bools (the updates' structure or "
            "a prefix), not a callable: `init` sees the shards and `update` the whole "
            "gradients, so a callable would see different leaves."
        )
    wants_sharding = sharded is not False
    for name, on in (("method=qt.TwoPhase()", two_phase), ("sharded", wants_sharding)):
        if on and axis_name is None:
            raise ValueError(f"`{name}` needs an `axis_name` to combine devices over.")
        if on and isinstance(error_feedback, EF21):
            raise ValueError(
                f"`{name}` works with `error_feedback=qto.ErrorFeedback()` or None, "
                "not `qto.EF21()` (whose aggregate needs the exact mean of the "
                "compressed changes)."
            )
    if two_phase and wants_sharding:
        raise ValueError(
            "Choose one of `method=qt.TwoPhase()` (an all-reduce) and `sharded` (a "
            "reduce-scatter into sharded parameters)."
        )
    if error_dtype is not None and not isinstance(error_feedback, ErrorFeedback):
        raise ValueError(
            "`error_dtype` sets how the carried error is stored; it needs "
            f"`error_feedback=qto.ErrorFeedback()`, got {error_feedback!r}."
        )


def _feedback(error_feedback: Any) -> Feedback:
    """`error_feedback` as a strategy, after a warning for a deprecated name."""
    error_feedback = strategy_of_name(
        error_feedback,
        _FEEDBACK_OF_NAME,
        old=f"compress_updates(error_feedback={error_feedback!r})",
        new="compress_updates(error_feedback=qto.{}())",
        stacklevel=4,
    )
    check_not_a_class("error_feedback", error_feedback, (ErrorFeedback, EF21), "qto.")
    if error_feedback is None or isinstance(error_feedback, (ErrorFeedback, EF21)):
        return error_feedback
    raise TypeError(f"`error_feedback` must be {_FEEDBACKS}, got {error_feedback!r}.")


def _shard_flags(sharded: bool | PyTree[bool], tree: PyTree) -> list[bool]:
    leaves = jtu.tree_leaves(tree)
    if isinstance(sharded, bool):
        return [sharded and jnp.ndim(leaf) >= 1 for leaf in leaves]
    try:
        expanded = jtu.tree_map(
            lambda flag, subtree: jtu.tree_map(lambda _: flag, subtree), sharded, tree
        )
    except ValueError as error:
        raise ValueError(
            "`sharded` must be a bool or a pytree of bools with the structure of the "
            "updates (or a prefix of it)."
        ) from error
    flags = jtu.tree_leaves(expanded)
    if not all(isinstance(flag, bool) for flag in flags):
        raise TypeError("A pytree `sharded` must hold Python bools.")
    return [flag and jnp.ndim(leaf) >= 1 for flag, leaf in zip(flags, leaves)]


def _whole(shard: Any, devices: int) -> jax.ShapeDtypeStruct:
    """The shape of a whole leaf whose shard (along the first dim) is `shard`."""
    shape = jnp.shape(shard)
    return jax.ShapeDtypeStruct((devices * shape[0], *shape[1:]), shard.dtype)


def _zero_error(leaf: Any, error_dtype: ErrorDtype, axis: AxisName) -> Any:
    if error_dtype is None:
        return zero_error(leaf, axis, error_dtype)
    # Zero codes and scales directly: XLA would constant-fold `quantize(zeros)`, which
    # takes seconds of compilation for a large leaf.
    shape = jnp.shape(leaf)
    size = math.prod(shape)
    block = block_size(size)
    blocks = -(-size // block)
    zeros = Quantized(
        jnp.zeros((blocks, block), jnp.int8),
        jnp.zeros((blocks,), jnp.float32),
        event_shape=shape,
        bits=8,
        block_size=block,
        dtype=leaf.dtype,
    )
    return _vary(zeros, axis)


def _vary(value: Any, axis: AxisName) -> Any:
    if axis is not None and axis_is_bound(axis):
        return device_varying(value, axis)
    return value


def _chunk_codec(c: CompressedArray) -> ChunkCompressor | None:
    return c.chunk_compressor() if c.batch_ndim == 0 else None


def _dense(x: Any, like: Array) -> Array:
    return jnp.asarray(x).astype(like.dtype)
