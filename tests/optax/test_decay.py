"""Decoupled weight decay: `qto.Decayed` updates, applied as `param * (1 - decay) +
update` without a dense update, and `qto.galore(weight_decay=...)`, whose steps are
`optax.adamw`'s decay of each weight beside the projected update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import assert_close, float_dtypes, random_array, seeds
from tests.helpers.lowrank import lowrank_values
from tests.helpers.rows import rows_values
from tests.optax.test_galore import _batch, _blocks, _params, loss_fn


@st.composite
def _updates(draw):
    """A compressed or dense update of some dtype, and a parameter of its shape."""
    dtype = draw(float_dtypes())
    kind = draw(st.sampled_from(["low_rank", "rows", "dense"]))
    if kind == "low_rank":
        update = draw(lowrank_values(dtype=dtype, projector_side=None))
    elif kind == "rows":
        update = draw(rows_values(dtype=dtype))
    else:
        update = random_array(draw(seeds()), draw(st.sampled_from([(3,), (2, 4)])))
        update = update.astype(dtype)
    param = random_array(draw(seeds()), update.shape).astype(dtype)
    return param, update


@settings(max_examples=30, deadline=None)
@given(_updates(), st.sampled_from([0.0, 1e-3, 0.25]))
def test_a_decayed_update_shrinks_its_parameter_then_adds_the_update(drawn, decay):
    param, update = drawn
    decayed = qto.Decayed(update, jnp.float32(decay))
    with qt.fallback("error"):  # a low-rank or rows update stays as it is
        (got,) = jax.tree.leaves(qto.apply_updates({"p": param}, {"p": decayed}))
    # The dense computation: the shrunk parameter plus the array the update
    # represents, in float32, cast to the parameter's dtype.
    expected = (
        param.astype(jnp.float32) * (1 - decay)
        + qt.materialise(update).astype(jnp.float32)
    ).astype(param.dtype)
    assert got.dtype == param.dtype and got.shape == param.shape
    assert_close(got, expected, param.dtype, factor=4)


SCHEDULE = optax.linear_schedule(2e-2, 5e-3, 4)


def _pair(**decay):
    """The pipeline with weight decay and without, otherwise alike."""
    common = dict(rank=2, learning_rate=SCHEDULE, refresh_every=2, project=_blocks)
    return qto.galore(**common, **decay), qto.galore(**common)


def _two_steps(opt, plain, params, keep_of):
    """Two steps of `opt` beside `plain` on the same gradients: `opt`'s parameters
    against `plain`'s update applied to the parameters that `keep_of(count)`
    shrinks (the decay of every weight at the learning rate of that step)."""
    state = plain.init(params)
    assert jax.tree.structure(opt.init(params)) == jax.tree.structure(state)
    value_and_grad = jax.jit(plain.value_and_grad(loss_fn))
    for count in range(2):
        _, grads = value_and_grad(params, state, _batch(count))
        with qt.fallback("error"):
            updates, new_state = jax.jit(opt.update)(grads, state, params)
            got = jax.jit(opt.apply)(params, updates)
        plain_updates, plain_state = jax.jit(plain.update)(grads, state, params)
        shrunk = keep_of(count, params)
        expected = plain.apply(shrunk, plain_updates)
        dense = jax.tree.map(
            lambda p, u: p + qt.materialise(u),
            shrunk,
            plain_updates,
            is_leaf=lambda x: isinstance(x, qt.LowRank),
        )
        for a, b, c in zip(*map(jax.tree.leaves, (got, expected, dense))):
            assert_close(a, b)
            assert_close(a, c, factor=4)
        # The decay leaves the state alone.
        for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(plain_state)):
            np.testing.assert_array_equal(a, b)
        params, state = got, new_state


def test_galore_weight_decay_is_adamw_decay_of_every_weight():
    wd = 0.5
    opt, plain = _pair(weight_decay=wd)

    def keep_of(count, params):
        return jax.tree.map(lambda p: p * (1 - SCHEDULE(count) * wd), params)

    _two_steps(opt, plain, _params(), keep_of)


def test_the_mask_chooses_the_weights_that_decay():
    wd = 0.5
    opt, plain = _pair(
        weight_decay=wd,
        weight_decay_mask=lambda p: {
            "blocks": {"up": True, "down": False},
            "head": False,
        },
    )

    def keep_of(count, params):
        keep = 1 - SCHEDULE(count) * wd
        blocks = {**params["blocks"], "up": params["blocks"]["up"] * keep}
        return {**params, "blocks": blocks}

    _two_steps(opt, plain, _params(), keep_of)


def test_the_updates_are_decayed_and_the_parameters_never_dense_updates():
    params = _params()
    opt = qto.galore(rank=2, learning_rate=1e-2, project=_blocks, weight_decay=0.1)
    state = opt.init(params)
    _, grads = opt.value_and_grad(loss_fn)(params, state, _batch(0))
    updates, _ = opt.update(grads, state, params)
    decayed = jax.tree.leaves(updates, is_leaf=lambda x: isinstance(x, qto.Decayed))
    assert all(isinstance(u, qto.Decayed) for u in decayed)
    # The projected weights' updates stay low-rank inside.
    assert isinstance(updates["blocks"]["up"].update, qt.LowRank)
    assert_close(updates["head"].decay, 1e-2 * 0.1)


def test_a_mask_mapped_over_parameters_with_none_leaves():
    # An Equinox model's arrays (`eqx.partition`) hold None for its other fields;
    # `jax.tree.map` over them keeps None, where nothing decays.
    params = {**_params(), "activation": None}
    opt = qto.galore(
        rank=2,
        learning_rate=1e-2,
        project=lambda p: {**_blocks(p), "activation": None},
        weight_decay=0.1,
        weight_decay_mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
    )
    state = opt.init(params)
    _, grads = opt.value_and_grad(lambda p, b: loss_fn(_params_only(p), b))(
        params, state, _batch(0)
    )
    updates, _ = opt.update(grads, state, params)
    new = opt.apply(params, updates)
    assert new["activation"] is None
    assert isinstance(updates["head"], qto.Decayed)


def _params_only(params):
    return {k: v for k, v in params.items() if k != "activation"}


def _first_gradients(mask):
    """A pipeline with weight decay masked by `mask`, and its first step's
    parameters, state and gradients."""
    params = _params()
    opt = qto.galore(
        rank=2,
        learning_rate=1e-2,
        project=_blocks,
        weight_decay=0.1,
        weight_decay_mask=mask,
    )
    state = opt.init(params)
    _, grads = opt.value_and_grad(loss_fn)(params, state, _batch(0))
    return opt, params, state, grads


def test_a_mask_of_traced_values_is_refused_by_name():
    # Computed from the values, so unknown when the step is traced.
    opt, params, state, grads = _first_gradients(
        lambda p: jax.tree.map(lambda x: jnp.all(x > -10), p)
    )
    with pytest.raises(TypeError, match="`weight_decay_mask` must hold bools"):
        jax.jit(opt.update)(grads, state, params)
    # Eagerly the same mask is concrete, and taken.
    updates, _ = opt.update(grads, state, params)
    assert isinstance(updates["head"], qto.Decayed)


def test_optax_apply_updates_of_a_decayed_update_names_the_fix():
    decayed = qto.Decayed(jnp.ones(3), jnp.float32(0.1))
    with pytest.raises(TypeError, match="quax_tangents.optax.apply_updates"):
        optax.apply_updates({"w": jnp.ones(3)}, {"w": decayed})


@pytest.mark.parametrize(
    "bad, error",
    [
        (-0.1, ValueError),
        (float("nan"), ValueError),
        ("0.1", TypeError),
        (True, TypeError),
    ],
)
def test_a_bad_weight_decay_is_refused_by_name(bad, error):
    with pytest.raises(error, match="`weight_decay`"):
        qto.galore(rank=2, learning_rate=1e-2, weight_decay=bad)


def test_weight_decay_without_a_learning_rate_is_refused():
    with pytest.raises(ValueError, match="`weight_decay` needs `learning_rate`"):
        qto.galore(rank=2, weight_decay=0.1)


def test_a_mask_of_another_structure_is_refused_by_name():
    opt, params, state, grads = _first_gradients({"head": True})
    with pytest.raises(ValueError, match="`weight_decay_mask`"):
        opt.update(grads, state, params)


def test_a_mask_written_for_one_leaf_is_refused_by_name():
    # `optax.adamw` hands a callable mask the whole tree; `x.ndim` of a dict fails.
    opt, params, state, grads = _first_gradients(lambda x: x.ndim >= 2)
    with pytest.raises(TypeError, match="jax.tree.map"):
        opt.update(grads, state, params)


def test_the_decay_adds_no_temporaries_to_the_apply_of_a_stack():
    # XLA:CPU's buffer assignment: the decay is a scale inside the loop that writes
    # each matrix, not a stack-sized array.
    stack = jax.ShapeDtypeStruct((6, 64, 96), jnp.bfloat16)
    left = jax.ShapeDtypeStruct((6, 64, 4), jnp.bfloat16)
    right = jax.ShapeDtypeStruct((6, 96, 4), jnp.bfloat16)

    def temp(decayed):
        def apply(param, left, right):
            u = qt.LowRank(left, right)
            u = qto.Decayed(u, jnp.float32(0.01)) if decayed else u
            return qto.apply_updates(param, u)

        compiled = jax.jit(apply, donate_argnums=0).lower(stack, left, right).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(True) <= temp(False) + 4096


def test_the_optax_view_decays_as_the_pipeline_does():
    params = _params()
    opt, _ = _pair(weight_decay=0.5)
    state = opt.init(params)
    _, grads = jax.jit(opt.value_and_grad(loss_fn))(params, state, _batch(0))
    tx = optax.chain(opt.transformation(params))
    updates, _ = tx.update(grads, tx.init(params), params)
    expected, _ = opt.update(grads, state, params)
    got = qto.apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(opt.apply(params, expected))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
