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

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jexc
import jax.numpy as jnp
import numpy as np
import quax
from jax.interpreters import ad, mlir
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from . import _fallback, _sharding, _validate
from ._projection import Finish, finish_p, outer_sum_p, rows_p
from ._registry import rule


_T = TypeVar("_T")


# ---------------------------------------------------------------------------------------
# The projector contract


class Projector(eqx.Module):
    """The projector of one weight for `projected_cotangent`, carried as data so that
    one jitted step serves both the steps that refresh it and those that do not.

    For a weight `w` of shape `(m, n)` and rank `r`, `matrix` has shape `(m, r)` when
    `m <= n` and `(n, r)` otherwise, the dtype of `w`, and orthonormal columns. When
    `refresh` is true, `matrix` is ignored (only its shape and dtype are read) and a
    fresh projector comes from the range finder, as with `projector=None`. Either
    way, the projector used is a factor of the gradient: `grad.left` when `m <= n`,
    `grad.right` otherwise; store it for the next steps.

    **Arguments:**

    - `matrix`: floating array `(min(m, n), r)`.
    - `refresh`: a bool scalar (Python or traced).
    """

    matrix: Float[Array, "side rank"]
    refresh: Bool[Array, ""]

    def __init__(self, matrix: Float[ArrayLike, "side rank"], refresh: Any):
        self.matrix = jnp.asarray(matrix)
        self.refresh = jnp.asarray(refresh)
        if self.refresh.shape != () or self.refresh.dtype != jnp.bool_:
            raise TypeError(
                "`Projector.refresh` must be a bool scalar, got "
                f"{self.refresh.dtype}{list(self.refresh.shape)}."
            )

    @classmethod
    def init(cls, shape: tuple[int, int], rank: int, dtype: Any) -> "Projector":
        """A placeholder (zeros) that asks for a fresh projector on first use."""
        m, n = shape
        return cls(jnp.zeros((min(m, n), rank), dtype), True)


# ---------------------------------------------------------------------------------------
# Public marks


def factored_cotangent(w: Float[Array, "m n"]) -> Float[Array, "m n"]:
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

    **Arguments:**

    - `w`: floating array `(m, n)`.

    **Returns:**

    `w`.
    """
    _check_matrix("w", w)
    return _mark(Finish("factored"), w, ())


def projected_cotangent(
    w: Float[Array, "m n"],
    rank: int,
    *,
    projector: Float[ArrayLike, "side rank"] | Projector | None = None,
    key: PRNGKeyArray | None = None,
    iters: int = 1,
) -> Float[Array, "m n"]:
    """The identity on a weight `w`, whose cotangent is the projection of its gradient
    `G` onto a rank-`rank` subspace of its smaller side, as in GaLore.

    Under `quax_tangents.grad`, `value_and_grad` and `vjp` the cotangent comes back
    as a `LowRank`: for `m <= n`, `LowRank(left=P, right=G^T P)` with `P` `(m, rank)`
    orthonormal (so the dense array is `P P^T G`); for `m > n`,
    `LowRank(left=G Q, right=Q)` with `Q` `(n, rank)` (the array `G Q Q^T`). Where `w`
    meets `dot_general`, `G = X^T C` is used only through `G v = X^T (C v)` and
    `G^T u = C^T (X u)`, `O(b (m + n) rank)` each: the `m x n` gradient is never
    formed. Uses of `w` elsewhere (weight decay, a tied embedding) add a dense term
    (counted); the result is then the projection of the dense total, never a
    different array. Elsewhere (plain `jax.grad`) it is the same projection, dense.

    **Arguments:**

    - `w`: floating array `(m, n)`.
    - `rank`: the rank `r`, `1 <= r <= min(m, n)`.
    - `projector`: `None` for a fresh projector from a randomized range finder on the
        implicit gradient; an array `(min(m, n), r)` of `w`'s dtype with orthonormal
        columns, used exactly (it is the `P`/`Q` factor of the result); or a
        `Projector`, which picks between the two with a traced bool.
    - `key`: PRNG key of the range finder's test matrix; `None` uses
        `jax.random.key(0)`.
    - `iters`: power iterations of the range finder.

    **Returns:**

    `w`.
    """
    m, n = _check_matrix("w", w)
    rank = _validate.check_positive_int(
        "rank", rank, upper=min(m, n), hint=f", the smaller side of `w` {(m, n)}"
    )
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"`iters` must be a non-negative int, got {iters!r}.")
    key_data, key_impl = _key_data(key)
    if projector is None:
        source, operands = "fresh", (key_data,)
    elif isinstance(projector, Projector):
        matrix = _check_projector(projector.matrix, w, rank)
        source, operands = "switch", (matrix, projector.refresh, key_data)
    else:
        source, operands = "given", (_check_projector(projector, w, rank),)
    spec = Finish("projected", rank, iters, source, key_impl)
    return _mark(spec, w, operands)


def sparse_rows_cotangent(table: Float[Array, "V d"]) -> Float[Array, "V d"]:
    """The identity on an embedding table, whose cotangent keeps only the rows read.

    Under `quax_tangents.grad`, `value_and_grad` and `vjp`, where `table` is read by
    a row gather (`jnp.take(table, ids, axis=0)`, `table[ids]`,
    `equinox.nn.Embedding`), its cotangent comes back as a `SparseRows` with one
    stored row per row read, duplicates summed into the first and the rest zero
    rows: at most `rows_read * (d * itemsize + 4)` bytes, never the `V x d` zeros
    that plain JAX scatters into. Other uses of `table` (a tied output projection)
    add a dense cotangent, and the sum is dense (counted). Elsewhere (plain
    `jax.grad`) it is the dense gradient.

    **Arguments:**

    - `table`: floating array `(V, d)`.

    **Returns:**

    `table`.
    """
    _check_matrix("table", table)
    return _mark(Finish("rows"), table, ())


# ---------------------------------------------------------------------------------------
# Input checks


def _check_matrix(name: str, w: Any) -> tuple[int, int]:
    if not jnp.issubdtype(jnp.result_type(w), jnp.floating):
        raise TypeError(
            f"`{name}` has dtype {jnp.result_type(w)}; only floating arrays have "
            "cotangents. Mark the floating weight, not the indices."
        )
    if jnp.ndim(w) != 2:
        raise ValueError(
            f"`{name}` must be a matrix (2 dims), got shape {jnp.shape(w)}. Mark "
            "each 2-d weight separately; leave biases and norms unmarked."
        )
    m, n = jnp.shape(w)
    return m, n


def _check_projector(matrix: Any, w: Any, rank: int) -> Any:
    m, n = jnp.shape(w)
    expected = (min(m, n), rank)
    if jnp.shape(matrix) != expected:
        raise ValueError(
            f"`projector` has shape {jnp.shape(matrix)}, but `w` of shape {(m, n)} at "
            f"rank {rank} needs {expected}: (rows of w, rank) when m <= n, "
            "(columns of w, rank) otherwise."
        )
    if jnp.result_type(matrix) != jnp.result_type(w):
        raise TypeError(
            f"`projector` has dtype {jnp.result_type(matrix)} but `w` has "
            f"{jnp.result_type(w)}; cast the projector to the weight's dtype."
        )
    return matrix


def _key_data(key: Any) -> tuple[Any, str]:
    key = jax.random.key(0) if key is None else key
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        return jax.random.key_data(key), str(jax.random.key_impl(key))
    if jnp.shape(key) != (2,) or jnp.result_type(key) != jnp.uint32:
        raise TypeError(
            "`key` must be a PRNG key (`jax.random.key(seed)`), got "
            f"{jnp.result_type(key)}{list(jnp.shape(key))}."
        )
    return key, "threefry2x32"


# ---------------------------------------------------------------------------------------
# Whether the entry point traces with the inner layer


class _NeedsInnerLayer(Exception):
    """Raised by a mark when an entry point traces without the inner layer."""


class _State(threading.local):
    def __init__(self) -> None:
        self.mode: str | None = None  # None, "probe" or "inner"


_state = _State()


def _mark(spec: Finish, w: Any, operands: tuple) -> Any:
    if _state.mode == "probe":
        raise _NeedsInnerLayer
    if _state.mode == "inner":
        return mark_p.bind(w, *operands, spec=spec)
    return _finished(spec, w, *operands)


def traced_with_marks(trace: Callable[[], _T]) -> _T:
    """Runs an entry point's `trace()`, and runs it again with the inner layer
    (`inner_layer`) when a mark is used; the counts of the first run are undone."""
    previous = _state.mode
    counts = Counter(_fallback._densify_counts), Counter(_fallback._budget_counts)
    _state.mode = "probe"
    try:
        return trace()
    except _NeedsInnerLayer:
        _restore(_fallback._densify_counts, counts[0])
        _restore(_fallback._budget_counts, counts[1])
        _state.mode = "inner"
        return trace()
    finally:
        _state.mode = previous


def _restore(counter: Counter, saved: Counter) -> None:
    counter.clear()
    counter.update(saved)


def inner_layer(fn: Callable) -> Callable:
    """`fn` traced under its own quax trace when marks are in use, so that their
    rules run above the AD transformation that wraps `fn`; otherwise `fn`."""
    if _state.mode != "inner":
        return fn
    return quax.quaxify(fn, filter_spec=lambda _: True)


# ---------------------------------------------------------------------------------------
# The mark: an identity whose backward pass finishes the total cotangent


def _finished_fwd(spec: Finish, w: Any, *operands: Any) -> tuple[Any, tuple]:
    return w, operands


def _finished_bwd(spec: Finish, operands: tuple, ct: Any) -> tuple:
    # A bwd rule may not return a quax value; a primitive whose quax rule builds one
    # can, because under the trace its output is a tracer.
    return (finish_p.bind(ct, *operands, spec=spec), *(None for _ in operands))


# The identity on `w`; `spec` and the operands only parameterise the backward pass.
_finished = jax.custom_vjp(lambda spec, w, *operands: w, nondiff_argnums=(0,))
_finished.defvjp(_finished_fwd, _finished_bwd)


mark_p = jexc.Primitive("mark_cotangent")
mark_p.def_impl(lambda w, *operands, spec: w)
mark_p.def_abstract_eval(lambda w, *operands, spec: w)
mlir.register_lowering(
    mark_p, mlir.lower_fun(lambda w, *operands, spec: w, multiple_results=False)
)


def _mark_jvp(primals: tuple, tangents: tuple, *, spec: Finish) -> tuple:
    raise RuntimeError(
        "A cotangent mark (`projected_cotangent`, `factored_cotangent`, "
        "`sparse_rows_cotangent`) reached JAX's differentiation without its rules: "
        "its function was traced by `quax_tangents.grad`/`value_and_grad`/`vjp`, "
        "cached (e.g. by `jax.jit`), and reused by another transformation, or it sits "
        "inside a transformation that the marks do not enter. Call the mark outside "
        "that transformation and pass the marked weight in, or call "
        "`jax.clear_caches()` before differentiating the function another way."
    )


ad.primitive_jvps[mark_p] = _mark_jvp


class Marked(quax.ArrayValue):
    """A marked weight inside the inner trace: `array` (or its transpose)."""

    array: Array
    kind: str = eqx.field(static=True)
    transposed: bool = eqx.field(static=True)

    def aval(self) -> jax.core.ShapedArray:
        # The weight's own type, with its sharding and varying mesh axes: JAX's
        # sharding and `check_vma` inference read them from the operands.
        return _sharding.transposed_type(jax.typeof(self.array), self.transposed)

    def materialise(self) -> Array:
        return self.array.T if self.transposed else self.array

    @staticmethod
    def default(primitive: jexc.Primitive, values: Any, params: dict) -> Any:
        # The weight itself: an identity, not a densification.
        arrays = [v.materialise() if isinstance(v, Marked) else v for v in values]
        return primitive.bind(*arrays, **params)


@rule(mark_p)
def _mark_rule(w: ArrayLike, *operands: ArrayLike, spec: Finish) -> Marked:
    return Marked(_finished(spec, w, *operands), spec.kind, False)


@rule(jax.lax.transpose_p)
def _transpose_marked(w: Marked, *, permutation: tuple[int, ...]) -> Marked:
    flip = tuple(permutation) == (1, 0)
    return Marked(w.array, w.kind, w.transposed != flip)


# ---------------------------------------------------------------------------------------
# dot_general with a marked weight


@dataclasses.dataclass(frozen=True)
class _Dot:
    """A `dot_general` whose operand `w_is_lhs` is the (maybe transposed) weight."""

    params: tuple
    w_is_lhs: bool
    transposed: bool

    def bind(self, x: Any, w: Any) -> Any:
        w = w.T if self.transposed else w
        lhs, rhs = (w, x) if self.w_is_lhs else (x, w)
        return jax.lax.dot_general_p.bind(lhs, rhs, **dict(self.params))


def _dot_fwd(dot: _Dot, x: Any, w: Any) -> tuple[Any, tuple]:
    return dot.bind(x, w), (x, w)


def _dot_bwd(dot: _Dot, residuals: tuple, ct: Any) -> tuple:
    x, w = residuals
    _, pullback = jax.vjp(lambda x: dot.bind(x, w), x)
    (ct_x,) = pullback(ct)
    a, b = _gradient_factors(dot, x, ct)
    a, b = a.astype(w.dtype), b.astype(w.dtype)
    return ct_x, outer_sum_p.bind(a, b)


_factored_dot = jax.custom_vjp(_Dot.bind, nondiff_argnums=(0,))
_factored_dot.defvjp(_dot_fwd, _dot_bwd)


def _contraction(dot: _Dot) -> tuple[int, int] | None:
    """`(x's contracting dim, w's contracting dim)` when the dot contracts exactly
    one dim of the weight and has no batch dims; otherwise `None`."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dict(dot.params)["dimension_numbers"]
    if lhs_b or rhs_b or len(lhs_c) != 1:
        return None
    (w_c, x_c) = (lhs_c[0], rhs_c[0]) if dot.w_is_lhs else (rhs_c[0], lhs_c[0])
    return x_c, w_c


def _gradient_factors(dot: _Dot, x: Array, ct: Array) -> tuple[Array, Array]:
    """`(a, b)` with the weight's gradient `a^T b`: `x` and `ct` flattened over the
    rows that the product sums over."""
    contraction = _contraction(dot)
    assert contraction is not None
    x_c, w_c = contraction
    rows_x = jnp.moveaxis(x, x_c, -1)
    rows_x = rows_x.reshape(-1, rows_x.shape[-1])
    # The weight's free dim is the output's first (w on the left) or last dim.
    rows_ct = jnp.moveaxis(ct, 0, -1) if dot.w_is_lhs else ct
    rows_ct = rows_ct.reshape(-1, rows_ct.shape[-1])
    # The gradient of the operand (w or w.T) is x^T ct if its contracting dim comes
    # first, ct^T x otherwise; transposing the operand swaps them again.
    x_first = (w_c == 0) != dot.transposed
    return (rows_x, rows_ct) if x_first else (rows_ct, rows_x)


def _dot_marked(x: Any, w: Marked, w_is_lhs: bool, params: dict) -> Any:
    dot = _Dot(tuple(sorted(params.items())), w_is_lhs, w.transposed)
    if w.kind == "rows" or _contraction(dot) is None:
        return Marked.default(
            jax.lax.dot_general_p, (w, x) if w_is_lhs else (x, w), params
        )
    return _factored_dot(dot, x, w.array)


@rule(jax.lax.dot_general_p)
def _dot_dense_marked(x: ArrayLike, w: Marked, **params: Any) -> Array:
    return _dot_marked(x, w, False, params)


@rule(jax.lax.dot_general_p)
def _dot_marked_dense(w: Marked, x: ArrayLike, **params: Any) -> Array:
    return _dot_marked(x, w, True, params)


# ---------------------------------------------------------------------------------------
# Row gathers from a marked table


@dataclasses.dataclass(frozen=True)
class _Gather:
    params: tuple

    def bind(self, table: Any, indices: Any) -> Any:
        return jax.lax.gather_p.bind(table, indices, **dict(self.params))


def _row_position(params: dict, shape: tuple[int, ...]) -> int | None:
    """Where the row number sits in a gather's index vectors, when the gather reads
    whole rows of a `(V, d)` table; otherwise `None`."""
    numbers = params["dimension_numbers"]
    whole_rows = tuple(params["slice_sizes"]) == (1, shape[1])
    if (
        not whole_rows
        or numbers.operand_batching_dims
        or 0 not in numbers.start_index_map
    ):
        return None
    return tuple(numbers.start_index_map).index(0)


def _gather_fwd(gather: _Gather, table: Any, indices: Any) -> tuple[Any, tuple]:
    return gather.bind(table, indices), (indices, jnp.shape(table))


def _gather_bwd(gather: _Gather, residuals: tuple, ct: Any) -> tuple:
    indices, (num_rows, row_size) = residuals
    params = dict(gather.params)
    ids = indices[..., _row_position(params, (num_rows, row_size))].reshape(-1)
    offset_dims = params["dimension_numbers"].offset_dims
    rows = jnp.moveaxis(ct, offset_dims, range(ct.ndim - len(offset_dims), ct.ndim))
    rows = rows.reshape(-1, row_size)
    if params["mode"] == jax.lax.GatherScatterMode.CLIP:
        ids = jnp.clip(ids, 0, num_rows - 1)
    else:  # out-of-bounds reads add nothing
        inside = (ids >= 0) & (ids < num_rows)
        rows = jnp.where(inside[:, None], rows, 0)
        ids = jnp.where(inside, ids, 0)
    return rows_p.bind(ids.astype(np.int32), rows, num_rows=num_rows), None


_rows_gather = jax.custom_vjp(_Gather.bind, nondiff_argnums=(0,))
_rows_gather.defvjp(_gather_fwd, _gather_bwd)


@rule(jax.lax.gather_p)
def _gather_marked(table: Marked, indices: ArrayLike, **params: Any) -> Array:
    rows_read = table.kind == "rows" and not table.transposed
    if not rows_read or _row_position(params, table.shape) is None:
        return Marked.default(jax.lax.gather_p, (table, indices), params)
    return _rows_gather(_Gather(tuple(sorted(params.items()))), table.array, indices)


# A single row read with a scalar index (`table[i]`, `equinox.nn.Embedding` outside
# `vmap`) is a dynamic_slice.


def _slice_row(table: Any, row: Any, column: Any) -> Any:
    return jax.lax.dynamic_slice_p.bind(
        table, row, column, slice_sizes=(1, jnp.shape(table)[1])
    )


def _slice_fwd(table: Any, row: Any, column: Any) -> tuple[Any, tuple]:
    return _slice_row(table, row, column), (row, jnp.shape(table)[0])


def _slice_bwd(residuals: tuple, ct: Any) -> tuple:
    row, num_rows = residuals
    # dynamic_slice clamps its start so that the slice fits.
    ids = jnp.clip(jnp.reshape(row, (1,)), 0, num_rows - 1).astype(np.int32)
    return rows_p.bind(ids, ct, num_rows=num_rows), None, None


_rows_slice = jax.custom_vjp(_slice_row)
_rows_slice.defvjp(_slice_fwd, _slice_bwd)


@rule(jax.lax.dynamic_slice_p)
def _slice_marked(
    table: Marked, row: ArrayLike, column: ArrayLike, *, slice_sizes: tuple
) -> Array:
    if table.kind != "rows" or table.transposed or slice_sizes != (1, table.shape[1]):
        return Marked.default(
            jax.lax.dynamic_slice_p, (table, row, column), dict(slice_sizes=slice_sizes)
        )
    return _rows_slice(table.array, row, column)
