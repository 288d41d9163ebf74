"""The range finder under another lowering of its linear algebra (the TPU's, run on
any backend): the same orthonormal range and top singular vectors as the plain one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quax_tangents._core import _sharding
from tests.helpers import assert_close


def assert_same_range_finder(lowering, m: int, w: int, seed: int) -> None:
    """`orthonormal_columns` of an `(m, w)` sketch and `top_left_singular` of a `(w,
    m + 5)` matrix, with `_sharding` patched by `lowering(patch)` and without, agree
    to float32 rounding: the same projection onto the range, and the same singular
    vectors up to sign (which `column_signs` fixes)."""
    rng = np.random.default_rng(seed)
    y = jnp.asarray(rng.standard_normal((m, w)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((w, m + 5)), jnp.float32)

    # Jitted, each traced where it runs (the patched one inside the patch): one
    # compile per example, where run op by op each shape compiles many.
    def both(y, b):
        return _sharding.orthonormal_columns(y), _sharding.top_left_singular(b, w - 1)

    q_plain, u_plain = jax.jit(both)(y, b)
    with pytest.MonkeyPatch.context() as patch:
        lowering(patch)
        q_other, u_other = jax.jit(both)(y, b)
    assert_close(q_other @ q_other.T, q_plain @ q_plain.T, factor=20)
    signs = _sharding.column_signs
    assert_close(u_other * signs(u_other), u_plain * signs(u_plain), factor=200)
