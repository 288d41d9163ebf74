"""`Sparse` and `top_k`: construction, validation, accounting, the compressor, rules
under `jit`/`vmap`/`jvp`, and the densification paths."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quax
from hypothesis import given, settings, strategies as st

import quax_tangents as qt
from quax_tangents._core._fallback import is_vector_shape
from tests.helpers import assert_close
from tests.helpers.sparse import (
    dense_sparse,
    dot_general_operands,
    numpy_dot_general,
    random_array,
    random_sparse,
    sparse_values,
)


def _numpy(x):
    return np.asarray(jnp.asarray(qt.materialise(x), jnp.float32), np.float64)


# ------------------------------------------------------------------------------------
# Construction and validation


def test_construction_and_materialise_add_duplicates():
    indices = np.array([0, 5, 5, 11])
    values = np.array([1.0, 2.0, -0.5, 3.0], np.float32)
    x = qt.Sparse(indices, values, (3, 4))
    assert x.shape == (3, 4) and x.dtype == jnp.float32
    assert x.indices.dtype == jnp.int32 and x.event_shape == (3, 4) and x.k == 4
    expected = np.zeros(12)
    np.add.at(expected, indices, values)
    np.testing.assert_array_equal(_numpy(x), expected.reshape(3, 4))


def test_batched_construction():
    indices = np.array([[0, 3], [2, 2]])
    values = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    x = qt.Sparse(indices, values, (2, 2, 2))
    assert x.shape == (2, 2, 2) and x.event_shape == (2, 2)
    expected = np.zeros((2, 4))
    np.add.at(expected, (np.arange(2)[:, None], indices), values)
    np.testing.assert_array_equal(_numpy(x), expected.reshape(2, 2, 2))


def test_zero_dimensional_event():
    x = qt.Sparse(np.zeros(3, np.int32), np.ones(3, np.float32), ())
    assert x.shape == () and float(x.materialise()) == 3.0


@pytest.mark.parametrize(
    "indices, values, shape, error, field",
    [
        (np.array([0.0, 1.0]), np.ones(2, np.float32), (4,), TypeError, "indices"),
        (np.array([0, 1]), np.ones(2, np.int32), (4,), TypeError, "values"),
        (np.array([0, 1]), np.ones(3, np.float32), (4,), ValueError, "indices"),
        (np.array(0), np.ones((), np.float32), (4,), ValueError, "indices"),
        (np.array([0, 4]), np.ones(2, np.float32), (4,), ValueError, "indices"),
        (np.array([-1, 0]), np.ones(2, np.float32), (4,), ValueError, "indices"),
        (np.array([2**32 + 1]), np.ones(1, np.float32), (4,), ValueError, "indices"),
        (
            np.array([[0], [1]]),
            np.ones((2, 1), np.float32),
            (3, 4),
            ValueError,
            "shape",
        ),
        (np.array([0, 1]), np.ones(2, np.float32), (4, -1), TypeError, "shape"),
        (np.array([0, 1]), np.ones(2, np.float32), 4, TypeError, "shape"),
        (np.array([0]), np.array([np.nan], np.float32), (4,), ValueError, "values"),
        (np.array([0]), np.array([np.inf], np.float32), (4,), ValueError, "values"),
        (np.array([0]), np.ones(1, np.float32), (2**16, 2**16), ValueError, "shape"),
    ],
)
def test_validation_errors_name_the_argument(indices, values, shape, error, field):
    with pytest.raises(error, match=f"`{field}`"):
        qt.Sparse(indices, values, shape)


def test_value_checks_are_skipped_under_jit():
    # Out-of-range indices cannot be seen while tracing: construction succeeds.
    make = jax.jit(lambda i, v: qt.Sparse(i, v, (4,)))
    x = make(jnp.array([1, 9]), jnp.array([1.0, 2.0]))
    assert isinstance(x, qt.Sparse) and x.shape == (4,)


def test_nbytes_and_compression_ratio():
    x = qt.Sparse(np.arange(5), np.ones(5, jnp.bfloat16), (10, 20))
    assert x.nbytes == 5 * (4 + 2)
    assert x.dense_nbytes == 10 * 20 * 2
    assert x.compression_ratio == pytest.approx(400 / 30)


def test_half_precision_duplicates_accumulate_in_float32():
    # Adding 1 to 256 in bfloat16 rounds back to 256; a float32 accumulation gives
    # 300 exactly (representable in bfloat16).
    x = qt.Sparse(np.zeros(300, np.int32), np.ones(300, jnp.bfloat16), (1,))
    assert x.dtype == jnp.bfloat16
    assert float(x.materialise()[0]) == 300.0


# ------------------------------------------------------------------------------------
# top_k


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_top_k_is_the_best_k_sparse_approximation(data):
    shape = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple))
    x = random_array(data.draw(st.integers(0, 2**31 - 1)), shape)
    size = math.prod(shape)
    k = data.draw(st.integers(1, size))
    y = qt.top_k(x, k)
    assert isinstance(y, qt.Sparse) and y.shape == x.shape and y.dtype == x.dtype
    assert y.k == k
    dense_x = np.asarray(x, np.float64)
    kept = _numpy(y)
    error = dense_x - kept
    # Kept entries are exact, dropped entries are zero in the approximation.
    assert np.all((kept == 0) | (kept == dense_x))
    assert np.count_nonzero(error) <= size - k
    # The error holds exactly the size - k smallest magnitudes.
    smallest = np.sort(np.abs(dense_x).ravel())[: size - k]
    assert np.sum(error**2) == pytest.approx(np.sum(smallest**2), rel=1e-6, abs=0)
    assert np.sum(error**2) <= (1 - k / size) * np.sum(dense_x**2) * (1 + 1e-6)
    if k < size:
        assert np.max(np.abs(error)) <= np.min(np.abs(dense_x.ravel()[y.indices]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_top_k_of_everything_is_exact(dtype):
    x = random_array(0, (3, 5), dtype)
    y = qt.top_k(x, x.size)
    assert y.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y.materialise()), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(qt.top_k(x, 1.0).materialise()), x)


def test_top_k_fraction():
    x = random_array(1, (4, 5))
    assert qt.top_k(x, 0.25).k == 5
    assert qt.top_k(x, 0.01).k == 1  # at least one entry
    assert qt.top_k(x, np.float32(0.5)).k == 10


@pytest.mark.parametrize(
    "k, error",
    [(0, ValueError), (21, ValueError), (-3, ValueError), (0.0, ValueError),
     (1.5, ValueError), (float("nan"), ValueError), (True, TypeError),
     ("3", TypeError), (None, TypeError)],
)  # fmt: skip
def test_top_k_rejects_bad_k(k, error):
    with pytest.raises(error, match="`k`"):
        qt.top_k(random_array(0, (4, 5)), k)


def test_top_k_rejects_bad_x():
    with pytest.raises(TypeError, match="`x`"):
        qt.top_k(jnp.arange(4), 2)
    with pytest.raises(ValueError, match="`x`"):
        qt.top_k(jnp.array([1.0, jnp.nan]), 1)
    with pytest.raises(ValueError, match="`x`"):
        qt.top_k(jnp.zeros((0, 3)), 1)


def test_top_k_under_jit():
    x = random_array(2, (6, 7))
    y = jax.jit(lambda a: qt.top_k(a, 5))(x)
    np.testing.assert_array_equal(
        np.asarray(y.materialise()), np.asarray(qt.top_k(x, 5).materialise())
    )


def test_top_k_under_vmap_keeps_k_per_batch_element():
    xs = random_array(3, (4, 3, 5))
    ys = jax.vmap(lambda a: qt.top_k(a, 2))(xs)
    assert ys.shape == (4, 3, 5) and ys.indices.shape == (4, 2)
    assert ys.event_shape == (3, 5)
    for i in range(4):
        np.testing.assert_array_equal(
            np.asarray(ys.materialise()[i]),
            np.asarray(qt.top_k(xs[i], 2).materialise()),
        )
        assert np.count_nonzero(np.asarray(ys.materialise()[i])) == 2


# ------------------------------------------------------------------------------------
# The "done when" item: a Sparse tangent through a matmul stays Sparse


def _jvp_setup():
    x = random_array(4, (3, 8))
    w = random_array(5, (8, 16))
    tangent = qt.top_k(random_array(6, (8, 16)), 2)
    return x, w, tangent


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("order", ["x @ W", "W @ x"])
def test_jvp_of_matmul_keeps_a_sparse_tangent(jit, order):
    x, w, tangent = _jvp_setup()
    if order == "x @ W":
        f = lambda W: x @ W  # noqa: E731
    else:
        x = random_array(7, (16, 3))
        f = lambda W: W @ x  # noqa: E731

    def jvp(w, tangent):
        return quax.quaxify(jax.jvp)(f, (w,), (tangent,))

    if jit:
        jvp = jax.jit(jvp)
    qt.reset_fallback_counts()
    with qt.fallback("error"):
        primal, out = jvp(w, tangent)
    assert qt.fallback_counts() == {}
    assert isinstance(out, qt.Sparse)
    assert_close(primal, f(w))
    expected = f(tangent.materialise())
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert_close(out, expected)
    assert out.nbytes < out.dense_nbytes


def test_vjp_with_a_sparse_cotangent_seed_stays_sparse():
    x, w, _ = _jvp_setup()
    _, vjp = jax.vjp(lambda W: x @ W, w)
    seed = qt.top_k(random_array(8, (3, 16)), 2)
    with qt.fallback("error"):
        (grad,) = quax.quaxify(vjp)(seed)
    assert isinstance(grad, qt.Sparse)
    assert_close(grad, vjp(seed.materialise())[0])


# ------------------------------------------------------------------------------------
# dtypes


def test_dot_general_follows_preferred_element_type():
    s = qt.top_k(random_array(9, (8, 6), jnp.bfloat16), 2)
    d = random_array(10, (6, 5), jnp.bfloat16)

    def f(a, b):
        return jax.lax.dot_general(
            a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    with qt.fallback("error"):
        out = quax.quaxify(f)(s, d)
    assert isinstance(out, qt.Sparse) and out.dtype == jnp.float32
    # bf16 products are exact in float32.
    numbers = (((1,), (0,)), ((), ()))
    expected = numpy_dot_general(dense_sparse(s), np.asarray(d, np.float64), numbers)
    np.testing.assert_allclose(_numpy(out), expected, rtol=1e-6, atol=1e-6)


def test_mixed_precision_matmul_promotes_like_dense():
    s = qt.top_k(random_array(11, (8, 6), jnp.bfloat16), 2)
    d = random_array(12, (6, 5), jnp.float32)
    with qt.fallback("error"):
        out = quax.quaxify(jnp.matmul)(s, d)
    expected = jnp.matmul(s.materialise(), d)
    assert isinstance(out, qt.Sparse) and out.dtype == expected.dtype
    assert_close(out, expected)


def test_convert_element_type_stays_sparse_and_to_int_densifies():
    s = qt.top_k(random_array(13, (4, 6)), 3)
    with qt.fallback("error"):
        half = quax.quaxify(lambda a: a.astype(jnp.float16))(s)
    assert isinstance(half, qt.Sparse) and half.dtype == jnp.float16
    qt.reset_fallback_counts()
    with qt.fallback("error"), pytest.raises(qt.DensificationError):
        quax.quaxify(lambda a: a.astype(jnp.int32))(s)
    with qt.fallback("silent"):
        ints = quax.quaxify(lambda a: a.astype(jnp.int32))(s)
    assert ints.dtype == jnp.int32
    np.testing.assert_array_equal(ints, s.materialise().astype(jnp.int32))
    assert qt.fallback_counts()[("convert_element_type", "Sparse")] >= 1


# ------------------------------------------------------------------------------------
# Rules under jit and vmap


def _chain(a, d):
    """transpose, reshape, mul by a broadcast dense row, reductions, scales, neg,
    sub and a copy."""
    b = jnp.transpose(a, (1, 0, 2)).reshape(a.shape[1], -1)
    return jnp.copy(2.0 * (b * d).sum(axis=0) - (-b).sum(axis=0) * 0.5)


@pytest.mark.parametrize("jit", [False, True])
def test_chain_of_rules_stays_sparse(jit):
    s = random_sparse(0, (3, 4, 5), k=6)
    d = random_array(14, (1, 15))
    f = quax.quaxify(_chain)
    f = jax.jit(f) if jit else f
    with qt.fallback("error"):
        out = f(s, d)
    assert isinstance(out, qt.Sparse)
    assert_close(out, _chain(s.materialise(), d))


def test_vmap_of_quaxified_rules():
    xs = random_array(15, (4, 6, 5))
    s = jax.vmap(lambda a: qt.top_k(a, 2))(xs)
    w = random_array(16, (5, 6))

    def f(a):
        return jnp.transpose(a @ w).reshape(-1) * 3.0

    with qt.fallback("error"):
        out = jax.vmap(quax.quaxify(f))(s)
    assert isinstance(out, qt.Sparse) and out.shape == (4, 36)
    assert_close(out, jax.vmap(f)(s.materialise()))


def test_vmap_inside_quaxify_uses_dot_batch_dims():
    s = jax.vmap(lambda a: qt.top_k(a, 2))(random_array(17, (4, 8, 8)))
    w = random_array(18, (4, 8, 16))
    f = jax.vmap(lambda a, b: a @ b)
    with qt.fallback("error"):
        out = quax.quaxify(f)(s, w)
    assert isinstance(out, qt.Sparse)
    assert_close(out, f(s.materialise(), w))


def test_sum_of_sparse_with_different_batch_layouts():
    batched = qt.Sparse(np.array([[0, 1], [3, 3]]), np.ones((2, 2), np.float32), (2, 4))
    flat = qt.Sparse(np.array([2, 7]), np.array([5.0, 6.0], np.float32), (2, 4))
    with qt.fallback("error"):
        out = quax.quaxify(jax.lax.sub)(batched, flat)
    # Different layouts: both fold their batch dims into flat indices.
    assert isinstance(out, qt.Sparse) and out.indices.shape == (6,)
    np.testing.assert_array_equal(_numpy(out), _numpy(batched) - _numpy(flat))


def test_reduce_sum_over_everything_is_a_scalar_sparse():
    s = random_sparse(1, (2, 3, 4), k=5, batch_dims=1)
    with qt.fallback("error"):
        out = quax.quaxify(jnp.sum)(s)
    assert isinstance(out, qt.Sparse) and out.event_shape == ()
    np.testing.assert_array_equal(np.asarray(out.indices), 0)
    assert_close(out, jnp.sum(s.materialise()))


# ------------------------------------------------------------------------------------
# Densification paths


def test_dot_general_densifies_when_sparse_result_is_larger():
    # Each entry of a sparse matrix spreads over a whole row of the product.
    s = qt.top_k(random_array(19, (3, 6)), 2)
    w = random_array(20, (6, 4))
    qt.reset_fallback_counts()
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="Sparse"):
        quax.quaxify(jnp.matmul)(s, w)
    with qt.fallback("silent"):
        out = quax.quaxify(jnp.matmul)(s, w)
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32
    assert_close(out, s.materialise() @ w)
    assert qt.fallback_counts() == {("dot_general", "Sparse"): 2}


def test_dot_general_gives_a_dense_vector_without_counting():
    s = qt.top_k(random_array(19, (6,)), 2)
    w = random_array(20, (6, 4))
    qt.reset_fallback_counts()
    with qt.fallback("error"):
        out = quax.quaxify(jnp.matmul)(s, w)
        out_left = quax.quaxify(jnp.matmul)(w.T, s)
    assert isinstance(out, jax.Array) and isinstance(out_left, jax.Array)
    assert_close(out, s.materialise() @ w)
    assert_close(out_left, w.T @ s.materialise())
    assert qt.fallback_counts() == {}


def test_add_with_dense_is_dense_by_design_and_counted():
    s = qt.top_k(random_array(21, (3, 4)), 2)
    d = random_array(22, (3, 4))
    qt.reset_fallback_counts()
    with qt.fallback("error"), pytest.raises(qt.DensificationError):
        quax.quaxify(jnp.add)(s, d)
    with pytest.warns(qt.DensificationWarning, match="add"):
        out = quax.quaxify(jnp.add)(d, s)
    assert isinstance(out, jax.Array)
    np.testing.assert_array_equal(out, d + s.materialise())
    assert qt.fallback_counts()[("add", "Sparse")] == 2


def test_mul_broadcasting_the_sparse_operand():
    s = qt.top_k(random_array(23, (5, 1)), 2)
    wide = random_array(24, (1, 8))
    with qt.fallback("error"):
        out = quax.quaxify(jax.lax.mul)(s, wide)
    assert isinstance(out, qt.Sparse) and out.shape == (5, 8)
    assert_close(out, s.materialise() * wide)
    # Every row holding an entry: the broadcast result is dense.
    s = qt.top_k(random_array(23, (5, 1)), 5)
    narrow = random_array(25, (1, 2))
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        dense = quax.quaxify(jax.lax.mul)(narrow, s)
    assert isinstance(dense, jax.Array)
    assert_close(dense, narrow * s.materialise())
    assert qt.fallback_counts() == {("mul", "Sparse"): 1}


def test_add_of_broadcast_sparse_operands_spreads_the_entries():
    """`lax.add` broadcasts size-1 dims: each entry spreads over them (exact)."""
    a = qt.Sparse(np.array([0]), np.ones(1, np.float32), (1, 3))
    b = qt.Sparse(np.array([4]), np.ones(1, np.float32), (2, 3))
    qt.reset_fallback_counts()
    with qt.fallback("error"):
        out = quax.quaxify(jax.lax.sub)(a, b)
    assert isinstance(out, qt.Sparse)
    np.testing.assert_array_equal(out.materialise(), a.materialise() - b.materialise())


def test_add_of_broadcast_sparse_operands_densifies_when_spreading_costs_more():
    a = qt.Sparse(np.arange(3), np.ones(3, np.float32), (1, 3))
    b = qt.Sparse(np.array([4]), np.ones(1, np.float32), (4, 3))
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(jax.lax.add)(a, b)
    np.testing.assert_array_equal(out, a.materialise() + b.materialise())
    assert qt.fallback_counts() == {("mul", "Sparse"): 1, ("add", "Sparse"): 1}


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_dense_dot_general_path_matches_dense(data):
    args, numbers, preferred = data.draw(dot_general_operands(data.draw(st.booleans())))
    dense_args = [qt.materialise(a) for a in args]

    def f(a, b):
        return jax.lax.dot_general(a, b, numbers, preferred_element_type=preferred)

    # The rule for a large k: duplicates and many entries, still exact.
    sparse_i = next(i for i, a in enumerate(args) if isinstance(a, qt.Sparse))
    s = args[sparse_i]
    big = data.draw(sparse_values(s.shape, s.dtype, k=4 * s.size, batch_dims=0))
    args = list(args)
    args[sparse_i] = big
    dense_args[sparse_i] = big.materialise()
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(f)(*args)
    expected = f(*dense_args)
    assert isinstance(out, jax.Array) and out.dtype == expected.dtype
    # A dense vector result is not counted (docs/fallback.md); any other is.
    counted = 0 if is_vector_shape(expected.shape) else 1
    assert qt.fallback_counts() == ({("dot_general", "Sparse"): 1} if counted else {})
    magnitudes = [
        np.abs(dense_sparse(a) if isinstance(a, qt.Sparse) else np.asarray(a, float))
        for a in args
    ]
    scale = max(float(np.max(numpy_dot_general(*magnitudes, numbers))), 1.0)
    assert_close(out, expected, s.dtype, scale=scale, factor=2.0)


@pytest.mark.parametrize("fn", [jnp.arcsin, jnp.arccos])
def test_unstored_entries_stay_zero_where_the_derivative_is_not_finite(fn):
    """Outside [-1, 1] the derivative is NaN: dense JAX gives NaN everywhere (0 times
    NaN), a `Sparse` tangent NaN at its stored entries and exact zeros elsewhere, as
    JAX's symbolic zeros would."""
    x = jnp.full((3, 4), 2.0)
    t = qt.Sparse(np.array([1, 6]), np.ones(2, np.float32), (3, 4))
    with qt.fallback("error"):
        _, out = qt.jvp(fn, (x,), (t,))
    assert isinstance(out, qt.Sparse)
    got = np.asarray(out.materialise())
    stored = np.zeros(12, bool)
    stored[[1, 6]] = True
    stored = stored.reshape(3, 4)
    assert np.all(np.isnan(got[stored]))
    np.testing.assert_array_equal(got[~stored], 0.0)
    dense = jax.jvp(fn, (x,), (t.materialise(),))[1]
    assert np.all(np.isnan(np.asarray(dense)))
