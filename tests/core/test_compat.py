"""Each item of `quax_tangents._core._compat` on the installed JAX and quax: the
private names exist and do what the package relies on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from quax_tangents._core import _compat


def test_the_installed_jax_is_a_supported_one():
    assert _compat.JAX_VERSION >= _compat.Version("0.10.2")
    assert _compat.JAX_VERSION < _compat.Version("0.13")


def test_the_private_primitives_are_primitives_with_their_names():
    assert _compat.pvary_p.name == "pvary"
    assert _compat.psum_invariant_p.name == "psum_invariant"
    assert _compat.reshard_p.name == "reshard"


def test_scan_counts_reads_either_form_of_the_scan_parameters():
    def body(carry, x):
        return carry + x * w, carry * x

    w = jnp.float32(2.0)
    jaxpr = jax.make_jaxpr(lambda c, xs: jax.lax.scan(body, c, xs))(
        jnp.float32(1.0), jnp.ones(3)
    )
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive is jax.lax.scan_p]
    args = [object()] * len(eqn.invars)
    assert _compat.scan_counts(args, eqn.params) == (1, 1)


def test_flatten_flat_tree_carries_aux():
    tree = _compat.flatten_flat_tree([1, 2]).with_aux(("a",))
    vals, aux = tree.unpack_aux()
    assert list(vals.vals) == [1, 2] and aux == ("a",)


def test_a_trace_context_state_keys_jit_traces():
    state = _compat.trace_context_state("quax_tangents_compat_test", ["a", "b"], "a")
    assert state is not None
    traces = []

    @jax.jit
    def f(x):
        traces.append(state.value)
        return x

    # Traced inside another trace, as the entry points trace a jitted loss: the
    # inner jit's trace is cached per value of the state.
    outer = lambda x: f(x)  # noqa: E731
    jax.make_jaxpr(outer)(1.0)
    with state("b"):
        jax.make_jaxpr(outer)(1.0)
    jax.make_jaxpr(outer)(1.0)
    assert traces == ["a", "b"]


def test_check_vma_enabled_follows_the_shard_map_body():
    mesh = jax.make_mesh((1,), ("d",))
    seen = []

    def body(x):
        seen.append(_compat.check_vma_enabled())
        return x

    for check in (True, False):
        jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=check)(
            jnp.ones(2)
        )
    assert seen == [True, False]
    assert not _compat.check_vma_enabled()


def test_a_registered_key_impl_is_found_by_its_name():
    from jax.extend import random as jex_random

    def refuse(*args, **kwargs):
        raise TypeError("not a random key")

    impl = jex_random.define_prng_impl(
        key_shape=(1,),
        seed=lambda s: jnp.zeros((1,), jnp.uint32),
        split=refuse,
        random_bits=refuse,
        fold_in=refuse,
        name="quax_tangents.compat_test",
    )
    _compat.register_key_impl(impl)
    _compat.register_key_impl(impl)  # idempotent
    key = jax.random.wrap_key_data(
        np.zeros((2, 1), np.uint32), impl="quax_tangents.compat_test"
    )
    assert key.shape == (2,)


def test_quax_internals_exist():
    assert hasattr(_compat.QuaxTrace, "process_primitive")
    assert hasattr(_compat.QuaxTrace, "process_shard_map")  # installed by us
    assert hasattr(_compat.QuaxTrace, "process_call")
    assert isinstance(_compat.wrap_if_array(jnp.ones(2)), _compat.DenseArrayValue)


@pytest.mark.parametrize("method", ["real", "conj"])
def test_explained_key_methods_leave_other_keys_alone(method):
    key = jax.random.key(0)
    with pytest.raises(Exception) as info:
        getattr(key, method)() if method == "conj" else key.real
    assert "quax_tangents" not in str(info.value)
    with pytest.raises(TypeError) as info:
        np.asarray(key)
    assert "quax_tangents" not in str(info.value)
