"""Projectors handed in by the user are checked for orthonormal columns: eagerly on
concrete arrays, and inside the program under `qt.fallback("error")`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quax_tangents as qt
from quax_tangents._marks._orthonormal import (
    orthonormality_error,
    orthonormality_tolerance,
)
from tests.helpers.precision import dots_below_highest


def _orthonormal(*shape, dtype=jnp.float32, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(np.linalg.qr(x)[0], dtype)


def _loss(w, projector):
    w = qt.projected_cotangent(w, 2, projector=projector)
    return jnp.sum(jnp.tanh(jnp.ones((3, 6)) @ w))


W = jnp.ones((6, 10))


def test_a_projector_that_is_not_orthonormal_is_refused_eagerly():
    p = _orthonormal(6, 2)
    with pytest.raises(ValueError, match="orthonormal"):
        qt.projected_cotangent(W, 2, projector=2 * p)
    with pytest.raises(ValueError, match="orthonormal"):
        qt.Projector(p + 1e-3, False)
    with pytest.raises(ValueError, match="orthonormal"):
        qt.grad(_loss)(W, 3 * p)
    # Orthonormal ones pass, and so does the placeholder that asks for a fresh one.
    qt.projected_cotangent(W, 2, projector=p)
    qt.Projector(p, False)
    qt.Projector.init((6, 10), 2, jnp.float32)
    qt.grad(_loss)(W, qt.Projector(jnp.zeros((6, 2)), True))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_tolerance_follows_the_dtype(dtype):
    p = _orthonormal(64, 4, dtype=dtype)  # rounded to dtype: still accepted
    qt.Projector(p, False)
    bad = p.astype(jnp.float32) * (1 + 4 * orthonormality_tolerance(dtype, 64))
    with pytest.raises(ValueError, match="orthonormal"):
        qt.Projector(bad.astype(dtype), False)


def test_under_jit_the_check_runs_when_fallback_error_asks():
    bad = 2 * _orthonormal(6, 2)
    # By default a traced projector is used as given (no check in the program).
    jax.jit(qt.grad(_loss))(W, bad)
    with qt.fallback("error"):
        step = jax.jit(qt.grad(_loss))
        with pytest.raises(Exception, match="orthonormal"):
            jax.block_until_ready(step(W, bad))
        jax.block_until_ready(step(W, _orthonormal(6, 2)))
        # The placeholder of a refresh step is not checked.
        placeholder = qt.Projector.init((6, 10), 2, jnp.float32)
        jax.block_until_ready(jax.jit(qt.grad(_loss))(W, placeholder))


def test_a_traced_refresh_skips_the_check_in_the_program():
    with qt.fallback("error"):
        grad = jax.jit(lambda w, m, r: qt.grad(_loss)(w, qt.Projector(m, r)))
        g = grad(W, jnp.zeros((6, 2)), jnp.array(True))
        assert isinstance(g, qt.LowRank)
        with pytest.raises(Exception, match="orthonormal"):
            jax.block_until_ready(grad(W, jnp.zeros((6, 2)), jnp.array(False)))
    assert eqx.is_array(g.left)


def test_zero_columns_are_allowed_but_not_all_zeros():
    # The range finder gives zero columns for a gradient of lower rank than the
    # projector; such a projector is fed back on the next step.
    p = np.zeros((6, 3), np.float32)
    p[:, :2] = np.linalg.qr(np.random.default_rng(0).standard_normal((6, 2)))[0]
    qt.Projector(jnp.asarray(p), False)
    with pytest.raises(ValueError, match="orthonormal"):
        qt.Projector(jnp.zeros((6, 3)), False)
    p[0, 2] = 0.3  # a column that is neither zero nor a unit vector
    with pytest.raises(ValueError, match="orthonormal"):
        qt.Projector(jnp.asarray(p), False)


def test_the_check_in_the_program_forms_p_transpose_p_at_the_highest_precision():
    """A TPU's default precision for a float32 product (one bfloat16 pass) puts
    `P^T P` of an exactly orthonormal projector 2e-4 to 4e-4 from the identity,
    above the float32 tolerance: the check would refuse good projectors."""
    assert dots_below_highest(orthonormality_error, _orthonormal(12, 4)) == []
