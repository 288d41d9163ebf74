"""Data parallel on an 8-chip slice: the bytes each chip receives per step, and the
memory per chip, for BF16 Adam and `qto.galore`, under `jax.jit` and inside
`jax.shard_map`.

The step is `bench_scale.py`'s (its models, arms and microbatches of `MICROBATCH`
sequences of `SEQ` tokens per chip), with the weights and the optimiser state
replicated on every chip and the batch split over the chips. Four ways to write it:

- `adam, jit`: `bench_scale.make_step`'s Adam step under `jax.jit`, the batch
    sharded; the partitioner all-reduces the gradients where it places them;
- `adam, shard_map`: the same inside `jax.shard_map`, written as one writes data
    parallel by hand: each chip's own gradient (`qt.device_varying` on the weights),
    added up over its microbatches, then one `lax.pmean` per step;
- `galore, jit`: `qto.galore`'s plain step (`opt.value_and_grad(loss,
    microbatches=k)`) under `jax.jit`, the batch sharded;
- `galore, shard_map`: the same inside `jax.shard_map` with
    `opt.value_and_grad(loss, microbatches=k, axis_name="data")`.

Per arm: the compiled step's memory per chip (argument + output - alias + temp, as
`bench_scale.py`), and the bytes one chip receives per step, summed over the
compiled program's collectives (`qt.hlo.collectives`, `qt.hlo.received_bytes`): on a
step that keeps the projectors (every switch on its branch 0, the loop over passes
counted as one trip per microbatch) and on a refresh step (three passes; inside
`shard_map`, the passes' own collectives once and the range finder's two steps'
all-reduces of each matrix's sum, read from the branches a keep step skips). Each
step is compiled ahead of time for the slice, never run.

    python benchmarks/bench_data_parallel.py --target tpu-v5e --models 1B
    python benchmarks/bench_data_parallel.py --models 1B   # 8 host CPU devices
    python benchmarks/bench_data_parallel.py --quick       # 60M, 8 host CPU devices

A TPU target needs libtpu (`pip install "jax[tpu]"`); one process can hold it at a
time. Writes `benchmarks/results/bench_data_parallel-<target>.md` (a quick run's to
`results/quick/`), or to `--out`.
"""

import os
import sys

from _targets import TARGETS, is_tpu_target, target_devices


DEVICES = 8
if not is_tpu_target(sys.argv):
    # The CPU target: 8 host devices, asked for before JAX starts.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={DEVICES}"
    )
# `bench_scale` turns a CPU compiler pass off unless this is set; the figures here
# keep every compiler's defaults.
os.environ["BENCH_SCALE_HOIST"] = "1"

# ruff: noqa: E402
import argparse
import functools
import time
import warnings

import bench_scale as bs
import jax
import jax.numpy as jnp
import optax
from _llama import MODELS, loss
from _report import add_out_argument, environment, produced_by, write_results
from jax.sharding import NamedSharding, PartitionSpec as P

import quax_tangents as qt


ARMS = ("adam, jit", "adam, shard_map", "galore, jit", "galore, shard_map")
# Passes over the microbatches on a refresh step (`qto.galore`'s default `iters=0`).
REFRESH_PASSES = 3
GIB = 2**30


def _adam_by_hand(config, tx):
    """Adam's data-parallel step inside `shard_map`: each chip's gradient summed
    over its microbatches, one mean over the chips."""
    loss_fn = functools.partial(loss, config)

    def step(params, state, tokens):
        local = qt.device_varying(params, "data")

        def body(carry, batch):
            total, acc = carry
            value, grads = jax.value_and_grad(loss_fn)(local, batch)
            return (total + value, jax.tree.map(jnp.add, acc, grads)), None

        zeros = qt.device_varying(jax.tree.map(jnp.zeros_like, params), "data")
        start = (qt.device_varying(jnp.zeros([]), "data"), zeros)
        (total, acc), _ = jax.lax.scan(body, start, tokens)
        count = tokens.shape[0]
        grads = jax.lax.pmean(
            jax.tree.map(lambda g: (g / count).astype(g.dtype), acc), "data"
        )
        updates, state = tx.update(grads, state, params)
        value = jax.lax.pmean(total / count, "data")
        return optax.apply_updates(params, updates), state, value

    return step


def _galore_in_shard_map(config):
    opt = bs.pipeline(config, "projected-8bit")
    loss_fn = functools.partial(loss, config)

    def step(params, state, tokens):
        batch = tokens.reshape(-1, tokens.shape[-1])
        value, grads = opt.value_and_grad(
            loss_fn, microbatches=tokens.shape[0], axis_name="data"
        )(params, state, batch)
        updates, state = opt.update(grads, state, params)
        return opt.apply(params, updates), state, value

    return step


def make_step(config, arm: str, mesh):
    """The arm's step and the jit arguments that place it on `mesh`."""
    replicated = NamedSharding(mesh, P())
    split = P(None, "data", None)  # (microbatches, batch, seq + 1)
    optimiser = "adam" if arm.startswith("adam") else "projected-8bit"
    if arm.endswith("jit"):
        step = bs.make_step(config, optimiser)
        batch = NamedSharding(mesh, split)
        return step, {
            "in_shardings": (replicated, replicated, batch),
            "out_shardings": (replicated, replicated, replicated),
        }
    body = (
        _adam_by_hand(config, bs.transformation(config, "adam"))
        if optimiser == "adam"
        else _galore_in_shard_map(config)
    )
    step = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), split), out_specs=(P(), P(), P())
    )
    return step, {}


def measure(config, arm: str, mesh, accumulation: int) -> dict:
    optimiser = "adam" if arm.startswith("adam") else "projected-8bit"
    params, state, tokens = bs._abstract_inputs(
        config, optimiser, bs.MICROBATCH * DEVICES, accumulation, bs.SEQ
    )
    step, placement = make_step(config, arm, mesh)
    start = time.perf_counter()
    with qt.fallback("silent"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers")
        compiled = (
            jax.jit(step, donate_argnums=(0, 1), **placement)
            .lower(params, state, tokens)
            .compile()
        )
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    total = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )

    def received(trips: int, branch: int | None = 0) -> float:
        found = qt.hlo.collectives(compiled, unknown_trips=trips, branch=branch)
        return sum(qt.hlo.received_bytes(c, DEVICES) for c in found)

    keep = received(accumulation)
    if optimiser == "adam":
        refresh = keep
    elif arm.endswith("jit"):
        # The partitioner's all-reduces run in every pass, per microbatch.
        refresh = received(REFRESH_PASSES * accumulation)
    else:
        # Inside `shard_map` the passes all-reduce nothing; each of the range
        # finder's steps (after every pass but the last: once per trip, on its last
        # microbatch) all-reduces each matrix's sum once, in the branches that a
        # step keeping the projectors skips.
        range_finder_step = received(1, branch=None) - received(1)
        refresh = keep + (REFRESH_PASSES - 1) * range_finder_step
    return {
        "gib": total / GIB,
        "temp": memory.temp_size_in_bytes / GIB,
        "keep": keep / GIB,
        "refresh": refresh / GIB,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["1B"])
    parser.add_argument("--accumulation", type=int, default=bs.ACCUMULATION)
    parser.add_argument("--quick", action="store_true", help="60M, 8 host CPUs")
    add_out_argument(parser, __file__)
    args = parser.parse_args()
    target = "cpu" if args.quick else args.target
    models = ["60M"] if args.quick else args.models
    chips = target_devices(target, DEVICES)
    if len(chips) < DEVICES:
        raise SystemExit(f"needs {DEVICES} devices, found {len(chips)}")
    mesh = jax.make_mesh(
        (DEVICES,),
        ("data",),
        devices=chips[:DEVICES],
        axis_types=(jax.sharding.AxisType.Auto,),
    )
    rows = []
    for model in models:
        figures = {}
        for arm in ARMS:
            f = measure(MODELS[model], arm, mesh, args.accumulation)
            figures[arm] = f
            print(
                f"{model} {arm}: {f['gib']:.2f} GiB per chip, receives "
                f"{f['keep']:.2f} GiB per step ({f['refresh']:.2f} on a refresh), "
                f"compiled in {f['seconds']:.0f} s",
                flush=True,
            )
        best_adam = min(figures[a]["keep"] for a in ARMS if a.startswith("adam"))
        for arm, f in figures.items():
            rows.append(
                f"| {model} | `{arm}` | {f['gib']:.2f} | {f['temp']:.2f} | "
                f"{f['keep']:.2f} | {f['keep'] / best_adam:.2f} | "
                f"{f['refresh']:.2f} | {f['seconds']:.0f} |"
            )
    backend = f"{target} ({chips[0].device_kind}), {DEVICES} devices" + (
        "" if target == "cpu" else ", compiled ahead of time, no TPU attached"
    )
    packages = ("jax", "jaxlib", "optax") + (() if target == "cpu" else ("libtpu",))
    lines = [
        *produced_by(f"Data parallel on {DEVICES} chips, {target}"),
        *environment(packages, backend),
        "",
        f"The step of `bench_scale.py` with {args.accumulation} microbatches of "
        f"{bs.MICROBATCH} sequences of {bs.SEQ} tokens per chip, weights and state "
        "replicated, the batch split over the chips; arms as in the script's "
        "docstring. *GiB*: per chip, argument + output - alias + temp. *Receives*: "
        "GiB one chip receives per step, on a step that keeps the projectors, and "
        f"on a refresh step ({REFRESH_PASSES} passes). *÷ best Adam*: of the fewer "
        "of the two Adam arms' bytes. *Compile s*: `lower` and `compile`, wall "
        "time on this machine.",
        "",
        "| model | arm | GiB per chip | temp | receives per step | ÷ best Adam "
        "| on a refresh step | compile s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    write_results(lines, args.out, __file__, args.quick, target)


if __name__ == "__main__":
    main()
