"""`quax_tangents.optax.mark`: the marks a `projected` state calls for, applied to
Equinox models as they are, inside the loss."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import assert_close


RANK = 2


class Net(eqx.Module):
    embedding: eqx.nn.Embedding
    hidden: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(20, 6, key=k1)
        self.hidden = eqx.nn.Linear(6, 10, key=k2)
        self.out = eqx.nn.Linear(10, 5, key=k3)

    def __call__(self, ids):
        h = jax.vmap(self.embedding)(ids)
        return jax.vmap(self.out)(jnp.tanh(jax.vmap(self.hidden)(h)))


def _loss(params, static, batch):
    ids, y = batch
    model = eqx.combine(params, static)
    return jnp.mean((model(ids) - y) ** 2)


def _batch(seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 20, 7)), jnp.asarray(
        rng.standard_normal((7, 5)), jnp.float32
    )


def _setup(**kwargs):
    params, static = eqx.partition(Net(jax.random.key(0)), eqx.is_inexact_array)
    rows = jax.tree.map(lambda _: False, params)
    rows = eqx.tree_at(lambda p: p.embedding.weight, rows, True)
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, learning_rate=1e-2, rows=rows, **kwargs
    )
    return params, static, tx


def test_mark_gives_the_gradients_projected_takes_and_a_step_runs():
    params, static, tx = _setup(refresh_every=2)
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch, key):
        marked_loss = lambda p, b: _loss(qto.mark(p, state, key=key), static, b)  # noqa: E731
        loss, grads = qt.value_and_grad(marked_loss)(params, batch)
        updates, state = tx.update(grads, state)
        return qto.apply_updates(params, updates), state, grads

    for t in range(3):
        before = state
        dense = jax.grad(_loss)(params, static, _batch(t))
        params, state, grads = step(params, state, _batch(t), jax.random.key(t))
        assert isinstance(grads.embedding.weight, qt.SparseRows)
        assert isinstance(grads.hidden.bias, jax.Array)
        for layer in (grads.hidden, grads.out):
            assert isinstance(layer.weight, qt.LowRank) and layer.weight.projector_side
        # hidden (10, 6) is tall: projector Q (6, r) on the right; out (5, 10) wide.
        q, p = grads.hidden.weight.right, grads.out.weight.left
        assert_close(state.projector.hidden.weight, q)
        assert_close(state.projector.out.weight, p)
        assert_close(grads.hidden.weight, dense.hidden.weight @ q @ q.T)
        assert_close(grads.out.weight, p @ p.T @ dense.out.weight)
        assert_close(grads.embedding.weight, dense.embedding.weight)
        if not bool(before.refresh):  # kept: exactly the state's projector
            assert_close(q, before.projector.hidden.weight)


def test_mark_splits_one_key_per_projected_leaf():
    params, static, tx = _setup()
    state = tx.init(params)
    key = jax.random.key(5)
    hidden_key, out_key = jax.random.split(key, 2)
    shown = qto.projectors(state)

    def by_hand(p, batch):
        p = eqx.tree_at(
            lambda p: (p.embedding.weight, p.hidden.weight, p.out.weight),
            p,
            (
                qt.sparse_rows_cotangent(p.embedding.weight),
                qt.projected_cotangent(
                    p.hidden.weight, RANK, projector=shown.hidden.weight, key=hidden_key
                ),
                qt.projected_cotangent(
                    p.out.weight, RANK, projector=shown.out.weight, key=out_key
                ),
            ),
        )
        return _loss(p, static, batch)

    got = qt.grad(lambda p, b: _loss(qto.mark(p, state, key=key), static, b))(
        params, _batch(0)
    )
    expected = qt.grad(by_hand)(params, _batch(0))
    arrays = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))  # noqa: E731
    for a, b in zip(arrays(got), arrays(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mark_takes_the_whole_module_and_a_chained_state():
    params, static, tx = _setup()
    chain = optax.chain(tx)
    state = chain.init(params)
    model = eqx.combine(params, static)
    marked = qto.mark(model, state)  # non-array leaves pass through
    assert isinstance(marked, Net)
    with pytest.raises(ValueError, match="exactly one"):
        qto.mark(params, optax.scale_by_adam().init(params))


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(6, 12, key=k1)
        self.down = eqx.nn.Linear(12, 6, key=k2)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class Scanned(eqx.Module):
    blocks: Block

    def __init__(self, key, layers=3):
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(key, layers))

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(h, weights):
            return jax.vmap(eqx.combine(weights, static))(h), None

        return jax.lax.scan(layer, x, dynamic)[0]


def test_mark_on_a_scanned_equinox_model():
    params, static = eqx.partition(Scanned(jax.random.key(1)), eqx.is_inexact_array)
    # Stacked biases are (layers, d): matrices by shape, so select the weights.
    weights = lambda p: (p.blocks.up.weight, p.blocks.down.weight)  # noqa: E731
    project = eqx.tree_at(weights, jax.tree.map(lambda _: False, params), (True, True))
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, learning_rate=1e-2, project=project
    )
    state = tx.init(params)
    assert state.projector.blocks.up.weight.shape == (3, 6, RANK)
    assert state.projector.blocks.up.bias is None
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6)), jnp.float32)

    def loss(p):
        return jnp.sum(eqx.combine(p, static)(x) ** 2)

    def step(params, state):
        grads = qt.grad(lambda p: loss(qto.mark(p, state)))(params)
        updates, state = tx.update(grads, state)
        return qto.apply_updates(params, updates), state, grads

    step = jax.jit(step)
    for _ in range(2):
        before = state
        dense = jax.grad(loss)(params)
        params, state, grads = step(params, state)
        g = grads.blocks.up.weight  # (3, 12, 6): tall, projected on its columns
        assert isinstance(g, qt.LowRank) and g.batch_ndim == 1
        q = g.right
        assert_close(g, dense.blocks.up.weight @ q @ jnp.swapaxes(q, -1, -2))
        if not bool(before.refresh):
            assert_close(q, before.projector.blocks.up.weight)


def test_a_leaf_viewed_with_dims_is_left_unmarked_and_counted():
    params = {"qkv": jnp.ones((6, 2, 5)), "w": jnp.ones((6, 10))}
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, dims={"qkv": (0, 1), "w": None}
    )
    state = tx.init(params)
    x = jnp.ones((3, 6))

    def loss(p):
        return jnp.sum(jnp.tanh(x @ p["w"])) + jnp.sum(
            jnp.tanh(jnp.einsum("bd,dhk->bhk", x, p["qkv"]))
        )

    with pytest.warns(qt.DensificationWarning, match="dims"):
        grads = qt.grad(lambda p: loss(qto.mark(p, state)))(params)
    assert isinstance(grads["w"], qt.LowRank)
    assert isinstance(grads["qkv"], jax.Array)
    updates, _ = tx.update(grads, state)
    assert updates["qkv"].shape == (6, 10)  # the matrix view
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="dims"):
        qt.grad(lambda p: loss(qto.mark(p, state)))(params)
