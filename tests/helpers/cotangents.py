"""Cases of the rules behind the cotangent marks: the `OuterSum` type, the
construction primitives of `quax_tangents._marks._projection` and `_slices`, and the
`Marked` weight."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume, strategies as st

import quax_tangents as qt
from quax_tangents._core._lax import add_any_p
from quax_tangents._marks._cotangents import mark_p
from quax_tangents._marks._marked import Marked, full_perm
from quax_tangents._marks._projection import Finish, finish_p, outer_sum_p, rows_p
from quax_tangents._marks._slices import (
    projected_factor_p,
    projected_pair_p,
    projection_p,
)
from quax_tangents._marks._sources import Fresh, Given, Phased, Switch
from quax_tangents._types.outer import OuterSum
from tests.helpers import float_dtypes, random_array, seeds
from tests.helpers.cases import Case, case
from tests.helpers.rows import rows_values


@st.composite
def batches(draw, max_ndim=2):
    """Leading batch dims of a stacked weight: none, one or two."""
    ndim = draw(st.integers(0, max_ndim))
    return tuple(draw(st.integers(1, 3)) for _ in range(ndim))


@st.composite
def outer_sums(draw, shape=None, dtype=None, batch=None):
    """An `OuterSum` `(*batch, m, n)` of a drawn (or given) shape with 1..5 standard
    normal terms per batch element."""
    batch = draw(batches()) if batch is None else batch
    m, n = shape or (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    dtype = draw(float_dtypes()) if dtype is None else dtype
    terms, seed = draw(st.integers(1, 5)), draw(seeds())
    return OuterSum(
        random_array(seed, (*batch, m, terms), dtype),
        random_array(seed + 1, (*batch, n, terms), dtype),
    )


@case("add_any", "OuterSum", "OuterSum")
def _add_any():
    @st.composite
    def draw_case(draw):
        x = draw(outer_sums())
        y = draw(outer_sums(x.shape[-2:], x.dtype, x.shape[:-2]))
        return Case(add_any_p.bind, (x, y), x.dtype, OuterSum, factor=4.0)

    return draw_case()


@case("reduce_sum", "OuterSum")
def _reduce_sum():
    @st.composite
    def draw_case(draw):
        # A sum over some batch dims: the terms side by side.
        batch = draw(batches().filter(bool))
        x = draw(outer_sums(dtype=jnp.float32, batch=batch))
        axes = tuple(draw(st.sets(st.sampled_from(range(len(batch))), min_size=1)))
        fn = lambda a: jnp.sum(a, axis=axes)  # noqa: E731
        return Case(fn, (x,), out_type=OuterSum, factor=4.0)

    return draw_case()


@st.composite
def _with_dense(draw, outer_first):
    x = draw(outer_sums())
    y = random_array(draw(seeds()), x.shape, x.dtype)
    args = (x, y) if outer_first else (y, x)
    return Case(add_any_p.bind, args, x.dtype, jax.Array, factor=4.0)


@case("add_any", "OuterSum", "dense")
def _add_any_right():
    return _with_dense(True)


@case("add_any", "dense", "OuterSum")
def _add_any_left():
    return _with_dense(False)


@case("outer_sum", "dense", "dense")
def _outer_sum():
    @st.composite
    def draw_case(draw):
        batch = draw(batches())
        rows, m, n = (draw(st.integers(1, 5)) for _ in range(3))
        dtype, seed = draw(float_dtypes()), draw(seeds())
        a, b = (
            random_array(seed, (*batch, rows, m), dtype),
            random_array(seed + 1, (*batch, rows, n), dtype),
        )
        fn = lambda a, b: outer_sum_p.bind(a, b, batch_ndim=len(batch))  # noqa: E731
        return Case(fn, (a, b), dtype, OuterSum, factor=4.0)

    return draw_case()


@case("rows", "dense", "dense")
def _rows():
    @st.composite
    def draw_case(draw):
        num_rows, k, d = (draw(st.integers(1, 6)) for _ in range(3))
        seed = draw(seeds())
        ids = jnp.asarray(np.random.default_rng(seed).integers(0, num_rows, k))
        rows = random_array(seed + 1, (k, d))
        fn = lambda i, r: rows_p.bind(i, r, num_rows=num_rows)  # noqa: E731
        return Case(fn, (ids, rows), out_type=qt.SparseRows, factor=2.0)

    return draw_case()


# ---------------------------------------------------------------------------------------
# finish


@st.composite
def _finish_operands(draw, shape, batch=()):
    """A projection spec for a matrix of `shape` (stacked over `batch`) and its
    operands: one projector and one key per slice, one `refresh` for all."""
    m, n = shape
    rank = draw(st.integers(1, min(m, n)))
    source = draw(st.sampled_from([Given(), Fresh(), Switch()]))
    iters = draw(st.integers(0, 2))
    spec = Finish("projected", rank=rank, iters=iters, source=source)
    keys = jax.random.split(jax.random.key(draw(seeds())), math.prod(batch))
    key = jax.random.key_data(keys.reshape(batch))
    projector = jnp.linalg.qr(random_array(draw(seeds()), (*batch, min(m, n), rank)))[0]
    refresh = jnp.asarray(draw(st.booleans()))
    operands = {
        Given(): (projector,),
        Fresh(): (key,),
        Switch(): (projector, refresh, key),
    }[source]
    return spec, operands


def _finish_fn(spec):
    return lambda ct, *operands: finish_p.bind(ct, *operands, spec=spec)


@case("finish", "OuterSum", "*dense")
def _finish_outer():
    @st.composite
    def draw_case(draw):
        x = draw(outer_sums(dtype=jnp.float32))
        m, n = x.shape[-2:]
        if draw(st.booleans()):
            # Factored: within the rank budget, an exact LowRank.
            assume(x.left.shape[-1] * (m + n) < m * n)
            return Case(_finish_fn(Finish("factored")), (x,), out_type=qt.LowRank)
        spec, operands = draw(_finish_operands((m, n), x.shape[:-2]))
        # The range finder sees the same matrix through different products.
        return Case(_finish_fn(spec), (x, *operands), out_type=qt.LowRank, factor=50.0)

    return draw_case()


@case("finish", "dense", "*dense")
def _finish_dense():
    @st.composite
    def draw_case(draw):
        batch = draw(batches())
        shape = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
        g = random_array(draw(seeds()), (*batch, *shape))
        kind = draw(st.sampled_from(["factored", "rows", "projected"]))
        if kind != "projected":
            return Case(_finish_fn(Finish(kind)), (g,), out_type=jax.Array)
        spec, operands = draw(_finish_operands(shape, batch))
        return Case(_finish_fn(spec), (g, *operands), out_type=qt.LowRank, factor=4.0)

    return draw_case()


@case("finish", "SparseRows", "*dense")
def _finish_rows():
    def build(x):
        return Case(_finish_fn(Finish("rows")), (x,), x.dtype, qt.SparseRows, 2.0)

    return rows_values().map(build)


# ---------------------------------------------------------------------------------------
# One slice of a projection inside a loop over the slices, and the stacked result


@st.composite
def _into_operands(draw, shape, batch):
    """A `Phased` spec for a matrix of `shape` (stacked over `batch`), in a drawn
    phase, and its operands: a projector (or basis), key data, the phase, test
    matrices when drawn with them, and a running sum."""
    m, n = shape
    small, large = min(m, n), max(m, n)
    rank = draw(st.integers(1, small))
    tested = draw(st.booleans())
    phase = jnp.int32(draw(st.integers(0, 2 if tested else 1)))
    projector = jnp.linalg.qr(random_array(draw(seeds()), (*batch, small, rank)))[0]
    keys = jax.random.split(jax.random.key(draw(seeds())), math.prod(batch))
    key = jax.random.key_data(keys).reshape((*batch, -1))
    tests = (random_array(draw(seeds()), (*batch, large, rank)),) if tested else ()
    total = random_array(draw(seeds()), (*batch, large, rank))
    spec = Finish("projected", rank, 0, Phased(tested=tested), "threefry2x32", 0)
    return spec, (projector, key, phase, *tests, total)


def _projected_factor_fn(spec):
    return lambda ct, *operands: projected_factor_p.bind(ct, *operands, spec=spec)


@case("projected_factor", "OuterSum", "*dense")
def _projected_factor_outer():
    @st.composite
    def draw_case(draw):
        x = draw(outer_sums(dtype=jnp.float32, batch=draw(batches(max_ndim=1))))
        spec, operands = draw(_into_operands(x.shape[-2:], x.shape[:-2]))
        fn = _projected_factor_fn(spec)
        return Case(fn, (x, *operands), out_type=jax.Array, factor=4.0)

    return draw_case()


@case("projected_factor", "dense", "*dense")
def _projected_factor_dense():
    @st.composite
    def draw_case(draw):
        batch = draw(batches(max_ndim=1))
        shape = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
        g = random_array(draw(seeds()), (*batch, *shape))
        spec, operands = draw(_into_operands(shape, batch))
        fn = _projected_factor_fn(spec)
        return Case(fn, (g, *operands), out_type=jax.Array, factor=4.0)

    return draw_case()


def _projected_pair_fn(spec, wide):
    """The projection that `projected_pair`'s projector and factor make (`P F^T`,
    or `F P^T` for a tall matrix): the projector's columns beyond the gradient's
    rank are any orthonormal completion, so the pair is compared through it."""

    def fn(ct, *operands):
        projector, factor = projected_pair_p.bind(ct, *operands, spec=spec)
        product = projector @ jnp.swapaxes(factor, -1, -2)
        return product if wide else jnp.swapaxes(product, -1, -2)

    return fn


@case("projected_pair", "OuterSum", "*dense")
def _projected_pair_outer():
    @st.composite
    def draw_case(draw):
        x = draw(outer_sums(dtype=jnp.float32, batch=draw(batches(max_ndim=1))))
        m, n = x.shape[-2:]
        spec, operands = draw(_finish_operands((m, n), x.shape[:-2]))
        fn = _projected_pair_fn(spec, m <= n)
        return Case(fn, (x, *operands), out_type=jax.Array, factor=50.0)

    return draw_case()


@case("projected_pair", "dense", "*dense")
def _projected_pair_dense():
    @st.composite
    def draw_case(draw):
        batch = draw(batches(max_ndim=1))
        m, n = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
        g = random_array(draw(seeds()), (*batch, m, n))
        spec, operands = draw(_finish_operands((m, n), batch))
        fn = _projected_pair_fn(spec, m <= n)
        return Case(fn, (g, *operands), out_type=jax.Array, factor=4.0)

    return draw_case()


@case("projection", "dense", "dense")
def _projection():
    @st.composite
    def draw_case(draw):
        batch = draw(batches(max_ndim=1))
        side, other, rank = (draw(st.integers(1, 5)) for _ in range(3))
        projector = random_array(draw(seeds()), (*batch, side, rank))
        factor = random_array(draw(seeds()), (*batch, other, rank))
        left = draw(st.booleans())
        fn = lambda p, f: projection_p.bind(p, f, left=left)  # noqa: E731
        return Case(fn, (projector, factor), out_type=qt.LowRank, factor=2.0)

    return draw_case()


# ---------------------------------------------------------------------------------------
# Marked weights, inside the inner trace


@st.composite
def _marked(draw, kind=None, transposed=None, batch=None, cast=None):
    """A `Marked` weight `(*batch, m, n)`, maybe transposed, maybe seen in another
    float dtype."""
    batch = draw(batches()) if batch is None else batch
    shape = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    kind = (
        draw(st.sampled_from(["factored", "projected", "rows"]))
        if kind is None
        else kind
    )
    transposed = draw(st.booleans()) if transposed is None else transposed
    cast = draw(st.sampled_from([None, jnp.bfloat16])) if cast is None else cast
    array = random_array(draw(seeds()), (*batch, *shape))
    return Marked(array, kind, transposed, None if cast is False else cast)


@case("mark_cotangent", "dense", "*dense")
def _mark():
    @st.composite
    def draw_case(draw):
        w = random_array(draw(seeds()), (draw(st.integers(1, 5)), 3))
        projector = random_array(draw(seeds()), (min(w.shape), 1))
        spec = Finish("projected", rank=1, source=Given())
        fn = lambda w, p: mark_p.bind(w, p, spec=spec)  # noqa: E731
        return Case(fn, (w, projector), out_type=Marked)

    return draw_case()


@case("transpose", "Marked")
def _transpose():
    @st.composite
    def draw_case(draw):
        w = draw(_viewed()) if draw(st.booleans()) else draw(_marked())
        # The matrix dims permuted; batch dims permuted too (dense, counted).
        nb = w.array.ndim - 2
        batch = draw(st.permutations(range(nb))) if nb else []
        matrix = tuple(draw(st.permutations(range(nb, w.ndim))))
        if w.view is None:
            matrix = draw(st.sampled_from([(nb, nb + 1), (nb + 1, nb)]))
        permutation = (*batch, *matrix)
        # Bound directly: `lax.transpose` skips the identity permutation.
        fn = lambda a: jax.lax.transpose_p.bind(a, permutation=permutation)  # noqa: E731
        out = Marked if list(batch) == list(range(nb)) else jax.Array
        return Case(fn, (w,), w.dtype, out_type=out)

    return draw_case()


@case("convert_element_type", "Marked")
def _convert():
    @st.composite
    def draw_case(draw):
        w = draw(_marked())
        dtype = draw(
            st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32])
        )
        # Bound directly: `lax.convert_element_type` skips a cast to the same dtype.
        fn = lambda a: jax.lax.convert_element_type_p.bind(  # noqa: E731
            a, new_dtype=jnp.dtype(dtype), weak_type=False, sharding=None
        )
        out = Marked if jnp.issubdtype(dtype, jnp.floating) else jax.Array
        return Case(fn, (w,), jnp.bfloat16, out_type=out)

    return draw_case()


def _factorisations(n):
    """Ways to write `n` as a product of one or two sizes."""
    pairs = [(a, n // a) for a in range(2, n) if n % a == 0]
    return [(n,), *pairs]


@case("reshape", "Marked")
def _reshape():
    @st.composite
    def draw_case(draw):
        w = draw(_marked(kind=draw(st.sampled_from(["factored", "projected"]))))
        *batch, m, n = w.array.shape
        # Split the rows or the columns (kept as a view), or flatten (dense).
        how = draw(st.sampled_from(["rows", "cols", "flatten"]))
        if how == "flatten" or w.transposed:
            sizes = (*batch, m * n)
        elif how == "rows":
            sizes = (*batch, *draw(st.sampled_from(_factorisations(m))), n)
        else:
            sizes = (*batch, m, *draw(st.sampled_from(_factorisations(n))))
        if w.transposed:
            sizes = (*batch, m * n)
        # Bound directly: `lax.reshape` skips a reshape to the same shape.
        fn = lambda a: jax.lax.reshape_p.bind(  # noqa: E731
            a, new_sizes=sizes, dimensions=None, sharding=None
        )
        kept = how != "flatten" and not w.transposed and m * n > 1
        return Case(fn, (w,), w.dtype, out_type=Marked if kept else None)

    return draw_case()


@st.composite
def _viewed(draw):
    """A `Marked` seen through a view: rows and columns each split into one or two
    dims, the non-batch dims permuted."""
    w = draw(_marked(kind=draw(st.sampled_from(["factored", "projected"]))))
    *_, m, n = w.array.shape
    rows = draw(st.sampled_from(_factorisations(m)))
    cols = draw(st.sampled_from(_factorisations(n)))
    perm = tuple(draw(st.permutations(range(len(rows) + len(cols)))))
    return w.replace(transposed=False, view=(rows, cols, perm))


@st.composite
def _dot_viewed(draw, marked_first):
    """A contraction of every dim of one side of a viewed weight, in a drawn order."""
    w = draw(_viewed())
    rows, cols, _ = w.view
    nb = w.array.ndim - 2
    full = full_perm(w.view, nb)
    side = draw(st.sampled_from(["rows", "cols"]))
    lo, hi = (nb, nb + len(rows)) if side == "rows" else (nb + len(rows), w.ndim)
    w_c = [a for a in range(nb, w.ndim) if lo <= full[a] < hi]
    w_c = list(draw(st.permutations(w_c)))
    free_shape = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2))))
    batch = w.shape[:nb]
    x = random_array(draw(seeds()), batch + free_shape + tuple(w.shape[a] for a in w_c))
    x_c = tuple(range(nb + len(free_shape), x.ndim))
    batch_dims = (tuple(range(nb)), tuple(range(nb)))
    if marked_first:
        dims = ((tuple(w_c), x_c), batch_dims)
        fn = lambda a, b: jax.lax.dot_general(a, b, dims)  # noqa: E731
        return Case(fn, (w, x), w.dtype, out_type=jax.Array)
    dims = ((x_c, tuple(w_c)), batch_dims)
    fn = lambda a, b: jax.lax.dot_general(a, b, dims)  # noqa: E731
    return Case(fn, (x, w), w.dtype, out_type=jax.Array)


@st.composite
def _dot(draw, marked_first):
    if draw(st.booleans()):
        return draw(_dot_viewed(marked_first))
    w = draw(_marked())
    nb = w.ndim - 2
    m, n = w.shape[-2:]
    batch = w.shape[:nb]
    # A contraction of either matrix side of the weight, with one or two free dims
    # of `x`; the weight's batch dims are the dot's batch dims.
    contract_first = draw(st.booleans())
    free_shape = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2))))
    x = random_array(
        draw(seeds()), batch + free_shape + ((m if contract_first else n),)
    )
    w_dim = nb if contract_first else nb + 1
    x_dim = x.ndim - 1
    batch_dims = (tuple(range(nb)), tuple(range(nb)))
    if marked_first:
        dims = (((w_dim,), (x_dim,)), batch_dims)
        fn = lambda a, b: jax.lax.dot_general(a, b, dims)  # noqa: E731
        return Case(fn, (w, x), w.dtype, out_type=jax.Array)
    dims = (((x_dim,), (w_dim,)), batch_dims)
    fn = lambda a, b: jax.lax.dot_general(a, b, dims)  # noqa: E731
    return Case(fn, (x, w), w.dtype, out_type=jax.Array)


@case("dot_general", "dense", "Marked")
def _dot_right():
    return _dot(False)


@case("dot_general", "Marked", "dense")
def _dot_left():
    return _dot(True)


@case("gather", "Marked", "dense")
def _gather():
    @st.composite
    def draw_case(draw):
        w = draw(_marked(transposed=False, batch=()))
        ids_shape = tuple(
            draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2)))
        )
        ids = np.random.default_rng(draw(seeds())).integers(0, w.shape[0], ids_shape)
        fn = lambda table, i: jnp.take(table, i, axis=0)  # noqa: E731
        return Case(fn, (w, jnp.asarray(ids)), w.dtype, out_type=jax.Array)

    return draw_case()


@case("dynamic_slice", "Marked", "dense", "dense")
def _dynamic_slice():
    @st.composite
    def draw_case(draw):
        w = draw(_marked(transposed=False, batch=()))
        row = jnp.asarray(draw(st.integers(-1, w.shape[0])), jnp.int32)
        size = (1, w.shape[1])
        fn = lambda table, r: jax.lax.dynamic_slice(table, (r, 0), size)  # noqa: E731
        return Case(fn, (w, row), w.dtype, out_type=jax.Array)

    return draw_case()
