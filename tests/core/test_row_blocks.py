"""The products in blocks of rows that a TPU lowering of the range finder uses
(`quax_tangents._core._row_blocks`): the same products as the plain ones, chosen on
a TPU only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from quax_tangents._core import _row_blocks, _sharding
from tests.helpers.precision import dots_below_highest
from tests.helpers.range_finder import assert_same_range_finder


HIGHEST = jax.lax.Precision.HIGHEST

shapes = st.tuples(st.integers(1, 40), st.integers(1, 9), st.integers(1, 9))


def _matrix(rng, shape, dtype):
    # Columns of different scales, as a sketch of a gradient has.
    scales = np.exp(rng.standard_normal((1, shape[1])) * 2)
    return jnp.asarray(rng.standard_normal(shape) * scales, dtype)


@settings(max_examples=16)
@given(
    product=st.sampled_from(["gram", "matmul"]),
    shape=shapes,
    rows=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    x64=st.booleans(),
)
def test_products_in_row_blocks_are_the_products(product, shape, rows, seed, x64):
    m, k, n = shape
    dtype = np.float64 if x64 else np.float32
    rng = np.random.default_rng(seed)
    with jax.enable_x64(x64):
        a = _matrix(rng, (m, k), dtype)
        if product == "gram":
            ours = _row_blocks.gram_in_row_blocks(a, HIGHEST, rows=rows)
            left, right = a.T, a
        else:
            b = _matrix(rng, (k, n), dtype)
            ours = _row_blocks.matmul_in_row_blocks(a, b, HIGHEST, rows=rows)
            left, right = a, b
        assert ours.dtype == a.dtype
    left, right = np.asarray(left, np.float64), np.asarray(right, np.float64)
    exact = left @ right
    assert ours.shape == exact.shape
    # Each entry is a sum of `m` products: within `m` roundings of the sum of their
    # magnitudes (float32, or float64 where enabled).
    bound = (m + 2) * np.finfo(dtype).eps * (np.abs(left) @ np.abs(right))
    error = np.abs(np.asarray(ours, np.float64) - exact)
    np.testing.assert_array_less(error, bound + np.finfo(dtype).tiny)


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
    assert_same_range_finder(_with_row_blocks, m, w, seed)
