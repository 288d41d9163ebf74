"""The guard leaf that keeps leafwise code from misreading a compressed value.

A compressed value is an equinox Module, so a pytree: code that maps a function over
array leaves (every optax transformation, `optax.apply_updates`'s callers,
`jax.tree.map(lambda g: -lr * g, grads)`) reaches its fields, not the array it
represents. Scaling both factors of a `LowRank` squares the scale; adding the fields
of two values is not the sum of the arrays. Such code would run and give a wrong
answer.

So every compressed value carries one more leaf, the guard: an array of JAX's
extended "key" kind, of a key implementation of our own whose tag is the message
below. It holds one `uint32` zero per value (its key shape is `(1,)`) and has the
value's batch shape, so `vmap`, `scan`, `cond` and `jit` stack, slice, select and
pass it as they do the fields. JAX refuses arithmetic, comparisons, reductions and
casts on key arrays at trace time, in the operation that tries, with an error that
names the dtype: `multiply does not accept dtypes key<...>, float32`, where `...` is
the message. The leafwise map fails where it is written, eagerly and under `jit`
alike, and the error says what to use instead. Nothing is checked anywhere else: no
cost on the hot path.

The guard's shape is the value's batch shape followed by `(1, 1)`, so that code that
only transforms leaves of at least two dims (`optax.centralize`) reaches it too.

What leafwise code can still do to a value without arithmetic (select between two
whole values, slice batch dims, make zeros of it, pass it through) leaves a correct
value.

Checkpoints. The key implementation is registered with JAX under its name
(`_compat.register_key_impl`), and the guard holds one word of data rather than
none, so that checkpoint libraries that save typed keys as their data plus the
implementation's name (orbax-checkpoint) save and restore it like any key.
equinox's default filter specs cannot save any typed key; `tree_serialise_leaves`
and `tree_deserialise_leaves` (`_core/_checkpoint.py`) skip the guard, which carries
no information, and make a fresh one on restore.

Two gaps are closed by hand (`_compat.explain_key_methods`): a *concrete* key array
(outside `jit`) answers the array methods it lacks (`x.real`, `x.conj()`,
`x.sum()`, ...) with JAX's bare "Cannot call abstract method real", and answers
`numpy.asarray` (what equinox's default serialiser calls) with an error that does not
say where the key came from. For a guard only, both errors carry the message; every
other key array gets JAX's own error unchanged.
"""

from typing import Any, cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.extend import random as jex_random

from ._compat import explain_key_methods, register_key_impl


GUARD_MESSAGE = (
    "a compressed value (quax_tangents), whose fields leafwise code must not "
    "transform: use quax_tangents.optax.lift(tx) for any optax transformation, "
    "quax_tangents.optax.projected(..., learning_rate=...) for projected gradients, "
    "galore's value_and_grad(loss_fn, microbatches=k) or "
    "quax_tangents.optax.accumulate_gradients for microbatches (not "
    "optax.MultiSteps), galore's max_grad_norm= or "
    "quax_tangents.optax.clip_by_global_norm to clip (not "
    "optax.clip_by_global_norm), quax_tangents.optax.apply_updates to apply "
    "updates, or quax_tangents.materialise for the dense array"
)


def _refuse(*args: Any, **kwargs: Any) -> Any:
    del args, kwargs
    raise TypeError(
        "The guard leaf of a compressed value is not a random key; do not pass it to "
        "`jax.random`."
    )


def _seed(seed: Any) -> jax.Array:
    del seed
    return jnp.zeros((1,), jnp.uint32)


# Module-level functions only, so that a value (its guard's dtype) pickles.
_GUARD_IMPL = jex_random.define_prng_impl(
    key_shape=(1,),
    seed=_seed,
    split=_refuse,
    random_bits=_refuse,
    fold_in=_refuse,
    name="quax_tangents.guard",
    tag=GUARD_MESSAGE,
)
register_key_impl(_GUARD_IMPL)


_CONCRETE: dict[tuple[int, ...], jax.Array] = {}


def guard(batch_shape: tuple[int, ...] = ()) -> jax.Array:
    """The guard leaf of a value with these batch dims: a key array of shape
    `(*batch_shape, 1, 1)`. Made once per shape where it can be concrete (a
    constant under `jit`); inside traces that evaluation cannot leave (a `shard_map`
    body) it is made afresh, never kept, so that no tracer outlives its trace."""
    batch_shape = tuple(batch_shape)
    cached = _CONCRETE.get(batch_shape)
    if cached is not None:
        return cached
    with jax.ensure_compile_time_eval():
        data = np.zeros((*batch_shape, 1, 1, 1), np.uint32)
        made = jax.random.wrap_key_data(cast(Any, data), impl=_GUARD_IMPL)
    if not isinstance(made, jax.core.Tracer):
        _CONCRETE[batch_shape] = made
    return made


# From the abstract value: importing the package must not start JAX's backend
# (`jax.distributed.initialize` has to come first in a multi-process program).
_ABSTRACT_GUARD = jax.eval_shape(
    lambda: jax.random.wrap_key_data(
        cast(Any, np.zeros((1, 1, 1), np.uint32)), impl=_GUARD_IMPL
    )
)
GUARD_DTYPE = _ABSTRACT_GUARD.dtype


def is_guard(x: Any) -> bool:
    """Whether `x` (an array, a tracer or a `jax.ShapeDtypeStruct`) is a guard."""
    return getattr(x, "dtype", None) == GUARD_DTYPE


SAVE_MESSAGE = (
    "equinox's default filter specs cannot save a typed key array, and this one is "
    "the guard leaf of a compressed value (quax_tangents): save with "
    "quax_tangents.tree_serialise_leaves and restore with "
    "quax_tangents.tree_deserialise_leaves, which take the same arguments as "
    "equinox's"
)


explain_key_methods(is_guard, GUARD_MESSAGE, SAVE_MESSAGE)
