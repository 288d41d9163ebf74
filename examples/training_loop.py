"""Training loops for a `@differentiable` equinox model.

Three loops fit the same student network to a teacher:

1. plain SGD, stepping with `model.move(-learning_rate * grads)`, where `grads` is the
   `MLP.Tangent` that `quax_tangents.grad` returns;
2. the same with a compressed gradient: the first layer's weight gradient comes back
   as a rank-4 `LowRank` inside the Tangent, `-learning_rate * grads` keeps it
   low-rank, and `move` materialises it only when it is added to the weight;
3. any optax optimizer (here Adam), through `quax_tangents.differentiable_part` (the
   "params" optax sees, a `MLP.Tangent`) and `quax_tangents.optax.apply_updates`
   (which takes a model and its updates).

The model also carries a step counter, which is data: it stays dynamic under `jit`,
so the jitted step compiles once.

Run: `python examples/training_loop.py` (`--steps 20` for a quick run). Needs optax,
which the `examples` extra installs.
"""

import argparse
import functools as ft
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

import quax_tangents as qt
import quax_tangents.optax as qto
from quax_tangents import Differentiable, differentiable


@differentiable
class Linear(eqx.Module):
    weight: Differentiable[Float[Array, "i o"]]
    bias: Differentiable[Float[Array, " o"]]

    def __call__(self, x: Float[Array, "b i"]) -> Float[Array, "b o"]:
        return x @ self.weight + self.bias


@differentiable
class MLP(eqx.Module):
    layers: list[Linear]  # a list of @differentiable layers: differentiable
    step: Int[Array, ""]  # unmarked: non-differentiable data
    activation: Callable = eqx.field(static=True)

    def __call__(self, x: Float[Array, "b i"]) -> Float[Array, "b o"]:
        *hidden, last = self.layers
        for layer in hidden:
            x = self.activation(layer(x))
        return last(x)


def init_mlp(rng: np.random.Generator, sizes: tuple[int, ...]) -> MLP:
    """LeCun-normal weights drawn with NumPy, zero biases, step 0."""
    layers = [
        Linear(
            jnp.asarray(rng.standard_normal((m, n)) / np.sqrt(m), jnp.float32),
            jnp.zeros(n),
        )
        for m, n in zip(sizes[:-1], sizes[1:])
    ]
    return MLP(layers, jnp.array(0), jnp.tanh)


def loss(model: MLP, x: Float[Array, "b i"], y: Float[Array, "b o"]) -> Array:
    """Mean squared error."""
    return jnp.mean((model(x) - y) ** 2)


def loss_low_rank_first_layer(
    model: MLP, x: Float[Array, "b i"], y: Float[Array, "b o"]
) -> Array:
    """`loss`, with the first weight's gradient compressed to rank 4."""
    first = model.layers[0]
    weight = qt.compress_cotangent(first.weight, ft.partial(qt.low_rank, rank=4))
    layers = [Linear(weight, first.bias), *model.layers[1:]]
    return loss(MLP(layers, model.step, model.activation), x, y)


def count_step(model: MLP) -> MLP:
    return eqx.tree_at(lambda m: m.step, model, model.step + 1)


def sgd_step(loss_fn: Callable, learning_rate: float, traces: list) -> Callable:
    """A jitted SGD step on a `@differentiable` model; appends to `traces` each time
    JAX traces it."""

    @jax.jit
    def step(model: MLP, x, y) -> tuple[MLP, Array]:
        traces.append(None)
        value, grads = qt.value_and_grad(loss_fn)(model, x, y)
        return count_step(model.move(-learning_rate * grads)), value

    return step


def optax_step(optimizer: optax.GradientTransformation) -> Callable:
    """A jitted step of any optax optimizer on a `@differentiable` model."""

    @jax.jit
    def step(model: MLP, state, x, y) -> tuple[MLP, optax.OptState, Array]:
        value, grads = qt.value_and_grad(loss)(model, x, y)
        params = qt.differentiable_part(model)
        updates, state = optimizer.update(grads, state, params)
        return count_step(qto.apply_updates(model, updates)), state, value

    return step


def main(steps: int = 300, learning_rate: float = 0.1) -> None:
    """Runs the three loops and prints their losses.

    **Arguments:**

    - `steps`: full-batch steps per loop.
    - `learning_rate`: the SGD step size (Adam uses a tenth of it).
    """
    rng = np.random.default_rng(0)
    teacher = init_mlp(rng, (16, 8, 4))
    x = jnp.asarray(rng.standard_normal((256, 16)), jnp.float32)
    y = teacher(x)
    initial = init_mlp(rng, (16, 64, 4))
    print(f"initial loss: {float(loss(initial, x, y)):.4f}")

    grads = qt.grad(loss_low_rank_first_layer)(initial, x, y)
    g = grads.layers[0].weight
    scaled = (-learning_rate * grads).layers[0].weight
    print(
        f"gradient type: {type(grads).__name__}; first weight: {type(g).__name__} "
        f"rank {g.rank}, {g.nbytes} bytes instead of {g.dense_nbytes}; "
        f"after scaling: {type(scaled).__name__}"
    )

    runs = {
        "sgd": loss,
        "sgd, rank-4 first-layer gradient": loss_low_rank_first_layer,
    }
    for name, loss_fn in runs.items():
        traces = []
        step = sgd_step(loss_fn, learning_rate, traces)
        model = initial
        for _ in range(steps):
            model, _ = step(model, x, y)
        print(
            f"{name}: loss {float(loss(model, x, y)):.4f} after {int(model.step)} "
            f"steps; traced {len(traces)} time(s)"
        )

    optimizer = optax.adam(learning_rate / 10)
    step = optax_step(optimizer)
    model, state = initial, optimizer.init(qt.differentiable_part(initial))
    for _ in range(steps):
        model, state, _ = step(model, state, x, y)
    print(
        f"adam (optax): loss {float(loss(model, x, y)):.4f} after {int(model.step)} "
        f"steps; model type {type(model).__name__}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split())  # the first paragraph
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    args = parser.parse_args()
    main(args.steps, args.learning_rate)
