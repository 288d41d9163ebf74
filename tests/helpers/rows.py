"""Random `SparseRows` values and the property-test cases of every SparseRows rule."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import quax_tangents as qt
from quax_tangents._core._lax import add_any_p
from tests.helpers import float_dtypes, random_array, seeds
from tests.helpers.cases import Case, bind_convert, case


def random_rows(seed, num_rows, row_size, k, dtype=jnp.float32, batch=()):
    """A `SparseRows` `(*batch, num_rows, row_size)` with `k` uniformly random
    (possibly repeated) row numbers per slice and standard normal rows,
    reproducible from `seed`."""
    indices = np.random.default_rng(seed).integers(0, num_rows, (*batch, k))
    rows = random_array(seed + 1, (*batch, k, row_size), dtype)
    return qt.SparseRows(indices, rows, num_rows)


@st.composite
def rows_values(draw, num_rows=None, row_size=None, dtype=None, k=None, batch=None):
    """A `SparseRows` of shape `(*batch, num_rows, row_size)` (drawn 1..6 each if
    `None`; `batch` none, one or two dims of 1..3) with `k` stored rows per slice
    (drawn 1..6), duplicates likely."""
    if batch is None:
        batch = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 2))))
    num_rows = draw(st.integers(1, 6)) if num_rows is None else num_rows
    row_size = draw(st.integers(1, 6)) if row_size is None else row_size
    dtype = draw(float_dtypes()) if dtype is None else dtype
    k = draw(st.integers(1, 6)) if k is None else k
    return random_rows(draw(seeds()), num_rows, row_size, k, dtype, batch)


def _unary(fn):
    return rows_values().map(lambda x: Case(fn, (x,), x.dtype, qt.SparseRows))


@case("neg", "SparseRows")
def _neg():
    return _unary(jax.lax.neg)


@case("copy", "SparseRows")
def _copy():
    return _unary(jnp.copy)


@case("convert_element_type", "SparseRows")
def _convert():
    @st.composite
    def draw_case(draw):
        x = draw(rows_values())
        target = draw(float_dtypes())
        fn = bind_convert(target)
        # Duplicate rows are rounded one by one before they add up.
        coarse = max((x.dtype, target), key=lambda d: jnp.finfo(d).eps)
        return Case(fn, (x,), coarse, qt.SparseRows, factor=2.0)

    return draw_case()


@st.composite
def _scaled(draw, rows_first):
    x = draw(rows_values())
    kind = draw(st.sampled_from(["scalar", "full"]))
    y_shape = () if kind == "scalar" else x.shape
    y = random_array(draw(seeds()), y_shape, x.dtype)
    args = (x, y) if rows_first else (y, x)
    return Case(jax.lax.mul, args, x.dtype, qt.SparseRows, factor=2.0)


@case("mul", "SparseRows", "dense")
def _mul_right():
    return _scaled(True)


@case("mul", "dense", "SparseRows")
def _mul_left():
    return _scaled(False)


@case("div", "SparseRows", "dense")
def _div():
    @st.composite
    def draw_case(draw):
        x = draw(rows_values())
        shape = draw(st.sampled_from([(), (1,) * x.ndim]))
        y = random_array(draw(seeds()), shape, x.dtype)
        # Away from zero, as a mean's count is.
        y = (jnp.sign(y) + (y == 0)) * (1 + jnp.abs(y))
        return Case(jax.lax.div, (x, y), x.dtype, qt.SparseRows, factor=2.0)

    return draw_case()


@st.composite
def _pair(draw, fn):
    x = draw(rows_values())
    y = draw(rows_values(x.num_rows, x.shape[-1], x.dtype, batch=x.shape[:-2]))
    return Case(fn, (x, y), x.dtype, qt.SparseRows, factor=2.0)


@case("add_any", "SparseRows", "SparseRows")
def _add_any():
    return _pair(add_any_p.bind)


@case("add", "SparseRows", "SparseRows")
def _add():
    return _pair(jax.lax.add)


@case("sub", "SparseRows", "SparseRows")
def _sub():
    return _pair(jax.lax.sub)


@st.composite
def _with_dense(draw, fn, rows_first):
    x = draw(rows_values())
    y = random_array(draw(seeds()), x.shape, x.dtype)
    args = (x, y) if rows_first else (y, x)
    return Case(fn, args, x.dtype, jax.Array, factor=2.0)


@case("add_any", "SparseRows", "dense")
def _add_any_right():
    return _with_dense(add_any_p.bind, True)


@case("add_any", "dense", "SparseRows")
def _add_any_left():
    return _with_dense(add_any_p.bind, False)


@case("add", "SparseRows", "dense")
def _add_right():
    return _with_dense(jax.lax.add, True)


@case("add", "dense", "SparseRows")
def _add_left():
    return _with_dense(jax.lax.add, False)
