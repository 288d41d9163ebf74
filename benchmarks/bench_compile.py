"""Where a training step's compile time goes, per optimiser: the phases of lowering
and compiling `bench_scale.py`'s step, read off the compiler's own trace events.

Each arm's step (`bench_scale.make_step`, donated, on abstract inputs) is lowered
(timed: JAX tracing the Python and emitting StableHLO) and compiled under
`jax.profiler`, and the compiler's events are summed by name. Per arm:

- *lower s*: tracing and lowering, in Python, on one core;
- *compile s*: the compiler's wall time;
- *HLO passes s*: the compiler's passes over the whole program, on one thread (on a
  TPU, *of which fusion* the main fusion pass);
- *kernels*: the fused kernels it generates code for, and *codegen s*, the seconds
  their code generation took summed over the threads that run it in parallel (so
  it can exceed the wall time);
- on a TPU, the kernels and codegen seconds of two parts of the step, told apart by
  the JAX operation each kernel came from: the *refresh* (the branches of a
  `lax.cond`, where the projectors are recomputed, their eigendecompositions
  included) and the *8-bit codes* (encoding and decoding the optimiser state).

A TPU target is compiled ahead of time with no TPU attached (`_targets.py`); `device`
compiles for the attached accelerator (on a TPU machine, that TPU). A TPU's
compiler generates each kernel's code on its own thread; the wall time is the HLO
passes plus the code generation spread over the host's cores.

    python benchmarks/bench_compile.py                          # CPU, 1B
    python benchmarks/bench_compile.py --target tpu-v5e         # ahead of time
    python benchmarks/bench_compile.py --target device          # attached TPU
    python benchmarks/bench_compile.py --quick                  # 60M, CPU
    python benchmarks/bench_compile.py --target device --pieces # and each piece

With `--pieces`, each arm's step is also compiled in three pieces, each a program of
its own (`bench_scale.step_pieces`): the gradients (`qto.accumulate_gradients` for
the projected arms, refresh included, as `GaLore.value_and_grad` runs it; the dense
ones for Adam), the optimiser's `update`, and the apply.
Each piece's ratio is to the first arm's whole step: where the step's compile time
goes, piece by piece.

Writes `results/bench_compile-<target>.md` (`-device-<platform>` for `device`; a
quick run's to `results/quick/`), or to `--out`.
"""

import os
import sys


# The CPU flags of `bench_scale.py`'s compile-time rows (it sets them when imported,
# and leaves a TPU target's compiler at its defaults); `device` is a TPU here.
if "device" in sys.argv[1:] or "--target=device" in sys.argv[1:]:
    os.environ["BENCH_SCALE_HOIST"] = "1"

# ruff: noqa: E402
import argparse
import collections
import glob
import re
import tempfile
import time
import warnings
from typing import Any

import bench_scale as bs
import jax
from _llama import MODELS
from _report import add_out_argument, environment, produced_by, write_results
from _targets import TARGETS, one_device, target_devices

import quax_tangents as qt


# The trace events each compiler names its phases with.
_HLO_PASSES = (
    "XLA::TPU run hlo passes",
    "HLO passes through layout assignment",
    "HLO passes after layout assignment",
)
_FUSION = "XLA::TPU main fusion pass"
_TPU_KERNEL = "XLA::TPU emitting for "
_CPU_KERNEL = "FusionCompiler::Compile"


def _part(op_name: str) -> str:
    """The part of the step a kernel came from, by its JAX operation's name."""
    if "_encode" in op_name or "_decode" in op_name:
        return "codes"
    if "cond/branch_" in op_name:
        return "refresh"
    return "rest"


def _op_names(hlo_text: str) -> dict[str, str]:
    """Each instruction's `op_name` metadata in a compiled module's text."""
    found = {}
    for line in hlo_text.splitlines():
        name = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        op = re.search(r'op_name="([^"]*)"', line)
        if name and op:
            found[name.group(1)] = op.group(1)
    return found


def _events(trace_dir: str) -> list[tuple[str, float]]:
    """`(name, seconds)` of every event of the trace written to `trace_dir`."""
    from jax.profiler import ProfileData

    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    data = ProfileData.from_file(path)
    return [
        (event.name, event.duration_ns / 1e9)
        for plane in data.planes
        for line in plane.lines
        for event in line.events
    ]


PIECES = ("gradients", "update", "apply")


def _program(config: Any, arm: str, piece: str, inputs: tuple) -> tuple:
    """`(function, arguments, donate_argnums)` of `piece` of the arm's step
    (`"step"`, or one of `PIECES`, as `bench_scale.step_pieces` makes them), on
    the step's abstract `inputs`."""
    if piece == "step":
        return bs.make_step(config, arm), inputs, (0, 1)
    return bs.step_pieces(config, arm, *inputs)[piece]


def phases(
    model: str, arm: str, accumulation: int, target: str, piece: str = "step"
) -> dict[str, Any]:
    """Lowers and compiles one arm's step (or one `piece` of it, see `PIECES`) for
    `target` under the profiler; the phases' seconds and the kernel counts, as
    described above."""
    config = MODELS[model]
    inputs = bs._abstract_inputs(config, arm, bs.MICROBATCH, accumulation, bs.SEQ)
    kwargs = {}
    if target not in ("cpu", "device"):
        one = one_device(target_devices(target, 1)[0])
        kwargs = {"in_shardings": one, "out_shardings": one}
    function, arguments, donate = _program(config, arm, piece, inputs)
    # After `_program`, whose shape evaluation would otherwise leave its traces to
    # the lowering timed below.
    jax.clear_caches()
    with qt.fallback("silent"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers")
        program = jax.jit(function, donate_argnums=donate, **kwargs)
        start = time.perf_counter()
        lowered = program.lower(*arguments)
        lower_s = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir)
            start = time.perf_counter()
            compiled = lowered.compile()
            compile_s = time.perf_counter() - start
            jax.profiler.stop_trace()
            events = _events(trace_dir)
    totals = collections.Counter()
    for name, seconds in events:
        totals[name] += seconds
    row: dict[str, Any] = {
        "arm": arm,
        "piece": piece,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "hlo_passes_s": sum(
            seconds for name, seconds in totals.items() if name.startswith(_HLO_PASSES)
        ),
        "fusion_s": totals.get(_FUSION),
    }
    tpu_kernels = [
        (n[len(_TPU_KERNEL) :], s) for n, s in events if n.startswith(_TPU_KERNEL)
    ]
    if tpu_kernels:
        ops = _op_names(compiled.as_text())
        parts = collections.defaultdict(lambda: [0, 0.0])
        for kernel, seconds in tpu_kernels:
            part = parts[_part(ops.get(kernel, ""))]
            part[0] += 1
            part[1] += seconds
        row["kernels"] = len(tpu_kernels)
        row["codegen_s"] = sum(s for _, s in tpu_kernels)
        row["parts"] = {name: tuple(value) for name, value in parts.items()}
    else:
        cpu_kernels = [s for n, s in events if n == _CPU_KERNEL]
        row["kernels"] = len(cpu_kernels)
        row["codegen_s"] = sum(cpu_kernels)
    return row


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _part_cells(row: dict, part: str) -> str:
    if "parts" not in row:
        return "n/a | n/a"
    count, seconds = row["parts"].get(part, (0, 0.0))
    return f"{count} | {seconds:.1f}"


def table(rows: list[dict]) -> list[str]:
    first = rows[0]
    lines = [
        "| arm | lower s | compile s | (lower + compile) ÷ first arm's | HLO passes s "
        "| of which fusion s | kernels | codegen s (all threads) | refresh kernels "
        "| refresh codegen s | 8-bit codes kernels | 8-bit codes codegen s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ratio = (row["lower_s"] + row["compile_s"]) / (
            first["lower_s"] + first["compile_s"]
        )
        piece = row.get("piece", "step")
        label = f"`{row['arm']}`" + ("" if piece == "step" else f" ({piece})")
        lines.append(
            f"| {label} | {row['lower_s']:.1f} | {row['compile_s']:.1f} "
            f"| {ratio:.2f} | {_cell(row['hlo_passes_s'])} | {_cell(row['fusion_s'])} "
            f"| {row['kernels']} | {row['codegen_s']:.1f} "
            f"| {_part_cells(row, 'refresh')} | {_part_cells(row, 'codes')} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=[*sorted(TARGETS), "device"], default="cpu")
    parser.add_argument("--models", nargs="+", default=["1B"], choices=sorted(MODELS))
    parser.add_argument("--arms", nargs="+", default=["adam", "projected-8bit"])
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="60M on CPU")
    parser.add_argument(
        "--pieces",
        action="store_true",
        help="also compile each arm's gradients, update and apply on their own",
    )
    add_out_argument(parser, __file__)
    args = parser.parse_args()
    models = ["60M"] if args.quick else args.models
    load_at_start = os.getloadavg()
    device = (
        jax.devices()[0] if args.target == "device" else target_devices(args.target)[0]
    )
    where = {
        "cpu": "this machine's CPU",
        "device": "the attached device",
    }.get(args.target, "compiled ahead of time, no TPU attached")
    backend = f"{args.target} ({device.platform}, {device.device_kind}), {where}"
    # One small program first, so that no arm pays for starting the compiler.
    jax.jit(lambda x: x + 1).lower(1.0).compile()
    sections = []
    for model in models:
        rows = []
        for arm in args.arms:
            for piece in ("step", *(PIECES if args.pieces else ())):
                row = phases(model, arm, args.accumulation, args.target, piece)
                print(model, row, flush=True)
                rows.append(row)
        sections += ["", f"## {model}", "", *table(rows)]
    lines = [
        *produced_by(f"Where the step's compile time goes, {args.target}"),
        *environment(("jax", "jaxlib"), backend, load_at_start),
        "",
        f"`bench_scale.py`'s step, {args.accumulation} microbatch(es) of "
        f"{bs.MICROBATCH} sequences of {bs.SEQ} tokens; phases as this script's "
        "docstring describes them; seconds on this machine, one run.",
        *sections,
    ]
    variant = args.target
    if args.target == "device":
        variant = f"device-{device.platform}-{device.device_kind}"
    variant = re.sub(r"[^A-Za-z0-9.]+", "-", variant)
    write_results(lines, args.out, __file__, args.quick, variant)


if __name__ == "__main__":
    main()
