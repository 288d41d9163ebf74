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
from tests.helpers import assert_close, float_dtypes, seeds
from tests.helpers.quantized import (
    EVENT_SHAPES,
    batched_compressor,
    normal_array,
    quantized_values,
)


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


def _good(**changes):
    kwargs = dict(
        codes=jnp.zeros((3, 4), jnp.int8),
        scales=jnp.ones((3,), jnp.float32),
        event_shape=(2, 5),
        bits=8,
        block_size=4,
        dtype=jnp.float32,
    )
    kwargs.update(changes)
    return kwargs


def test_good_arguments_construct():
    q = qt.Quantized(**_good())
    assert q.shape == (2, 5) and q.num_blocks == 3 and q.qmax == 127


@pytest.mark.parametrize(
    "changes, error, field",
    [
        (dict(bits=3), ValueError, "bits"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=2.0), TypeError, "block_size"),
        (
            dict(bits=4, block_size=5, codes=jnp.zeros((2, 2), jnp.uint8)),
            ValueError,
            "block_size",
        ),
        (dict(codes=jnp.zeros((3, 4), jnp.int32)), TypeError, "codes"),
        (dict(bits=4, codes=jnp.zeros((3, 2), jnp.int8)), TypeError, "codes"),
        (dict(codes=jnp.zeros((2, 4), jnp.int8)), ValueError, "codes"),
        (dict(codes=jnp.zeros((3, 5), jnp.int8)), ValueError, "codes"),
        (dict(codes=jnp.zeros((12,), jnp.int8)), ValueError, "codes"),
        (dict(scales=jnp.ones((3,), jnp.float16)), TypeError, "scales"),
        (dict(scales=jnp.ones((4,), jnp.float32)), ValueError, "scales"),
        (dict(scales=jnp.array([1.0, jnp.nan, 1.0])), ValueError, "scales"),
        (dict(scales=jnp.array([1.0, jnp.inf, 1.0])), ValueError, "scales"),
        (dict(dtype=jnp.int32), TypeError, "dtype"),
        (dict(event_shape=(2, -5)), ValueError, "event_shape"),
    ],
)
def test_constructor_validation_names_the_field(changes, error, field):
    with pytest.raises(error, match=f"`{field}`"):
        qt.Quantized(**_good(**changes))


def test_value_checks_skip_traced_scales():
    # Under jit the scales are not known: only shapes and dtypes are checked.
    @jax.jit
    def build(scales):
        return qt.Quantized(**_good(scales=scales)).materialise()

    assert bool(jnp.isnan(build(jnp.array([1.0, jnp.nan, 1.0]))).any())
    with pytest.raises(ValueError, match="`scales`"):
        jax.jit(lambda s: qt.Quantized(**_good(scales=s)))(jnp.ones(4))


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


def test_quantize_validates_input():
    with pytest.raises(TypeError, match="`x`"):
        qt.quantize(jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="`x`"):
        qt.quantize(jnp.array([1.0, jnp.nan]))
    with pytest.raises(ValueError, match="`x`"):
        qt.quantize(jnp.array([1.0, -jnp.inf]))


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
    x = normal_array(seed, event_shape, jnp.float32) * np.float32(spread)
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
    x = normal_array(seed, event_shape, jnp.float32)
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
    x = jnp.asarray(normal_array(0, (256,), jnp.float32))
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
    x = jnp.asarray(normal_array(3, (40,), jnp.float32))
    a = qt.quantize(x, key=jax.random.key(7))
    b = qt.quantize(x, key=jax.random.key(7))
    c = qt.quantize(x, key=jax.random.key(8))
    np.testing.assert_array_equal(a.codes, b.codes)
    assert not np.array_equal(a.codes, c.codes)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_input_keeps_dtype(dtype):
    x = jnp.asarray(normal_array(5, (3, 7), dtype))
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
    x = jnp.asarray(normal_array(9, (6, 5), jnp.float32))
    for key in (None, jax.random.key(2)):
        eager = qt.quantize(x, 4, 8, key=key)
        jitted = jax.jit(lambda a, k: qt.quantize(a, 4, 8, key=k))(x, key)
        assert isinstance(jitted, qt.Quantized)
        np.testing.assert_array_equal(eager.codes, jitted.codes)
        np.testing.assert_array_equal(eager.scales, jitted.scales)


def test_quantize_under_vmap_stacks_batch_dims():
    xs = jnp.asarray(normal_array(4, (3, 2, 5), jnp.float32))
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


def _scaled_view(q):
    return (-(q * 2.0)).reshape(-1)


def test_quaxified_rules_under_jit_and_vmap():
    xs = jnp.asarray(normal_array(11, (3, 4, 5), jnp.float32))
    qs = batched_compressor(qt.quantize, 1, 8, 8)(xs)
    expected = jax.vmap(lambda x: _scaled_view(x))(qs.materialise())
    with qt.fallback("error"):
        jitted = jax.jit(quax.quaxify(_scaled_view))(qt.quantize(xs[0], 8, 8))
        assert isinstance(jitted, qt.Quantized)
        assert_close(jitted, expected[0])
        outer = jax.vmap(quax.quaxify(_scaled_view))(qs)
        assert isinstance(outer, qt.Quantized) and outer.shape == (3, 20)
        assert_close(outer, expected)
        inner = quax.quaxify(jax.vmap(_scaled_view))(qs)
        assert isinstance(inner, qt.Quantized)
        assert_close(inner, expected)


def test_jvp_carries_a_quantized_tangent():
    x = jnp.asarray(normal_array(1, (4, 6), jnp.float32))
    tangent = qt.quantize(jnp.asarray(normal_array(2, (4, 6), jnp.float32)), 8, 8)

    def f(a):
        return jnp.reshape(-3.0 * a, (24,))

    with qt.fallback("error"):
        primal, tangent_out = quax.quaxify(jax.jvp)(f, (x,), (tangent,))
    assert isinstance(tangent_out, qt.Quantized)
    assert_close(primal, f(x))
    assert_close(tangent_out, f(tangent.materialise()))


def test_negative_traced_scalar_under_jit():
    q = qt.quantize(jnp.asarray(normal_array(6, (9,), jnp.float32)), 4, 4)
    out = jax.jit(quax.quaxify(lambda a, s: a * s))(q, jnp.float32(-1.5))
    assert isinstance(out, qt.Quantized)
    assert_close(out, q.materialise() * -1.5)


def test_mixed_batch_transpose_stays_compressed():
    xs = jnp.asarray(normal_array(8, (2, 3, 4, 1), jnp.float32))
    qs = batched_compressor(qt.quantize, 2, 8, 4)(xs)
    fn = lambda a: jnp.transpose(a, (1, 0, 3, 2))  # noqa: E731
    with qt.fallback("error"):
        out = quax.quaxify(fn)(qs)
    assert isinstance(out, qt.Quantized) and out.codes.shape[:2] == (3, 2)
    assert_close(out, fn(qs.materialise()))


# --------------------------------------------------------------------------------
# Paths that densify


def _q(shape=(3, 4), seed=0):
    return qt.quantize(jnp.asarray(normal_array(seed, shape, jnp.float32)), 8, 4)


DENSIFYING = {
    "transpose": (lambda a: a.T, "transpose"),
    "reshape_dimensions": (lambda a: jax.lax.reshape(a, (12,), (1, 0)), "reshape"),
    "hadamard_row": (lambda a: a * jnp.arange(4.0), "mul"),
    "to_int": (lambda a: a.astype(jnp.int32), "convert_element_type"),
}


@pytest.mark.parametrize("name", sorted(DENSIFYING))
def test_densify_paths_are_counted_and_exact(name):
    fn, primitive = DENSIFYING[name]
    q = _q()
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(fn)(q)
    assert not isinstance(out, qt.CompressedArray)
    assert qt.fallback_counts() == {(primitive, "Quantized"): 1}
    np.testing.assert_array_equal(out, fn(q.materialise()))
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match=primitive):
        quax.quaxify(fn)(q)


def test_reshape_that_moves_batch_dims_densifies():
    qs = batched_compressor(qt.quantize, 1, 8, 4)(
        jnp.asarray(normal_array(2, (2, 3), jnp.float32))
    )
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(lambda a: a.reshape(6))(qs)
    assert qt.fallback_counts() == {("reshape", "Quantized"): 1}
    np.testing.assert_array_equal(out, qs.materialise().reshape(6))


def test_adding_two_quantized_densifies_exactly():
    a, b = _q(seed=1), _q(seed=2)
    qt.reset_fallback_counts()
    with pytest.warns(qt.DensificationWarning, match="add"):
        out = quax.quaxify(jnp.add)(a, b)
    assert not isinstance(out, qt.CompressedArray)
    assert qt.fallback_counts() == {("add", "Quantized"): 1}
    np.testing.assert_array_equal(out, a.materialise() + b.materialise())
    with qt.fallback("error"), pytest.raises(qt.DensificationError):
        quax.quaxify(jnp.add)(a, b)


def test_densify_counts_once_per_trace_under_jit():
    q = _q()
    qt.reset_fallback_counts()
    f = jax.jit(quax.quaxify(lambda a: a.T))
    with qt.fallback("silent"):
        f(q)
        f(q)
    assert qt.fallback_counts() == {("transpose", "Quantized"): 1}


@settings(max_examples=6, deadline=None)
@given(values=quantized_values(), dtype=float_dtypes())
def test_float_conversion_keeps_the_type(values, dtype):
    with qt.fallback("error"):
        out = quax.quaxify(lambda a: a.astype(dtype))(values)
    assert isinstance(out, qt.Quantized) and out.dtype == dtype
    np.testing.assert_array_equal(out.codes, values.codes)
