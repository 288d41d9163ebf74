"""A primal type whose tangent is a smaller, lossy structure: sign bits plus a norm.

This follows a user's request to JAX: a `Primal` buffer whose tangent is stored as a
sign and a norm to save memory, built with `custom_jvp` rules `init` and `add`. Plain
JAX rejects it, because a custom_jvp rule must return a tangent with the primal's
pytree structure. Here the tangent keeps the primal's container, and its leaf is a
`SignNorm`: 1 bit per element plus one norm, which JAX sees with the primal's shape
and dtype.

What differs from the request, and why:

- The tangent of `Primal(x)` is `Primal(x=SignNorm(...))`, not a separate `Tangent`
  class: JAX matches tangents to primals leaf by leaf, so the container stays and the
  leaf carries the smaller representation.
- The request's update `Tangent(n > 0, norm + |n|)` is not linear in the tangents,
  and JAX requires tangent maps to be linear. The update here is linear and then
  lossy: add the incoming tangent, and store the sum as sign + norm again.
- The initial tangent is a compressed zero (`init` ignores its input's tangent, as in
  the request).

Run: `python examples/lossy_tangent.py`.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

import quax_tangents as qt


SHAPE = (4096,)


class Primal(NamedTuple):
    x: jax.Array


def lossy(tangent: jax.Array) -> qt.SignNorm:
    """The tangent's storage: one sign bit per element and a single l2 norm."""
    return qt.sign_norm(tangent)


@jax.custom_jvp
def init(dummy: jax.Array) -> Primal:
    return Primal(jnp.zeros(SHAPE))


@init.defjvp
def init_jvp(primals, tangents):
    (dummy,), _ = primals, tangents
    return init(dummy), Primal(qt.compress(jnp.zeros(SHAPE), lossy))


@jax.custom_jvp
def add(p: Primal, n: jax.Array) -> Primal:
    return Primal(p.x + n)


@add.defjvp
def add_jvp(primals, tangents):
    (p, n), (t, n_dot) = primals, tangents
    # Accumulate densely for this one step, then store lossily again.
    accumulated = qt.materialise(t.x) + n_dot
    return add(p, n), Primal(qt.compress(accumulated, lossy))


def accumulate(dummy: jax.Array, updates: jax.Array) -> Primal:
    p = init(dummy)
    for n in updates:
        p = add(p, n)
    return p


def main() -> None:
    key_updates, key_directions = jax.random.split(jax.random.key(0))
    updates = jax.random.normal(key_updates, (3, *SHAPE))
    directions = jax.random.normal(key_directions, (3, *SHAPE))
    primal, tangent = qt.jvp(accumulate, (jnp.zeros(()), updates), (None, directions))

    assert isinstance(tangent, Primal) and isinstance(tangent.x, qt.SignNorm)
    exact = jax.jvp(lambda u: jnp.sum(u, axis=0), (updates,), (directions,))[1]
    lossy_value = qt.materialise(tangent.x)
    print(
        f"primal:   {type(primal).__name__}(x={primal.x.dtype}{list(primal.x.shape)})"
    )
    print(f"tangent:  {type(tangent).__name__}(x={type(tangent.x).__name__})")
    print(f"storage:  {tangent.x.nbytes} bytes vs {tangent.x.dense_nbytes} dense")
    print(
        "norm kept: "
        f"{float(jnp.linalg.norm(lossy_value)):.4f} (lossy) vs "
        f"{float(jnp.linalg.norm(exact)):.4f} (exact tangent of the last step's sum)"
    )
    signs_agree = float(jnp.mean(jnp.sign(lossy_value) == jnp.sign(exact)))
    print(f"signs agreeing with the exact tangent: {signs_agree:.1%}")


if __name__ == "__main__":
    main()
