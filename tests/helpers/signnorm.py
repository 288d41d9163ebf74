"""Random `SignNorm` values and the property-test cases of every SignNorm rule."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import quax_tangents as qt
from tests.helpers import float_dtypes, seeds
from tests.helpers.cases import Case, case
from tests.helpers.quantized import (
    batch_shapes,
    batched_compressor,
    convert_case,
    event_shapes,
    normal_array,
    reshape_case,
    scale_case,
    transpose_case,
)


@st.composite
def signnorm_values(draw, event_shape=None, dtype=None, block_size=0, batch_shape=None):
    """A `SignNorm` of standard normal data (with some exact zeros). `block_size=0`
    draws one (None included). Batch dims come from vmapping `sign_norm`."""
    event_shape = draw(event_shapes()) if event_shape is None else tuple(event_shape)
    batch_shape = draw(batch_shapes()) if batch_shape is None else tuple(batch_shape)
    dtype = draw(float_dtypes()) if dtype is None else dtype
    if block_size == 0:
        block_size = draw(st.sampled_from([None, 1, 3, 8]))
    x = normal_array(draw(seeds()), batch_shape + event_shape, dtype)
    x[np.abs(x.astype(np.float32)) < 0.2] = 0
    return batched_compressor(qt.sign_norm, len(batch_shape), block_size)(x)


@case("neg", "SignNorm")
def _neg():
    return signnorm_values().map(
        lambda x: Case(jax.lax.neg, (x,), x.dtype, qt.SignNorm)
    )


@case("copy", "SignNorm")
def _copy():
    return signnorm_values().map(lambda x: Case(jnp.copy, (x,), x.dtype, qt.SignNorm))


@case("mul", "SignNorm", "dense")
def _mul_right():
    return scale_case(signnorm_values(), qt.SignNorm, value_first=True)


@case("mul", "dense", "SignNorm")
def _mul_left():
    return scale_case(signnorm_values(), qt.SignNorm, value_first=False)


@case("convert_element_type", "SignNorm")
def _convert():
    return convert_case(signnorm_values(), qt.SignNorm)


@case("transpose", "SignNorm")
def _transpose():
    return transpose_case(signnorm_values(), qt.SignNorm)


@case("reshape", "SignNorm")
def _reshape():
    return reshape_case(signnorm_values(), qt.SignNorm)
