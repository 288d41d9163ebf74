"""The input checks every compressor shares: array-likes are accepted, anything else
and keys that are not keys are refused with an error naming the argument."""

import functools as ft

import jax
import numpy as np
import pytest

import quax_tangents as qt


COMPRESSORS = {
    "low_rank": ft.partial(qt.low_rank, rank=1),
    "top_k": ft.partial(qt.top_k, k=2),
    "quantize": qt.quantize,
    "sign_norm": qt.sign_norm,
}
NESTED_LIST = [[1.0, -2.0, 3.0], [0.5, 4.0, -1.0]]


@pytest.mark.parametrize("name", COMPRESSORS)
def test_compressors_accept_array_likes(name):
    compress = COMPRESSORS[name]
    from_list = compress(NESTED_LIST).materialise()
    from_array = compress(np.asarray(NESTED_LIST, np.float32)).materialise()
    np.testing.assert_array_equal(from_list, from_array)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_compressors_refuse_what_is_not_array_like(name):
    with pytest.raises(TypeError, match="`x`"):
        COMPRESSORS[name]([[1.0, 2.0], [3.0]])  # ragged
    with pytest.raises(TypeError, match="`x`"):
        COMPRESSORS[name]([[1, 2], [3, 4]])  # integers have no tangent


@pytest.mark.parametrize(
    "compress",
    [ft.partial(qt.low_rank, rank=1), qt.quantize],
    ids=["low_rank", "quantize"],
)
def test_key_must_be_a_prng_key(compress):
    x = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match=r"`key` must be a PRNG key.*got 0"):
        compress(x, key=0)
    with pytest.raises(TypeError, match=r"`key` must be a PRNG key.*float32\[2\]"):
        compress(x, key=np.zeros(2, np.float32))
    typed = compress(x, key=jax.random.key(1)).materialise()
    raw = compress(x, key=jax.random.PRNGKey(1)).materialise()
    np.testing.assert_array_equal(typed, raw)
