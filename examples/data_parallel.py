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

With `--processes N` the same training runs on `N` processes of `--devices` host
devices each, one JAX cluster (`jax.distributed`, gloo collectives for the CPU) over
127.0.0.1: this script starts the `N` workers itself. On several machines start one
worker per machine yourself, each with the same arguments plus its own
`--process-id` and the coordinator's address:

    python examples/data_parallel.py --processes 2 --process-id 0 \
        --coordinator 10.0.0.1:12345   # on the first machine (the coordinator)
    python examples/data_parallel.py --processes 2 --process-id 1 \
        --coordinator 10.0.0.1:12345   # on the second
"""

# JAX reads XLA_FLAGS when it first starts its CPU backend, so the device count is
# set before anything imports JAX.
# ruff: noqa: E402

import os
import sys


def _devices_in_argv(default: int = 8) -> int:
    """`--devices N` of the command line, read before JAX starts."""
    for i, arg in enumerate(sys.argv):
        value = None
        if arg == "--devices" and i + 1 < len(sys.argv):
            value = sys.argv[i + 1]
        elif arg.startswith("--devices="):
            value = arg.split("=", 1)[1]
        if value is not None:
            # A bad value is left for the argument parser to report.
            return int(value) if value.isdigit() and int(value) > 0 else default
    return default


_DEVICE_FLAG = f"--xla_force_host_platform_device_count={_devices_in_argv()}"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}"

import argparse
import dataclasses
import functools as ft
import pathlib
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
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
        # The all-gather of compressed values, by name: the default schedule
        # ("auto") would choose the two-phase one from 3 devices on, which the
        # collective benchmark compares separately.
        "top-k-1%-ef": lambda: qto.compress_updates(
            lambda g: qt.top_k(g, 0.01),
            error_feedback=qto.ErrorFeedback(),
            axis_name=AXIS,
            method=qt.GatherSum(),
        ),
        "int8": lambda: qto.compress_updates(
            ft.partial(qt.quantize, bits=8),
            error_feedback=None,
            axis_name=AXIS,
            method=qt.GatherSum(),
        ),
        "sign-ef": lambda: qto.compress_updates(
            qt.sign_norm,
            error_feedback=qto.ErrorFeedback(),
            axis_name=AXIS,
            method=qt.GatherSum(),
        ),
    }


# ---------------------------------------------------------------------------------
# Training on the mesh


@dataclasses.dataclass
class Result:
    method: str
    accuracy: float
    collectives: list[qt.hlo.Collective]
    seconds: float
    losses: np.ndarray
    params: list[dict] | None = None

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


def _batches(
    n_train: int, config: Config, rng: np.random.Generator, devices: int
) -> np.ndarray:
    """Indices `(steps, devices * batch_per_device)`, epoch by epoch without
    replacement."""
    size = devices * config.batch_per_device
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


def put(tree, sharding: NamedSharding):
    """Host arrays (the same in every process) placed as `sharding` says: each process
    supplies the blocks of its own devices, so this works across processes too."""
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(
            np.shape(x), sharding, lambda index: np.asarray(x)[index]
        ),
        tree,
    )


def fetch(tree):
    """A replicated array as a host array; every process holds a full copy."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def train(
    name: str,
    make_tx: Callable[[], optax.GradientTransformation],
    data,
    config: Config,
    mesh: jax.sharding.Mesh,
    progress: bool = True,
) -> Result:
    x_train, y_train, x_test, y_test = data
    devices = mesh.size
    rng = np.random.default_rng(config.seed)
    params = init_mlp(rng, config.sizes)
    tx = optax.chain(make_tx(), optax.adam(config.learning_rate))
    state_specs = qto.partition_specs(jax.eval_shape(tx.init, params), AXIS)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, AXIS))
    params = put(params, replicated)
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
    batches = _batches(len(x_train), config, rng, devices)
    k = min(config.steps_per_call, config.steps)
    xs = put(x_train[batches[:k]], split)
    ys = put(y_train[batches[:k]], split)
    run_chunk = run_chunk.lower(params, state, xs, ys).compile()
    # The bytes of one step: the scan's body is compiled once, as a loop, so each of
    # its collectives is listed once.
    found = qt.hlo.collectives(run_chunk)
    losses = []
    start = time.perf_counter()
    bar = tqdm(
        range(0, config.steps, k), desc=f"{name:>12}", disable=not progress, leave=False
    )
    for first in bar:
        idx = batches[first : first + k]
        if len(idx) < k:
            break
        xs = put(x_train[idx], split)
        ys = put(y_train[idx], split)
        params, state, chunk_losses = run_chunk(params, state, xs, ys)
        chunk_losses = multihost_utils.process_allgather(chunk_losses, tiled=True)
        losses.append(np.asarray(chunk_losses).reshape(devices, k).mean(0))
        bar.set_postfix(loss=f"{float(losses[-1][-1]):.3f}")
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    final = fetch(params)
    acc = accuracy(final, x_test, y_test)
    return Result(name, acc, found, seconds, np.concatenate(losses), final)


def make_mesh(devices: int = DEVICES) -> jax.sharding.Mesh:
    """A mesh over the first `devices` devices of the cluster (every process's
    devices when `jax.distributed` is initialised, process by process)."""
    if len(jax.devices()) < devices:
        raise RuntimeError(
            f"Found {len(jax.devices())} devices; this example needs {devices}. JAX was "
            f"started before `XLA_FLAGS={_DEVICE_FLAG}` could be set: run the example "
            "as a script, or set the flag yourself."
        )
    return jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])


# ---------------------------------------------------------------------------------
# Reporting


def _fmt_bytes(n: float) -> str:
    return f"{n:,.0f}"


def table(results: list[Result], devices: int = DEVICES) -> list[str]:
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
            f"{ratio:.1f}x | {_fmt_bytes(r.received_per_device(devices))} | {kinds} | "
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


def build_parser() -> argparse.ArgumentParser:
    # The description is the docstring's first paragraph: its first sentence.
    description = " ".join(__doc__.split("\n\n")[0].split())
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small network (64 -> 64 -> 10) for 20 steps, written to "
        "examples/results/quick/ (git-ignored)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps of every method (default: 300, or 20 with --quick)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the initial weights and the batch order (the train/test split "
        "is fixed; default: 0)",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        help="Markdown table to write; the plot goes next to it as .png (default: "
        "examples/results/data_parallel.md, or "
        "examples/results/quick/data_parallel.md with --quick)",
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated subset of the methods to run (default: all)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar while training"
    )
    parser.add_argument(
        "--save-params",
        type=pathlib.Path,
        default=None,
        help="write every method's final parameters to this .npz file",
    )
    cluster = parser.add_argument_group("several processes")
    cluster.add_argument(
        "--devices", type=int, default=DEVICES, help="host devices per process"
    )
    cluster.add_argument(
        "--processes", type=int, default=1, help="processes in the JAX cluster"
    )
    cluster.add_argument(
        "--process-id",
        type=int,
        default=None,
        help="this process's index; without it, all processes start on this machine",
    )
    cluster.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of process 0's coordinator (with --process-id)",
    )
    cluster.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds before the processes started here are stopped",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.devices < 1 or args.processes < 1:
        parser.error("--devices and --processes must be at least 1")
    if args.process_id is not None:
        if not 0 <= args.process_id < args.processes:
            parser.error("--process-id must be in [0, --processes)")
        if args.coordinator is None:
            parser.error("--process-id needs --coordinator HOST:PORT")
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


# ---------------------------------------------------------------------------------
# Several processes


def free_port() -> int:
    """A TCP port of the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(devices: int) -> dict[str, str]:
    """This environment with `devices` host devices, whatever XLA_FLAGS said."""
    env = dict(os.environ)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(
        [*flags, f"--xla_force_host_platform_device_count={devices}"]
    )
    return env


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    """Starts the `--processes` workers on this machine, joined over 127.0.0.1, and
    waits for all of them; stops every worker if one fails or time runs out."""
    coordinator = f"127.0.0.1:{free_port()}"
    workers: list[subprocess.Popen] = []
    # A terminated launcher stops its workers too (`finally` runs on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deadline = time.monotonic() + args.timeout
    try:
        for i in range(args.processes):
            command = [sys.executable, __file__, *argv]
            command += ["--process-id", str(i), "--coordinator", coordinator]
            workers.append(subprocess.Popen(command, env=worker_env(args.devices)))
        while True:
            codes = [w.poll() for w in workers]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                raise SystemExit(f"Worker {failed[0][0]} exited with {failed[0][1]}.")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"The workers took longer than {args.timeout:.0f} s.")
            time.sleep(0.1)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(timeout=30)


def join_cluster(args: argparse.Namespace) -> None:
    """Joins this process to the JAX cluster. On a loopback coordinator it listens
    on loopback only; elsewhere on every interface (JAX's default)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    host = args.coordinator.rsplit(":", 1)[0]
    loopback = host in ("127.0.0.1", "localhost")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.processes,
        process_id=args.process_id,
        coordinator_bind_address=args.coordinator if loopback else None,
    )


def _without_cluster_options(argv: list[str]) -> list[str]:
    """The command line as the user gave it, without what `launch` adds."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--process-id", "--coordinator"):
            skip = True
        elif not arg.startswith(("--process-id=", "--coordinator=")):
            out.append(arg)
    return out


def save_params(path: pathlib.Path, results: list[Result]) -> None:
    arrays = {
        f"{r.method}/{i}/{name}": value
        for r in results
        for i, layer in enumerate(r.params or [])
        for name, value in layer.items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


# ---------------------------------------------------------------------------------
# Main


def main(argv: list[str] | None = None) -> list[Result]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.processes > 1 and args.process_id is None:
        launch(args, argv)
        return []
    if args.processes > 1:
        join_cluster(args)
    lead = jax.process_index() == 0
    config = config_from(args)
    devices = args.processes * args.devices
    mesh = make_mesh(devices)
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
        progress = lead and not args.no_progress
        result = train(name, make_tx, data, config, mesh, progress=progress)
        results.append(result)
        if lead:
            print(
                f"{name:>12}: test accuracy {100 * result.accuracy:.1f}%, "
                f"{result.bytes_per_step:,} bytes per step, {result.seconds:.1f} s",
                flush=True,
            )
    if not lead:
        return results
    if args.save_params is not None:
        save_params(args.save_params, results)
    command = "python examples/data_parallel.py " + shlex.join(
        _without_cluster_options(argv)
    )
    sizes = " -> ".join(map(str, config.sizes))
    where = f"{devices} host CPU devices"
    if args.processes > 1:
        where += f" in {args.processes} processes"
    header = [
        "# Data-parallel digits MLP with compressed gradient all-reduce",
        "",
        f"Produced by `{command.strip()}`: MLP {sizes} (ReLU), {where}, "
        f"{config.batch_per_device} examples per device per step, "
        f"{config.steps} steps of Adam (lr {config.learning_rate}), seed "
        f"{config.seed}. Bytes are the operands of one step's collectives in the "
        "compiled program (what one device contributes); the model column is what "
        "one device receives with a ring all-reduce or an all-gather.",
        "",
    ]
    lines = table(results, devices)
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(header + lines) + "\n")
    plot(results, args.out.with_suffix(".png"), f"digits MLP {sizes}, {where}")
    print(f"Wrote {args.out} and {args.out.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
