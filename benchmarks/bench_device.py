"""A Llama training step run on an attached accelerator, per optimiser: that it
runs, its compile and step times, and the compiler's memory estimate on the device.

The step is `bench_scale.py`'s (its models, arms, microbatches of `MICROBATCH`
sequences of `SEQ` tokens, `make_step`, `init_state`), here run for real: random
bfloat16 weights and random tokens (the same batch every step, so the loss should
fall), the optimiser state built on the device by a jitted `init`, `jax.jit(step,
donate_argnums=(0, 1))` lowered and compiled (timed), then run `--steps` times. Per
model, step and arm:

- *compile s*: the wall time of `lower` and `compile`;
- *estimate*: `compiled.memory_analysis()` on this device, argument + output − alias
  + temp, as in `bench_scale.py`;
- the time of the first step (a refresh of the projectors) and of the later ones;
- *runtime peak*: `memory_stats()["peak_bytes_in_use"]` after the steps, less the
  bytes in use before the step's inputs were made. On a TPU it counts the buffers
  the runtime allocates (the inputs, and building them), not the compiled program's
  temporaries: it is not the step's peak, and the step's memory is the compiler's
  (its estimate, and whether it refuses the program for the chip);
- the loss at each step.

Each model and arm runs in a fresh Python process, one after another: a device's
peak never resets, and one process at a time can hold a TPU. Every compile keeps its
compiler's defaults (no `bench_scale.py` CPU flag), as the TPU figures of
`results/bench_scale_targets.md` do. The peak figures need an attached accelerator;
on CPU `memory_stats()` gives none, and they read n/a.

    python benchmarks/bench_device.py --models 1B --arms adam projected-8bit \\
        --accumulation 1
    python benchmarks/bench_device.py --quick   # 60M, 64 tokens, 1 step (CPU)

`--eigh jnp` runs the refresh's eigendecompositions as `jnp.linalg.eigh` on every
backend, in place of the library's block Jacobi method on a TPU (see
`quax_tangents/_core/_eigh.py`): its run time against its compile time.

Writes `results/bench_device-<platform>.md` and the raw `.json` beside it (a quick
run's to `results/quick/`), or to `--out`.
"""

import os


# `bench_scale` turns a CPU compiler pass off unless this is set; the figures here
# keep every compiler's defaults.
os.environ["BENCH_SCALE_HOIST"] = "1"

# ruff: noqa: E402
import argparse
import functools
import gc
import importlib.metadata
import json
import math
import pathlib
import re
import subprocess
import sys
import time
import traceback
import warnings
from typing import Any

import bench_scale as bs
import jax
import jax.numpy as jnp
from _llama import MODELS, VARIANTS, init_params
from _report import (
    RESULTS,
    add_out_argument,
    command,
    default_out,
    environment,
    produced_by,
)
from jax.experimental.layout import Format, Layout

import quax_tangents as qt


# The parent process imports JAX but never starts a backend: only the child
# processes (`--one`) touch the device.

CONFIGS = {**MODELS, **VARIANTS}
STEPS = 3
QUICK_MODELS = ("60M",)
GIB = 2**30
# `device_kind` to the target names of `_targets.py`.
KINDS = {
    "TPU v4": "tpu-v4",
    "TPU v5 lite": "tpu-v5e",
    "TPU v5e": "tpu-v5e",
    "TPU v5": "tpu-v5p",
    "TPU v5p": "tpu-v5p",
    "TPU v6 lite": "tpu-v6e",
    "TPU v6e": "tpu-v6e",
}


# The child processes read `--eigh` from here.
_EIGH_ENV = "BENCH_DEVICE_EIGH"


def _use_eigh(choice: str) -> None:
    """`jnp`: the library's eigendecomposition lowered as `jnp.linalg.eigh` on a TPU
    too, for this process and the children it starts."""
    os.environ[_EIGH_ENV] = choice
    if choice == "jnp":
        from quax_tangents._core import _eigh

        _eigh.block_jacobi_eigh = lambda a: tuple(jnp.linalg.eigh(a))


# ---------------------------------------------------------------------------------------
# One model and arm, in a child process


def platform_name(device: Any) -> str:
    """`cpu`, a `_targets.py` target name (`tpu-v5e`), or the device kind as a
    slug."""
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind
    return KINDS.get(kind, re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-"))


def _stats(device: Any) -> dict[str, int] | None:
    """The device's bytes in use, peak and limit, or None where it keeps no
    statistics (CPU)."""
    stats = device.memory_stats()
    if not stats:
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: int(stats[k]) for k in keys if k in stats}


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def measure(
    model: str,
    arm: str,
    accumulation: int,
    steps: int,
    batch: int = bs.MICROBATCH,
    seq: int = bs.SEQ,
    layouts: str = "default",
) -> dict:
    """Builds, compiles and runs one model's step with one arm on `jax.devices()[0]`,
    `accumulation` microbatches of `batch` sequences of `seq` tokens; its figures as a
    JSON-able dict. A step that does not fit (`RESOURCE_EXHAUSTED`
    while building, compiling or running) is reported, with the error's first line,
    in `status` and `error`. With `layouts="auto"` the compiler chooses the
    parameters' and the state's layouts (`bench_scale.estimate`'s `layouts`): the
    step is compiled on abstract inputs first, and the weights and the state are
    then built in the layouts it chose (`compiled.input_formats`)."""
    jax.clear_caches()
    gc.collect()
    config = CONFIGS[model]
    device = jax.devices()[0]
    row: dict[str, Any] = {
        "model": model,
        "arm": arm,
        "accumulation": accumulation,
        "steps": steps,
        "batch": batch,
        "seq": seq,
        "platform": platform_name(device),
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "status": "ok",
        "layouts": layouts,
        "losses": [],
        "step_s": [],
        "before": _stats(device),
    }
    stage = "init"
    try:
        make_params = functools.partial(init_params, config)
        make_state = functools.partial(bs.init_state, config, arm)
        key = jax.random.key(0)
        if layouts == "auto":
            params = jax.eval_shape(make_params, key)
            state = jax.eval_shape(make_state, params)
        else:
            params = jax.jit(make_params)(key)
            # Jitted, as `docs/llm.md` says to build it: op by op, the 8-bit
            # state's encoding held 11 GiB of the 1B step's runtime peak (Adam's 7.5).
            state = jax.jit(make_state)(params)
        tokens = jax.random.randint(
            jax.random.key(1),
            (accumulation, batch, seq + 1),
            0,
            config.vocab,
            jnp.int32,
        )
        jax.block_until_ready((params, state, tokens))
        row["after_init"] = _stats(device)

        stage = "compile"
        step = bs.make_step(config, arm)
        with qt.fallback("silent"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers")
            start = time.perf_counter()
            lowered = jax.jit(step, donate_argnums=(0, 1), **_formats(layouts)).lower(
                params, state, tokens
            )
            row["lower_s"] = time.perf_counter() - start
            compiled = lowered.compile()
            row["compile_s"] = time.perf_counter() - start
        if layouts == "auto":
            stage = "init"
            params_format, state_format, _ = compiled.input_formats[0]
            params = jax.jit(make_params, out_shardings=params_format)(key)
            state = jax.jit(make_state, out_shardings=state_format)(params)
            jax.block_until_ready((params, state))
        memory = compiled.memory_analysis()
        estimate = {
            "argument": memory.argument_size_in_bytes,
            "output": memory.output_size_in_bytes,
            "alias": memory.alias_size_in_bytes,
            "temp": memory.temp_size_in_bytes,
        }
        estimate["total"] = (
            estimate["argument"]
            + estimate["output"]
            - estimate["alias"]
            + estimate["temp"]
        )
        row["estimate"] = estimate

        stage = "run"
        for _ in range(steps):
            start = time.perf_counter()
            params, state, value = compiled(params, state, tokens)
            jax.block_until_ready((params, state, value))
            row["step_s"].append(time.perf_counter() - start)
            row["losses"].append(float(value))
    except Exception as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        row["status"] = f"does not fit ({stage})"
        row["error"] = _first_line(error)
    row["after"] = _stats(device)
    return row


def _formats(layouts: str) -> dict:
    """`jax.jit`'s keyword arguments for the parameters' and the state's layouts."""
    if layouts == "default":
        return {}
    auto = Format(Layout.AUTO)
    return {"in_shardings": (auto, auto, None), "out_shardings": (auto, auto, None)}


def _one(
    model: str, arm: str, accumulation: int, steps: int, layouts: str, *shape: int
) -> None:
    """The child's work: one JSON line on stdout, whatever happens (an error other
    than running out of memory is `status: failed`, its traceback on stderr)."""
    try:
        row = measure(model, arm, accumulation, steps, *shape, layouts=layouts)
    except Exception as error:
        traceback.print_exc()
        row = {
            "model": model,
            "arm": arm,
            "accumulation": accumulation,
            "steps": steps,
            "status": "failed",
            "error": _first_line(error),
        }
    row["eigh"] = os.environ.get(_EIGH_ENV, "library")
    print(json.dumps(row), flush=True)


def run_one(
    model: str,
    arm: str,
    accumulation: int,
    steps: int,
    shape: tuple[int, int],
    timeout: float | None,
    layouts: str = "default",
) -> dict:
    """`measure` in a fresh Python process (its stderr passed through)."""
    failed = {
        "model": model,
        "arm": arm,
        "accumulation": accumulation,
        "steps": steps,
        "status": "failed",
    }
    args = ["--one", model, arm, "--accumulation", str(accumulation), "--steps"]
    args += [str(steps), "--batch", str(shape[0]), "--seq", str(shape[1])]
    args += ["--layouts", layouts]
    try:
        out = subprocess.run(
            [sys.executable, __file__, *args],
            stdout=subprocess.PIPE,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {**failed, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {**failed, "error": f"the child process exited with {out.returncode}"}


# ---------------------------------------------------------------------------------------
# Report


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def peak(row: dict) -> int | None:
    """The peak bytes in use, less those in use before the step's inputs were
    made; None without device statistics."""
    before, after = row.get("before"), row.get("after")
    if not before or not after or "peak_bytes_in_use" not in after:
        return None
    return after["peak_bytes_in_use"] - before.get("bytes_in_use", 0)


def _aot_totals() -> dict[tuple, int]:
    """`bench_scale.py --target`'s totals (compiled ahead of time, no device), by
    model, microbatches, arm and target."""
    path = RESULTS / "bench_scale_targets.json"
    if not path.exists():
        return {}
    runs = json.loads(path.read_text())["runs"]
    return {
        (r["model"], r["accumulation"], r["arm"], r["target"], bs.layouts_of(r)): (
            r["argument"] + r["output"] - r["alias"] + r["temp"]
        )
        for r in runs
        if r["devices"] == 1
    }


def _same_shape(row: dict) -> bool:
    """Whether a row's microbatches have `bench_scale.py`'s shape."""
    return (row.get("batch"), row.get("seq")) == (bs.MICROBATCH, bs.SEQ)


def table(rows: list[dict]) -> list[str]:
    aot = _aot_totals()
    lines = [
        "| model | microbatches | arm | compile s | compile ÷ adam | estimate GiB | "
        "AOT estimate GiB (no device) | runtime peak GiB | first step s | "
        "later steps s | losses |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        cells = [row["model"], str(row["accumulation"]), f"`{row['arm']}`"]
        if "estimate" not in row:
            lines.append("| " + " | ".join(cells + [row["status"]] + [""] * 7) + " |")
            continue
        adam = next(
            (
                r
                for r in rows
                if (r["model"], r["accumulation"], r["arm"], r["status"])
                == (row["model"], row["accumulation"], "adam", "ok")
            ),
            None,
        )
        other = aot.get(
            (
                row["model"],
                row["accumulation"],
                row["arm"],
                row.get("platform"),
                bs.layouts_of(row),
            )
        )
        if not _same_shape(row):
            other = None
        later = row["step_s"][1:]
        cells += [
            f"{row['compile_s']:.1f}",
            "" if adam is None else f"{row['compile_s'] / adam['compile_s']:.1f}",
            _gib(row["estimate"]["total"]),
            "" if other is None else _gib(other),
            _gib(peak(row)) if row["status"] == "ok" else row["status"],
            f"{row['step_s'][0]:.2f}" if row["step_s"] else "",
            f"{sum(later) / len(later):.2f}" if later else "",
            ", ".join(f"{x:.3f}" for x in row["losses"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(rows: list[dict], platform: str) -> str:
    first = next((r for r in rows if "device_kind" in r), {})
    limits = [
        r["after"]["bytes_limit"]
        for r in rows
        if r.get("after") and "bytes_limit" in r["after"]
    ]
    backend = f"{platform} ({first.get('device_kind', 'unknown')})"
    if limits:
        backend += f", bytes_limit {_gib(limits[0])} GiB"
    refused = [r for r in rows if r["status"] != "ok"]
    return "\n".join(
        [
            *produced_by(f"A Llama training step run on {platform}"),
            *environment(("jax", "jaxlib", "optax", "equinox", "quax"), backend),
            "",
            "Each row ran in its own process: random bfloat16 weights and optimiser "
            "state built on the device (each by a jitted function), "
            "`jax.jit(step, donate_argnums=(0, 1))` lowered and "
            "compiled (*compile s*: `lower` and `compile`, wall time, on this "
            "machine's host), then the step run on the same random tokens each time "
            "(*losses*). The first step refreshes the projectors; the later steps "
            "keep them. *Estimate*: the compiled step's `memory_analysis()`, "
            "argument + output − alias + temp, as in `bench_scale.py`; *AOT "
            "estimate*: the same step's total in `bench_scale_targets.md`, compiled "
            "for this target with no device attached. *Runtime peak*: "
            "`memory_stats()['peak_bytes_in_use']` after the steps, less the bytes in "
            "use before the inputs were made: the buffers the runtime allocates (the "
            "inputs, and building them), not the compiled program's temporaries, "
            "which a TPU's allocator does not count. It is not the step's peak. "
            "Arms, models and step as in `bench_scale.py` "
            f"({_shapes(rows)}).",
            *(
                [
                    "",
                    "With the compiler's layouts (`--layouts auto`): the step "
                    "compiled on abstract inputs with `Format(Layout.AUTO)` for the "
                    "parameters and the state, in and out, then the weights and the "
                    "state built by jitted functions in the layouts it chose "
                    "(`compiled.input_formats`); the AOT estimate is "
                    "`bench_scale.py --layouts auto`'s.",
                ]
                if any(bs.layouts_of(r) == "auto" for r in rows)
                else []
            ),
            *(
                [
                    "",
                    "With `--eigh jnp`: the refresh's eigendecompositions lowered as "
                    "`jnp.linalg.eigh` on a TPU too, not as the library's block "
                    "Jacobi method.",
                ]
                if any(r.get("eigh") == "jnp" for r in rows)
                else []
            ),
            "",
            *table(rows),
            "",
            *(
                ["Did not fit or failed:", ""]
                + [
                    f"- {r['model']} `{r['arm']}`, microbatches {r['accumulation']}: "
                    f"{r['status']}: `{r.get('error', '')}`"
                    for r in refused
                ]
                + [""]
                if refused
                else []
            ),
        ]
    )


def _shapes(rows: list[dict]) -> str:
    shapes = sorted({(r["batch"], r["seq"]) for r in rows if "batch" in r})
    return ", ".join(
        f"{b} sequence{'s' if b > 1 else ''} of {s} tokens per microbatch"
        for b, s in shapes
    )


def _out_path(args: argparse.Namespace, platform: str) -> pathlib.Path:
    if args.out is not None:
        return args.out
    out = default_out(__file__, args.quick)
    return out.with_name(f"{out.stem}-{platform}.md")


def _log(row: dict) -> None:
    figures = ""
    if "estimate" in row:
        figures = (
            f"compiled in {row['compile_s']:.1f} s, estimate "
            f"{_gib(row['estimate']['total'])} GiB, peak {_gib(peak(row))} GiB, "
            f"losses {[round(x, 3) for x in row['losses']]}"
        )
    print(
        f"{row['model']} x{row['accumulation']} {row['arm']}: {row['status']} "
        f"{figures} {row.get('error', '')}".rstrip(),
        flush=True,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60M, one step")
    parser.add_argument("--models", nargs="+", choices=tuple(CONFIGS))
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=(*bs.ARMS, bs.CLIP_ARM, bs.ADAMW_ARM, bs.ALL_ARM, bs.SIMPLE_ARM),
        default=bs.QUICK_ARMS,
    )
    parser.add_argument(
        "--accumulation",
        type=int,
        nargs="+",
        help=f"microbatches per step, one or more (default {bs.ACCUMULATION}; 1 "
        "with --quick)",
    )
    parser.add_argument("--steps", type=int, help=f"default {STEPS}; 1 with --quick")
    parser.add_argument(
        "--batch",
        type=int,
        help=f"sequences per microbatch (default {bs.MICROBATCH}; 1 with --quick)",
    )
    parser.add_argument(
        "--seq",
        type=int,
        help=f"tokens per sequence (default {bs.SEQ}; 64 with --quick)",
    )
    parser.add_argument(
        "--timeout", type=float, help="seconds for each model and arm (default none)"
    )
    parser.add_argument(
        "--layouts",
        choices=("default", "auto"),
        default="default",
        help="`auto`: the compiler chooses the parameters' and the state's layouts "
        "(default: those `jax.jit` takes)",
    )
    parser.add_argument(
        "--eigh",
        choices=("library", "jnp"),
        default=os.environ.get(_EIGH_ENV, "library"),
        help="the refresh's eigendecompositions: the library's (block Jacobi on a "
        "TPU; the default) or `jnp.linalg.eigh` on every backend",
    )
    parser.add_argument(
        "--one",
        nargs=2,
        metavar=("MODEL", "ARM"),
        help="measure one model and arm in this process; print a JSON line",
    )
    add_out_argument(parser, __file__)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _use_eigh(args.eigh)
    steps = args.steps or (1 if args.quick else STEPS)
    if args.accumulation is None:
        args.accumulation = [1 if args.quick else bs.ACCUMULATION]
    shape = (
        args.batch or (1 if args.quick else bs.MICROBATCH),
        args.seq or (64 if args.quick else bs.SEQ),
    )
    if args.one:
        _one(*args.one, args.accumulation[0], steps, args.layouts, *shape)
        return
    models = args.models or (QUICK_MODELS if args.quick else ("1B",))
    rows: list[dict] = []
    out = None
    for model in models:
        for accumulation in args.accumulation:
            for arm in args.arms:
                row = run_one(
                    model, arm, accumulation, steps, shape, args.timeout, args.layouts
                )
                _log(row)
                rows.append(row)
                platform = next((r["platform"] for r in rows if "platform" in r), "")
                out = _out_path(args, platform or "unknown")
                out.parent.mkdir(parents=True, exist_ok=True)
                # Written after every arm: a run cut short keeps what it measured.
                out.with_suffix(".json").write_text(
                    json.dumps({"command": command(), "rows": rows}, indent=1)
                )
                out.write_text(render(rows, platform or "unknown") + "\n")
    print(f"wrote {out}")
    if any(math.isnan(x) or math.isinf(x) for r in rows for x in r.get("losses", [])):
        print("warning: a loss is not finite", file=sys.stderr)


if __name__ == "__main__":
    main()
