"""Compressed gradient all-reduce: bytes on the wire and accuracy of data-parallel
training, against the targets of the collective work.

Run it with

    python benchmarks/bench_collective.py

(about ten minutes on two CPU cores; `--quick` for a smoke run, whose results go to
`benchmarks/results/quick/`, which git ignores; `--step-times-only` measures only the
two-phase step times against dense, `--runs` times, into
`benchmarks/results/bench_collective_step_times.md`). It writes
`benchmarks/results/bench_collective.md` and `bench_collective.png`. It trains the MLP of
`examples/data_parallel.py` on 8 host CPU devices with every method of that example,
then checks:

- rank-4 PowerSGD moves at least 50x fewer bytes per step than the dense all-reduce;
- each PowerSGD round moves exactly `r * (m + n) * itemsize` bytes per matrix: the
  operands of the compiled all-reduces are one with every `(m, r)` factor P
  concatenated, one with every `(n, r)` factor Q, and one with the dense biases (on
  the example MLP; `powersgd` batches its communication), and on single matrices
  through `quax_tangents.all_reduce(..., PowerSum(iters))` one `(m, r)` and one
  `(n, r)` per round, in float32 and bfloat16;
- rank-4 PowerSGD's test accuracy is within 1 point of dense training (mean over
  seeds);
- the two-phase all-reduce (`qto.compress_updates(..., method=qt.TwoPhase())`) of int8 and sign
  gradients receives at most `2.2 * dense_bytes / compression_ratio` bytes per
  device per step (int8: >= 1.8x fewer than the dense ring all-reduce; sign: >= 14x
  fewer), and its step takes at most 1.5x the dense step's wall time (measured side
  by side, alternating, in this process).

It also sweeps the device count (2, 4, 8): the bytes one device receives per step for
dense and every method, from compiled programs only (nothing is run, so the sweep
takes a minute or two of compilation).

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
import functools as ft
import importlib.util
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _report import RESULTS, ROOT, default_out, environment, produced_by
from jax.sharding import NamedSharding, PartitionSpec as P

import quax_tangents as qt
import quax_tangents.optax as qto


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
TWO_PHASE_SLACK = 2.2
TWO_PHASE_FEWER = {"int8-two-phase": 1.8, "sign-ef-two-phase": 14.0}
TARGET_TIME_RATIO = 1.5
SWEEP_DEVICES = (2, 4, 8)
# Where `--step-times-only` writes its report.
STEP_TIMES_OUT = RESULTS / "bench_collective_step_times.md"


def two_phase_methods() -> dict:
    """The two-phase variants of the example's int8 and sign methods."""
    axis = example.AXIS
    return {
        "int8-two-phase": lambda: qto.compress_updates(
            ft.partial(qt.quantize, bits=8),
            error_feedback=None,
            axis_name=axis,
            method=qt.TwoPhase(),
        ),
        "sign-ef-two-phase": lambda: qto.compress_updates(
            qt.sign_norm,
            error_feedback=qto.ErrorFeedback(),
            axis_name=axis,
            method=qt.TwoPhase(),
        ),
    }


def all_methods() -> dict:
    return {**example.methods(), **two_phase_methods()}


# The compressor of each compressing method, for its compression ratio.
COMPRESSORS = {
    "int8-two-phase": ft.partial(qt.quantize, bits=8),
    "sign-ef-two-phase": qt.sign_norm,
}


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
            ("dense", "powersgd-r1", "powersgd-r4", *two_phase_methods()),
            True,
        )
    return Plan(example.Config(), (0, 1, 2), tuple(all_methods()), False)


# ---------------------------------------------------------------------------------
# Bytes per matrix per round


def expected_powersgd_operands(
    sizes: tuple[int, ...], rank: int, rate: float = 2.0
) -> collections.Counter:
    """The multiset of all-reduce operand shapes one PowerSGD step (one power round)
    of the example MLP must have. `powersgd` batches its communication: every `(m, r)`
    factor P goes in one all-reduce, every `(n, r)` factor Q in another, and every
    dense leaf (biases, and matrices that compression would not pay for) in a third,
    each flattened and concatenated; a group of one array keeps its own shape."""
    groups: dict[str, list[tuple[int, ...]]] = {"p": [], "q": [], "dense": []}
    for m, n in zip(sizes[:-1], sizes[1:]):
        if rank <= min(m, n) and m * n >= rate * rank * (m + n):
            groups["p"].append((m, rank))
            groups["q"].append((n, rank))
        else:
            groups["dense"].append((m, n))
        groups["dense"].append((n,))
    shapes: collections.Counter = collections.Counter()
    for group in groups.values():
        if len(group) == 1:
            shapes[f"f32[{','.join(map(str, group[0]))}]"] += 1
        elif group:
            shapes[f"f32[{sum(math.prod(shape) for shape in group)}]"] += 1
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
        reduced(qt.hlo.collectives(lowered)),
        reduced(qt.hlo.collectives(lowered.compile())),
        iters * rank * (m + n) * jnp.dtype(dtype).itemsize,
    )


# ---------------------------------------------------------------------------------
# Bytes received, step times and the device-count sweep


def received(found: list[qt.hlo.Collective], devices: int) -> float:
    """Bytes one device receives for these collectives (`qt.hlo.received_bytes`)."""
    return sum(qt.hlo.received_bytes(c, devices) for c in found)


def compression_ratio(name: str, sizes: tuple[int, ...]) -> float:
    """Dense bytes over compressed bytes of the weight gradients `name` compresses."""
    shapes = list(zip(sizes[:-1], sizes[1:]))
    dense = sum(4 * m * n for m, n in shapes)
    compressed = sum(
        jax.eval_shape(
            COMPRESSORS[name], jax.ShapeDtypeStruct((m, n), jnp.float32)
        ).nbytes
        for m, n in shapes
    )
    return dense / compressed


def chunk_runner(make_tx, data, config, mesh):
    """A function that runs one compiled call of `config.steps_per_call` training
    steps of the example (the same batches every time) and returns its seconds."""
    axis = example.AXIS
    x_train, y_train, _, _ = data
    rng = np.random.default_rng(config.seed)
    params = example.init_mlp(rng, config.sizes)
    tx = optax.chain(make_tx(), optax.adam(config.learning_rate))
    state_specs = qto.partition_specs(jax.eval_shape(tx.init, params), axis)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_specs)
    state = jax.jit(init)(params)
    step = example.make_step(tx)

    def chunk(params, state, xs, ys):
        def body(carry, batch):
            params, state, loss_value = step(*carry, *batch)
            return (params, state), loss_value

        (params, state), losses = jax.lax.scan(body, (params, state), (xs, ys))
        return params, state, losses

    specs = (P(), state_specs, P(None, axis), P(None, axis))
    run = jax.jit(
        jax.shard_map(
            chunk, mesh=mesh, in_specs=specs, out_specs=specs[:2] + (P(axis),)
        )
    )
    idx = example._batches(len(x_train), config, rng, example.DEVICES)[
        : config.steps_per_call
    ]
    split = NamedSharding(mesh, P(None, axis))
    xs, ys = jax.device_put(x_train[idx], split), jax.device_put(y_train[idx], split)
    compiled = run.lower(params, state, xs, ys).compile()
    carry = [params, state]

    def once() -> float:
        start = time.perf_counter()
        out = compiled(carry[0], carry[1], xs, ys)
        jax.block_until_ready(out)
        carry[:] = out[:2]
        return time.perf_counter() - start

    return once


def step_time_ratios(names, data, config, mesh, repeats: int) -> dict[str, float]:
    """The median over `repeats` rounds of each method's time for one call of training
    steps over dense's in the same round; the methods alternate within a round."""
    factories = all_methods()
    runners = {n: chunk_runner(factories[n], data, config, mesh) for n in names}
    for once in runners.values():
        once()  # warm up
    ratios = collections.defaultdict(list)
    for _ in range(repeats):
        times = {n: once() for n, once in runners.items()}
        for n in names:
            ratios[n].append(times[n] / times["dense"])
    return {n: float(np.median(r)) for n, r in ratios.items()}


def sweep_received(make_tx, sizes: tuple[int, ...], devices: int) -> float:
    """Bytes one device receives per step when `make_tx` combines the example MLP's
    gradients over `devices` devices, from the compiled update (nothing runs)."""
    axis = example.AXIS
    mesh = jax.make_mesh((devices,), (axis,), devices=jax.devices()[:devices])
    shapes = jax.tree.map(np.shape, example.init_mlp(np.random.default_rng(0), sizes))
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    grads = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(
            (devices, *s), jnp.float32, sharding=NamedSharding(mesh, P(axis))
        ),
        shapes,
        is_leaf=is_shape,
    )

    def body(grads):
        tx = make_tx()
        params = jax.tree.map(lambda s: jnp.zeros(s), shapes, is_leaf=is_shape)
        state = tx.init(params)
        updates, _ = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
        return updates

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P()))
    return received(qt.hlo.collectives(step.lower(grads).compile()), devices)


def sweep(names, sizes) -> list[str]:
    factories = all_methods()
    rows = []
    for name in names:
        cells = [sweep_received(factories[name], sizes, n) for n in SWEEP_DEVICES]
        rows.append(f"| {name} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |")
    return rows


# ---------------------------------------------------------------------------------
# Report


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def table(results, devices: int) -> list[str]:
    dense = next(r for r in results if r.method == "dense")
    dense_received = received(dense.collectives, devices)
    lines = [
        "| method | test accuracy | bytes per step (operands) | bytes received per "
        "device | ÷ dense (received) | collectives | wall time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        counts = collections.Counter(c.kind for c in r.collectives)
        kinds = ", ".join(f"{v}x {k}" for k, v in sorted(counts.items()))
        got = received(r.collectives, devices)
        lines.append(
            f"| {r.method} | {100 * r.accuracy:.1f}% | {r.bytes_per_step:,} | "
            f"{got:,.0f} | {dense_received / got:.1f}x | {kinds} | {r.seconds:.1f} |"
        )
    return lines


def run(quick: bool, out: pathlib.Path, progress: bool) -> str:
    load_at_start = os.getloadavg()
    started = time.perf_counter()
    setup = plan(quick)
    mesh = example.make_mesh()
    data = example.load_data()
    factories = all_methods()
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

    # The two-phase targets: bytes received per device, and step time against dense
    # measured side by side.
    devices = example.DEVICES
    dense_bytes = 4 * sum(
        m * n + n for m, n in zip(config.sizes[:-1], config.sizes[1:])
    )
    dense_received = received(dense.collectives, devices)
    time_ratios = step_time_ratios(
        ["dense", *TWO_PHASE_FEWER], data, config, mesh, repeats=3 if quick else 15
    )
    two_phase_rows = []
    for name, fewer in TWO_PHASE_FEWER.items():
        got = received(by_name[name].collectives, devices)
        bound = TWO_PHASE_SLACK * dense_bytes / compression_ratio(name, config.sizes)
        times = time_ratios[name]
        two_phase_rows += [
            f"| {name}: received <= {TWO_PHASE_SLACK} x dense bytes / compression "
            f"ratio | {got:,.0f} <= {bound:,.0f} | {_verdict(got <= bound)} |",
            f"| {name}: >= {fewer:g}x fewer bytes received than the dense ring "
            f"all-reduce | {dense_received:,.0f} / {got:,.0f} = "
            f"{dense_received / got:.2f}x | {_verdict(dense_received / got >= fewer)} |",
            f"| {name}: step wall time <= {TARGET_TIME_RATIO} x dense (median ratio, "
            f"side by side) | {times:.2f}x | {_verdict(times <= TARGET_TIME_RATIO)} |",
        ]
    # A quick run sweeps only what it adds to the example's methods.
    sweep_names = ("dense", *(n for n in setup.methods if n != "dense"))
    if quick:
        sweep_names = ("dense", *two_phase_methods())
    sweep_rows = sweep(sweep_names, config.sizes)

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
        "step (what one device puts in). Bytes received per device follow "
        "`quax_tangents.hlo.received_bytes`: an all-gather or all-to-all receives "
        "`(n-1)/n` of its result, a reduce-scatter `(n-1)` times its result, a ring "
        "all-reduce `2(n-1)/n` of its operand. Wall time is the training loop "
        "after compilation, each method at its own time; host devices share two "
        "cores and memory, so communication is nearly free here and the "
        "compressors' extra compute shows as extra time (the step-time target below "
        "is measured side by side instead). Accuracy is on the test set after the "
        "last step, seed 0. The `-two-phase` rows use `qto.compress_updates(..., "
        "method=qt.TwoPhase())`: an `all_to_all` of compressed chunks, then an all-gather "
        "of the compressed chunks of the sum (with error feedback for sign, on both "
        "sides); the others use the example's methods (gather-based for top-k, int8 "
        "and sign).",
        "",
        *table(results, devices),
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
        *two_phase_rows,
        "",
        f"Dense bytes: {dense_bytes:,} (every float32 gradient of the MLP). The step "
        "time ratio is the median over rounds, each running one compiled call of "
        f"{config.steps_per_call} steps of dense and of each two-phase method in "
        "turn, of the method's time over dense's.",
        "",
        "## Device-count sweep",
        "",
        "Bytes one device receives per step when each method combines the gradients "
        f"of the MLP {sizes} over 2, 4 and 8 devices, read from the compiled update "
        "(`tx.update` inside `shard_map`; no training runs, so this section is "
        "bytes only). Gather-based methods grow with the device count; the dense "
        "ring all-reduce, PowerSGD and the two-phase methods stay about flat.",
        "",
        "| method | " + " | ".join(f"{n} devices" for n in SWEEP_DEVICES) + " |",
        "|---|" + "---|" * len(SWEEP_DEVICES),
        *sweep_rows,
        "",
        "### All-reduce operands of one PowerSGD step of the example MLP",
        "",
        "Expected: `powersgd` batches its communication, so one operand holds every "
        "weight matrix's `(m, r)` factor P (flattened and concatenated), one every "
        "`(n, r)` factor Q, and one every dense leaf (the biases, and a matrix whose "
        "`m n < 2 r (m + n)`, the default `min_compression_rate`); a group of one "
        "array keeps its shape. XLA may combine several into one all-reduce; the "
        "operands are counted one by one.",
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
    return _publish(out, lines)


def _publish(out: pathlib.Path, lines: list[str]) -> str:
    """Writes the report to `out`, prints it and returns it."""
    text = "\n".join(lines)
    out.write_text(text)
    print(text)
    return text


def run_step_times(quick: bool, out: pathlib.Path, runs: int) -> str:
    """Only the two-phase step-time targets: `runs` independent measurements (each
    the median over rounds of `step_time_ratios`) of the int8 and sign two-phase
    steps against the dense step, with their median and spread."""
    load_at_start = os.getloadavg()
    started = time.perf_counter()
    setup = plan(quick)
    mesh, data = example.make_mesh(), example.load_data()
    names = ["dense", *TWO_PHASE_FEWER]
    measured = collections.defaultdict(list)
    for run_index in range(runs):
        ratios = step_time_ratios(
            names, data, setup.config, mesh, repeats=3 if quick else 15
        )
        for name in TWO_PHASE_FEWER:
            measured[name].append(ratios[name])
        print(f"run {run_index + 1}: {ratios}", flush=True)
    rows = [
        f"| {name}: step wall time <= {TARGET_TIME_RATIO} x dense | "
        + ", ".join(f"{r:.2f}x" for r in ratios)
        + f" | {np.median(ratios):.2f}x | {min(ratios):.2f} - {max(ratios):.2f} | "
        f"{_verdict(np.median(ratios) <= TARGET_TIME_RATIO)} |"
        for name, ratios in measured.items()
    ]
    elapsed = time.perf_counter() - started
    sizes = " -> ".join(map(str, setup.config.sizes))
    lines = [
        *produced_by("Two-phase all-reduce: step time against the dense step"),
        *environment(
            ("jax", "jaxlib", "quax", "optax", "quax-tangents"),
            f"{jax.default_backend()}, {len(jax.devices())} host devices",
            load_at_start,
        ),
        f"- {'quick (smoke) run' if quick else 'full run'}: MLP {sizes} (ReLU), "
        f"{example.DEVICES} host CPU devices, {setup.config.batch_per_device} "
        f"examples per device per step; {runs} runs; total wall time {elapsed:.0f} s.",
        "",
        "Each run compiles one call of "
        f"{setup.config.steps_per_call} training steps for dense and for each "
        "two-phase method, then times the calls in turn, round after round; a run's "
        "ratio is the median over its rounds of the method's time over dense's in "
        "the same round. The verdict is on the median of the runs.",
        "",
        "| target | ratio of each run | median | spread (min - max) | verdict |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    return _publish(out, lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # The description is the docstring's first paragraph: its first sentence.
    description = " ".join(__doc__.split("\n\n")[0].split())
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        help="Markdown report; the plot goes next to it as .png (default: "
        f"{default_out(__file__, False)}, or {default_out(__file__, True)} with "
        "--quick)",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--step-times-only",
        action="store_true",
        help="measure only the step time of the int8 and sign two-phase steps "
        "against the dense step, --runs times (minutes instead of the full run's "
        "quarter of an hour); the report goes to --out (default: "
        f"{STEP_TIMES_OUT}, or its quick/ twin with --quick)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=3,
        help="independent measurements for --step-times-only (default 3)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.step_times_only:
        default = STEP_TIMES_OUT
        if args.quick:
            default = default.parent / "quick" / default.name
        out = args.out or default
        out.parent.mkdir(parents=True, exist_ok=True)
        run_step_times(args.quick, out, args.runs)
        return
    out = args.out or default_out(__file__, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    run(args.quick, out, progress=not args.no_progress)


if __name__ == "__main__":
    main()
