"""Marks on weights whose cotangents are born compressed: `projected_cotangent`,
`factored_cotangent` and `sparse_rows_cotangent`.

JAX's transpose of `dot_general` forms the dense weight gradient `X^T C` before any
marker on the weight could see it, so the interception happens where the weight meets
`dot_general` (or a gather), above JAX's AD. Under `quax_tangents.grad`, `value_and_grad`
and `vjp`, a function that uses a mark is traced a second time with an inner quax
trace inside `jax.vjp`:

1. the mark binds `mark_p`, whose rule returns a `Marked` value around the weight
    (passed through a `jax.custom_vjp` identity whose backward pass *finishes* the
    weight's total cotangent with `finish_p`);
2. `Marked`'s `dot_general` and `gather` rules call a `jax.custom_vjp` product whose
    backward pass binds `outer_sum_p` (the gradient as its factors `X`, `C`) or
    `rows_p` (the rows read); every other primitive uses the weight itself;
3. in the backward pass, which runs at the outer quax trace, those construction
    primitives become `OuterSum` / `SparseRows` values, JAX adds the uses up, and
    `finish_p` turns the total into a `LowRank` or deduplicated `SparseRows`.

The first trace runs without the inner layer; a mark raises a private signal there,
and the entry point traces again with it, so functions without marks pay nothing.
Outside our entry points a mark is the custom_vjp identity alone, whose backward pass
computes the same numbers densely.
"""

import contextlib
import dataclasses
import itertools
import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jexc
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from .._core import _fallback, _validate
from .._core._compat import trace_context_state
from .._core._registry import rule
from .._core._trace import enter_trace
from ._marked import Marked
from ._orthonormal import check_orthonormal
from ._projection import Finish, finish_p
from ._sources import Fresh, Given, Source, Switch


_T = TypeVar("_T")


# ---------------------------------------------------------------------------------------
# The projector contract


class Projector(eqx.Module):
    """The projector of one weight for `projected_cotangent`, carried as data so that
    one jitted step serves both the steps that refresh it and those that do not.

    For a weight `w` of shape `(*batch, m, n)` and rank `r`, `matrix` has shape
    `(*batch, m, r)` when `m <= n` and `(*batch, n, r)` otherwise (one projector per
    slice of a stacked weight), a floating dtype (cast to `w`'s), and orthonormal
    columns. When `refresh` is true, `matrix` is ignored (only its shape is read) and
    a fresh projector comes from the range finder, as with `projector=None`. Either
    way, the projector used is a factor of the gradient: `grad.left` when `m <= n`,
    `grad.right` otherwise (`grad.projector_side` says which); store it for the next
    steps.

    **Arguments:**

    - `matrix`: floating array `(*batch, min(m, n), r)`.
    - `refresh`: a bool scalar (Python or traced), shared by every slice.
    """

    matrix: Float[Array, "*batch side rank"]
    refresh: Bool[Array, ""]

    def __init__(self, matrix: Float[ArrayLike, "*batch side rank"], refresh: Any):
        self.matrix = jnp.asarray(matrix)
        self.refresh = jnp.asarray(refresh)
        if self.refresh.shape != () or self.refresh.dtype != jnp.bool_:
            raise TypeError(
                "`Projector.refresh` must be a bool scalar, got "
                f"{self.refresh.dtype}{list(self.refresh.shape)}."
            )
        # Eager only (concrete arrays); `projected_cotangent` checks traced ones.
        if not isinstance(self.matrix, jax.core.Tracer):
            check_orthonormal(self.matrix, "Projector.matrix", skip=self.refresh)

    @classmethod
    def init(cls, shape: tuple[int, ...], rank: int, dtype: Any) -> "Projector":
        """A placeholder (zeros) that asks for a fresh projector on first use, for a
        weight of `shape` `(*batch, m, n)`."""
        if len(shape) < 2:
            raise ValueError(
                f"`shape` must be (*batch, m, n), got {tuple(shape)}: a projector "
                "belongs to a matrix or a stack of them."
            )
        *batch, m, n = shape
        return cls(jnp.zeros((*batch, min(m, n), rank), dtype), True)


# ---------------------------------------------------------------------------------------
# Public marks


def factored_cotangent(w: Float[Array, "*batch m n"]) -> Float[Array, "*batch m n"]:
    """The identity on a weight `w`, whose cotangent is the exact low-rank `X^T C`.

    Under `quax_tangents.grad`, `value_and_grad` and `vjp`, every use of `w` in a
    `dot_general` (`x @ w`, `w @ x`, `einsum`, `equinox.nn.Linear` under `vmap`, with
    `w` or `w.T`) contributes the factors of its gradient `X^T C` (`X` the other
    operand, `C` the output cotangent, both flattened over the dims contracted with
    each other), and the weight's cotangent comes back as a `LowRank` whose rank is
    the total number of rows contracted, subject to the rank budget
    (`quax_tangents.rank_budget`). The `m x n` gradient is never formed. A use of
    `w` in any other operation adds a dense cotangent, and the sum is dense
    (counted). Elsewhere (plain `jax.grad`) it is the dense gradient.

    A stacked weight `(*batch, m, n)` (the blocks of a scanned model) is handled
    slice by slice: its cotangent is a `LowRank` with `batch_ndim == len(batch)`.

    **Arguments:**

    - `w`: floating array `(*batch, m, n)`.

    **Returns:**

    `w`.
    """
    _check_matrix("w", w)
    return bind_mark(Finish("factored"), w, ())


def projected_cotangent(
    w: Float[Array, "*batch m n"],
    rank: int,
    *,
    projector: Float[ArrayLike, "*batch side rank"] | Projector | None = None,
    key: PRNGKeyArray | None = None,
    iters: int = 1,
    oversample: int = 4,
) -> Float[Array, "*batch m n"]:
    """The identity on a weight `w`, whose cotangent is the projection of its gradient
    `G` onto a rank-`rank` subspace of its smaller side, as in GaLore.

    Under `quax_tangents.grad`, `value_and_grad` and `vjp` the cotangent comes back
    as a `LowRank`: for `m <= n`, `LowRank(left=P, right=G^T P)` with `P` `(m, rank)`
    orthonormal (so the dense array is `P P^T G`); for `m > n`,
    `LowRank(left=G Q, right=Q)` with `Q` `(n, rank)` (the array `G Q Q^T`). Its
    `projector_side` is `"left"` or `"right"` accordingly. Where `w` meets
    `dot_general`, `G = X^T C` is used only through `G v = X^T (C v)` and
    `G^T u = C^T (X u)`, `O(b (m + n) rank)` each: the `m x n` gradient is never
    formed. Uses of `w` elsewhere (weight decay, a tied embedding) add a dense term
    (counted); the result is then the projection of the dense total, never a
    different array. Elsewhere (plain `jax.grad`) it is the same projection, dense.

    A stacked weight `(*batch, m, n)` is projected slice by slice, with one projector
    per slice (`(*batch, min(m, n), rank)`) and, for fresh projectors, one key per
    slice split from `key`; the `LowRank` then has `batch_ndim == len(batch)`.

    **Arguments:**

    - `w`: floating array `(*batch, m, n)`.
    - `rank`: the rank `r`, `1 <= r <= min(m, n)`.
    - `projector`: `None` for a fresh projector from a randomized range finder on the
        implicit gradient; a floating array `(*batch, min(m, n), r)` with orthonormal
        columns, cast to `w`'s dtype and used exactly (it is the `P`/`Q` factor of
        the result); or a `Projector`, which picks between the two with a traced
        bool.
    - `key`: PRNG key of the range finder's test matrix; `None` uses
        `jax.random.key(0)`.
    - `iters`: power iterations of the range finder (1 by default: each costs
        two products with the gradient's factors, and sharpens a fresh projector
        where the gradient's spectrum decays slowly). The optax layer's marks
        (`quax_tangents.optax.mark`) default to 0, as its accumulation does.
    - `oversample`: extra columns of the range finder's test matrix, dropped by its
        final SVD (4 by default). The optax layer's marks use none, as its
        accumulation does: at LLM ranks they change the energy a fresh projector
        keeps by under 0.003 (`benchmarks/bench_oversample.py`).

    **Returns:**

    `w`.
    """
    return projected_mark(w, rank, projector, key, iters, oversample, by_layer=False)


def projected_mark(
    w: Any,
    rank: int,
    projector: Any,
    key: Any,
    iters: int,
    oversample: int,
    *,
    by_layer: bool,
    axis_name: Any = None,
) -> Any:
    """`projected_cotangent`, and with `by_layer` a stacked weight that one
    `lax.scan` slices is projected layer by layer in that scan's backward pass
    (`quax_tangents._marks._marked_scan`; the optax layer's marks ask for it).
    `axis_name`: inside `shard_map`, the axes over which a fresh projector's
    products with the gradient are summed (`Finish.axis_name`)."""
    batch, (m, n) = _check_matrix("w", w)
    rank = _validate.check_positive_int(
        "rank", rank, upper=min(m, n), hint=f", the smaller side of `w` {(m, n)}"
    )
    _validate.check_non_negative_int("iters", iters)
    _validate.check_non_negative_int("oversample", oversample)
    key_data, key_impl = _key_data(key, batch)
    source: Source
    if projector is None:
        source, operands = Fresh(), (key_data,)
    elif isinstance(projector, Projector):
        matrix = _check_projector(projector.matrix, w, rank, skip=projector.refresh)
        source, operands = Switch(), (matrix, projector.refresh, key_data)
    else:
        source, operands = Given(), (_check_projector(projector, w, rank),)
    spec = Finish(
        "projected",
        rank,
        iters,
        source,
        key_impl,
        oversample,
        by_layer=by_layer,
        axis_name=axis_name,
    )
    return bind_mark(spec, w, operands)


def sparse_rows_cotangent(
    table: Float[Array, "*batch V d"],
) -> Float[Array, "*batch V d"]:
    """The identity on an embedding table, whose cotangent keeps only the rows read.

    Under `quax_tangents.grad`, `value_and_grad` and `vjp`, where `table` is read by
    a row gather (`jnp.take(table, ids, axis=0)`, `table[ids]`,
    `equinox.nn.Embedding`), its cotangent comes back as a `SparseRows` with one
    stored row per row read, duplicates summed into the first and the rest zero
    rows: at most `rows_read * (d * itemsize + 4)` bytes, never the `V x d` zeros
    that plain JAX scatters into. Other uses of `table` (a tied output projection)
    add a dense cotangent, and the sum is dense (counted). Elsewhere (plain
    `jax.grad`) it is the dense gradient.

    A stacked table `(*batch, V, d)`, sliced by `lax.scan`, gives a `SparseRows` with
    `indices` `(*batch, k)`: the rows each slice reads.

    **Arguments:**

    - `table`: floating array `(*batch, V, d)`.

    **Returns:**

    `table`.
    """
    _check_matrix("table", table)
    return bind_mark(Finish("rows"), table, ())


# ---------------------------------------------------------------------------------------
# Input checks


def _check_matrix(name: str, w: Any) -> tuple[tuple[int, ...], tuple[int, int]]:
    """`(batch, (m, n))` of a floating `(*batch, m, n)` weight."""
    if not jnp.issubdtype(jnp.result_type(w), jnp.floating):
        raise TypeError(
            f"`{name}` has dtype {jnp.result_type(w)}; only floating arrays have "
            "cotangents. Mark the floating weight, not the indices."
        )
    if jnp.ndim(w) < 2:
        raise ValueError(
            f"`{name}` must be a matrix or a stack of them (*batch, m, n), got shape "
            f"{jnp.shape(w)}. Leave biases and norms unmarked."
        )
    *batch, m, n = jnp.shape(w)
    return tuple(batch), (m, n)


def _check_projector(matrix: Any, w: Any, rank: int, skip: Any = False) -> Any:
    *batch, m, n = jnp.shape(w)
    expected = (*batch, min(m, n), rank)
    if jnp.shape(matrix) != expected:
        raise ValueError(
            f"`projector` has shape {jnp.shape(matrix)}, but `w` of shape "
            f"{jnp.shape(w)} at rank {rank} needs {expected}: (*batch, rows of w, "
            "rank) when m <= n, (*batch, columns of w, rank) otherwise."
        )
    if not jnp.issubdtype(jnp.result_type(matrix), jnp.floating):
        raise TypeError(
            f"`projector` has dtype {jnp.result_type(matrix)}; it must be a floating "
            "array with orthonormal columns."
        )
    matrix = check_orthonormal(matrix, "projector", skip=skip)
    # A projector kept in another float dtype (an f32 optimizer state for a bf16
    # weight) is cast; the result's projector factor is in the weight's dtype.
    return jnp.asarray(matrix).astype(jnp.result_type(w))


def _key_data(key: Any, batch: tuple[int, ...] = ()) -> tuple[Any, str]:
    """The raw data of `key` (one key split per slice of a stacked weight) and the
    name of its implementation."""
    key = jax.random.key(0) if key is None else key
    if not jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        if jnp.shape(key) != (2,) or jnp.result_type(key) != jnp.uint32:
            raise TypeError(
                "`key` must be a PRNG key (`jax.random.key(seed)`), got "
                f"{jnp.result_type(key)}{list(jnp.shape(key))}."
            )
        key = jax.random.wrap_key_data(key, impl="threefry2x32")
    if jnp.shape(key) != ():
        raise TypeError(
            f"`key` must be a single PRNG key, got a batch of shape {jnp.shape(key)}."
        )
    impl = str(jax.random.key_impl(key))
    if batch:
        key = jax.random.split(key, math.prod(batch)).reshape(batch)
    return jax.random.key_data(key), impl


# ---------------------------------------------------------------------------------------
# Whether the entry point traces with the inner layer


class _NeedsInnerLayer(Exception):
    """Raised by a mark when an entry point traces without the inner layer."""


class _State(threading.local):
    def __init__(self) -> None:
        self.mode: str | None = None  # None, "probe" or "inner"
        # Marks a scan may project layer by layer, and the tokens of those it did,
        # by token (see `Pushable`).
        self.pushable: dict[int, Pushable] = {}
        self.projected_by_scan: set[int] = set()


_state = _State()


# The mode is part of JAX's trace context, so that `jax.jit` keeps the traces that
# an entry point made (with marks bound as `mark_p`) apart from plain JAX's (marks
# as the custom_vjp identity): `jax.grad` and `quax_tangents.grad` of one jitted
# function then each find their own trace, in either order.
# (`_compat.trace_context_state`.)
def _mode_context(mode: str) -> Any:
    return contextlib.nullcontext()


_mode_state = trace_context_state(
    "quax_tangents_mark_mode", ["none", "probe", "inner"], "none"
)
_trace_mode: Callable[[str], Any] = (
    _mode_context if _mode_state is None else _mode_state
)


def bind_mark(spec: Finish, w: Any, operands: tuple) -> Any:
    if _state.mode == "probe":
        raise _NeedsInnerLayer
    if _state.mode == "inner":
        return mark_p.bind(w, *operands, spec=spec)
    return _finished(spec, w, *operands)


def traced_with_marks(trace: Callable[[], _T]) -> _T:
    """Runs an entry point's `trace()`, and runs it again with the inner layer
    (`inner_layer`) when a mark is used; the counts of the first run are undone."""
    previous = _state.mode
    counts = _fallback.saved_counts()
    _state.mode = "probe"
    try:
        with _trace_mode("probe"):
            return trace()
    except _NeedsInnerLayer:
        _fallback.restore_counts(counts)
        _state.mode = "inner"
        with _trace_mode("inner"):
            return trace()
    finally:
        _state.mode = previous
        if previous is None:
            _state.pushable.clear()
            _state.projected_by_scan.clear()


def tracing_inner_layer() -> bool:
    """Whether an entry point is tracing with the inner layer (marks bind `mark_p`)."""
    return _state.mode == "inner"


def inner_layer(fn: Callable) -> Callable:
    """`fn` traced under its own quax trace when marks are in use, so that their
    rules run above the AD transformation that wraps `fn`; otherwise `fn`."""
    if _state.mode != "inner":
        return fn
    return enter_trace(fn)


# ---------------------------------------------------------------------------------------
# The mark: an identity whose backward pass finishes the total cotangent


def _finished_fwd(spec: Finish, w: Any, *operands: Any) -> tuple[Any, tuple]:
    # Symbolic zeros: the primals come as `CustomVJPPrimal`s.
    return w.value, tuple(o.value for o in operands)


def _finished_bwd(spec: Finish, operands: tuple, ct: Any) -> tuple:
    none = tuple(None for _ in operands)
    if isinstance(ct, SymbolicZero):
        # A mark whose stack a scan projected layer by layer (its total cotangent
        # went to the weight directly), or a weight that is not used.
        return (None, *none)
    if spec.token in _state.projected_by_scan:
        raise ValueError(
            "A marked stacked weight was both scanned over by `lax.scan` and used "
            "elsewhere; the scan projected its layers' gradients, which leaves out "
            f"what the other uses add. {_ONE_SCAN}"
        )
    # A bwd rule may not return a quax value; a primitive whose quax rule builds one
    # can, because under the trace its output is a tracer.
    return (finish_p.bind(ct, *operands, spec=spec), *none)


# The identity on `w`; `spec` and the operands only parameterise the backward pass.
_finished = jax.custom_vjp(lambda spec, w, *operands: w, nondiff_argnums=(0,))
_finished.defvjp(_finished_fwd, _finished_bwd, symbolic_zeros=True)


# ---------------------------------------------------------------------------------------
# Marks whose stack a scan may project layer by layer
#
# A projection of a stacked weight is a projection of each slice: when a `lax.scan`
# slices the marked stack, its backward pass can project each layer's cotangent as
# soon as it is made (`quax_tangents._marks._marked_scan`), instead of keeping every
# layer's factors (each matrix's inputs and output cotangents for every token, so
# growing with the batch) until the projection. A `Phased` mark's slice (how
# `accumulate_gradients` adds a microbatch's projection into the running sum) is
# written over its slice of the sum in place; any other's (`Given`, `Fresh`,
# `Switch`: the marks of `quax_tangents.optax.mark`) gives the layer's projector and
# factor as the scan's outputs.


class Pushable(NamedTuple):
    """What the scan needs of such a mark: the weight before the mark, its
    operands (those of its source: for a `Phased` mark the stacked sum last), and
    the spec."""

    marked_output: Any
    weight: Any
    operands: tuple
    spec: Finish


_tokens = itertools.count(1)


def _register_pushable(spec: Finish, w: Any, operands: tuple) -> Finish | None:
    if spec.kind != "projected" or not spec.by_layer or jnp.ndim(w) < 3:
        return None
    return dataclasses.replace(spec, token=next(_tokens))


def pushable(x: Any) -> Pushable | None:
    """The mark behind `x`, if `x` is a stacked projection mark asked to be
    projected layer by layer, as `mark_p` made it, not transposed since. A cast
    (`w.astype(bfloat16)`, as mixed-precision policies do) and a matrix view
    (`dims=` on a per-head weight) are kept: the scan slices the stack's layers
    either way, and the body sees each slice cast or viewed."""
    if not isinstance(x, Marked) or x.transposed or not x.token:
        return None
    entry = _state.pushable.get(x.token)
    if entry is None or jax.typeof(x.array) != jax.typeof(entry.marked_output):
        return None
    return entry


_ONE_SCAN = (
    "`quax_tangents.optax.accumulate_gradients` (and `qto.galore(...).value_and_grad`"
    ") and `quax_tangents.optax.mark` project a stacked weight's gradient layer by "
    "layer in the backward pass of the `lax.scan` over its stack; that needs the "
    "stack to be used in exactly one scan and nowhere else. Pass `by_layer=False` to "
    "`accumulate_gradients` or `mark` for a model that uses it more than once: the "
    "same result, with each layer's factors kept until the scan ends."
)


class LayerByLayerWarning(UserWarning):
    """Warned when `quax_tangents.optax.accumulate_gradients(by_layer=True)` (or
    `quax_tangents.optax.mark(by_layer=True)`, the default of both) finds a
    `lax.scan` over (or closing over) a stacked projected weight that it cannot
    project layer by layer: the result is the same, but every layer's factors are
    kept until the scan ends."""


def projected_by_scan(entry: Pushable) -> None:
    """Records that a scan projects `entry`'s mark: its own finish must then see no
    cotangent, and no other scan may project it too (each would add the running sum
    once more)."""
    if entry.spec.token in _state.projected_by_scan:
        raise ValueError(
            f"A marked stacked weight is scanned over by two `lax.scan`s. {_ONE_SCAN}"
        )
    _state.projected_by_scan.add(entry.spec.token)


mark_p = jexc.Primitive("mark_cotangent")
mark_p.def_impl(lambda w, *operands, spec: w)
mark_p.def_abstract_eval(lambda w, *operands, spec: w)
mlir.register_lowering(
    mark_p, mlir.lower_fun(lambda w, *operands, spec: w, multiple_results=False)
)


def _mark_jvp(primals: tuple, tangents: tuple, *, spec: Finish) -> tuple:
    # A trace cached with the mark in it (say by `jax.jit` under `grad`) and then
    # differentiated by plain JAX: the mark is the custom_vjp identity there, so
    # linearising and transposing finish the cotangent densely, as elsewhere.
    w, *operands = primals
    tangent = ad.instantiate_zeros(tangents[0])
    return jax.jvp(lambda w: _finished(spec, w, *operands), (w,), (tangent,))


def _mark_batch(args: tuple, dims: tuple, *, spec: Finish) -> tuple:
    mapped = jax.vmap(lambda w, *ops: _finished(spec, w, *ops), in_axes=tuple(dims))
    return mapped(*args), 0


batching.primitive_batchers[mark_p] = _mark_batch
ad.primitive_jvps[mark_p] = _mark_jvp


@rule(mark_p)
def _mark_rule(w: ArrayLike, *operands: ArrayLike, spec: Finish) -> Marked:
    tagged = _register_pushable(spec, w, operands)
    if tagged is None:
        return Marked(_finished(spec, w, *operands), spec.kind, False)
    array = _finished(tagged, w, *operands)
    token = tagged.token
    _state.pushable[token] = Pushable(array, w, tuple(operands), tagged)
    return Marked(array, spec.kind, False, by_layer=True, token=token)
