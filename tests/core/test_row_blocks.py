"""The products in blocks of rows that a TPU lowering of the range finder uses
(`quax_tangents._core._row_blocks`): the same products as the plain ones, chosen on
a TPU only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from quax_tangents._core import _row_blocks, _sharding
from tests.helpers import assert_close
from tests.helpers.precision import dots_below_highest


HIGHEST = jax.lax.Precision.HIGHEST

shapes = st.tuples(st.integers(1, 40), st.integers(1, 9), st.integers(1, 9))


def _matrix(rng, shape, dtype):
    # Columns of different scales, as a sketch of a gradient has.
    scales = np.exp(rng.standard_normal((1, shape[1])) * 2)
    return jnp.asarray(rng.standard_normal(shape) * scales, dtype)


def _close_to(ours, exact, a, b, dtype):
    # Each entry is a sum of `m` products: within `m` roundings of the sum of their
    # magnitudes (float32, or float64 where enabled).
    bound = np.abs(a).T @ np.abs(b) if b is not None else np.abs(a).T @ np.abs(a)
    eps = np.finfo(dtype).eps
    np.testing.assert_array_less(
        np.abs(np.asarray(ours, np.float64) - exact),
        (a.shape[0] + 2) * eps * bound + np.finfo(dtype).tiny,
    )


@settings(max_examples=10)
@given(
    shape=shapes, rows=st.integers(1, 8), seed=st.integers(0, 2**16), x64=st.booleans()
)
def test_gram_in_row_blocks_is_the_gram_matrix(shape, rows, seed, x64):
    m, k, _ = shape
    dtype = np.float64 if x64 else np.float32
    with jax.enable_x64(x64):
        a = _matrix(np.random.default_rng(seed), (m, k), dtype)
        ours = _row_blocks.gram_in_row_blocks(a, HIGHEST, rows=rows)
        assert ours.shape == (k, k) and ours.dtype == a.dtype
    a64 = np.asarray(a, np.float64)
    _close_to(ours, a64.T @ a64, a64, None, dtype)


@settings(max_examples=10)
@given(
    shape=shapes, rows=st.integers(1, 8), seed=st.integers(0, 2**16), x64=st.booleans()
)
def test_matmul_in_row_blocks_is_the_product(shape, rows, seed, x64):
    m, k, n = shape
    dtype = np.float64 if x64 else np.float32
    rng = np.random.default_rng(seed)
    with jax.enable_x64(x64):
        a, b = _matrix(rng, (m, k), dtype), _matrix(rng, (k, n), dtype)
        ours = _row_blocks.matmul_in_row_blocks(a, b, HIGHEST, rows=rows)
        assert ours.shape == (m, n) and ours.dtype == a.dtype
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    _close_to(ours, a64 @ b64, a64.T, b64, dtype)


def test_the_blocks_ask_for_the_precision_given():
    a = jnp.ones((40, 6), jnp.float32)
    gram = lambda a: _row_blocks.gram_in_row_blocks(a, HIGHEST, rows=8)  # noqa: E731
    product = lambda a, b: _row_blocks.matmul_in_row_blocks(a, b, HIGHEST, rows=8)  # noqa: E731
    assert dots_below_highest(gram, a) == []
    assert dots_below_highest(product, a, a.T) == []


def _tall(dtype=jnp.float32):
    rng = np.random.default_rng(1)
    return _matrix(rng, (2 * _row_blocks.ROWS + 3, 5), dtype)


def test_off_a_tpu_the_product_is_the_plain_one():
    # The choice is made when the program is lowered: on CPU the plain product, bit
    # for bit, though the program holds both.
    a = _tall()
    b = jnp.asarray(np.random.default_rng(2).standard_normal((5, 7)), jnp.float32)
    gram = jax.jit(lambda a: _sharding.gram(a))(a)
    np.testing.assert_array_equal(
        gram, jax.jit(lambda a: jnp.matmul(a.T, a, precision=HIGHEST))(a)
    )
    exact = jax.jit(lambda a, b: _sharding.matmul(a, b, _sharding.EXACT))(a, b)
    np.testing.assert_array_equal(
        exact, jax.jit(lambda a, b: jnp.matmul(a, b, precision=HIGHEST))(a, b)
    )
    assert "platform_index" in str(jax.make_jaxpr(_sharding.gram)(a))
    assert "platform_index" in str(
        jax.make_jaxpr(lambda a, b: _sharding.matmul(a, b, _sharding.EXACT))(a, b)
    )


@pytest.mark.parametrize(
    "case",
    ["short", "bfloat16", "default precision"],
)
def test_only_tall_float32_products_at_a_precision_may_go_in_blocks(case):
    a = _tall(jnp.bfloat16) if case == "bfloat16" else _tall()
    if case == "short":
        a = a[: 2 * _row_blocks.ROWS]
    precision = None if case == "default precision" else HIGHEST
    assert "platform_index" not in str(
        jax.make_jaxpr(lambda a: _row_blocks.exact_gram(a, precision))(a)
    )
    assert "platform_index" not in str(
        jax.make_jaxpr(lambda a: _row_blocks.exact_matmul(a, a.T, precision))(a)
    )


def _with_row_blocks(patch) -> None:
    """`_sharding`'s products at a precision in blocks of 3 rows, as a TPU lowers
    them (in blocks of `ROWS`)."""

    def gram(a, precision):
        return _row_blocks.gram_in_row_blocks(a, precision, rows=3)

    def matmul(a, b, precision):
        if precision is None:
            return jnp.matmul(a, b)
        return _row_blocks.matmul_in_row_blocks(a, b, precision, rows=3)

    patch.setattr(_sharding, "exact_gram", gram)
    patch.setattr(_sharding, "exact_matmul", matmul)


@settings(max_examples=10)
@given(m=st.integers(8, 30), w=st.integers(2, 8), seed=st.integers(0, 2**16))
def test_the_range_finder_is_the_same_with_products_in_row_blocks(m, w, seed):
    rng = np.random.default_rng(seed)
    y = jnp.asarray(rng.standard_normal((m, w)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((w, m + 5)), jnp.float32)
    q_plain = _sharding.orthonormal_columns(y)
    u_plain = _sharding.top_left_singular(b, w - 1)
    with pytest.MonkeyPatch.context() as patch:
        _with_row_blocks(patch)
        q_blocks = _sharding.orthonormal_columns(y)
        u_blocks = _sharding.top_left_singular(b, w - 1)
    assert_close(q_blocks @ q_blocks.T, q_plain @ q_plain.T, factor=20)
    signs = _sharding.column_signs
    assert_close(u_blocks * signs(u_blocks), u_plain * signs(u_plain), factor=200)
