"""Marks for tests about the fallback policy."""

import pytest


# For tests that give `quax_tangents.optax.projected` dense gradients on purpose (the
# reference GaLore computes, or a step compared with the marked one): that is counted
# as a densification and warns, which the suite otherwise turns into an error. Only
# this one warning is let through; `tests/optax/test_projected.py` checks that it is
# raised, counted, and an error under `fallback("error")`.
projects_dense_gradients = pytest.mark.filterwarnings(
    r"ignore:`quax_tangents\.optax\.projected` turns a LowRank:"
    "quax_tangents.DensificationWarning"
)
