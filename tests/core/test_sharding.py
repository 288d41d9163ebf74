"""The linear algebra of `_sharding.py` against the factorisations it replaces
(Householder QR, SVD), on one device; the sharded runs are in
`tests/autodiff/test_shard_map.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import quax_tangents as qt
from quax_tangents._core import _sharding
from quax_tangents._marks import _projection
from tests.helpers import assert_close
from tests.helpers.precision import dots_below_highest


_orthonormal_columns = jax.jit(_sharding.orthonormal_columns)


def _orthonormality_error(q) -> float:
    q = np.asarray(q, np.float64)
    live = np.linalg.norm(q, axis=0) > 0
    q = q[:, live]
    return float(np.abs(q.T @ q - np.eye(q.shape[1])).max()) if q.shape[1] else 0.0


def _range_residual(q, y) -> float:
    """How much of `y` lies outside the span of `q`, relative to `y`."""
    q, y = np.asarray(q, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(y - q @ (q.T @ y)) / max(np.linalg.norm(y), 1e-300))


@given(
    m=st.integers(4, 40),
    w=st.integers(1, 10),
    seed=st.integers(0, 2**16),
    log_scale=st.sampled_from([-30, 0, 30]),
)
def test_orthonormal_columns_spans_what_qr_spans(m, w, seed, log_scale):
    w = min(w, m)
    y = np.random.default_rng(seed).standard_normal((m, w)) * 10.0**log_scale
    y = jnp.asarray(y, jnp.float32)
    # Compiled, as projections run it (one program per drawn shape instead of one per
    # operation); the other tests here run it eagerly.
    q = _orthonormal_columns(y)
    q_qr = jnp.linalg.qr(y)[0]
    assert q.shape == y.shape and q.dtype == y.dtype
    assert _orthonormality_error(q) < 5e-6
    # The same subspace as QR's: the same projection, to float32 rounding.
    assert_close(q @ q.T, q_qr @ q_qr.T)
    assert _range_residual(q, y) < 5e-6


@given(rank=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_orthonormal_columns_of_a_rank_deficient_matrix_has_zero_columns(rank, seed):
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((30, rank)) @ rng.standard_normal((rank, 6))
    q = _sharding.orthonormal_columns(jnp.asarray(y, jnp.float32))
    assert not bool(jnp.any(jnp.isnan(q)))
    assert int(np.sum(np.linalg.norm(np.asarray(q), axis=0) > 0.5)) == rank
    assert _orthonormality_error(q) < 5e-6
    assert _range_residual(q, y) < 5e-6


def _nearly_orthonormal(m, w, zero, size, seed):
    """Orthonormal `(m, w)` columns times `I + E` (`E` symmetric, entries up to
    `size`), the first `zero` columns zeroed: what the eigendecomposition's rounds
    hand `polished`."""
    rng = np.random.default_rng(seed)
    q = np.linalg.qr(rng.standard_normal((m, w)))[0]
    e = rng.uniform(-size, size, (w, w))
    q = q @ (np.eye(w) + (e + e.T) / 2)
    q[:, :zero] = 0
    return q


def _spectral_error(q) -> float:
    """`|Q^T Q - I|_2` over the nonzero columns of `q`."""
    q = np.asarray(q, np.float64)
    q = q[:, np.linalg.norm(q, axis=0) > 0]
    return float(np.linalg.norm(q.T @ q - np.eye(q.shape[1]), 2)) if q.size else 0.0


@given(
    w=st.integers(1, 12),
    zero=st.integers(0, 3),
    log_size=st.floats(-6, -2),
    seed=st.integers(0, 2**16),
)
def test_polished_squares_the_orthonormality_error(w, zero, log_size, seed):
    zero = min(zero, w)
    q = _nearly_orthonormal(3 * w, w, zero, 10.0**log_size, seed)
    before = _spectral_error(q)
    with jax.enable_x64(True):
        out = np.asarray(_sharding.polished(jnp.asarray(q)))
    # `D = Q^T Q - I` becomes `-3/4 D^2 + 1/4 D^3`; zero columns stay zero (exactly),
    # and the columns stay in `q`'s range.
    assert _spectral_error(out) <= 0.75 * before**2 + 0.25 * before**3 + 1e-13
    assert np.all(out[:, :zero] == 0)
    if zero < w:
        basis = np.linalg.qr(q[:, zero:])[0]
        outside = out - basis @ (basis.T @ out)
        assert np.linalg.norm(outside) <= 1e-12 * np.linalg.norm(out)


def test_polished_in_float32_reaches_rounding():
    # As the eigendecomposition's rounds leave it: orthonormal to about 1e-4.
    q = _nearly_orthonormal(600, 64, 5, 1e-5, 0)
    assert _spectral_error(q) > 1e-5
    out = _sharding.polished(jnp.asarray(q, jnp.float32))
    assert out.dtype == jnp.float32
    assert _orthonormality_error(out) < 2e-6
    assert np.all(np.asarray(out)[:, :5] == 0)


@pytest.mark.parametrize("kappa", [1e2, 1e4])
def test_orthonormal_columns_keeps_an_ill_conditioned_range(kappa):
    rng = np.random.default_rng(0)
    u = np.linalg.qr(rng.standard_normal((50, 8)))[0]
    v = np.linalg.qr(rng.standard_normal((8, 8)))[0]
    y = (u * np.logspace(0, -np.log10(kappa), 8)) @ v.T
    q = _sharding.orthonormal_columns(jnp.asarray(y, jnp.float32))
    assert _orthonormality_error(q) < 5e-6
    assert _range_residual(q, y) < 1e-5


def test_orthonormal_columns_keeps_a_graded_range_at_a_layers_size():
    # A sketch the size of a GaLore layer's at rank 128, singular values from 1 down
    # to 1e-3: every direction is kept, as QR keeps it. The shift of shifted
    # CholeskyQR's worst case (`11 (m w + w (w + 1)) u`, 0.19 here) dropped all
    # those below about 1% of the largest (44 of the 132).
    rng = np.random.default_rng(0)
    m, w = 2048, 132
    u = np.linalg.qr(rng.standard_normal((m, w)))[0]
    v = np.linalg.qr(rng.standard_normal((w, w)))[0]
    y = (u * np.logspace(0, -3, w)) @ v.T
    q = _orthonormal_columns(jnp.asarray(y, jnp.float32))
    assert int(np.sum(np.linalg.norm(np.asarray(q), axis=0) > 0.5)) == w
    assert _orthonormality_error(q) < 5e-6
    assert _range_residual(q, y) < 1e-5


def test_orthonormal_columns_in_float64():
    with jax.enable_x64(True):
        y = jnp.asarray(np.random.default_rng(1).standard_normal((20, 5)))
        q = _sharding.orthonormal_columns(y)
        assert q.dtype == jnp.float64
        assert _orthonormality_error(q) < 1e-13


@given(w=st.integers(2, 8), n=st.integers(8, 30), seed=st.integers(0, 2**16))
def test_top_left_singular_vectors_match_the_svd(w, n, seed):
    rng = np.random.default_rng(seed)
    # Well separated singular values, so that each vector is determined.
    b = (np.linalg.qr(rng.standard_normal((w, w)))[0] * 2.0 ** -np.arange(w)) @ (
        np.linalg.qr(rng.standard_normal((n, w)))[0].T
    )
    rank = max(w // 2, 1)
    u = _sharding.top_left_singular(jnp.asarray(b, jnp.float32), rank)
    u_svd = np.linalg.svd(b)[0][:, :rank]
    assert_close(u @ u.T, u_svd @ u_svd.T, factor=10)


def test_fresh_projection_equals_the_qr_range_finder(monkeypatch):
    """The projection a fresh projector gives, with the Gram-based orthonormalisation
    and truncation, against the same range finder built on QR and the SVD."""
    rng = np.random.default_rng(3)
    spectrum = 0.5 ** np.arange(16)
    g = (np.linalg.qr(rng.standard_normal((16, 16)))[0] * spectrum) @ np.linalg.qr(
        rng.standard_normal((24, 16))
    )[0].T
    x = jnp.asarray(np.eye(16), jnp.float32)
    w = jnp.zeros((16, 24), jnp.float32)
    target = jnp.asarray(g, jnp.float32)

    def loss(w):
        w = qt.projected_cotangent(w, 4, key=jax.random.key(1), iters=2)
        return jnp.sum((x @ w) * target)

    ours = qt.grad(loss)(w)

    def qr_basis(apply, apply_t, shape, spec, key):
        m, n = shape
        width = min(spec.rank + spec.oversample, m, n)
        orth = lambda a: jnp.linalg.qr(a)[0]  # noqa: E731
        basis = orth(apply(jax.random.normal(key, (n, width), jnp.float32)))
        for _ in range(spec.iters):
            basis = orth(apply(orth(apply_t(basis))))
        u = jnp.linalg.svd(apply_t(basis).T, full_matrices=False)[0]
        return basis @ u[:, : spec.rank]

    monkeypatch.setattr(_projection, "_range_basis", qr_basis)
    jax.clear_caches()
    reference = qt.grad(loss)(w)
    p = np.asarray(ours.left, np.float64)
    assert _orthonormality_error(p) < 5e-6
    assert_close(ours.materialise(), reference.materialise())
    # And both are the best rank-4 projection of this spectrum.
    u = np.linalg.svd(g)[0][:, :4]
    assert_close(ours.materialise(), u @ (u.T @ g), factor=10)


def test_orthonormalisation_products_ask_for_the_highest_precision():
    y = jnp.ones((40, 12), jnp.float32)
    assert dots_below_highest(_sharding.orthonormal_columns, y) == []
    assert dots_below_highest(lambda b: _sharding.top_left_singular(b, 4), y.T) == []
    assert dots_below_highest(_sharding.batched_gram, y[None]) == []
    assert dots_below_highest(_sharding.gram, y) == []
    # `matmul` keeps the default unless asked.
    assert len(dots_below_highest(_sharding.matmul, y, y.T)) == 1
    exact = lambda a, b: _sharding.matmul(a, b, _sharding.EXACT)  # noqa: E731
    assert dots_below_highest(exact, y, y.T) == []


def test_the_range_finder_orthonormalises_at_the_highest_precision():
    """Of a fresh projector's products, only those with the gradient itself (here
    asked at HIGHEST too) may run at another precision."""
    g = jnp.asarray(np.random.default_rng(0).standard_normal((24, 16)), jnp.float32)
    spec = _projection.Finish("projected", rank=4, iters=1)

    def basis(g):
        exact = jax.lax.Precision.HIGHEST
        return _projection._range_basis(
            lambda v: jnp.matmul(g, v, precision=exact),
            lambda u: jnp.matmul(g.T, u, precision=exact),
            g.shape,
            spec,
            jax.random.key(0),
        )

    assert dots_below_highest(basis, g) == []


def test_helpers_are_plain_without_explicit_axes():
    a = jnp.arange(6.0).reshape(2, 3)
    assert not _sharding.explicit_axes()
    assert _sharding.spec_entries(a) == (None, None)
    assert_close(_sharding.matmul(a, a.T), a @ a.T)
    assert_close(_sharding.gram(a), a.T @ a)
    assert _sharding.like(a, a) is a
    aval = _sharding.transposed_type(jax.typeof(a), True)
    assert aval.shape == (3, 2)


def test_lowrank_type_is_its_shape_and_dtype_without_a_mesh():
    x = qt.LowRank(jnp.ones((5, 2)), jnp.ones((3, 2)))
    aval = x.aval()
    assert aval.shape == (5, 3) and aval.dtype == jnp.float32
    assert not aval.manual_axis_type.varying
