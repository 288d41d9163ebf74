"""Compressed tangents against plain `jax.jvp`/`jax.vjp` on materialised ones, for an
MLP, residual blocks and a small conv net."""

import jax
import jax.numpy as jnp
import pytest

import quax_tangents as qt
from tests.helpers import assert_close, random_array


X = random_array(0, (8, 16))
WIDTHS = [16, 24, 24, 10]
WEIGHTS = [
    random_array(1 + i, (a, b)) / jnp.sqrt(a)
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:]))
]
COMPRESSORS = {
    "LowRank": lambda w: qt.low_rank(w, 2),
    "Sparse": lambda w: qt.top_k(w, 0.1),
    "Quantized": lambda w: qt.quantize(w, 8, 16),
    "SignNorm": lambda w: qt.sign_norm(w, 16),
}


def mlp(weights, x=X):
    h = x
    for w in weights[:-1]:
        h = jnp.tanh(h @ w)
    return h @ weights[-1]


def _scale(array):
    return float(jnp.abs(array).max()) + 1.0


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_mlp_jvp_matches_dense(name):
    tangents = [
        COMPRESSORS[name](random_array(10 + i, w.shape)) for i, w in enumerate(WEIGHTS)
    ]
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        primal, tangent = qt.jvp(mlp, (WEIGHTS,), (tangents,))
    ref_primal, ref_tangent = jax.jvp(mlp, (WEIGHTS,), (qt.materialise(tangents),))
    assert_close(primal, ref_primal, scale=_scale(ref_primal))
    assert_close(tangent, ref_tangent, scale=_scale(ref_tangent), factor=5)
    counted = {prim for prim, _ in qt.fallback_counts()}
    if name == "LowRank":
        # The matmuls keep LowRank exactly; tanh's derivative (an elementwise
        # product with a full matrix) is where it densifies, and that is counted.
        assert "dot_general" not in counted and "mul" in counted
    else:
        # Quantized and SignNorm have no matmul rule; Sparse's exact product holds
        # more entries than the dense result here (k * batch > out size).
        assert "dot_general" in counted


def test_mlp_vjp_with_a_compressed_cotangent_seed():
    seed = qt.low_rank(random_array(20, (8, 10)), 1)
    with qt.fallback("silent"):
        out, pullback = qt.vjp(mlp, WEIGHTS)
        (grads,) = pullback(seed)
    _, ref_pullback = jax.vjp(mlp, WEIGHTS)
    (ref_grads,) = ref_pullback(seed.materialise())
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, scale=_scale(want), factor=5)
    # The last layer's weight cotangent is h^T seed: low rank, exactly.
    assert isinstance(grads[-1], qt.LowRank)


def residual_stack(weights, x=X):
    h = x
    for w in weights:
        h = h + h @ w
    return h


RES_WEIGHTS = [random_array(30 + i, (16, 16)) / 8 for i in range(6)]


def test_residual_rank_growth_hits_the_budget_and_stays_exact():
    tangents = [qt.low_rank(random_array(40 + i, (16, 16)), 1) for i in range(6)]
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        _, tangent = qt.jvp(residual_stack, (RES_WEIGHTS,), (tangents,))
    _, ref = jax.jvp(residual_stack, (RES_WEIGHTS,), (qt.materialise(tangents),))
    assert_close(tangent, ref, scale=_scale(ref), factor=5)
    # Ranks add up at every skip connection until factors stop saving memory.
    assert not isinstance(tangent, qt.LowRank)
    assert any(prim in ("add", "add_any") for prim, _ in qt.fallback_counts())


def test_residual_rank_growth_under_recompress_keeps_the_rank_capped():
    tangents = [qt.low_rank(random_array(40 + i, (16, 16)), 1) for i in range(6)]
    with qt.rank_budget(qt.Recompress(), max_rank=3), qt.fallback("error"):
        _, tangent = qt.jvp(residual_stack, (RES_WEIGHTS,), (tangents,))
    assert isinstance(tangent, qt.LowRank) and tangent.rank <= 3
    _, ref = jax.jvp(residual_stack, (RES_WEIGHTS,), (qt.materialise(tangents),))
    # Lossy: each truncation is optimal for its rank, so the result is a rank-3
    # matrix no further from the exact tangent than the rank-3 truncations allow.
    error = jnp.linalg.norm(tangent.materialise() - ref) / jnp.linalg.norm(ref)
    assert float(error) < 0.5
    assert qt.rank_budget_counts()


def conv_net(kernel, x):
    y = jax.lax.conv_general_dilated(
        x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.tanh(y).mean(axis=(1, 2))


def test_conv_net_falls_back_and_counts_it():
    x = random_array(50, (2, 6, 6, 3))
    kernel = random_array(51, (3, 3, 3, 4))
    tangent_in = qt.top_k(random_array(52, kernel.shape), 10)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        _, tangent = qt.jvp(conv_net, (kernel, x), (tangent_in, None))
    _, ref = jax.jvp(lambda k: conv_net(k, x), (kernel,), (tangent_in.materialise(),))
    assert_close(tangent, ref, scale=_scale(ref))
    assert ("conv_general_dilated", "Sparse") in qt.fallback_counts()
    with (
        qt.fallback("error"),
        pytest.raises(qt.DensificationError, match="conv_general_dilated"),
    ):
        qt.jvp(conv_net, (kernel, x), (tangent_in, None))
