"""The guard leaf of compressed values: leafwise arithmetic on a value fails with an
error that names the fix, while JAX's transformations, our rules and the value's
storage are as without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quax

import quax_tangents as qt
from quax_tangents._core._guard import GUARD_DTYPE, is_guard
from tests.helpers import assert_close, field_leaves, random_array
from tests.helpers.values import compressed


TYPES = ("LowRank", "Sparse", "Quantized", "SignNorm", "SparseRows")
FIX = r"quax_tangents\.optax\.lift\(tx\)"


def _value(type_name, shape=(6, 4), seed=0):
    if type_name == "SparseRows":
        rows = random_array(seed, (3, *shape[1:]))
        return qt.SparseRows(jnp.array([0, 4, 0]), rows, shape[0])
    return compressed(type_name, shape, seed)


def _guards(value):
    return [leaf for leaf in jax.tree.leaves(value) if is_guard(leaf)]


@pytest.mark.parametrize("type_name", TYPES)
def test_every_value_has_one_guard_of_one_word(type_name):
    value = _value(type_name)
    (guard,) = _guards(value)
    assert guard.dtype == GUARD_DTYPE and guard.shape == (1, 1)
    # `nbytes` counts the fields only; the guard holds one zero word, no information
    # (checkpoint libraries drop arrays with no elements).
    fields = sum(leaf.nbytes for leaf in field_leaves(value))
    assert value.nbytes == fields
    data = jax.random.key_data(guard)
    assert data.shape == (1, 1, 1) and not np.any(data)


def test_the_guard_is_restored_by_its_name():
    # orbax-checkpoint restores a typed key from its data and its implementation's
    # name.
    (guard,) = _guards(_value("LowRank"))
    name = str(jax.random.key_impl(guard))
    again = jax.random.wrap_key_data(jax.random.key_data(guard), impl=name)
    assert again.dtype == GUARD_DTYPE


@pytest.mark.parametrize("type_name", TYPES)
def test_rule_outputs_have_a_guard(type_name):
    value = _value(type_name)
    with qt.fallback("error"):
        out = quax.quaxify(lambda x: 2.0 * x)(value)
    assert len(_guards(out)) == 1


def test_the_guard_has_the_batch_shape_after_vmap_and_in_rules():
    stacked = jax.vmap(lambda s: compressed("LowRank", (6, 4), 0) * s)(jnp.arange(3.0))
    (guard,) = _guards(stacked)
    assert guard.shape == (3, 1, 1)
    batched = qt.LowRank(random_array(0, (2, 3, 6, 2)), random_array(1, (2, 3, 4, 2)))
    assert _guards(batched)[0].shape == (2, 3, 1, 1)
    with qt.fallback("error"):
        moved = quax.quaxify(lambda x: jnp.transpose(x, (1, 0, 2, 3)))(batched)
    assert _guards(moved)[0].shape == (3, 2, 1, 1)


@pytest.mark.parametrize("type_name", TYPES)
def test_leafwise_arithmetic_names_the_fix_eagerly_and_under_jit(type_name):
    value = _value(type_name)

    def scale(v):
        return jax.tree.map(lambda leaf: -0.1 * leaf, v)

    with pytest.raises(TypeError, match=FIX):
        scale(value)
    with pytest.raises(TypeError, match=FIX):
        jax.jit(scale)(value)


def test_concrete_guards_explain_the_array_methods_they_lack():
    (guard,) = _guards(compressed("LowRank", (6, 4)))
    for method in (lambda g: g.real, lambda g: g.conj(), lambda g: g.sum()):
        with pytest.raises(TypeError, match=FIX):
            method(guard)
    # Other key arrays keep JAX's own error.
    with pytest.raises(NotImplementedError, match="abstract method"):
        jax.random.key(0).real  # noqa: B018


def test_structure_errors_name_the_fix():
    # Generic code whose first tree is the gradients, the second shaped like the
    # parameters: JAX names the compressed class, whose repr says what to use.
    grads = {"w": compressed("LowRank", (6, 4))}
    with pytest.raises(ValueError, match=FIX):
        jax.tree.map(lambda g, m: g + m, grads, {"w": jnp.zeros((6, 4))})


def test_jit_scan_and_cond_carry_values_with_their_guards():
    a, b = compressed("LowRank", (6, 4), 0), compressed("LowRank", (6, 4), 1)
    stacked = jax.vmap(lambda s: a * s)(jnp.arange(1.0, 4.0))
    qt.reset_fallback_counts()
    with qt.fallback("error"):

        @jax.jit
        @quax.quaxify
        def run(stacked, a, b, flag):
            def body(carry, x):
                return carry, qt.materialise(x)

            carry, dense = jax.lax.scan(body, a, stacked)
            chosen = jax.lax.cond(flag, lambda: a, lambda: b)
            return carry, dense, chosen

        carry, dense, chosen = run(stacked, a, b, jnp.asarray(False))
    assert qt.fallback_counts() == {}
    assert isinstance(carry, qt.LowRank) and len(_guards(carry)) == 1
    assert_close(dense, np.stack([s * a.materialise() for s in (1.0, 2.0, 3.0)]))
    assert_close(chosen, b.materialise())


def test_selecting_or_zeroing_whole_values_stays_correct():
    # What leafwise code may do without arithmetic gives a correct value.
    a, b = compressed("LowRank", (6, 4), 0), compressed("LowRank", (6, 4), 1)
    picked = jax.tree.map(lambda x, y: jnp.where(False, x, y), a, b)
    assert_close(picked, b.materialise())
    zeros = jax.tree.map(jnp.zeros_like, a)
    assert_close(zeros, np.zeros((6, 4)))


def test_lax_psum_of_a_value_outside_quax_names_the_fix():
    # `psum` flattens the value and would sum the factors separately (the sum of the
    # left factors times the sum of the right ones); the guard refuses the sum.
    stacked = jax.vmap(lambda s: compressed("LowRank", (6, 4), 0) * s)(
        jnp.arange(1.0, 3.0)
    )
    with pytest.raises(TypeError, match=FIX):
        jax.vmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(stacked)


def test_filtering_by_dtype_drops_the_guard():
    # The guard is not a floating array: a filter for floating leaves (as
    # `eqx.filter(grads, eqx.is_inexact_array)`) drops it, and leafwise arithmetic
    # on what is left is no longer refused. The sharp bits say so.
    import equinox as eqx

    value = compressed("LowRank", (6, 4))
    filtered = eqx.filter(value, eqx.is_inexact_array)
    scaled = jax.tree.map(lambda leaf: -0.1 * leaf, filtered)
    wrong = scaled.left @ scaled.right.T
    assert_close(wrong, 0.01 * value.materialise())


def test_values_pickle_with_their_guard():
    import pickle

    value = compressed("Quantized", (6, 4))
    restored = pickle.loads(pickle.dumps(value))
    assert len(_guards(restored)) == 1
    assert_close(restored, value.materialise())


def test_a_guard_made_inside_shard_map_is_not_kept():
    # Compile-time evaluation cannot leave a `shard_map` body: a guard made there is
    # a tracer, and keeping it for later values would leak it.
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("d",))
    left, right = random_array(0, (5, 7, 6, 2)), random_array(1, (5, 7, 4, 2))

    def body(left, right):
        return qt.LowRank(left, right).materialise()

    jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(left, right)
    (guard,) = _guards(qt.LowRank(left, right))
    assert not isinstance(guard, jax.core.Tracer) and guard.shape == (5, 7, 1, 1)
