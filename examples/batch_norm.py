"""Batch normalisation whose running statistics are data, not parameters.

The use case from the `@differentiable` thread: a layer holds learnable parameters,
running statistics and hyperparameters in one structure. Here

- `scale`, `offset` and the weights are `Differentiable`: they make up
  `MLP.Tangent`, and `quax_tangents.grad` returns their gradient;
- `running_mean`, `running_var` and the step counter are `NoDerivative` data: traced
  under `jit`, carried by `lax.scan`, updated functionally by the forward pass, and
  never differentiated;
- `momentum`, `eps` and the activation's name are static.

A whole training run is one `lax.scan` over minibatches inside one `jax.jit`; each
step is `model.move(-learning_rate * grads)` on the model whose statistics the
forward pass just updated.

Run: `python examples/batch_norm.py` (`--steps 30` for a quick run).
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

import quax_tangents as qt
from quax_tangents import Differentiable, NoDerivative, Static, differentiable


@differentiable
@dataclasses.dataclass(frozen=True)
class BatchNorm:
    """Normalises each feature by batch statistics when training, by running
    statistics when evaluating."""

    scale: Differentiable[Float[Array, " n"]]
    offset: Differentiable[Float[Array, " n"]]
    running_mean: NoDerivative[Float[Array, " n"]]
    running_var: NoDerivative[Float[Array, " n"]]
    momentum: Static[float] = 0.9
    eps: Static[float] = 1e-5

    @classmethod
    def init(cls, n: int) -> "BatchNorm":
        ones, zeros = jnp.ones(n), jnp.zeros(n)
        return cls(scale=ones, offset=zeros, running_mean=zeros, running_var=ones)

    def __call__(
        self, x: Float[Array, "b n"], training: bool
    ) -> tuple[Float[Array, "b n"], "BatchNorm"]:
        """The normalised batch and the layer with updated running statistics."""
        if training:
            mean, var = jnp.mean(x, axis=0), jnp.var(x, axis=0)
            # Statistics are bookkeeping: no gradient flows into the update.
            stats_mean, stats_var = lax.stop_gradient((mean, var))
            updated = dataclasses.replace(
                self,
                running_mean=self.momentum * self.running_mean
                + (1 - self.momentum) * stats_mean,
                running_var=self.momentum * self.running_var
                + (1 - self.momentum) * stats_var,
            )
        else:
            mean, var, updated = self.running_mean, self.running_var, self
        normalised = (x - mean) * lax.rsqrt(var + self.eps)
        return self.scale * normalised + self.offset, updated


@differentiable
@dataclasses.dataclass(frozen=True)
class MLP:
    """`linear -> batch norm -> activation -> linear`."""

    w1: Differentiable[Float[Array, "d h"]]
    b1: Differentiable[Float[Array, " h"]]
    norm: BatchNorm  # nested: its parameters are differentiable, its statistics not
    w2: Differentiable[Float[Array, "h c"]]
    b2: Differentiable[Float[Array, " c"]]
    steps: Int[Array, ""]  # unmarked array: non-differentiable data
    activation: str = "relu"  # unmarked str: static

    def __call__(
        self, x: Float[Array, "b d"], training: bool
    ) -> tuple[Float[Array, "b c"], "MLP"]:
        hidden, norm = self.norm(x @ self.w1 + self.b1, training)
        hidden = getattr(jax.nn, self.activation)(hidden)
        return hidden @ self.w2 + self.b2, dataclasses.replace(self, norm=norm)


def init_mlp(rng: np.random.Generator, sizes: tuple[int, int, int]) -> MLP:
    """LeCun-normal weights (drawn with NumPy: one compilation less per shape)."""
    d, h, c = sizes
    normal = lambda *shape: jnp.asarray(
        rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32
    )
    return MLP(
        w1=normal(d, h),
        b1=jnp.zeros(h),
        norm=BatchNorm.init(h),
        w2=normal(h, c),
        b2=jnp.zeros(c),
        steps=jnp.array(0),
    )


def loss(
    model: MLP, x: Float[Array, "b d"], y: Int[Array, " b"]
) -> tuple[Float[Array, ""], MLP]:
    """Mean cross-entropy in training mode; the updated model is the aux output."""
    logits, updated = model(x, training=True)
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], 1)), updated


def accuracy(model: MLP, x: Float[Array, "b d"], y: Int[Array, " b"]) -> float:
    """Accuracy in evaluation mode, which uses the running statistics."""
    logits, _ = model(x, training=False)
    return float(jnp.mean(jnp.argmax(logits, axis=1) == y))


def make_data(
    rng: np.random.Generator, n: int, d: int, classes: int
) -> tuple[Float[Array, "n d"], Int[Array, " n"]]:
    """Gaussian clusters on features of wildly different offsets and scales, the
    situation batch normalisation is for."""
    centres = rng.standard_normal((classes, d)) * 2.0
    y = rng.integers(classes, size=n)
    x = centres[y] + rng.standard_normal((n, d))
    x = x * np.geomspace(0.1, 30.0, d) + np.linspace(-50.0, 50.0, d)
    return jnp.asarray(x, jnp.float32), jnp.asarray(y)


def main(steps: int = 300, batch: int = 64, learning_rate: float = 0.1) -> None:
    """Trains with one jitted `lax.scan` and prints what the run shows.

    **Arguments:**

    - `steps`: minibatch SGD steps (one scan iteration each).
    - `batch`: the minibatch size.
    - `learning_rate`: the SGD step size.
    """
    rng = np.random.default_rng(0)
    x, y = make_data(rng, n=steps * batch + 1000, d=8, classes=3)
    (x, x_test), (y, y_test) = (
        jnp.split(x, [steps * batch]),
        jnp.split(y, [steps * batch]),
    )
    model = init_mlp(rng, (8, 32, 3))

    tangent_fields = [f.name for f in dataclasses.fields(MLP.Tangent)]
    norm_fields = [f.name for f in dataclasses.fields(BatchNorm.Tangent)]
    print(f"MLP.Tangent fields: {tangent_fields}")
    print(f"BatchNorm.Tangent fields: {norm_fields}")

    traces = []

    def step(model: MLP, minibatch):
        traces.append(None)  # runs once per trace, not per step
        (value, updated), grads = qt.value_and_grad(loss, has_aux=True)(
            model, *minibatch
        )
        # The statistics come from `updated`; the parameters move by the gradient.
        moved = updated.move(-learning_rate * grads)
        return dataclasses.replace(moved, steps=moved.steps + 1), value

    @jax.jit
    def train(model, xs, ys):
        return lax.scan(step, model, (xs, ys))

    xs = x.reshape(steps, batch, -1)
    ys = y.reshape(steps, batch)
    half = steps // 2
    before = accuracy(model, x_test, y_test)
    model, losses_1 = train(model, xs[:half], ys[:half])
    # The second call starts from other statistics and another step count. They are
    # data, not static, so the compiled scan is reused: one trace in all.
    model, losses_2 = train(model, xs[half : 2 * half], ys[half : 2 * half])
    losses = jnp.concatenate([losses_1, losses_2])

    print(f"model type after two jitted scans: {type(model).__name__}")
    print(f"traces of the step function: {len(traces)}")
    print(f"steps counted by the model: {int(model.steps)}")
    window = max(1, len(losses) // 10)
    first, last = float(jnp.mean(losses[:window])), float(jnp.mean(losses[-window:]))
    print(f"training loss: first {window} steps {first:.3f}, last {window} {last:.3f}")

    hidden = x_test @ model.w1 + model.b1
    gap = float(jnp.max(jnp.abs(model.norm.running_mean - jnp.mean(hidden, axis=0))))
    spread = float(jnp.max(jnp.abs(jnp.mean(hidden, axis=0))))
    print(
        f"running mean vs test-set mean of the pre-activations: max gap {gap:.3f} "
        f"(the means themselves reach {spread:.1f})"
    )
    print(
        f"test accuracy with running statistics: {before:.3f} before, "
        f"{accuracy(model, x_test, y_test):.3f} after"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split())  # the first paragraph
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    args = parser.parse_args()
    main(args.steps, args.batch, args.learning_rate)
