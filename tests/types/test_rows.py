"""`SparseRows.inner` of two `SparseRows`: from the stored rows, duplicates summed,
checked against the materialised arrays."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st
from jax.sharding import AxisType, PartitionSpec as P

import quax_tangents as qt
from tests.helpers import assert_close, float_dtypes
from tests.helpers.collective import skip_without_devices
from tests.helpers.rows import rows_values


def _dense(x):
    return np.asarray(qt.materialise(x).astype(jnp.float32), np.float64)


def _magnitude(a, b):
    """A bound on the sum of the magnitudes of the products summed: each stored row
    of `a` meets at most all `k` stored rows of `b`."""
    rows = lambda x: np.abs(np.asarray(x.rows.astype(jnp.float32)))  # noqa: E731
    return float(np.sum(rows(a)) * np.max(rows(b), initial=0.0) * b.k)


# Jitted: one compile per shape, where run op by op each shape compiles many.
_inner = jax.jit(lambda a, b: a.inner(b))


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
            assert_close(_inner(x, y), expected, dtype, scale=_magnitude(x, y))


def test_rows_stored_twice_add_up_before_they_are_multiplied():
    # Row 1 stored twice: the array's row 1 is their sum, [4, 6]; squared, 52.
    a = qt.SparseRows(jnp.array([1, 1]), jnp.array([[1.0, 2.0], [3.0, 4.0]]), 3)
    b = qt.SparseRows(jnp.array([2, 1]), jnp.array([[5.0, 5.0], [1.0, -1.0]]), 3)
    with qt.fallback("error"):
        assert float(a.inner(a)) == 52.0
        assert float(jax.jit(qt.norm)(a) ** 2) == 52.0
        assert float(jax.jit(lambda a, b: a.inner(b))(a, b)) == 4.0 - 6.0


@skip_without_devices(2)
def test_the_inner_product_of_rows_sharded_along_the_stored_rows():
    # Under explicit mesh axes a batch's row numbers come sharded along the stored
    # rows; the sort that finds the distinct ones needs them whole.
    mesh = jax.make_mesh(
        (2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )
    a = qt.SparseRows(jnp.array([1, 1, 3, 0]), jnp.arange(8.0).reshape(4, 2), 5)
    expected = float(np.sum(_dense(a) ** 2))
    with jax.set_mesh(mesh):
        shard = lambda x: jax.device_put(x, P("data"))  # noqa: E731
        sharded = qt.SparseRows.build(shard(a.indices), shard(a.rows), a.num_rows)
        got = jax.jit(lambda x: x.inner(x))(sharded)
    assert float(got) == expected


@skip_without_devices(2)
def test_rows_sharded_along_the_stored_rows_materialise():
    # The scatter that adds the rows into zeros laid out otherwise keeps the
    # zeros' layout.
    mesh = jax.make_mesh(
        (2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )
    a = qt.SparseRows(jnp.array([1, 1, 3, 0]), jnp.arange(8.0).reshape(4, 2), 6)
    with jax.set_mesh(mesh):
        shard = lambda x: jax.device_put(x, P("data"))  # noqa: E731
        sharded = qt.SparseRows.build(shard(a.indices), shard(a.rows), a.num_rows)
        dense = jax.jit(qt.materialise)(sharded)
    np.testing.assert_array_equal(dense, _dense(a))
