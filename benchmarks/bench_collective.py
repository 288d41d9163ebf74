"""Compressed gradient all-reduce: bytes on the wire and accuracy of data-parallel
training, against the targets of the collective work.

Run it with

    python benchmarks/bench_collective.py

(about ten minutes on two CPU cores; `--quick` for a smoke run, whose results go to
`benchmarks/results/quick/`, which git ignores). It writes
`benchmarks/results/bench_collective.md` and `bench_collective.png`. It trains the MLP of
`examples/data_parallel.py` on 8 host CPU devices with every method of that example,
then checks:

- rank-4 PowerSGD moves at least 50x fewer bytes per step than the dense all-reduce;
- each PowerSGD round moves exactly `r * (m + n) * itemsize` bytes per matrix: the
  operands of the compiled all-reduces are, shape for shape, one `(m, r)` and one
  `(n, r)` per compressed matrix and round, plus the dense biases (on the example
  MLP, and on single matrices through `quax_tangents.all_reduce(..., PowerSum(iters))`
  in float32 and bfloat16);
- rank-4 PowerSGD's test accuracy is within 1 point of dense training (mean over
  seeds).

Bytes are read from the compiled programs, so they are deterministic; wall times on a
shared machine are not, and are reported only as measured.
"""

# JAX reads XLA_FLAGS when it first starts its CPU backend, so the device count is
# set before anything imports JAX.
# ruff: noqa: E402

import os


_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}"

import argparse
import collections
import dataclasses
import importlib.util
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from _report import ROOT, default_out, environment, produced_by
from jax.sharding import NamedSharding, PartitionSpec as P

import quax_tangents as qt


def _load_example():
    spec = importlib.util.spec_from_file_location(
        "data_parallel", ROOT / "examples" / "data_parallel.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()

TARGET_RATIO = 50.0
TARGET_POINTS = 1.0


@dataclasses.dataclass(frozen=True)
class Plan:
    config: object
    accuracy_seeds: tuple[int, ...]
    methods: tuple[str, ...]
    quick: bool


def plan(quick: bool) -> Plan:
    if quick:
        return Plan(
            example.Config(sizes=(64, 64, 10), steps=20, steps_per_call=10),
            (0,),
            ("dense", "powersgd-r1", "powersgd-r4"),
            True,
        )
    return Plan(example.Config(), (0, 1, 2), tuple(example.methods()), False)


# ---------------------------------------------------------------------------------
# Bytes per matrix per round


def expected_powersgd_operands(
    sizes: tuple[int, ...], rank: int, rate: float = 2.0
) -> collections.Counter:
    """The multiset of all-reduce operand shapes one PowerSGD step of the example MLP
    must have: `(m, r)` and `(n, r)` per compressed matrix, dense biases, and dense
    matrices that compression would not pay for (as `powersgd` decides)."""
    shapes: collections.Counter = collections.Counter()
    for m, n in zip(sizes[:-1], sizes[1:]):
        if rank <= min(m, n) and m * n >= rate * rank * (m + n):
            shapes[f"f32[{m},{rank}]"] += 1
            shapes[f"f32[{n},{rank}]"] += 1
        else:
            shapes[f"f32[{m},{n}]"] += 1
        shapes[f"f32[{n}]"] += 1
    return shapes


def single_matrix_bytes(
    m: int, n: int, rank: int, iters: int, dtype, mesh
) -> tuple[int, int, int]:
    """Bytes that `all_reduce(LowRank, PowerSum(iters))` on one `m x n` matrix of
    `dtype` all-reduces: in the program as lowered, as compiled, and analytically
    (`iters * r * (m + n) * itemsize`)."""
    axis = example.AXIS

    def body(left, right):
        value = qt.LowRank(left[0], right[0])
        out = qt.all_reduce(value, axis, qt.PowerSum(iters=iters))
        return out.left, out.right

    shard = NamedSharding(mesh, P(axis))
    devices = len(mesh.devices.flat)
    left = jax.ShapeDtypeStruct((devices, m, rank), dtype, sharding=shard)
    right = jax.ShapeDtypeStruct((devices, n, rank), dtype, sharding=shard)
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P()))
    lowered = step.lower(left, right)

    def reduced(found):
        return sum(c.operand_bytes for c in found if c.kind == "all-reduce")

    return (
        reduced(qt.collectives(lowered)),
        reduced(qt.collectives(lowered.compile())),
        iters * rank * (m + n) * jnp.dtype(dtype).itemsize,
    )


# ---------------------------------------------------------------------------------
# Report


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def run(quick: bool, out: pathlib.Path, progress: bool) -> str:
    load_at_start = os.getloadavg()
    started = time.perf_counter()
    setup = plan(quick)
    mesh = example.make_mesh()
    data = example.load_data()
    factories = example.methods()
    config = setup.config

    results = []
    for name in setup.methods:
        result = example.train(name, factories[name], data, config, mesh, progress)
        results.append(result)
        print(f"{name}: {100 * result.accuracy:.1f}%, {result.bytes_per_step:,} B")

    # Accuracy over several seeds for the accuracy target.
    seeds = {}
    for name in ("dense", "powersgd-r4"):
        accuracies = [next(r.accuracy for r in results if r.method == name)]
        for seed in setup.accuracy_seeds[1:]:
            seeded = dataclasses.replace(config, seed=seed)
            result = example.train(name, factories[name], data, seeded, mesh, progress)
            accuracies.append(result.accuracy)
            print(f"{name} seed {seed}: {100 * result.accuracy:.1f}%")
        seeds[name] = accuracies

    by_name = {r.method: r for r in results}
    dense, r4 = by_name["dense"], by_name["powersgd-r4"]
    ratio = dense.bytes_per_step / r4.bytes_per_step
    gap = 100 * (np.mean(seeds["dense"]) - np.mean(seeds["powersgd-r4"]))

    operand_rows = []
    operands_ok = True
    for name in ("powersgd-r1", "powersgd-r2", "powersgd-r4"):
        if name not in by_name:
            continue
        rank = int(name.rsplit("r", 1)[1])
        measured = collections.Counter(
            shape
            for c in by_name[name].collectives
            if c.kind == "all-reduce"
            for shape in c.operand_shapes
        )
        expected = expected_powersgd_operands(config.sizes, rank)
        ok = measured == expected and all(
            c.kind == "all-reduce" for c in by_name[name].collectives
        )
        operands_ok &= ok
        operand_rows.append(
            f"| {name} | {', '.join(f'{k} x{v}' for k, v in sorted(measured.items()))}"
            f" | {_verdict(ok)} |"
        )

    matrix_rows = []
    matrices = [(64, 1024, 4, 1), (1024, 1024, 4, 2), (1024, 10, 2, 1)]
    if quick:
        matrices = [(64, 32, 4, 1), (32, 16, 2, 2)]
    for m, n, rank, iters in matrices:
        for dtype in (jnp.float32, jnp.bfloat16):
            program, compiled, analytic = single_matrix_bytes(
                m, n, rank, iters, dtype, mesh
            )
            # XLA's CPU compiler runs bfloat16 all-reduces in float32: the compiled
            # bytes then are the float32 ones, twice the program's.
            promoted = analytic * 4 // jnp.dtype(dtype).itemsize
            ok = program == analytic and compiled in (analytic, promoted)
            operands_ok &= ok
            matrix_rows.append(
                f"| {m}x{n} | {rank} | {iters} | {jnp.dtype(dtype).name} | "
                f"{program:,} | {compiled:,} | {analytic:,} | {_verdict(ok)} |"
            )

    example.plot(results, out.with_suffix(".png"), "digits MLP, 8 host devices")
    elapsed = time.perf_counter() - started
    sizes = " -> ".join(map(str, config.sizes))
    seeds_text = ", ".join(map(str, setup.accuracy_seeds))
    lines = [
        *produced_by(
            "Compressed gradient all-reduce: bytes and accuracy of data-parallel "
            "training"
        ),
        *environment(
            ("jax", "jaxlib", "quax", "optax", "quax-tangents"),
            f"{jax.default_backend()}, {len(jax.devices())} host devices",
            load_at_start,
        ),
        f"- {'quick (smoke) run' if quick else 'full run'}: MLP {sizes} (ReLU) on "
        f"digits (1437 train / 360 test), {example.DEVICES} host CPU devices, "
        f"{config.batch_per_device} examples per device per step, {config.steps} "
        f"steps of Adam (lr {config.learning_rate}); total wall time {elapsed:.0f} s.",
        "",
        "Bytes per step are the operands of the collectives of one compiled training "
        "step (what one device puts in; the model column is what one device receives "
        "with a ring all-reduce or an all-gather). Wall time is the training loop "
        "after compilation; host devices share two cores and memory, so "
        "communication is nearly free here and the compressors' extra compute shows "
        "as extra time. Accuracy is on the test set after the last step, seed 0.",
        "",
        *example.table(results),
        "",
        f"![accuracy against bytes]({out.with_suffix('.png').name})",
        "",
        "## Targets",
        "",
        *(
            [
                "A quick run trains a small network for a few steps: the verdicts are "
                "computed as in the full run, but only the full run's configuration "
                "is the one the targets are about.",
                "",
            ]
            if quick
            else []
        ),
        "| target | measured | verdict |",
        "|---|---|---|",
        f"| rank-4 PowerSGD moves >= {TARGET_RATIO:.0f}x fewer bytes per step than "
        f"dense | {dense.bytes_per_step:,} / {r4.bytes_per_step:,} = {ratio:.1f}x | "
        f"{_verdict(ratio >= TARGET_RATIO)} |",
        "| bytes per matrix per round = r (m + n) itemsize | every all-reduce operand "
        "as predicted (tables below) | " + _verdict(operands_ok) + " |",
        f"| rank-4 test accuracy within {TARGET_POINTS:.0f} point of dense (mean over "
        f"seeds {seeds_text}) | dense "
        + ", ".join(f"{100 * a:.1f}" for a in seeds["dense"])
        + f" (mean {100 * np.mean(seeds['dense']):.2f}); rank 4 "
        + ", ".join(f"{100 * a:.1f}" for a in seeds["powersgd-r4"])
        + f" (mean {100 * np.mean(seeds['powersgd-r4']):.2f}); gap {gap:+.2f} points"
        f" | {_verdict(gap <= TARGET_POINTS)} |",
        "",
        "### All-reduce operands of one PowerSGD step of the example MLP",
        "",
        "Expected: per weight matrix `(m, n)` one `(m, r)` (P) and one `(n, r)` (Q); "
        "one dense operand per bias; a matrix whose `m n < 2 r (m + n)` stays dense "
        "(the default `min_compression_rate`). XLA may combine several into one "
        "all-reduce; the operands are counted one by one.",
        "",
        "| method | operand shapes (count) | as expected |",
        "|---|---|---|",
        *operand_rows,
        "",
        "### One matrix through `all_reduce(LowRank, PowerSum(iters))`",
        "",
        "The program column reads the HLO before XLA's optimisations (what the "
        "program asks to send), the compiled column the HLO that runs. XLA's CPU "
        "compiler promotes bfloat16 all-reduces to float32, so on these host devices "
        "a bfloat16 round moves the float32 bytes; the program sends bfloat16, as a "
        "backend with bfloat16 collectives would run it.",
        "",
        "| matrix | rank | rounds | dtype | program bytes | compiled bytes (CPU) | "
        "iters r (m + n) itemsize | verdict |",
        "|---|---|---|---|---|---|---|---|",
        *matrix_rows,
        "",
    ]
    text = "\n".join(lines)
    out.write_text(text)
    print(text)
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        help="Markdown report; the plot goes next to it as .png (default: "
        f"{default_out(__file__, False)}, or {default_out(__file__, True)} with "
        "--quick)",
    )
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out or default_out(__file__, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    run(args.quick, out, progress=not args.no_progress)


if __name__ == "__main__":
    main()
