"""`SparseRows.inner` of two `SparseRows`: from the stored rows, duplicates summed,
checked against the materialised arrays."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

import quax_tangents as qt
from tests.helpers import assert_close, float_dtypes
from tests.helpers.rows import rows_values


def _dense(x):
    return np.asarray(qt.materialise(x).astype(jnp.float32), np.float64)


def _magnitude(a, b):
    """A bound on the sum of the magnitudes of the products summed: each stored row
    of `a` meets at most all `k` stored rows of `b`."""
    rows = lambda x: np.abs(np.asarray(x.rows.astype(jnp.float32)))  # noqa: E731
    return float(np.sum(rows(a)) * np.max(rows(b), initial=0.0) * b.k)


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_the_inner_product_of_two_sparse_rows_matches_dense(data):
    # Few shapes, so that the examples share their compiled programs; duplicate
    # rows are likely at every one.
    batch = data.draw(st.sampled_from([(), (2,), (2, 3)]))
    num_rows, row_size = data.draw(st.sampled_from([(1, 1), (4, 3), (6, 2)]))
    dtype = data.draw(float_dtypes())
    k = data.draw(st.sampled_from([1, 5]))
    a = data.draw(rows_values(num_rows, row_size, dtype, k=k, batch=batch))
    b = data.draw(rows_values(num_rows, row_size, dtype, k=k, batch=batch))
    with qt.fallback("error"):  # nothing dense
        for x, y in [(a, b), (a, a)]:
            expected = float(np.sum(_dense(x) * _dense(y)))
            assert_close(x.inner(y), expected, dtype, scale=_magnitude(x, y))


def test_rows_stored_twice_add_up_before_they_are_multiplied():
    # Row 1 stored twice: the array's row 1 is their sum, [4, 6]; squared, 52.
    a = qt.SparseRows(jnp.array([1, 1]), jnp.array([[1.0, 2.0], [3.0, 4.0]]), 3)
    b = qt.SparseRows(jnp.array([2, 1]), jnp.array([[5.0, 5.0], [1.0, -1.0]]), 3)
    with qt.fallback("error"):
        assert float(a.inner(a)) == 52.0
        assert float(jax.jit(qt.norm)(a) ** 2) == 52.0
        assert float(jax.jit(lambda a, b: a.inner(b))(a, b)) == 4.0 - 6.0
