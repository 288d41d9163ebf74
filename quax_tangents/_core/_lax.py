"""Primitives and small helpers that rules share."""

from jax.extend.core import primitives as _primitives


# JAX's tangent and cotangent accumulation primitive; `jax.lax` does not export it.
add_any_p = _primitives.add_jaxvals_p
