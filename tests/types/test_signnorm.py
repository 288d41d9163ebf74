"""`SignNorm` and `sign_norm`: layout, validation, storage, norm and sign keeping,
transforms and the paths that densify."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quax
from hypothesis import given, settings, strategies as st

import quax_tangents as qt
from tests.helpers import assert_close, random_array, seeds
from tests.helpers.blocked import EVENT_SHAPES, constructor_arguments


def _blocks_numpy(x, block_size):
    """Blocks of the flat `x` (the last one possibly partial), in float64."""
    flat = np.asarray(x, np.float64).reshape(-1)
    size = max(flat.size, 1) if block_size is None else block_size
    return [flat[i : i + size] for i in range(0, flat.size, size)]


# --------------------------------------------------------------------------------
# Construction and validation


def test_direct_construction_decodes_by_hand():
    # 0b00000101: elements 0 and 2 non-negative, element 1 negative.
    s = qt.SignNorm(
        jnp.array([[0b00000101]], jnp.uint8),
        jnp.array([3.0], jnp.float32),
        event_shape=(3,),
        dtype=jnp.float32,
    )
    assert s.shape == (3,) and s.dtype == jnp.float32
    np.testing.assert_allclose(s.materialise(), np.array([1, -1, 1]) * 3 / math.sqrt(3))


def test_direct_construction_with_partial_last_block():
    # 10 elements in blocks of 4: the last block has 2 real elements.
    s = qt.SignNorm(
        jnp.full((3, 1), 0xFF, jnp.uint8),
        jnp.array([2.0, 4.0, 1.0], jnp.float32),
        event_shape=(2, 5),
        block_size=4,
        dtype=jnp.bfloat16,
    )
    expected = np.array([1.0] * 4 + [2.0] * 4 + [1 / math.sqrt(2)] * 2).reshape(2, 5)
    assert s.materialise().dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(s.materialise(), np.float32), expected, rtol=1e-2
    )
    np.testing.assert_array_equal(s.block_counts(), [4, 4, 2])


def test_good_arguments_construct():
    s = qt.SignNorm(**constructor_arguments("SignNorm"))
    assert s.shape == (2, 5) and s.num_blocks == 3 and s.block_elems == 4
    whole = qt.SignNorm(
        **constructor_arguments(
            "SignNorm",
            bits=jnp.zeros((1, 2), jnp.uint8),
            norms=jnp.ones(1),
            block_size=None,
        )
    )
    assert whole.block_size is None and whole.block_elems == 10


def test_sign_norm_validates_block_size():
    with pytest.raises(ValueError, match="`block_size`"):
        qt.sign_norm(jnp.ones((4,)), block_size=0)
    with pytest.raises(TypeError, match="`block_size`"):
        qt.sign_norm(jnp.ones((4,)), block_size=2.5)


# --------------------------------------------------------------------------------
# Layout and storage


def test_layout_and_nbytes_small():
    x = jnp.arange(10.0) - 4.5
    blocked = qt.sign_norm(x, block_size=4)
    assert blocked.bits.shape == (3, 1) and blocked.norms.shape == (3,)
    assert blocked.nbytes == 3 * 1 + 3 * 4
    whole = qt.sign_norm(x)
    assert whole.bits.shape == (1, 2) and whole.norms.shape == (1,)
    assert whole.nbytes == 2 + 4
    assert whole.dense_nbytes == 40
    assert whole.compression_ratio == pytest.approx(40 / 6)


def test_compression_ratio_2048_squared():
    x = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    s = jax.eval_shape(qt.sign_norm, x)
    assert s.dense_nbytes == 2048 * 2048 * 4
    assert s.compression_ratio >= 30, s.compression_ratio


def test_block_size_is_reduced_to_the_array():
    s = qt.sign_norm(jnp.ones((5,)), block_size=64)
    assert s.block_size == 5 and s.bits.shape == (1, 1)


def test_empty_and_scalar_inputs():
    empty = qt.sign_norm(jnp.zeros((0, 3)))
    assert empty.shape == (0, 3) and empty.materialise().shape == (0, 3)
    scalar = qt.sign_norm(jnp.array(-2.5))
    np.testing.assert_allclose(scalar.materialise(), -2.5)


# --------------------------------------------------------------------------------
# What sign_norm keeps: per-block l2 norms and signs


@settings(max_examples=20, deadline=None)
@given(
    event_shape=st.sampled_from(EVENT_SHAPES),
    block_size=st.sampled_from([None, 1, 3, 8]),
    seed=seeds(),
    with_zeros=st.booleans(),
)
def test_keeps_block_norms_and_signs(event_shape, block_size, seed, with_zeros):
    x = np.array(random_array(seed, event_shape))
    if with_zeros:
        x[np.abs(x) < 0.5] = 0
    s = qt.sign_norm(x, block_size)
    blocks = _blocks_numpy(x, s.block_size)
    expected_norms = np.array([np.linalg.norm(b) for b in blocks])
    np.testing.assert_allclose(s.norms, expected_norms, rtol=2e-6, atol=1e-30)
    dense = np.asarray(s.materialise(), np.float64)
    # Every element keeps its sign; zero counts as non-negative.
    np.testing.assert_array_equal(dense >= 0, np.asarray(x) >= 0)
    # The materialised blocks have exactly the stored norms.
    got = np.array([np.linalg.norm(b) for b in _blocks_numpy(dense, s.block_size)])
    np.testing.assert_allclose(got, expected_norms, rtol=2e-6, atol=1e-30)
    # Within a block every magnitude is the same: norm / sqrt(n_b).
    for block, norm in zip(_blocks_numpy(dense, s.block_size), got, strict=True):
        np.testing.assert_allclose(
            np.abs(block), norm / math.sqrt(block.size), rtol=1e-6
        )


def test_zero_is_positive_and_negation_flips_it():
    s = qt.sign_norm(jnp.array([0.0, -0.0, -2.0, 1.0]))
    np.testing.assert_array_equal(np.sign(s.materialise()), [1, 1, -1, 1])
    negated = quax.quaxify(jnp.negative)(s)
    np.testing.assert_array_equal(np.sign(negated.materialise()), [-1, -1, 1, -1])


def test_all_zero_block_gives_zeros():
    s = qt.sign_norm(jnp.array([0.0, 0.0, 0.0, 1.0, -2.0]), block_size=3)
    np.testing.assert_array_equal(s.norms[0], 0.0)
    dense = s.materialise()
    assert bool(jnp.all(jnp.isfinite(dense)))
    np.testing.assert_array_equal(dense[:3], np.zeros(3))


def test_large_values_do_not_overflow_the_norm():
    x = jnp.array([3e30, -4e30], jnp.float32)  # the squares overflow float32
    s = qt.sign_norm(x)
    np.testing.assert_allclose(s.norms, [5e30], rtol=1e-6)
    np.testing.assert_allclose(
        s.materialise(), np.array([1, -1]) * 5e30 / math.sqrt(2), rtol=1e-6
    )


_F32 = np.finfo(np.float32)


def _edge_input(seed, event_shape, block_elems, edge):
    """Random signs with magnitudes in [1, 2) times a scale at one end of float32:
    `"large"`: so that the largest block norm is just under float32's maximum;
    `"tiny"`: just above float32's smallest normal, so every element is normal."""
    rng = np.random.default_rng(seed)
    magnitudes = rng.uniform(1.0, 2.0, event_shape)
    signs = np.where(rng.random(event_shape) < 0.5, -1.0, 1.0)
    if edge == "large":
        scale = 0.99 * float(_F32.max) / (2.0 * math.sqrt(block_elems))
    else:
        scale = float(_F32.tiny)
    return np.asarray(signs * magnitudes * scale, np.float32)


@settings(max_examples=20, deadline=None)
@given(
    event_shape=st.sampled_from(EVENT_SHAPES),
    block_size=st.sampled_from([None, 1, 3, 8]),
    seed=seeds(),
    edge=st.sampled_from(["large", "tiny"]),
)
def test_error_bound_at_the_float32_edges(event_shape, block_size, seed, edge):
    size = math.prod(event_shape)
    elems = max(size, 1) if block_size is None else min(block_size, max(size, 1))
    x = _edge_input(seed, event_shape, elems, edge)
    s = qt.sign_norm(x, block_size)
    blocks = _blocks_numpy(x, s.block_size)
    expected_norms = np.array([np.linalg.norm(b) for b in blocks])
    np.testing.assert_allclose(s.norms, expected_norms, rtol=2e-6, atol=0)
    dense = np.asarray(s.materialise(), np.float64)
    assert np.all(np.isfinite(dense))
    np.testing.assert_array_equal(dense >= 0, x >= 0)
    for block, norm in zip(
        _blocks_numpy(dense, s.block_size), expected_norms, strict=True
    ):
        np.testing.assert_allclose(
            np.abs(block), norm / math.sqrt(block.size), rtol=2e-6, atol=0
        )


def test_single_element_blocks_keep_every_normal_magnitude():
    # One element per block: the norm is the magnitude itself, at every binade of
    # float32 from the smallest normal to the largest finite value, so the power of
    # two that scales each block is right over the whole exponent range.
    exponents = np.arange(-126, 128)
    x = np.concatenate(
        [np.ldexp(np.float32(1.0), exponents), np.ldexp(np.float32(1.75), exponents)]
    ).astype(np.float32)
    x[: len(x) // 2 : 2] *= -1
    x = np.append(x, _F32.max)
    s = qt.sign_norm(x, block_size=1)
    np.testing.assert_array_equal(s.norms, np.abs(x))
    np.testing.assert_array_equal(s.materialise(), x)


@pytest.mark.parametrize("block_size", [None, 1, 3, 8])
def test_subnormal_values_err_by_less_than_the_smallest_normal(block_size):
    x = random_array(0, (3, 4)) * np.float32(1e-40)
    dense = qt.sign_norm(x, block_size).materialise()
    assert bool(jnp.all(jnp.isfinite(dense)))
    np.testing.assert_allclose(dense, x, rtol=0, atol=2 * float(_F32.tiny))


def test_block_norm_beyond_float32_is_an_error():
    x = jnp.full((16,), 1e38, jnp.float32)  # norm 4e38
    with pytest.raises(ValueError, match="overflows float32.*smaller `block_size`"):
        qt.sign_norm(x)
    np.testing.assert_allclose(qt.sign_norm(x, block_size=1).materialise(), x)
    np.testing.assert_allclose(qt.sign_norm(x, block_size=4).materialise(), x)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_input_keeps_dtype(dtype):
    x = random_array(5, (3, 7), dtype)
    s = qt.sign_norm(x, 8)
    assert s.dtype == dtype and s.materialise().dtype == dtype
    assert s.norms.dtype == jnp.float32
    np.testing.assert_allclose(
        np.linalg.norm(np.asarray(s.materialise(), np.float64)),
        np.linalg.norm(np.asarray(x, np.float64)),
        rtol=float(jnp.finfo(dtype).eps),
    )


# --------------------------------------------------------------------------------
# jit and vmap


def test_sign_norm_under_jit_and_vmap():
    xs = random_array(4, (3, 2, 5))
    eager = qt.sign_norm(xs[1], 4)
    jitted = jax.jit(lambda a: qt.sign_norm(a, 4))(xs[1])
    assert isinstance(jitted, qt.SignNorm)
    np.testing.assert_array_equal(jitted.bits, eager.bits)
    np.testing.assert_allclose(jitted.norms, eager.norms, rtol=1e-6)
    batched = jax.vmap(lambda a: qt.sign_norm(a, 4))(xs)
    assert batched.shape == (3, 2, 5) and batched.bits.shape == (3, 3, 1)
    assert_close(batched.materialise()[1], eager.materialise())
    # One block per example (reduced as a whole array): one norm each.
    whole = jax.vmap(qt.sign_norm)(xs)
    assert whole.norms.shape == (3, 1)
    for i in range(3):
        single = qt.sign_norm(xs[i])
        np.testing.assert_array_equal(whole.bits[i], single.bits)
        np.testing.assert_allclose(whole.norms[i], single.norms, rtol=1e-6)


@pytest.mark.parametrize("scalar", [-2.0, 0.0, 3.0])
def test_traced_scalar_flips_bits_only_when_negative(scalar):
    s = qt.sign_norm(random_array(6, (9,)), 4)
    out = jax.jit(quax.quaxify(lambda a, c: c * a))(s, jnp.float32(scalar))
    assert isinstance(out, qt.SignNorm)
    assert bool(jnp.all(out.norms >= 0))
    assert_close(out, s.materialise() * scalar)
    flipped = np.asarray(out.bits) == np.bitwise_not(np.asarray(s.bits))
    assert bool(np.all(flipped)) == (scalar < 0)
