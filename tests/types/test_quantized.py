"""`Quantized` and `quantize`: layout, validation, storage, error bounds, transforms and
the paths that densify."""

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


def _per_element_scale(q: qt.Quantized) -> np.ndarray:
    """Each element's block scale, from the documented layout (computed here with
    numpy, independently of the code under test)."""
    scales = np.asarray(q.scales)
    n = math.prod(q.event_shape)
    batch = scales.shape[:-1]
    per = np.repeat(scales, q.block_size, axis=-1)[..., :n]
    return per.reshape((*batch, *q.event_shape))


def _blocks_numpy(x: np.ndarray, block_size: int) -> np.ndarray:
    flat = np.asarray(x, np.float32).reshape(-1)
    padded = np.zeros(-(-flat.size // block_size) * block_size, np.float32)
    padded[: flat.size] = flat
    return padded.reshape(-1, block_size)


# --------------------------------------------------------------------------------
# Construction and validation


def test_direct_construction_8bit_decodes_by_hand():
    q = qt.Quantized(
        jnp.array([[1, -2, 3, 0]], jnp.int8),
        jnp.array([0.5], jnp.float32),
        event_shape=(3,),
        bits=8,
        block_size=4,
        dtype=jnp.float32,
    )
    assert q.shape == (3,) and q.dtype == jnp.float32
    np.testing.assert_array_equal(q.materialise(), [0.5, -1.0, 1.5])


def test_direct_construction_4bit_nibble_order_by_hand():
    # Codes (1, -2, 3, -7) as nibbles 0x1, 0xE, 0x3, 0x9; byte = low | high << 4.
    q = qt.Quantized(
        jnp.array([[0xE1, 0x93]], jnp.uint8),
        jnp.array([2.0], jnp.float32),
        event_shape=(2, 2),
        bits=4,
        block_size=4,
        dtype=jnp.bfloat16,
    )
    assert q.shape == (2, 2) and q.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(q.materialise(), np.float32), [[2.0, -4.0], [6.0, -14.0]]
    )


def test_every_4bit_code_round_trips():
    x = jnp.arange(-7.0, 8.0)  # scale 1, so every code -7..7 is hit exactly
    q = qt.quantize(x, bits=4, block_size=16)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == (1, 8)
    np.testing.assert_array_equal(q.materialise(), x)
    np.testing.assert_array_equal(
        np.asarray(q.integer_codes())[0, :15], np.arange(-7, 8)
    )


def test_good_arguments_construct():
    q = qt.Quantized(**constructor_arguments("Quantized"))
    assert q.shape == (2, 5) and q.num_blocks == 3 and q.qmax == 127


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(bits=16), ValueError, "bits"),
        (dict(bits=True), ValueError, "bits"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=-4), ValueError, "block_size"),
        (dict(block_size=8.0), TypeError, "block_size"),
        (dict(bits=4, block_size=7), ValueError, "block_size"),
    ],
)
def test_quantize_validates_settings(kwargs, error, field):
    with pytest.raises(error, match=f"`{field}`"):
        qt.quantize(jnp.ones((4,)), **kwargs)


# --------------------------------------------------------------------------------
# Layout and storage


@pytest.mark.parametrize("bits, expected", [(8, 3 * 4 + 3 * 4), (4, 3 * 2 + 3 * 4)])
def test_layout_and_nbytes_small(bits, expected):
    x = jnp.arange(10.0) - 4.5
    q = qt.quantize(x, bits=bits, block_size=4)
    # 10 elements in blocks of 4: 3 blocks, the last holding 2 values and 2 padding.
    width = 4 if bits == 8 else 2
    assert q.codes.shape == (3, width) and q.scales.shape == (3,)
    assert q.scales.dtype == jnp.float32
    assert q.nbytes == expected
    assert q.dense_nbytes == 40
    assert q.compression_ratio == pytest.approx(40 / expected)


def test_block_size_is_reduced_to_the_array():
    q8 = qt.quantize(jnp.ones((5,)), bits=8, block_size=256)
    assert q8.block_size == 5 and q8.codes.shape == (1, 5)
    q4 = qt.quantize(jnp.ones((5,)), bits=4, block_size=256)
    assert q4.block_size == 6 and q4.codes.shape == (1, 3)


@pytest.mark.parametrize("bits, ratio", [(8, 3.9), (4, 7.5)])
def test_compression_ratio_2048_squared(bits, ratio):
    x = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    q = jax.eval_shape(lambda a: qt.quantize(a, bits=bits, block_size=256), x)
    assert q.dense_nbytes == 2048 * 2048 * 4
    assert q.compression_ratio >= ratio, q.compression_ratio


def test_zero_blocks_give_zeros_not_nan():
    x = jnp.concatenate([jnp.zeros(8), jnp.array([0.0, 3.0, -1.0, 0.5])])
    for bits in (8, 4):
        q = qt.quantize(x, bits=bits, block_size=4)
        assert bool(jnp.all(jnp.isfinite(q.scales)))
        deq = q.materialise()
        np.testing.assert_array_equal(deq[:8], np.zeros(8))
        assert bool(jnp.all(jnp.isfinite(deq)))


def test_empty_and_scalar_inputs():
    for bits in (8, 4):
        empty = qt.quantize(jnp.zeros((0, 3)), bits=bits)
        assert empty.shape == (0, 3) and empty.materialise().shape == (0, 3)
    scalar = qt.quantize(jnp.array(-2.5), bits=4)
    assert scalar.shape == ()
    np.testing.assert_array_equal(scalar.materialise(), -2.5)


# --------------------------------------------------------------------------------
# Error bounds (stated in `quantize`'s docstring)


@settings(max_examples=15, deadline=None)
@given(
    event_shape=st.sampled_from(EVENT_SHAPES),
    bits=st.sampled_from([4, 8]),
    block_size=st.sampled_from([2, 4, 256]),
    seed=seeds(),
    spread=st.sampled_from([1e-3, 1.0, 1e6]),
)
def test_nearest_rounding_error_is_at_most_half_a_scale(
    event_shape, bits, block_size, seed, spread
):
    x = np.asarray(random_array(seed, event_shape)) * np.float32(spread)
    q = qt.quantize(x, bits=bits, block_size=block_size)
    # The scale is max|block| / qmax, checked against numpy.
    qmax = 127 if bits == 8 else 7
    blocks = _blocks_numpy(x, q.block_size)
    np.testing.assert_allclose(q.scales, np.abs(blocks).max(-1) / qmax, rtol=1e-6)
    deq = np.asarray(q.materialise(), np.float64)
    error = np.abs(np.asarray(x, np.float64) - deq)
    bound = _per_element_scale(q) / 2 * (1 + 1e-6) + 1e-6 * np.abs(x)
    assert np.all(error <= bound), float(np.max(error - bound))


@settings(max_examples=10, deadline=None)
@given(
    event_shape=st.sampled_from(EVENT_SHAPES),
    bits=st.sampled_from([4, 8]),
    seed=seeds(),
)
def test_stochastic_rounding_error_is_below_one_scale(event_shape, bits, seed):
    x = np.asarray(random_array(seed, event_shape))
    q = qt.quantize(x, bits=bits, block_size=4, key=jax.random.key(seed))
    deq = np.asarray(q.materialise(), np.float64)
    error = np.abs(np.asarray(x, np.float64) - deq)
    bound = _per_element_scale(q) * (1 + 1e-6) + 1e-6 * np.abs(x)
    assert np.all((error < bound) | (error == 0)), float(np.max(error - bound))


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits):
    """The mean of 2000 stochastic quantisations is within 6 standard errors of x.

    Per element the dequantised value takes the two grid neighbours of x, so its
    variance is at most scale**2 / 4 and the standard error of the mean over N keys is
    at most scale / (2 sqrt(N)). By Hoeffding's inequality a deviation of 6 such units
    has probability <= 2 exp(-18) = 3e-8 per element (1e-5 for all 256 elements). The
    same tolerance rejects nearest rounding, whose bias is up to half a scale.
    """
    n_keys = 2000
    x = random_array(0, (256,))
    keys = jax.random.split(jax.random.key(1), n_keys)
    stochastic = jax.jit(
        jax.vmap(lambda k: qt.quantize(x, bits, 64, key=k).materialise())
    )
    mean = np.asarray(stochastic(keys), np.float64).mean(0)
    scale = _per_element_scale(qt.quantize(x, bits, 64))
    tolerance = 6 * scale / (2 * math.sqrt(n_keys))
    assert np.all(np.abs(mean - np.asarray(x)) <= tolerance)
    nearest = np.asarray(qt.quantize(x, bits, 64).materialise(), np.float64)
    assert np.any(np.abs(nearest - np.asarray(x)) > tolerance)


def test_stochastic_rounding_is_deterministic_given_a_key():
    x = random_array(3, (40,))
    a = qt.quantize(x, key=jax.random.key(7))
    b = qt.quantize(x, key=jax.random.key(7))
    c = qt.quantize(x, key=jax.random.key(8))
    np.testing.assert_array_equal(a.codes, b.codes)
    assert not np.array_equal(a.codes, c.codes)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_input_keeps_dtype(dtype):
    x = random_array(5, (3, 7), dtype)
    q = qt.quantize(x, bits=8, block_size=8)
    assert q.dtype == dtype and q.materialise().dtype == dtype
    assert q.scales.dtype == jnp.float32
    # Half a scale, plus the rounding of the final cast to `dtype`.
    error = np.abs(np.asarray(x, np.float64) - np.asarray(q.materialise(), np.float64))
    eps = float(jnp.finfo(dtype).eps)
    bound = _per_element_scale(q) / 2 + eps * np.abs(np.asarray(x, np.float64))
    assert np.all(error <= bound * (1 + 1e-6))


# --------------------------------------------------------------------------------
# jit and vmap


def test_quantize_under_jit_matches_eager():
    x = random_array(9, (6, 5))
    for key in (None, jax.random.key(2)):
        eager = qt.quantize(x, 4, 8, key=key)
        jitted = jax.jit(lambda a, k: qt.quantize(a, 4, 8, key=k))(x, key)
        assert isinstance(jitted, qt.Quantized)
        np.testing.assert_array_equal(eager.codes, jitted.codes)
        np.testing.assert_array_equal(eager.scales, jitted.scales)


def test_quantize_under_vmap_stacks_batch_dims():
    xs = random_array(4, (3, 2, 5))
    q = jax.vmap(lambda a: qt.quantize(a, 8, 4))(xs)
    assert q.shape == (3, 2, 5) and q.event_shape == (2, 5)
    assert q.codes.shape == (3, 3, 4)
    for i in range(3):
        np.testing.assert_array_equal(
            q.materialise()[i], qt.quantize(xs[i], 8, 4).materialise()
        )
    # vmapping over keys too: one independent rounding per example
    keys = jax.random.split(jax.random.key(0), 3)
    qk = jax.vmap(lambda a, k: qt.quantize(a, 8, 4, key=k))(xs, keys)
    np.testing.assert_array_equal(
        qk.codes[1], qt.quantize(xs[1], 8, 4, key=keys[1]).codes
    )


def test_negative_traced_scalar_under_jit():
    q = qt.quantize(random_array(6, (9,)), 4, 4)
    out = jax.jit(quax.quaxify(lambda a, s: a * s))(q, jnp.float32(-1.5))
    assert isinstance(out, qt.Quantized)
    assert_close(out, q.materialise() * -1.5)
