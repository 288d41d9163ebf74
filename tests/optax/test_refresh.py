"""The steps of a pipeline's projector refresh (`quax_tangents.optax._refresh`)."""

import jax
import jax.numpy as jnp

from quax_tangents.optax import _refresh
from tests.helpers.precision import dots_below_highest


def test_a_refresh_steps_products_ask_for_the_highest_precision():
    """Each step after a trip (a basis, a truncation, test matrices) orthonormalises
    from Gram matrices: a TPU's default precision for them (one bfloat16 pass) would
    leave projectors orthonormal to about 3e-3, not to float32's rounding."""
    m = jnp.ones((12, 4), jnp.bfloat16)
    t = jnp.ones((20, 4), jnp.bfloat16)
    sums = (jnp.ones((20, 4), jnp.float32),)

    def step(action, m, t, sums):
        return _refresh.step(action, (m, t), sums, tested=True)

    assert dots_below_highest(step, jnp.int32(1), m, t, sums) == []
    # The truncation's Gram matrix, a round's, and a round's rotation at least.
    text = jax.jit(step).lower(jnp.int32(1), m, t, sums).as_text()
    assert text.count("dot_general") >= 3, text
