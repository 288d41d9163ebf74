"""Construction primitives of the cotangents that are born compressed.

- `outer_sum_p(a, b)`: the weight gradient `a^T b` of one `dot_general` use, kept as
    an `OuterSum` of its factors under quax.
- `rows_p(ids, rows)`: the table gradient of one row gather, a `SparseRows` under
    quax (a scatter-add into zeros outside it).
- `finish_p(ct, *operands, spec=)`: a marked weight's total cotangent turned into its
    final form: a `LowRank` under the rank budget, a projection onto a rank-`r`
    subspace of the smaller side, or deduplicated rows.

Outside a quax trace each one computes its dense semantics, so that plain `jax.grad`
of code with marks computes the same numbers densely.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.core
import jax.extend.core as jexc
import jax.numpy as jnp
from jax.interpreters import ad, mlir
from jaxtyping import Array, ArrayLike

from . import _sharding
from ._fallback import record_densification
from ._primitives import _outer_abstract, _outer_dense
from ._registry import rule
from ._types.lowrank import LowRank, within_budget
from ._types.outer import OuterSum
from ._types.rows import SparseRows


def _define(primitive: jexc.Primitive, dense: Callable, abstract: Callable) -> None:
    primitive.def_impl(dense)
    primitive.def_abstract_eval(abstract)
    mlir.register_lowering(primitive, mlir.lower_fun(dense, multiple_results=False))


# ---------------------------------------------------------------------------------------
# outer_sum: (a, b) -> a^T b, the gradient of a weight from one dot_general use

outer_sum_p = jexc.Primitive("outer_sum")
_define(
    outer_sum_p,
    lambda a, b: _outer_dense(a, b, batch_ndim=0),
    lambda a, b: _outer_abstract(a, b, batch_ndim=0),
)


@rule(outer_sum_p)
def _outer_sum(a: ArrayLike, b: ArrayLike) -> OuterSum:
    return OuterSum(jnp.asarray(a).T, jnp.asarray(b).T)


# ---------------------------------------------------------------------------------------
# rows: (ids, rows) -> zeros (num_rows, d) with rows[i] added at row ids[i]

rows_p = jexc.Primitive("rows")


def _rows_dense(ids: Array, rows: Array, *, num_rows: int) -> Array:
    zeros = jnp.zeros((num_rows, *rows.shape[1:]), rows.dtype)
    return zeros.at[ids].add(rows, mode="drop")


def _rows_abstract(ids: Any, rows: Any, *, num_rows: int) -> jax.core.ShapedArray:
    return jax.core.ShapedArray((num_rows, *rows.shape[1:]), rows.dtype)


_define(rows_p, _rows_dense, _rows_abstract)


@rule(rows_p)
def _rows(ids: ArrayLike, rows: ArrayLike, *, num_rows: int) -> SparseRows:
    return SparseRows.build(jnp.asarray(ids), jnp.asarray(rows), num_rows)


# ---------------------------------------------------------------------------------------
# finish: a marked weight's total cotangent in its final form


Kind = Literal["factored", "projected", "rows"]
Source = Literal["given", "fresh", "switch"]


@dataclasses.dataclass(frozen=True)
class Finish:
    """What `finish_p` makes of a cotangent, and which operands follow it.

    `source` says where a projection's projector comes from: `"given"` (operands:
    the projector), `"fresh"` (operands: the key data) or `"switch"` (operands: the
    projector, a bool saying "refresh", the key data).
    """

    kind: Kind
    rank: int = 0
    iters: int = 0
    source: Source = "fresh"
    key_impl: str = "threefry2x32"
    oversample: int = 4


finish_p = jexc.Primitive("finish")


def _work_dtype(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


def _orthonormal(x: Array) -> Array:
    # Not `jnp.linalg.qr`, which refuses rows sharded over an explicit mesh axis:
    # shifted Cholesky-QR then two eigh passes on small Gram matrices, exact to
    # rounding against QR's range (see `_sharding.orthonormal_columns`).
    return _sharding.orthonormal_columns(x)


def _range_basis(
    apply: Callable, apply_t: Callable, shape: tuple[int, int], spec: Finish, key: Any
) -> Array:
    """An orthonormal `(m, rank)` basis of the dominant column space of the `(m, n)`
    matrix `G` that `apply(v) = G v` and `apply_t(u) = G^T u` act as: a randomized
    range finder with `spec.iters` power iterations and a little oversampling,
    truncated with the top left singular vectors of the small `width x n` matrix
    `Y^T G` (from its `width x width` Gram matrix, so that `n` may be sharded)."""
    m, n = shape
    width = min(spec.rank + spec.oversample, m, n)
    dtype = _work_dtype(jnp.float32)
    sketch = jax.random.normal(key, (n, width), dtype)
    basis = _orthonormal(apply(sketch))
    for _ in range(spec.iters):
        basis = _orthonormal(apply(_orthonormal(apply_t(basis))))
    u = _sharding.top_left_singular(apply_t(basis).T, spec.rank)
    return _sharding.matmul(basis, u)


def _key(spec: Finish, key_data: Array) -> Any:
    return jax.random.wrap_key_data(key_data, impl=spec.key_impl)


def _projector(
    spec: Finish, operands: tuple, apply: Callable, apply_t: Callable, shape: tuple
) -> Array:
    """The projector this step uses, in the working dtype."""
    if spec.source == "given":
        return operands[0].astype(_work_dtype(operands[0].dtype))
    fresh = lambda: _range_basis(apply, apply_t, shape, spec, _key(spec, operands[-1]))  # noqa: E731
    if spec.source == "fresh":
        return fresh()
    given, refresh = operands[0], operands[1]
    given = given.astype(_work_dtype(given.dtype))
    # Both cases of the switch must share a sharding (explicit mesh axes).
    return jax.lax.cond(refresh, lambda: _sharding.like(fresh(), given), lambda: given)


def _projected(
    spec: Finish,
    operands: tuple,
    apply: Callable,
    apply_t: Callable,
    shape: tuple[int, ...],
    dtype: Any,
) -> LowRank:
    """`LowRank(P, G^T P)` for `m <= n`, `LowRank(G Q, Q)` for `m > n`, from the
    products of `G` alone."""
    m, n = shape
    if m > n:  # project G^T, whose smaller side comes first
        apply, apply_t, shape = apply_t, apply, (n, m)
    basis = _projector(spec, operands, apply, apply_t, shape)
    if spec.source == "given":
        basis_out = operands[0]  # exactly the projector given
    else:
        basis_out = basis.astype(dtype)
    other = apply_t(basis).astype(dtype)
    return LowRank(basis_out, other) if m <= n else LowRank(other, basis_out)


def _factor_products(left: Array, right: Array) -> tuple[Callable, Callable]:
    """`v -> G v` and `u -> G^T u` for `G = left @ right.T`, in the working dtype."""
    work = _work_dtype(left.dtype)
    left, right = left.astype(work), right.astype(work)
    mm = _sharding.matmul
    return (lambda v: mm(left, mm(right.T, v))), (lambda u: mm(right, mm(left.T, u)))


def _dense_products(g: Array) -> tuple[Callable, Callable]:
    g = g.astype(_work_dtype(g.dtype))
    return (lambda v: _sharding.matmul(g, v)), (lambda u: _sharding.matmul(g.T, u))


def _finish_dense(ct: Array, *operands: Array, spec: Finish) -> Array:
    if spec.kind != "projected":
        return ct
    apply, apply_t = _dense_products(ct)
    return _projected(spec, operands, apply, apply_t, ct.shape, ct.dtype).materialise()


def _finish_abstract(ct: Any, *operands: Any, spec: Finish) -> jax.core.ShapedArray:
    # The cotangent's own type: its sharding and varying mesh axes too.
    return ct


_define(finish_p, _finish_dense, _finish_abstract)


def _finish_jvp(primals: tuple, tangents: tuple, *, spec: Finish) -> tuple:
    # Linear in the cotangent for a given projector; the operands are constants.
    tangent = ad.instantiate_zeros(tangents[0])
    return finish_p.bind(*primals, spec=spec), finish_p.bind(
        tangent, *primals[1:], spec=spec
    )


ad.primitive_jvps[finish_p] = _finish_jvp


@rule(finish_p)
def _finish_outer(ct: OuterSum, *operands: ArrayLike, spec: Finish) -> Any:
    if spec.kind == "factored":
        return within_budget(finish_p, ct.left, ct.right)
    if spec.kind == "projected":
        apply, apply_t = _factor_products(ct.left, ct.right)
        return _projected(spec, operands, apply, apply_t, ct.shape, ct.dtype)
    record_densification(finish_p.name, ("OuterSum",), "a matmul of a row-marked table")
    return ct.materialise()


@rule(finish_p)
def _finish_array(ct: ArrayLike, *operands: ArrayLike, spec: Finish) -> Any:
    # A dense total: some use of the weight had no compressed form (and was counted
    # where it was added). A projection still compresses it.
    ct = jnp.asarray(ct)
    if spec.kind != "projected":
        return ct
    apply, apply_t = _dense_products(ct)
    return _projected(spec, operands, apply, apply_t, ct.shape, ct.dtype)


@rule(finish_p)
def _finish_rows(ct: SparseRows, *operands: ArrayLike, spec: Finish) -> Any:
    if spec.kind != "rows":
        record_densification(finish_p.name, ("SparseRows",), "a row gather of a matrix")
        return _finish_array(ct.materialise(), *operands, spec=spec)
    return unique_rows(ct)


def unique_rows(x: SparseRows) -> SparseRows:
    """The same array with each row number stored once (duplicates summed), padded
    with zero rows at row 0 to the same number of stored rows."""
    ids, inverse = jnp.unique(x.indices, size=x.k, fill_value=0, return_inverse=True)
    rows = jnp.zeros_like(x.rows).at[inverse.reshape(-1)].add(x.rows)
    return SparseRows.build(ids, rows, x.num_rows)
