"""Helpers shared by the whole test suite: tolerances, comparisons, strategies."""

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from hypothesis import strategies as st

import quax_tangents as qt


FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# Relative to the largest magnitude involved: rounding of the inputs and of the
# accumulations in a different order is all these comparisons allow.
_TOLERANCE = {
    jnp.dtype(jnp.float32): 2e-5,
    jnp.dtype(jnp.float16): 4e-3,
    jnp.dtype(jnp.bfloat16): 3e-2,
    jnp.dtype(jnp.float64): 1e-12,
}


def tolerance(dtype) -> float:
    return _TOLERANCE[jnp.dtype(dtype)]


def assert_close(actual, expected, dtype=None, *, scale=None, factor=1.0):
    """`actual` equals `expected` up to the rounding of `dtype`.

    The error is measured against the largest magnitude of `expected` (at least
    1), or against `scale` where that is larger, which keeps sums of many terms
    from failing on cancellation.
    """
    actual = np.asarray(jnp.asarray(qt.materialise(actual), jnp.float32), np.float64)
    expected = np.asarray(
        jnp.asarray(qt.materialise(expected), jnp.float32), np.float64
    )
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    dtype = dtype if dtype is not None else jnp.float32
    largest = max(float(np.max(np.abs(expected), initial=0.0)), 1.0)
    scale = largest if scale is None else max(scale, largest)
    error = float(np.max(np.abs(actual - expected), initial=0.0))
    bound = factor * tolerance(dtype) * scale
    assert error <= bound, f"max error {error:.3g} > {bound:.3g} ({jnp.dtype(dtype)})"


def tree_allclose(x, y, dtype=None, **kwargs) -> bool:
    """`True` when two pytrees have the same structure and close leaves."""
    x_leaves, x_def = jtu.tree_flatten(qt.materialise(x))
    y_leaves, y_def = jtu.tree_flatten(qt.materialise(y))
    if x_def != y_def:
        return False
    try:
        for a, b in zip(x_leaves, y_leaves, strict=True):
            assert_close(a, b, dtype, **kwargs)
    except AssertionError:
        return False
    return True


def field_leaves(value) -> list:
    """The array fields of a compressed value, without its guard leaf (which holds no
    data and cannot be converted to NumPy)."""
    from quax_tangents._core._guard import is_guard

    return [leaf for leaf in jtu.tree_leaves(value) if not is_guard(leaf)]


def float_dtypes(include_half: bool = True):
    return st.sampled_from(FLOAT_DTYPES if include_half else (jnp.float32,))


def shapes(min_dims=1, max_dims=3, min_side=1, max_side=5):
    return st.lists(
        st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims
    ).map(tuple)


def seeds():
    return st.integers(0, 2**31 - 1)


def random_array(seed, shape, dtype=jnp.float32, *, low=None, high=None):
    """A standard normal (or uniform in [low, high)) array, reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    if low is None:
        data = rng.standard_normal(shape)
    else:
        data = rng.uniform(low, high, shape)
    # Cast in NumPy (ml_dtypes knows bfloat16): a cast in JAX would compile per shape.
    return jnp.asarray(np.asarray(data, np.float32).astype(jnp.dtype(dtype)))


@st.composite
def dense_arrays(draw, shape, dtype=jnp.float32):
    return random_array(draw(seeds()), shape, dtype)


def key(seed: int = 0):
    return jax.random.key(seed)
