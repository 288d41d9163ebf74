"""Projected training of Flax models: NNX state from `nnx.split`, NNX's own
`nnx.Optimizer`, and Linen parameter dicts."""

import jax
import jax.numpy as jnp
import optax
import pytest

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import random_array


nnx = pytest.importorskip("flax.nnx", reason="flax is in the `dev` extra")
linen = pytest.importorskip("flax.linen", reason="flax is in the `dev` extra")

X, Y = random_array(1, (32, 16)), random_array(2, (32, 8))


def _matrices(params):
    return jax.tree.map(lambda a: jnp.ndim(a) == 2, params)


def _tx():
    return qto.projected(
        optax.scale_by_adam(), rank=4, learning_rate=1e-2, project=_matrices
    )


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def _nnx_functional_losses(steps):
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    tx = _tx()
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        def loss_fn(p):
            return jnp.mean((nnx.merge(graphdef, qto.mark(p, state))(X) - Y) ** 2)

        loss, grads = qt.value_and_grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return qto.apply_updates(params, updates), state, loss, grads

    losses = []
    for _ in range(steps):
        params, state, loss, grads = step(params, state)
        losses.append(float(loss))
    assert isinstance(grads["up"]["kernel"].get_value(), qt.LowRank)
    return losses


def test_nnx_optimizer_trains_as_the_functional_step_does():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer):
        graphdef, params = nnx.split(model, nnx.Param)

        def loss_fn(p):
            marked = qto.mark(p, optimizer.opt_state)
            return jnp.mean((nnx.merge(graphdef, marked)(X) - Y) ** 2)

        loss, grads = qt.value_and_grad(loss_fn)(params)
        # `nnx.Optimizer.update` applies the updates with `optax.apply_updates`,
        # which adds each low-rank update to its weight densely: counted, silenced.
        with qt.fallback("silent"):
            optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer)) for _ in range(4)]
    assert losses == pytest.approx(_nnx_functional_losses(4), rel=1e-5)
    assert losses[-1] < losses[0]


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(8)(jax.nn.gelu(linen.Dense(32)(x)))


def test_linen_params_train_with_projected_gradients():
    model = LinenMLP()
    params = model.init(jax.random.key(0), X)["params"]
    tx = _tx()
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        def loss_fn(p):
            return jnp.mean((model.apply({"params": qto.mark(p, state)}, X) - Y) ** 2)

        loss, grads = qt.value_and_grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return qto.apply_updates(params, updates), state, loss, grads

    losses = []
    for _ in range(4):
        params, state, loss, grads = step(params, state)
        losses.append(float(loss))
    assert isinstance(grads["Dense_0"]["kernel"], qt.LowRank)
    assert losses[-1] < losses[0]


def test_parameters_of_another_structure_are_still_refused():
    _, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    state = _tx().init(params)
    with pytest.raises(ValueError, match="must have the structure"):
        qto.mark({"up": params["up"]}, state)
