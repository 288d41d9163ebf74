"""Primitives and small helpers that rules share."""

from jax._src import ad_util


# JAX's tangent and cotangent accumulation primitive; `jax.lax` does not export it.
add_any_p = ad_util.add_jaxvals_p
