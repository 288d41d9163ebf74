"""Compressed values and the optimisers' states survive a checkpoint bit for bit,
through equinox (`qt.tree_serialise_leaves`) and orbax-checkpoint
(`StandardCheckpointer`, `CheckpointManager`), and training resumed from one gives
the losses of training that never stopped."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import quax_tangents as qt
import quax_tangents.optax as qto
from quax_tangents._core._guard import is_guard
from tests.helpers import random_array
from tests.helpers.values import compressed


ocp = pytest.importorskip(
    "orbax.checkpoint", reason="orbax-checkpoint is in the `dev` extra"
)

TYPES = ("LowRank", "Sparse", "Quantized", "SignNorm", "SparseRows")


def _value(type_name):
    if type_name == "SparseRows":
        return qt.SparseRows(jnp.array([0, 4, 0]), random_array(0, (3, 4)), 6)
    return compressed(type_name, (2, 6, 4), 3)


def _assert_same_tree(restored, original):
    assert jax.tree.structure(restored) == jax.tree.structure(original)
    for new, old in zip(jax.tree.leaves(restored), jax.tree.leaves(original)):
        assert new.shape == old.shape and new.dtype == old.dtype
        if is_guard(old):
            continue
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


def _abstract(tree):
    return eqx.filter_eval_shape(lambda: tree)


def _eqx_round_trip(tree, tmp_path, like):
    path = tmp_path / "tree.eqx"
    qt.tree_serialise_leaves(path, tree)
    return qt.tree_deserialise_leaves(path, like)


def _orbax_round_trip(tree, tmp_path, like):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", tree)
    checkpointer.wait_until_finished()
    return checkpointer.restore(tmp_path / "ckpt", like)


ROUND_TRIPS = {"equinox": _eqx_round_trip, "orbax": _orbax_round_trip}


@pytest.mark.parametrize("library", ROUND_TRIPS)
@pytest.mark.parametrize("type_name", TYPES)
def test_every_type_round_trips_bit_for_bit(type_name, library, tmp_path):
    value = _value(type_name)
    tree = {"value": value, "dense": jnp.arange(3.0)}
    restored = ROUND_TRIPS[library](tree, tmp_path, _abstract(tree))
    _assert_same_tree(restored, tree)
    assert type(restored["value"]) is type(value)
    np.testing.assert_array_equal(
        qt.materialise(restored["value"]), qt.materialise(value)
    )
    # The restored value is still guarded against leafwise arithmetic.
    with pytest.raises(TypeError, match=r"quax_tangents\.optax\.lift"):
        jax.tree.map(lambda leaf: 2.0 * leaf, restored["value"])


def test_equinox_restores_into_a_concrete_like_too(tmp_path):
    tree = {"value": _value("LowRank")}
    restored = _eqx_round_trip(tree, tmp_path, jax.tree.map(jnp.zeros_like, tree))
    _assert_same_tree(restored, tree)


def test_equinox_default_names_the_functions_that_save_a_guard(tmp_path):
    with pytest.raises(Exception) as info:
        eqx.tree_serialise_leaves(tmp_path / "x.eqx", {"value": _value("LowRank")})
    chain = []
    error = info.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__
    assert any("quax_tangents.tree_serialise_leaves" in text for text in chain)


def test_a_tree_without_compressed_values_gives_equinox_own_file(tmp_path):
    tree = {"w": random_array(0, (3, 4)), "n": jnp.int32(3)}
    qt.tree_serialise_leaves(tmp_path / "ours.eqx", tree)
    eqx.tree_serialise_leaves(tmp_path / "theirs.eqx", tree)
    assert (tmp_path / "ours.eqx").read_bytes() == (
        tmp_path / "theirs.eqx"
    ).read_bytes()


def test_orbax_checkpoint_manager_keeps_several_steps(tmp_path):
    manager = ocp.CheckpointManager(
        tmp_path / "run", options=ocp.CheckpointManagerOptions(max_to_keep=2)
    )
    trees = {step: {"value": compressed("LowRank", (6, 4), step)} for step in range(3)}
    for step, tree in trees.items():
        manager.save(step, args=ocp.args.StandardSave(tree))
    manager.wait_until_finished()
    assert manager.all_steps() == [1, 2]
    for step in (1, 2):
        restored = manager.restore(
            step, args=ocp.args.StandardRestore(_abstract(trees[step]))
        )
        _assert_same_tree(restored, trees[step])
    manager.close()


# ---------------------------------------------------------------------------------------
# Training resumed from a checkpoint


def _params():
    return {"w": random_array(1, (8, 6)) * 0.3, "b": jnp.zeros(6)}


_X, _Y = random_array(2, (16, 8)), random_array(3, (16, 6))


def _loss(params):
    return jnp.mean((jnp.tanh(_X @ params["w"] + params["b"]) - _Y) ** 2)


def _is_matrix(tree):
    return jax.tree.map(lambda x: jnp.ndim(x) == 2, tree)


def _dense_step(tx):
    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(_loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def _projected_step(tx):
    @jax.jit
    def step(params, state):
        loss, grads = qt.value_and_grad(lambda p: _loss(qto.mark(p, state)))(params)
        updates, state = tx.update(grads, state, params)
        return qto.apply_updates(params, updates), state, loss

    return step


def _projected(base):
    return qto.projected(
        base, rank=2, learning_rate=1e-2, refresh_every=3, project=_is_matrix
    )


OPTIMISERS = {
    "powersgd-int8-error": lambda: (
        optax.chain(qto.powersgd(2, error_dtype="int8"), optax.adam(1e-2)),
        _dense_step,
    ),
    "compress-error-feedback": lambda: (
        optax.chain(qto.compress_updates(ft.partial(qt.top_k, k=8)), optax.sgd(0.1)),
        _dense_step,
    ),
    "projected": lambda: (_projected(optax.scale_by_adam()), _projected_step),
    "projected-8bit": lambda: (
        _projected(qto.quantized_state(optax.scale_by_adam())),
        _projected_step,
    ),
    "adam-8bit": lambda: (qto.quantized_state(optax.adam(1e-2)), _dense_step),
}


def _train(step, params, state, n):
    losses = []
    for _ in range(n):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return params, state, losses


@pytest.mark.parametrize("library", ROUND_TRIPS)
@pytest.mark.parametrize("name", OPTIMISERS)
def test_training_resumed_from_a_checkpoint_gives_the_same_losses(
    name, library, tmp_path
):
    tx, make_step = OPTIMISERS[name]()
    step = make_step(tx)
    params = _params()
    state = tx.init(params)
    _, _, straight = _train(step, params, state, 6)

    params, state, first = _train(step, params, state, 4)
    like = _abstract((params, state))
    params, state = ROUND_TRIPS[library]((params, state), tmp_path, like)
    _, _, rest = _train(step, params, state, 2)
    # The same compiled step on bit-identical inputs: the same losses, exactly.
    assert first + rest == straight
