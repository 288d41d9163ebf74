"""What `Quantized` and `SignNorm` share (the `BlockedArray` base and its rules):
quaxified rules under jit, vmap and jvp, and the paths that densify, run for each type."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quax
from hypothesis import given, settings

import quax_tangents as qt
from quax_tangents._types._blocked import BlockedArray
from tests.helpers import assert_close, field_leaves, float_dtypes, random_array
from tests.helpers.blocked import (
    batched_compressor,
    blocked_values,
    constructor_arguments,
)


# Each type's compressor and the settings its tests use.
COMPRESSORS = {
    "Quantized": (qt.quantize, (8, 4)),
    "SignNorm": (qt.sign_norm, (4,)),
}
TYPES = sorted(COMPRESSORS)


def _compress(name, x, n_batch=0):
    """`x` compressed to type `name`, with `n_batch` leading batch dims."""
    compress, settings_ = COMPRESSORS[name]
    if n_batch:
        return batched_compressor(compress, n_batch, *settings_)(x)
    return compress(x, *settings_)


def _value(name, shape=(3, 4), seed=0):
    return _compress(name, random_array(seed, shape))


def test_the_types_share_an_abstract_base():
    assert issubclass(qt.Quantized, BlockedArray)
    assert issubclass(qt.SignNorm, BlockedArray)
    with pytest.raises(TypeError, match="abstract"):
        BlockedArray()


# --------------------------------------------------------------------------------
# Validation (the checks of `BlockedArray._check_structure` and each type's own)

INVALID_ARGUMENTS = {
    "Quantized": [
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
    "SignNorm": [
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=4.0), TypeError, "block_size"),
        (dict(bits=jnp.zeros((3, 1), jnp.int8)), TypeError, "bits"),
        (dict(bits=jnp.zeros((2, 1), jnp.uint8)), ValueError, "bits"),
        (dict(bits=jnp.zeros((3, 2), jnp.uint8)), ValueError, "bits"),
        (dict(bits=jnp.zeros((3,), jnp.uint8)), ValueError, "bits"),
        (dict(norms=jnp.ones((3,), jnp.float16)), TypeError, "norms"),
        (dict(norms=jnp.ones((2,), jnp.float32)), ValueError, "norms"),
        (dict(norms=jnp.array([1.0, jnp.nan, 1.0])), ValueError, "norms"),
        (dict(norms=jnp.array([1.0, jnp.inf, 1.0])), ValueError, "norms"),
        (dict(norms=jnp.array([1.0, -1.0, 1.0])), ValueError, "norms"),
        (dict(dtype=jnp.int8), TypeError, "dtype"),
        (dict(event_shape=(-1, 5)), ValueError, "event_shape"),
    ],
}


@pytest.mark.parametrize(
    "name, changes, error, field",
    [
        pytest.param(name, *row, id=f"{name}-{i}-{row[2]}")
        for name in TYPES
        for i, row in enumerate(INVALID_ARGUMENTS[name])
    ],
)
def test_constructor_validation_names_the_field(name, changes, error, field):
    with pytest.raises(error, match=f"`{field}`"):
        getattr(qt, name)(**constructor_arguments(name, **changes))


@pytest.mark.parametrize(
    "name, field, bad",
    [("Quantized", "scales", [1.0, jnp.nan, 1.0]), ("SignNorm", "norms", [1, -1, 1])],
)
def test_value_checks_skip_traced_statistics(name, field, bad):
    # Under jit the values are not known: only shapes and dtypes are checked.
    def build(stats):
        return getattr(qt, name)(**constructor_arguments(name, **{field: stats}))

    bad = jnp.array(bad, jnp.float32)
    with pytest.raises(ValueError, match=f"`{field}`"):
        build(bad)
    assert jax.jit(lambda s: build(s).materialise())(bad).shape == (2, 5)
    with pytest.raises(ValueError, match=f"`{field}`"):
        jax.jit(build)(jnp.ones(4))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize(
    "x, error",
    [
        (jnp.ones((4,), jnp.int32), TypeError),
        (jnp.array([1.0, jnp.nan]), ValueError),
        (jnp.array([1.0, -jnp.inf]), ValueError),
    ],
    ids=["int", "nan", "-inf"],
)
def test_compressor_validates_input(name, x, error):
    with pytest.raises(error, match="`x`"):
        _compress(name, x)


# --------------------------------------------------------------------------------
# jit, vmap and jvp


def _scaled_view(x, c):
    return jnp.reshape(c * -(x * 2.0), (-1,))


@pytest.mark.parametrize("name", TYPES)
def test_quaxified_rules_under_jit_and_vmap(name):
    xs = random_array(11, (3, 4, 5))
    batched = _compress(name, xs, n_batch=1)
    cls = type(batched)
    c = jnp.float32(-0.5)
    expected = jax.vmap(lambda a: _scaled_view(a, c))(batched.materialise())
    with qt.fallback("error"):
        jitted = jax.jit(quax.quaxify(_scaled_view))(_compress(name, xs[0]), c)
        assert isinstance(jitted, cls)
        assert_close(jitted, expected[0])
        outer = jax.vmap(quax.quaxify(_scaled_view), in_axes=(0, None))(batched, c)
        assert isinstance(outer, cls) and outer.shape == (3, 20)
        assert_close(outer, expected)
        inner = quax.quaxify(jax.vmap(_scaled_view, in_axes=(0, None)))(batched, c)
        assert isinstance(inner, cls)
        assert_close(inner, expected)


@pytest.mark.parametrize("name", TYPES)
def test_jvp_carries_a_compressed_tangent(name):
    x = random_array(1, (4, 6))
    tangent = _value(name, (4, 6), seed=2)

    def f(a):
        return jnp.reshape(-3.0 * a, (24,))

    with qt.fallback("error"):
        primal, tangent_out = quax.quaxify(jax.jvp)(f, (x,), (tangent,))
    assert isinstance(tangent_out, type(tangent))
    assert_close(primal, f(x))
    assert_close(tangent_out, f(tangent.materialise()))


@pytest.mark.parametrize("name", TYPES)
def test_mixed_batch_transpose_stays_compressed(name):
    values = _compress(name, random_array(8, (2, 3, 4, 1)), n_batch=2)
    fn = lambda a: jnp.transpose(a, (1, 0, 3, 2))  # noqa: E731
    with qt.fallback("error"):
        out = quax.quaxify(fn)(values)
    assert isinstance(out, type(values)) and out.shape == (3, 2, 1, 4)
    assert all(leaf.shape[:2] == (3, 2) for leaf in jax.tree.leaves(out))
    assert_close(out, fn(values.materialise()))


@settings(max_examples=8, deadline=None)
@given(values=blocked_values(), dtype=float_dtypes())
def test_float_conversion_keeps_the_type_and_the_blocks(values, dtype):
    with qt.fallback("error"):
        out = quax.quaxify(lambda a: a.astype(dtype))(values)
    assert isinstance(out, type(values)) and out.dtype == dtype
    for got, stored in zip(field_leaves(out), field_leaves(values), strict=True):
        np.testing.assert_array_equal(got, stored)


# --------------------------------------------------------------------------------
# Paths that densify

DENSIFYING = {
    "transpose": (lambda a: a.T, "transpose"),
    "reshape_dimensions": (lambda a: jax.lax.reshape(a, (12,), (1, 0)), "reshape"),
    "hadamard_row": (lambda a: a * jnp.arange(4.0), "mul"),
    "hadamard_column": (lambda a: a * jnp.arange(3.0)[:, None], "mul"),
    "to_int": (lambda a: a.astype(jnp.int32), "convert_element_type"),
}


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("path", sorted(DENSIFYING))
def test_densify_paths_are_counted_and_exact(name, path):
    fn, primitive = DENSIFYING[path]
    value = _value(name)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(fn)(value)
    assert not isinstance(out, qt.CompressedArray)
    assert qt.fallback_counts() == {(primitive, name): 1}
    np.testing.assert_array_equal(out, fn(value.materialise()))
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match=primitive):
        quax.quaxify(fn)(value)


@pytest.mark.parametrize("name", TYPES)
def test_reshape_that_moves_batch_dims_densifies(name):
    values = _compress(name, random_array(2, (2, 3)), n_batch=1)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(lambda a: a.reshape(6))(values)
    assert qt.fallback_counts() == {("reshape", name): 1}
    np.testing.assert_array_equal(out, values.materialise().reshape(6))


@pytest.mark.parametrize("name", TYPES)
def test_densify_counts_once_per_trace_under_jit(name):
    value = _value(name)
    qt.reset_fallback_counts()
    f = jax.jit(quax.quaxify(lambda a: a.T))
    with qt.fallback("silent"):
        f(value)
        f(value)
    assert qt.fallback_counts() == {("transpose", name): 1}


@pytest.mark.parametrize("name", TYPES)
def test_adding_two_values_of_a_type_densifies_exactly(name):
    a, b = _value(name, seed=1), _value(name, seed=2)
    qt.reset_fallback_counts()
    with pytest.warns(qt.DensificationWarning, match="add"):
        out = quax.quaxify(jnp.add)(a, b)
    assert not isinstance(out, qt.CompressedArray)
    assert qt.fallback_counts() == {("add", name): 1}
    np.testing.assert_array_equal(out, a.materialise() + b.materialise())
    with qt.fallback("error"), pytest.raises(qt.DensificationError):
        quax.quaxify(jnp.add)(a, b)


def test_adding_signnorm_and_quantized_densifies_both():
    a, b = _value("SignNorm", seed=1), _value("Quantized", seed=3)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(jnp.add)(a, b)
    assert qt.fallback_counts() == {("add", "SignNorm"): 1, ("add", "Quantized"): 1}
    np.testing.assert_array_equal(out, a.materialise() + b.materialise())
