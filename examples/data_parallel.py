"""Data-parallel training with compressed gradient all-reduce: an MLP on scikit-learn's
digits, on 8 host CPU devices.

Run it with

    python examples/data_parallel.py

(five to ten minutes on two CPU cores; `--quick` runs a small network for a few
steps). Each of the 8 devices holds a replica of the MLP and computes the gradient of
its own slice of every batch; the gradients are combined across devices by one of:

- `dense`: a plain all-reduce (mean) of every gradient;
- `powersgd-rK`: `quax_tangents.optax.powersgd(K)`, rank K with error feedback;
- `top-k-1%-ef`: the top 1% of entries of each weight gradient, with error feedback;
- `int8`: 8-bit block-wise quantised weight gradients;
- `sign-ef`: one sign bit per element and one l2 norm per tensor, with error feedback;

each followed by Adam. Biases (1-D) are always averaged densely. For each method it
reports the test accuracy, the bytes that one training step's collectives move (read
from the compiled program) and the wall time, as a Markdown table and a PNG plot of
accuracy against bytes (`--out`, default `examples/results/data_parallel.md`, and the
`.png` next to it; with `--quick`, `examples/results/quick/data_parallel.md`, which
git ignores, so a smoke run never replaces a full run's results).
"""

# JAX reads XLA_FLAGS when it first starts its CPU backend, so the device count is
# set before anything imports JAX.
# ruff: noqa: E402

import os


_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}"

import argparse
import dataclasses
import functools as ft
import pathlib
import shlex
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import quax_tangents as qt
import quax_tangents.optax as qto


AXIS = "data"
DEVICES = 8
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "data_parallel.md"
QUICK_OUT = DEFAULT_OUT.parent / "quick" / DEFAULT_OUT.name


# ---------------------------------------------------------------------------------
# Data and model


def load_data(seed: int = 0):
    """Digits, standardised with the training set's statistics, split 80/20."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x.astype(np.float32), y, test_size=0.2, random_state=seed, stratify=y
    )
    mean, std = x_train.mean(0), x_train.std(0) + 1e-3
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def init_mlp(rng: np.random.Generator, sizes: tuple[int, ...]) -> list[dict]:
    """He-normal weights (NumPy, to avoid a compilation per shape) and zero biases."""
    return [
        {
            "w": jnp.asarray(rng.standard_normal((m, n)) * np.sqrt(2 / m), jnp.float32),
            "b": jnp.zeros(n, jnp.float32),
        }
        for m, n in zip(sizes[:-1], sizes[1:])
    ]


def logits(params: list[dict], x: jax.Array) -> jax.Array:
    *hidden, last = params
    for layer in hidden:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


def loss(params: list[dict], x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def accuracy(params: list[dict], x: np.ndarray, y: np.ndarray) -> float:
    predicted = jax.jit(logits)(params, x).argmax(-1)
    return float(np.mean(np.asarray(predicted) == y))


# ---------------------------------------------------------------------------------
# Gradient transformations that combine the devices' gradients


def dense_mean() -> optax.GradientTransformation:
    """The baseline: every gradient all-reduced (averaged) densely."""
    return optax.stateless(
        lambda updates, params: qt.all_reduce(updates, AXIS, mean=True)
    )


def methods() -> dict[str, Callable[[], optax.GradientTransformation]]:
    """The compared ways of combining gradients, each a factory of a transformation
    that must run inside `shard_map` over `AXIS`."""
    return {
        "dense": dense_mean,
        "powersgd-r1": lambda: qto.powersgd(1, axis_name=AXIS),
        "powersgd-r2": lambda: qto.powersgd(2, axis_name=AXIS),
        "powersgd-r4": lambda: qto.powersgd(4, axis_name=AXIS),
        "top-k-1%-ef": lambda: qto.compress(
            lambda g: qt.top_k(g, 0.01), error_feedback="ef", axis_name=AXIS
        ),
        "int8": lambda: qto.compress(
            ft.partial(qt.quantize, bits=8), error_feedback=None, axis_name=AXIS
        ),
        "sign-ef": lambda: qto.compress(
            qt.sign_norm, error_feedback="ef", axis_name=AXIS
        ),
    }


# ---------------------------------------------------------------------------------
# Training on the mesh


@dataclasses.dataclass
class Result:
    method: str
    accuracy: float
    collectives: list[qt.Collective]
    seconds: float
    losses: np.ndarray

    @property
    def bytes_per_step(self) -> int:
        return sum(c.operand_bytes for c in self.collectives)

    def received_per_device(self, devices: int) -> float:
        """Bytes each device receives per step under the usual algorithms: a ring
        all-reduce receives `2 (N - 1) / N` times its operand, an all-gather receives
        every other device's operand."""
        total = 0.0
        for c in self.collectives:
            factor = {"all-reduce": 2 * (devices - 1) / devices}.get(
                c.kind, devices - 1
            )
            total += factor * c.operand_bytes
        return total


@dataclasses.dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...] = (64, 1024, 1024, 10)
    steps: int = 300
    batch_per_device: int = 32
    learning_rate: float = 1e-3
    steps_per_call: int = 10
    seed: int = 0


def _batches(n_train: int, config: Config, rng: np.random.Generator) -> np.ndarray:
    """Indices `(steps, devices * batch_per_device)`, epoch by epoch without
    replacement."""
    size = DEVICES * config.batch_per_device
    order: list[np.ndarray] = []
    while sum(len(o) for o in order) < config.steps * size:
        order.append(rng.permutation(n_train))
    return np.concatenate(order)[: config.steps * size].reshape(config.steps, size)


def make_step(tx: optax.GradientTransformation):
    """One training step on one device: its own gradient (of a replica that is
    marked device-varying, so JAX's AD adds no dense all-reduce), then `tx`, which
    combines the devices' gradients, then the update of the (replicated) params."""

    def step(params, state, x, y):
        grads = jax.grad(loss)(qt.device_varying(params, AXIS), x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss(params, x, y)

    return step


def train(
    name: str,
    make_tx: Callable[[], optax.GradientTransformation],
    data,
    config: Config,
    mesh: jax.sharding.Mesh,
    progress: bool = True,
) -> Result:
    x_train, y_train, x_test, y_test = data
    rng = np.random.default_rng(config.seed)
    params = init_mlp(rng, config.sizes)
    tx = optax.chain(make_tx(), optax.adam(config.learning_rate))
    state_specs = qto.partition_specs(jax.eval_shape(tx.init, params), AXIS)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, AXIS))
    params = jax.device_put(params, replicated)
    state = jax.jit(
        jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_specs)
    )(params)
    step = make_step(tx)

    def chunk(params, state, xs, ys):
        def body(carry, batch):
            params, state, loss_value = step(*carry, *batch)
            return (params, state), loss_value

        (params, state), losses = jax.lax.scan(body, (params, state), (xs, ys))
        return params, state, losses

    specs = (P(), state_specs, P(None, AXIS), P(None, AXIS))
    # Each device's losses come back side by side, without a collective.
    run_chunk = jax.jit(
        jax.shard_map(
            chunk, mesh=mesh, in_specs=specs, out_specs=specs[:2] + (P(AXIS),)
        )
    )
    batches = _batches(len(x_train), config, rng)
    k = config.steps_per_call
    xs = jax.device_put(x_train[batches[:k]], split)
    ys = jax.device_put(y_train[batches[:k]], split)
    run_chunk = run_chunk.lower(params, state, xs, ys).compile()
    # The bytes of one step: the scan's body is compiled once, as a loop, so each of
    # its collectives is listed once.
    found = qt.collectives(run_chunk)
    losses = []
    start = time.perf_counter()
    bar = tqdm(
        range(0, config.steps, k), desc=f"{name:>12}", disable=not progress, leave=False
    )
    for first in bar:
        idx = batches[first : first + k]
        if len(idx) < k:
            break
        xs = jax.device_put(x_train[idx], split)
        ys = jax.device_put(y_train[idx], split)
        params, state, chunk_losses = run_chunk(params, state, xs, ys)
        losses.append(np.asarray(chunk_losses).reshape(DEVICES, k).mean(0))
        bar.set_postfix(loss=f"{float(losses[-1][-1]):.3f}")
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    acc = accuracy(jax.device_get(params), x_test, y_test)
    return Result(name, acc, found, seconds, np.concatenate(losses))


def make_mesh() -> jax.sharding.Mesh:
    if len(jax.devices()) < DEVICES:
        raise RuntimeError(
            f"Found {len(jax.devices())} devices; this example needs {DEVICES}. JAX was "
            f"started before `XLA_FLAGS={_DEVICE_FLAG}` could be set: run the example "
            "as a script, or set the flag yourself."
        )
    return jax.make_mesh((DEVICES,), (AXIS,), devices=jax.devices()[:DEVICES])


# ---------------------------------------------------------------------------------
# Reporting


def _fmt_bytes(n: float) -> str:
    return f"{n:,.0f}"


def table(results: list[Result]) -> list[str]:
    dense = next((r for r in results if r.method == "dense"), results[0])
    lines = [
        "| method | test accuracy | bytes per step (operands) | ÷ dense | bytes "
        "received per device (model) | collectives | wall time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        kinds = ", ".join(
            f"{count}x {kind}"
            for kind, count in sorted(
                {
                    c.kind: sum(d.kind == c.kind for d in r.collectives)
                    for c in r.collectives
                }.items()
            )
        )
        ratio = dense.bytes_per_step / max(r.bytes_per_step, 1)
        lines.append(
            f"| {r.method} | {100 * r.accuracy:.1f}% | {_fmt_bytes(r.bytes_per_step)} | "
            f"{ratio:.1f}x | {_fmt_bytes(r.received_per_device(DEVICES))} | {kinds} | "
            f"{r.seconds:.1f} |"
        )
    return lines


def plot(results: list[Result], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, r in enumerate(results):
        ax.scatter(r.bytes_per_step, 100 * r.accuracy, s=40)
        # Alternate labels above and below, so that neighbours do not overlap.
        ax.annotate(
            r.method,
            (r.bytes_per_step, 100 * r.accuracy),
            textcoords="offset points",
            xytext=(5, 5 if i % 2 == 0 else -12),
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_xlabel("bytes per step (collective operands, one device)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a small network and a few steps"
    )
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        help="Markdown table to write; the plot goes next to it as .png (default: "
        f"{DEFAULT_OUT}, or {QUICK_OUT} with --quick)",
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated subset of the methods to run (default: all)",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = QUICK_OUT if args.quick else DEFAULT_OUT
    return args


def config_from(args: argparse.Namespace) -> Config:
    if args.quick:
        config = Config(sizes=(64, 64, 10), steps=20, steps_per_call=10)
    else:
        config = Config()
    if args.steps is not None:
        config = dataclasses.replace(config, steps=args.steps)
    return dataclasses.replace(config, seed=args.seed)


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    config = config_from(args)
    mesh = make_mesh()
    data = load_data()
    chosen = methods()
    if args.methods is not None:
        names = args.methods.split(",")
        unknown = sorted(set(names) - set(chosen))
        if unknown:
            raise SystemExit(f"Unknown methods {unknown}; choose from {list(chosen)}.")
        chosen = {name: chosen[name] for name in names}
    results = []
    for name, make_tx in chosen.items():
        result = train(name, make_tx, data, config, mesh, progress=not args.no_progress)
        results.append(result)
        print(
            f"{name:>12}: test accuracy {100 * result.accuracy:.1f}%, "
            f"{result.bytes_per_step:,} bytes per step, {result.seconds:.1f} s",
            flush=True,
        )
    command = "python examples/data_parallel.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    sizes = " -> ".join(map(str, config.sizes))
    header = [
        "# Data-parallel digits MLP with compressed gradient all-reduce",
        "",
        f"Produced by `{command.strip()}`: MLP {sizes} (ReLU), {DEVICES} host CPU "
        f"devices, {config.batch_per_device} examples per device per step, "
        f"{config.steps} steps of Adam (lr {config.learning_rate}), seed "
        f"{config.seed}. Bytes are the operands of one step's collectives in the "
        "compiled program (what one device contributes); the model column is what "
        "one device receives with a ring all-reduce or an all-gather.",
        "",
    ]
    lines = table(results)
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(header + lines) + "\n")
    plot(
        results, args.out.with_suffix(".png"), f"digits MLP {sizes}, {DEVICES} devices"
    )
    print(f"Wrote {args.out} and {args.out.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
