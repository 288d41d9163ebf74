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
import functools as ft
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jexc
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array, ArrayLike

from .._core import _sharding
from .._core._devices import axes_of, dense_all_reduce
from .._core._fallback import record_densification
from .._core._layout import constrain, drop_leading
from .._core._registry import rule
from .._core._unchecked import unchecked
from .._types._primitives import (
    define_batched,
    outer_abstract,
    outer_dense,
)
from .._types.lowrank import LowRank, within_budget
from .._types.outer import OuterSum
from .._types.rows import SparseRows
from ._sources import Fresh, Phased, Source


def define_primitive(
    primitive: jexc.Primitive, dense: Callable, abstract: Callable
) -> None:
    """`primitive`'s dense semantics (outside a quax trace) and its shapes."""
    primitive.def_impl(dense)
    primitive.def_abstract_eval(abstract)
    mlir.register_lowering(primitive, mlir.lower_fun(dense, multiple_results=False))


# ---------------------------------------------------------------------------------------
# outer_sum: (a, b) -> a^T b, the gradient of a weight from one dot_general use, for
# `a` `(*batch, R, m)` and `b` `(*batch, R, n)` (one gradient per batch element)

outer_sum_p = jexc.Primitive("outer_sum")
define_batched(outer_sum_p, outer_dense, outer_abstract)


@rule(outer_sum_p)
def _outer_sum(a: ArrayLike, b: ArrayLike, *, batch_ndim: int) -> OuterSum:
    a, b = jnp.asarray(a), jnp.asarray(b)
    return OuterSum(jnp.swapaxes(a, -1, -2), jnp.swapaxes(b, -1, -2))


# ---------------------------------------------------------------------------------------
# rows: (ids, rows) -> zeros (num_rows, d) with rows[i] added at row ids[i]

rows_p = jexc.Primitive("rows")


def _rows_dense(ids: Array, rows: Array, *, num_rows: int) -> Array:
    zeros = jnp.zeros((num_rows, *rows.shape[1:]), rows.dtype)
    return zeros.at[ids].add(rows, mode="drop")


def _rows_abstract(ids: Any, rows: Any, *, num_rows: int) -> jax.core.ShapedArray:
    return _sharding.varying_type((num_rows, *rows.shape[1:]), rows.dtype, ids, rows)


define_primitive(rows_p, _rows_dense, _rows_abstract)


@rule(rows_p)
def _rows(ids: ArrayLike, rows: ArrayLike, *, num_rows: int) -> SparseRows:
    return SparseRows.build(jnp.asarray(ids), jnp.asarray(rows), num_rows)


# ---------------------------------------------------------------------------------------
# finish: a marked weight's total cotangent in its final form


Kind = Literal["factored", "projected", "rows"]


@dataclasses.dataclass(frozen=True)
class Finish:
    """What `finish_p` makes of a cotangent, and which operands follow it.

    `source` says where a projection's projector comes from, and so which operands
    follow the cotangent: one of the types of `quax_tangents._marks._sources`
    (`Given`, `Fresh`, `Switch`, `Phased`).
    """

    kind: Kind
    rank: int = 0
    iters: int = 0
    source: Source = Fresh()
    key_impl: str = "threefry2x32"
    oversample: int = 4
    # Which mark a spec belongs to, when a scan over its stack may project it layer
    # by layer (see `quax_tangents._marks._marked_scan`); not compared.
    token: int = dataclasses.field(default=0, compare=False)
    # Whether a scan over a stacked weight may project it layer by layer
    # (`accumulate_gradients(by_layer=...)`, `quax_tangents.optax.mark(by_layer=...)`).
    by_layer: bool = False
    # How the running sum `S` of an `into` source is laid out over a mesh (a
    # `NamedSharding`, or None): each slice's new sum is constrained to its share,
    # so that the partitioner reduce-scatters it rather than all-reducing.
    layout: Any = None
    # Inside `shard_map`, data parallel (`quax_tangents.optax.mark(axis_name=...)`):
    # the mesh axes over which a fresh projector's products with the gradient are
    # summed, so that every device finds the projector of the summed gradient from
    # its own part of it. None: the cotangent is the whole gradient.
    axis_name: Any = None

    def __post_init__(self):
        if not isinstance(self.source, Source):
            raise TypeError(
                f"`source` must be a `Source` (quax_tangents._marks._sources), got "
                f"{self.source!r}."
            )


finish_p = jexc.Primitive("finish")


def _work_dtype(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


def _orthonormal(x: Array) -> Array:
    # Not `jnp.linalg.qr`, which refuses rows sharded over an explicit mesh axis:
    # a shifted eigh step then two unshifted ones on small Gram matrices, exact to
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
    if spec.axis_name is not None:
        # Products with the summed gradient: each device's, summed (small: `m` or
        # `n` by the sketch's width), the same on every device afterwards.
        apply, apply_t = (
            _summed(apply, spec.axis_name),
            _summed(apply_t, spec.axis_name),
        )
    sketch = test_matrix(key, shape, spec.rank, spec.oversample)
    basis = _orthonormal(apply(sketch))
    for _ in range(spec.iters):
        basis = _orthonormal(apply(_orthonormal(apply_t(basis))))
    u = _sharding.top_left_singular(apply_t(basis).T, spec.rank)
    projector = _sharding.matmul(basis, u, _sharding.EXACT)
    return projector * _sharding.column_signs(projector)


def _summed(product: Callable, axis_name: Any) -> Callable:
    """`product`, summed over the axes of `axis_name` that its result varies over
    (a cotangent already summed over the devices is the same on each)."""

    def summed(x: Array) -> Array:
        y = product(x)
        axes = tuple(a for a in axes_of(axis_name) if a in _sharding.varying_axes(y))
        return dense_all_reduce(y, axes) if axes else y

    return summed


def sketch_width(shape: tuple[int, int], rank: int, oversample: int) -> int:
    """Columns of the range finder's test matrix for a rank-`rank` projector."""
    return min(rank + oversample, *shape)


def test_matrix(key: Any, shape: tuple[int, int], rank: int, oversample: int) -> Array:
    """The range finder's random-sign test matrix `(n, width)` for the `(m, n)`
    matrix whose column space it finds (`m` the smaller side of the weight)."""
    # Random signs, not Gaussian draws: the range finder needs a sub-Gaussian sketch
    # only (Halko, Martinsson and Tropp, 2011), and the normal's inverse error
    # function cost 1.2 to 2.6 s of the 1B step's compile time for a TPU v5e chip
    # (one microbatch, two runs: 29.5 -> 28.3 s and 32.9 -> 30.3 s).
    width = sketch_width(shape, rank, oversample)
    return jax.random.rademacher(key, (shape[1], width), _work_dtype(jnp.float32))


def _key(spec: Finish, key_data: Array) -> Any:
    return jax.random.wrap_key_data(key_data, impl=spec.key_impl)


def _projector(
    spec: Finish, operands: tuple, apply: Callable, apply_t: Callable, shape: tuple
) -> Array:
    """The projector this step uses, in the working dtype."""
    if spec.source.given:
        return operands[0].astype(_work_dtype(operands[0].dtype))
    fresh = lambda: _range_basis(apply, apply_t, shape, spec, _key(spec, operands[-1]))  # noqa: E731
    if isinstance(spec.source, Fresh):
        return fresh()
    # A `Switch`: keep the given projector or find a fresh one.
    given, refresh = operands[0], operands[1]
    given = given.astype(_work_dtype(given.dtype))
    # Both cases of the switch must share a sharding (explicit mesh axes).
    return jax.lax.cond(refresh, lambda: _sharding.like(fresh(), given), lambda: given)


def _projected(
    spec: Finish,
    operands: tuple,
    apply: Callable,
    apply_t: Callable,
    shape: tuple[int, int],
    dtype: Any,
) -> LowRank:
    """`LowRank(P, G^T P)` for `m <= n`, `LowRank(G Q, Q)` for `m > n`, from the
    products of `G` alone."""
    m, n = shape
    if m > n:  # project G^T, whose smaller side comes first
        apply, apply_t, shape = apply_t, apply, (n, m)
    if isinstance(spec.source, Phased):
        return _phased(spec, operands, apply, apply_t, shape, m <= n, dtype)
    basis = _projector(spec, operands, apply, apply_t, shape)
    if spec.source.given:
        basis_out = operands[0].astype(dtype)  # exactly the projector given
    else:
        basis_out = basis.astype(dtype)
    other = apply_t(basis)
    if spec.source.into:
        total = operands[1].astype(other.dtype)
        other = _sharding.like(other, total) + total
    other = other.astype(dtype)
    # Computed, not user input: a NaN in the gradient flows on (see `_unchecked`).
    if m <= n:
        return unchecked(LowRank, left=basis_out, right=other, projector_side="left")
    return unchecked(LowRank, left=other, right=basis_out, projector_side="right")


def _phased(
    spec: Finish,
    operands: tuple,
    apply: Callable,
    apply_t: Callable,
    shape: tuple[int, int],
    m_le_n: bool,
    dtype: Any,
) -> LowRank:
    """A `Phased` mark's `LowRank(M, F)` (`(F, M)` for a tall weight), its factor
    `F` chosen by the phase operand with a `lax.switch` of small products; `shape`
    is `(small, large)`."""
    source = spec.source
    assert isinstance(source, Phased)
    matrix, key_data, phase = operands[:3]
    small, large = shape
    work = _work_dtype(dtype)

    def given() -> Array:
        return apply_t(matrix.astype(work))

    # Under explicit mesh axes the branches of a switch must agree in layout: each
    # gives its factor laid out as the sum (or as the projection, without one).
    reference = operands[-1] if source.into else given()

    def in_rows(sketch: Array) -> Array:
        # A sketch `(small, r)` in the first rows of a `(large, r)` factor; its rows
        # gathered first where sharded, as the zeros below them are not.
        if small < large:
            sketch = _sharding.typed_like_spec(sketch, ())
            rest = jnp.zeros((large - small, sketch.shape[-1]), sketch.dtype)
            sketch = jnp.concatenate([sketch, rest], axis=0)
        return _sharding.like(sketch, reference)

    def drawn() -> Array:
        omega = test_matrix(_key(spec, key_data), shape, spec.rank, 0)
        return in_rows(apply(omega))

    branches = [lambda: _sharding.like(given(), reference), drawn]
    if source.tested:
        tests = operands[3]
        branches.append(lambda: in_rows(apply(tests.astype(work))))
    other = jax.lax.switch(phase, branches)
    if source.into:
        other = other + operands[-1].astype(other.dtype)
    other, basis = other.astype(dtype), matrix.astype(dtype)
    if m_le_n:
        return unchecked(LowRank, left=basis, right=other, projector_side="left")
    return unchecked(LowRank, left=other, right=basis, projector_side="right")


def _over_slices(fn: Callable, spec: Finish, arrays: int, batch_ndim: int) -> Callable:
    """`fn(*arrays, *operands)` for one matrix, over `batch_ndim` leading dims of
    the arrays and of the per-slice operands: one slice after another
    (`lax.map`), so that a slice's working buffers (its test matrix, the float32
    products, a refresh's range finder) are live one slice at a time, and a
    `lax.cond` between keeping and refreshing a projector stays a branch."""
    if batch_ndim == 0:
        return fn
    if isinstance(spec.source, Phased) and spec.source.into:
        return _into_slices(fn, batch_ndim, spec.source.per_slice, spec.layout)
    per_slice = (True,) * arrays + spec.source.per_slice

    def mapped(*args: Any) -> Any:
        batch = args[0].shape[:batch_ndim]
        sliced = [
            a.reshape(-1, *a.shape[batch_ndim:]) if cut else None
            for a, cut in zip(args, per_slice)
        ]
        shared = [None if cut else a for a, cut in zip(args, per_slice)]

        def one(xs: tuple) -> Any:
            full = [x if cut else y for x, y, cut in zip(xs, shared, per_slice)]
            return fn(*full)

        out = jax.lax.map(one, tuple(sliced))
        return jtu.tree_map(lambda y: y.reshape(*batch, *y.shape[1:]), out)

    return mapped


def _into_slices(
    fn: Callable, batch_ndim: int, per_slice: tuple[bool, ...], layout: Any = None
) -> Callable:
    """`fn(*arrays, *operands, sum)` of a finish into a running sum (`Phased`),
    slice by slice in a loop that writes each slice's new sum over the
    old one (in place), so that the stack of sums is the only factor-sized buffer.
    `per_slice`: the source's, whether each operand (the sum last) is per slice."""

    def mapped(*args: Any) -> LowRank:
        count = len(per_slice)
        arrays, operands = args[:-count], args[-count:-1]
        total = args[-1]
        batch = total.shape[:batch_ndim]
        flat = lambda a: a.reshape(-1, *a.shape[batch_ndim:])  # noqa: E731
        arrays = [flat(a) for a in arrays]
        operands = [flat(o) if cut else o for o, cut in zip(operands, per_slice)]
        left_side: list[bool] = []
        slice_layout = drop_leading(layout, batch_ndim)

        def body(i: Any, buffer: Any) -> Any:
            take = lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False)  # noqa: E731
            sliced = [take(o) if cut else o for o, cut in zip(operands, per_slice)]
            out = fn(*[take(a) for a in arrays], *sliced, take(buffer))
            left_side.append(out.projector_side == "left")
            factor = out.right if left_side[-1] else out.left
            new = constrain(factor.astype(total.dtype), slice_layout)
            return jax.lax.dynamic_update_index_in_dim(buffer, new, i, 0)

        sums = jax.lax.fori_loop(0, flat(total).shape[0], body, flat(total))
        sums = sums.reshape(total.shape)
        projector = operands[0]
        basis = projector.reshape(*batch, *projector.shape[1:]).astype(total.dtype)
        if left_side[0]:
            return unchecked(LowRank, left=basis, right=sums, projector_side="left")
        return unchecked(LowRank, left=sums, right=basis, projector_side="right")

    return mapped


def _project_factors(spec: Finish, left: Array, right: Array, *operands) -> LowRank:
    apply, apply_t = _factor_products(left, right)
    shape = (left.shape[0], right.shape[0])
    return _projected(spec, operands, apply, apply_t, shape, left.dtype)


def _project_dense(spec: Finish, g: Array, *operands: Array) -> LowRank:
    apply, apply_t = _dense_products(g)
    m, n = g.shape
    return _projected(spec, operands, apply, apply_t, (m, n), g.dtype)


def project_outer(spec: Finish, ct: OuterSum, operands: tuple) -> LowRank:
    """The projection of a (stacked) `OuterSum`, slice by slice."""
    fn = _over_slices(ft.partial(_project_factors, spec), spec, 2, ct.batch_ndim)
    return fn(ct.left, ct.right, *operands)


def project_dense(spec: Finish, g: Array, operands: tuple) -> LowRank:
    """The projection of a (stacked) dense gradient, slice by slice."""
    fn = _over_slices(ft.partial(_project_dense, spec), spec, 1, g.ndim - 2)
    return fn(g, *operands)


def _factor_products(left: Array, right: Array) -> tuple[Callable, Callable]:
    """`v -> G v` and `u -> G^T u` for `G = left @ right.T`, in the working dtype."""
    work = _work_dtype(left.dtype)
    left, right = left.astype(work), right.astype(work)
    mm = _sharding.matmul
    return (lambda v: mm(left, mm(right.T, v))), (lambda u: mm(right, mm(left.T, u)))


def project_rows(spec: Finish, ct: SparseRows, operands: tuple) -> LowRank:
    """The projection of a table's gradient that row gathers made (one slice)."""
    apply, apply_t = _rows_products(ct.indices, ct.rows, ct.num_rows)
    shape = (ct.num_rows, ct.rows.shape[1])
    return _projected(spec, operands, apply, apply_t, shape, ct.rows.dtype)


def _rows_products(ids: Array, rows: Array, num_rows: int) -> tuple[Callable, Callable]:
    """`v -> G v` and `u -> G^T u` for the `(num_rows, d)` gradient `G` that
    holds `rows[i]` added at row `ids[i]`: products with the rows read, never
    with a table-sized array (`G v` is a scatter-add of `rows @ v`)."""
    rows = rows.astype(_work_dtype(rows.dtype))
    mm = _sharding.matmul

    def apply(v: Array) -> Array:
        return jnp.zeros((num_rows, v.shape[1]), v.dtype).at[ids].add(mm(rows, v))

    return apply, (lambda u: mm(rows.T, u[ids]))


def _dense_products(g: Array) -> tuple[Callable, Callable]:
    g = g.astype(_work_dtype(g.dtype))
    return (lambda v: _sharding.matmul(g, v)), (lambda u: _sharding.matmul(g.T, u))


def _finish_dense(ct: Array, *operands: Array, spec: Finish) -> Array:
    if spec.kind != "projected":
        return ct
    return project_dense(spec, ct, operands).materialise()


def _finish_abstract(ct: Any, *operands: Any, spec: Finish) -> jax.core.ShapedArray:
    # The cotangent's own type: its sharding and varying mesh axes too.
    return ct


define_primitive(finish_p, _finish_dense, _finish_abstract)


def _finish_jvp(primals: tuple, tangents: tuple, *, spec: Finish) -> tuple:
    # Linear in the cotangent for a given projector; the operands are constants.
    tangent = ad.instantiate_zeros(tangents[0])
    if spec.source.into:
        # Affine: the sum does not move with `ct`.
        linear = dataclasses.replace(spec, source=spec.source.linear())
        return finish_p.bind(*primals, spec=spec), finish_p.bind(
            tangent, *primals[1:-1], spec=linear
        )
    return finish_p.bind(*primals, spec=spec), finish_p.bind(
        tangent, *primals[1:], spec=spec
    )


ad.primitive_jvps[finish_p] = _finish_jvp


def _finish_batch(args: tuple, dims: tuple, *, spec: Finish) -> tuple:
    # One dense finish per batch element (a vmapped loss with a mark, differentiated
    # by plain JAX).
    finish = lambda ct, *ops: _finish_dense(ct, *ops, spec=spec)  # noqa: E731
    return jax.vmap(finish, in_axes=tuple(dims))(*args), 0


batching.primitive_batchers[finish_p] = _finish_batch


def typed_as(finished: Any, ct_type: Any) -> Any:
    """A finished cotangent typed exactly as the weight's cotangent `ct_type` (a
    custom_vjp's output must be): a `LowRank`'s factors follow the weight's
    sharding, each on its own side, a dense array takes it whole. Nothing moves
    without explicit mesh axes."""
    if isinstance(finished, LowRank):
        factors = _sharding.factors_like(finished.left, finished.right, ct_type)
        return eqx.tree_at(lambda x: (x.left, x.right), finished, factors)
    if isinstance(finished, jax.Array) and _sharding.explicit_axes():
        spec = getattr(getattr(ct_type, "sharding", None), "spec", None)
        return finished if spec is None else _sharding.typed_like_spec(finished, spec)
    return finished


@rule(finish_p)
def _finish_outer(ct: OuterSum, *operands: ArrayLike, spec: Finish) -> Any:
    return typed_as(_finished_outer(ct, operands, spec), ct.aval())


def _finished_outer(ct: OuterSum, operands: tuple, spec: Finish) -> Any:
    if spec.kind == "factored":
        return within_budget(finish_p, ct.left, ct.right)
    if spec.kind == "projected":
        return project_outer(spec, ct, operands)
    record_densification(finish_p.name, ("OuterSum",), "a matmul of a row-marked table")
    return ct.materialise()


@rule(finish_p, dense_output=True)
def _finish_array(ct: ArrayLike, *operands: ArrayLike, spec: Finish) -> Any:
    # A dense total: some use of the weight had no compressed form. It is counted
    # here, where the mark had to take a dense cotangent, whatever made it dense. A
    # projection still compresses it.
    ct = jnp.asarray(ct)
    record_densification(
        finish_p.name,
        ("Marked",),
        "the marked weight's total cotangent is dense",
        "A use of the weight other than a matmul, or a sum over devices of its "
        "gradient (`psum_invariant`, inside `shard_map`), made it so: counted under "
        "that primitive too, with what to change.",
    )
    if spec.kind != "projected":
        return ct
    return typed_as(project_dense(spec, ct, operands), jax.typeof(ct))


@rule(finish_p)
def _finish_rows(ct: SparseRows, *operands: ArrayLike, spec: Finish) -> Any:
    if spec.kind == "projected" and ct.indices.ndim == 1 and ct.rows.ndim == 2:
        # A table read by row gathers, projected from the rows read.
        return typed_as(project_rows(spec, ct, operands), ct.aval())
    if spec.kind != "rows":
        record_densification(finish_p.name, ("SparseRows",), "a row gather of a matrix")
        dense = ct.materialise()
        return (
            project_dense(spec, dense, operands) if spec.kind == "projected" else dense
        )
    return unique_rows(ct)


def unique_rows(x: SparseRows) -> SparseRows:
    """The same array with each row number stored once per slice (duplicates
    summed), padded with zero rows at row 0 to the same number of stored rows."""

    def one(indices: Array, rows: Array) -> tuple[Array, Array]:
        ids, inverse = jnp.unique(
            indices, size=indices.shape[0], fill_value=0, return_inverse=True
        )
        return ids, jnp.zeros_like(rows).at[inverse.reshape(-1)].add(rows)

    for _ in range(x.batch_ndim):
        one = jax.vmap(one)
    # The stored rows whole on every device: the sort of their numbers needs them
    # all.
    k_axis = x.batch_ndim
    indices = _sharding.unsharded_along(x.indices, k_axis)
    ids, rows = one(indices, _sharding.unsharded_along(x.rows, k_axis))
    return SparseRows.build(ids, rows, x.num_rows)
