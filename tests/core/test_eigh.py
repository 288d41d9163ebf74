"""`symmetric_eigh` and its TPU lowering, the block Jacobi method, against LAPACK's
`eigh` in float64 (numpy), on CPU. The TPU lowering is pure JAX, so it runs here
called by name, with small blocks that exercise the same rounds and padding as the
TPU's blocks of 128 rows."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from quax_tangents._core import _eigh, _sharding
from tests.helpers import assert_close
from tests.helpers.range_finder import assert_same_range_finder


def _symmetric(kind: str, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "indefinite":
        x = rng.standard_normal((w, w))
        return x + x.T
    if kind == "psd":
        x = rng.standard_normal((w, w + 3))
        return x @ x.T
    if kind == "low rank":  # a Gram matrix of a rank-deficient range
        x = rng.standard_normal((w, max(1, w // 3)))
        return x @ x.T
    if kind == "clustered":  # repeated eigenvalues, a random basis
        q = np.linalg.qr(rng.standard_normal((w, w)))[0]
        return (q * np.repeat([1.0, 2.0], [w // 2, w - w // 2])) @ q.T
    return np.zeros((w, w))


def _check_decomposition(a: np.ndarray, values, vectors, tolerance: float) -> None:
    values, vectors = np.asarray(values, np.float64), np.asarray(vectors, np.float64)
    scale = max(float(np.abs(np.linalg.eigvalsh(a)).max()), 1e-30)
    assert values.shape == a.shape[:1] and vectors.shape == a.shape
    assert np.all(np.diff(values) >= -tolerance * scale)  # ascending
    assert np.abs(values - np.linalg.eigvalsh(a)).max() <= tolerance * scale
    assert np.abs(a @ vectors - vectors * values).max() <= tolerance * scale
    assert np.abs(vectors.T @ vectors - np.eye(len(a))).max() <= tolerance


# One compile per example's shape and block, where run op by op it is many.
_jitted_block_jacobi = jax.jit(_eigh.block_jacobi_eigh, static_argnames="block")


@settings(max_examples=25)
@given(
    w=st.integers(1, 40),
    block=st.sampled_from([1, 2, 3, 4, 8]),
    kind=st.sampled_from(["indefinite", "psd", "low rank", "clustered", "zero"]),
    log_scale=st.sampled_from([-20, 0, 20]),
    seed=st.integers(0, 2**16),
)
def test_block_jacobi_matches_lapack(w, block, kind, log_scale, seed):
    a = _symmetric(kind, w, seed) * 10.0**log_scale
    values, vectors = _jitted_block_jacobi(jnp.asarray(a, jnp.float32), block=block)
    assert values.dtype == jnp.float32 and vectors.dtype == jnp.float32
    _check_decomposition(a, values, vectors, 2e-5)


def test_block_jacobi_at_the_tpu_block_size():
    # The sizes of the GaLore ranks' Gram matrices (rank + 4), with 128-row blocks.
    a = _symmetric("psd", 516, 0)
    values, vectors = _eigh.block_jacobi_eigh(jnp.asarray(a, jnp.float32))
    _check_decomposition(a, values, vectors, 2e-5)


def test_block_jacobi_in_float64():
    a = _symmetric("indefinite", 30, 1)
    with jax.enable_x64(True):
        values, vectors = _eigh.block_jacobi_eigh(jnp.asarray(a), block=4)
        assert values.dtype == jnp.float64
    _check_decomposition(a, values, vectors, 1e-12)


def test_block_jacobi_of_a_stack_is_per_matrix():
    stack = np.stack([_symmetric("psd", 9, seed) for seed in range(3)])
    values, vectors = _eigh.block_jacobi_eigh(jnp.asarray(stack, jnp.float32), block=2)
    for i, a in enumerate(stack):
        one = _eigh.block_jacobi_eigh(jnp.asarray(a, jnp.float32), block=2)
        assert_close(values[i], one[0])
        assert_close(vectors[i], one[1])


def test_block_jacobi_passes_nan_on():
    a = np.full((6, 6), np.nan, np.float32)
    values, _ = _eigh.block_jacobi_eigh(jnp.asarray(a), block=2)
    assert bool(jnp.all(jnp.isnan(values)))


@pytest.mark.parametrize("blocks", [2, 4, 6, 10])
def test_the_tournament_pairs_every_two_blocks_once(blocks):
    rounds = _eigh._round_robin(blocks)
    assert rounds.shape == (blocks - 1, blocks)
    met = [frozenset(r[2 * j : 2 * j + 2]) for r in rounds for j in range(blocks // 2)]
    assert all(sorted(r) == list(range(blocks)) for r in rounds)  # a permutation each
    assert sorted(met, key=sorted) == sorted(
        map(frozenset, itertools.combinations(range(blocks), 2)), key=sorted
    )


def test_symmetric_eigh_off_a_tpu_is_lapacks():
    # Above the TPU's native size, only a TPU lowering takes the block Jacobi branch;
    # on CPU the result is `jnp.linalg.eigh`'s, bit for bit.
    a = jnp.asarray(_symmetric("psd", _eigh.NATIVE_ROWS + 4, 2), jnp.float32)
    values, vectors = jax.jit(_eigh.symmetric_eigh)(a)
    expected = jax.jit(jnp.linalg.eigh)(a)
    np.testing.assert_array_equal(values, expected[0])
    np.testing.assert_array_equal(vectors, expected[1])
    assert "platform_index" in str(jax.make_jaxpr(_eigh.symmetric_eigh)(a))


def _with_block_jacobi(monkeypatch) -> None:
    """`_sharding`'s eigendecompositions by block Jacobi, as a TPU lowers them."""
    monkeypatch.setattr(
        _sharding,
        "symmetric_eigh",
        lambda a: _eigh.block_jacobi_eigh(a, block=3),
    )


@settings(max_examples=10)
@given(m=st.integers(8, 30), w=st.integers(2, 8), seed=st.integers(0, 2**16))
def test_the_range_finder_is_the_same_with_block_jacobi(m, w, seed):
    # The TPU lowering and LAPACK give the same orthonormal range and the same top
    # singular vectors, to float32 rounding.
    assert_same_range_finder(_with_block_jacobi, m, w, seed)


def test_a_rank_deficient_range_has_zero_columns_with_block_jacobi(monkeypatch):
    _with_block_jacobi(monkeypatch)
    rng = np.random.default_rng(3)
    y = rng.standard_normal((30, 2)) @ rng.standard_normal((2, 7))
    q = _sharding.orthonormal_columns(jnp.asarray(y, jnp.float32))
    assert not bool(jnp.any(jnp.isnan(q)))
    assert int(np.sum(np.linalg.norm(np.asarray(q), axis=0) > 0.5)) == 2
