"""Forward gradients: train an MLP on scikit-learn's digits without backpropagation.

Three ways to train the same MLP (64 -> 64 -> 10, tanh) with minibatch SGD:

1. `backprop`: the exact gradient from `jax.grad`;
2. `forward, dense`: `quax_tangents.forward_grad(..., directions=qt.GaussianDirections())`, the
   forward-gradient estimate `(grad f . v) v` of Baydin et al. (2022) with a dense
   Gaussian direction `v`, from one JVP and no backward pass;
3. `forward, low-rank`: the same with a rank-1 direction `a b^T` per weight matrix
   (biases get dense Gaussian directions). The JVP pushes the direction through the
   first layer from its factors, and the estimate is a `LowRank`: a scalar times
   `a b^T`.

A forward gradient is unbiased but noisy: its expected squared error is about `d`
times the squared gradient norm, for `d` parameters (here d = 4,810). So the forward
methods take a much smaller step and many more of them. The script writes a PNG of
test accuracy against step and a Markdown table of the results to the folder `--out`
(default `examples/results/`; with `--quick`, `examples/results/quick/`, which git
ignores, so a smoke run never replaces the full run's results).

Run it with

    python examples/forward_gradient.py            # about 2 minutes on 2 CPU cores
    python examples/forward_gradient.py --quick    # a few steps, to check it runs
"""

import argparse
import dataclasses
import importlib.metadata
import math
import os
import pathlib
import platform
import shlex
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import quax_tangents as qt


matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)


DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results"
QUICK_OUT = DEFAULT_OUT / "quick"
SIZES = (64, 64, 10)
BATCH = 128


# ---------------------------------------------------------------------------------
# Data and model: a plain JAX MLP, params a list of (weight, bias) pairs.


class Data(NamedTuple):
    """Training and test split; a NamedTuple, so a pytree that `jit` accepts."""

    x_train: jax.Array
    y_train: jax.Array
    x_test: jax.Array
    y_test: jax.Array


def load_data(seed: int) -> Data:
    """The 8x8 digits, pixels scaled to [0, 1], split 75/25 with every class in
    proportion."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0,
        digits.target,
        test_size=0.25,
        random_state=seed,
        stratify=digits.target,
    )
    as_x = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return Data(as_x(x_train), jnp.asarray(y_train), as_x(x_test), jnp.asarray(y_test))


def init_mlp(rng: np.random.Generator, sizes: tuple[int, ...]) -> list:
    """LeCun-normal weights and zero biases, drawn with NumPy: on CPU each new shape
    drawn with `jax.random` outside `jit` costs a compilation."""
    return [
        (
            jnp.asarray(rng.standard_normal((m, n)) / np.sqrt(m), jnp.float32),
            jnp.zeros(n),
        )
        for m, n in zip(sizes[:-1], sizes[1:])
    ]


def mlp(params: list, x: jax.Array) -> jax.Array:
    *hidden, (w_out, b_out) = params
    for w, b in hidden:
        x = jnp.tanh(x @ w + b)
    return x @ w_out + b_out


def loss(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy."""
    logits = mlp(params, x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def accuracy(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(mlp(params, x), axis=-1) == y)


@jax.jit
def evaluate(params: list, data: Data) -> tuple[jax.Array, jax.Array]:
    """Test accuracy and full training loss. Jitted: run eagerly, each operation
    would compile on its own."""
    return (
        accuracy(params, data.x_test, data.y_test),
        loss(params, data.x_train, data.y_train),
    )


# ---------------------------------------------------------------------------------
# The three methods


@dataclasses.dataclass(frozen=True)
class Method:
    """How to get a gradient: `directions=None` is backprop, otherwise the
    `directions` argument of `quax_tangents.forward_grad`, which the results table
    calls `label`."""

    name: str
    label: str
    directions: qt.GaussianDirections | qt.LowRankDirections | None
    learning_rate: float
    steps: int


def full_methods() -> list[Method]:
    # Backprop takes big steps and converges in a few hundred. The forward methods
    # diverged at a learning rate of 0.03 (and were erratic at 0.02) in trial runs;
    # 0.01 is stable for both, and 60,000 steps fit the time budget.
    return [
        Method("backprop", "exact", None, 0.5, 2_000),
        Method("forward, dense", "gaussian", qt.GaussianDirections(), 0.01, 60_000),
        Method("forward, low-rank", "low_rank", qt.LowRankDirections(), 0.01, 60_000),
    ]


def quick_methods() -> list[Method]:
    return [
        Method("backprop", "exact", None, 0.5, 20),
        Method("forward, dense", "gaussian", qt.GaussianDirections(), 0.01, 20),
        Method("forward, low-rank", "low_rank", qt.LowRankDirections(), 0.01, 20),
    ]


def gradient(method: Method, params: list, x, y, key) -> list:
    """The exact gradient, or a forward-gradient estimate (dense leaves: the SGD
    update below adds it to every parameter anyway)."""
    fn = lambda p: loss(p, x, y)  # noqa: E731
    if method.directions is None:
        return jax.grad(fn)(params)
    estimate = qt.forward_grad(fn, params, key, directions=method.directions)
    return qt.materialise(estimate)


def stored_floats(method: Method, params: list, data: Data) -> int:
    """The floats in one gradient (or gradient estimate), from shapes only."""
    x, y = data.x_train[:BATCH], data.y_train[:BATCH]
    with qt.fallback("silent"):
        shapes = jax.eval_shape(
            lambda p, key: (
                jax.grad(loss)(p, x, y)
                if method.directions is None
                else qt.forward_grad(
                    lambda p: loss(p, x, y), p, key, directions=method.directions
                )
            ),
            params,
            jax.random.key(0),
        )
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))


def make_chunk(method: Method, data: Data):
    """A jitted `chunk(params, key, start, count)`: SGD steps `start` to
    `start + count - 1` on random minibatches, then test accuracy and full training
    loss. `count` is traced, so chunks of any length share one compilation."""

    def step(i, params, key):
        step_key = jax.random.fold_in(key, i)  # the same stream however it is chunked
        batch_key, direction_key = jax.random.split(step_key)
        index = jax.random.randint(batch_key, (BATCH,), 0, data.x_train.shape[0])
        x, y = data.x_train[index], data.y_train[index]
        grads = gradient(method, params, x, y, direction_key)
        return jax.tree.map(lambda p, g: p - method.learning_rate * g, params, grads)

    @jax.jit
    def chunk(params, key, start, count):
        params = jax.lax.fori_loop(
            start, start + count, lambda i, p: step(i, p, key), params
        )
        return params, *evaluate(params, data)

    return chunk


def measured_steps(steps: int, points: int) -> list[int]:
    """About `points` step counts from 1 to `steps`, evenly spaced on a log scale."""
    return sorted({int(round(s)) for s in np.geomspace(1, steps, points)})


# ---------------------------------------------------------------------------------
# Training, the figure and the table


@dataclasses.dataclass
class History:
    method: Method
    steps: list[int]
    test_accuracy: list[float]
    train_loss: list[float]
    seconds: float
    floats: int


def train(method: Method, data: Data, params: list, key, points: int) -> History:
    """Trains with `method`, measuring after about `points` log-spaced steps."""
    chunk = make_chunk(method, data)
    history = History(method, [0], [], [], 0.0, stored_floats(method, params, data))
    test_accuracy, train_loss = evaluate(params, data)
    history.test_accuracy.append(float(test_accuracy))
    history.train_loss.append(float(train_loss))
    start = time.perf_counter()
    with tqdm(total=method.steps, desc=f"{method.name:<18}", unit="step") as bar:
        # Tangents densify after the first layer, as they must; "silent" counts
        # that instead of warning.
        with qt.fallback("silent"):
            for done in measured_steps(method.steps, points):
                count = done - history.steps[-1]
                params, test_accuracy, train_loss = chunk(
                    params, key, history.steps[-1], count
                )
                history.steps.append(done)
                history.test_accuracy.append(float(test_accuracy))
                history.train_loss.append(float(train_loss))
                bar.update(count)
                bar.set_postfix(test_acc=f"{float(test_accuracy):.3f}")
    history.seconds = time.perf_counter() - start
    return history


def plot(histories: list[History], path: pathlib.Path) -> None:
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for h in histories:
        left.plot(h.steps, h.test_accuracy, label=h.method.name)
        right.plot(h.steps, h.train_loss, label=h.method.name)
    left.set(xlabel="SGD step", ylabel="test accuracy", ylim=(0, 1))
    right.set(xlabel="SGD step", ylabel="training loss", yscale="log")
    for axes in (left, right):
        # Logarithmic from step 1, linear from 0 to 1, so step 0 shows too.
        axes.set_xscale("symlog", linthresh=1)
        axes.set_xlim(left=0)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    figure.suptitle("MLP on digits: backprop vs. forward gradients")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _environment() -> str:
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}"
        for name in ("jax", "quax", "quax-tangents")
    )
    return (
        f"{versions}, python {platform.python_version()}; "
        f"{jax.default_backend()}, {len(os.sched_getaffinity(0))} CPU cores"
    )


def table(histories: list[History], quick: bool) -> str:
    lines = [
        "# Forward gradients on digits",
        "",
        "Produced by:",
        "",
        "```",
        "python " + shlex.join(sys.argv),
        "```",
        "",
        f"- {_environment()}",
        f"- MLP {' -> '.join(map(str, SIZES))} (tanh), minibatch {BATCH}, plain "
        "SGD, one direction per forward-gradient step.",
        "- Wall time includes compilation and is from a shared machine: read it "
        "loosely.",
        *(["- Quick mode: a smoke run, not a result."] if quick else []),
        "",
        "| method | directions | steps | learning rate | floats in a gradient "
        "| final test accuracy | best test accuracy | final training loss "
        "| wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for h in histories:
        m = h.method
        lines.append(
            f"| {m.name} | {m.label} | {m.steps:,} "
            f"| {m.learning_rate:g} | {h.floats:,} | {h.test_accuracy[-1]:.3f} "
            f"| {max(h.test_accuracy):.3f} | {h.train_loss[-1]:.4f} "
            f"| {h.seconds:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(out: pathlib.Path, quick: bool = False, seed: int = 0) -> list[History]:
    """Trains with each method from the same initialisation and writes
    `forward_gradient.png` and `forward_gradient.md` to `out`.

    **Arguments:**

    - `out`: the output folder (created if missing).
    - `quick`: a few steps of each method, to check that everything runs.
    - `seed`: seeds the data split, the initialisation, minibatches and directions.

    **Returns:**

    One `History` per method.
    """
    out.mkdir(parents=True, exist_ok=True)
    data = load_data(seed)
    params = init_mlp(np.random.default_rng(seed), SIZES)
    methods = quick_methods() if quick else full_methods()
    points = 4 if quick else 60
    key = jax.random.key(seed)
    histories = [train(m, data, params, key, points) for m in methods]
    plot(histories, out / "forward_gradient.png")
    text = table(histories, quick)
    (out / "forward_gradient.md").write_text(text)
    print(text)
    return histories


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split())  # the first paragraph
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        help=f"output folder (default: {DEFAULT_OUT}, or {QUICK_OUT} with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="a few steps only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    main(out, quick=args.quick, seed=args.seed)
