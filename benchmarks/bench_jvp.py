"""JVP of a 4-layer tanh MLP with a tangent on every weight, three ways.

- `dense`: plain `jax.jvp` with a dense tangent on every weight;
- `lowrank-r<k>`: `quax_tangents.jvp` with a rank-k `LowRank` tangent on every weight;
- `hand-r<k>`: the same factored math written directly in JAX,
  `dh_next = tanh'(z) * (dh @ W + (h @ U) @ V.T)`.

Everything runs under `jax.jit` and `quax_tangents.fallback("silent")`, in one process.
Runtimes are reported as ratios of variants timed interleaved, because the machine is
shared; compiled FLOPs and memory are deterministic and reported as they are.

    python benchmarks/jvp.py            # widths 2048 and 4096, batch 256, 5 repeats
    python benchmarks/jvp.py --quick    # width 256, batch 32, 2 repeats (smoke run)

The results go to benchmarks/results/jvp.md, or to `--out`.
"""

# ruff: noqa: E402 (the imports below must follow the sys.path fix)

import pathlib
import sys

# Before the sys.path fix below: it lives in this folder.
from _report import load_line, machine_line, versions


# Run as a script, this folder comes first on `sys.path`, and a sibling benchmark
# named like a module JAX imports shadows it: `compression.py` hides the standard
# library's `compression` package, which `import jax` tries. Drop the folder.
if (
    sys.path
    and pathlib.Path(sys.path[0] or ".").resolve()
    == pathlib.Path(__file__).resolve().parent
):
    del sys.path[0]

import argparse
import cProfile
import dataclasses
import os
import pstats
import re
import shlex
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import quax_tangents as qt
from quax_tangents._registry import RULES


DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "jvp.md"
LAYERS = 4
RANKS = (1, 4, 16)
# The rank whose trace and compile times are compared with plain `jax.jvp`.
TRACE_RANK = 4
# The targets this benchmark checks.
RUNTIME_TARGET = 1.10
FLOPS_TARGET = 1.2
TRACE_TARGET = 2.0


@dataclasses.dataclass(frozen=True)
class Config:
    widths: tuple[int, ...]
    batch: int
    repeats: int  # timed calls per variant, after one warm-up call
    trace_repeats: int  # fresh trace + lower runs per variant (cheap)
    compile_repeats: int  # fresh compilations per variant (hundreds of ms each)


FULL = Config(
    widths=(2048, 4096), batch=256, repeats=5, trace_repeats=15, compile_repeats=3
)
QUICK = Config(widths=(256,), batch=32, repeats=2, trace_repeats=3, compile_repeats=1)


# ---------------------------------------------------------------------------------------
# The network and the three ways to push tangents through it


def mlp(weights, biases, inputs):
    """`LAYERS` dense layers with tanh between them and no activation after the last."""
    hidden = inputs
    last = len(weights) - 1
    for layer, (weight, bias) in enumerate(zip(weights, biases)):
        pre = hidden @ weight + bias
        hidden = pre if layer == last else jnp.tanh(pre)
    return hidden


def dense_jvp(weights, tangents, biases, inputs):
    # Biases and inputs are closed over, so only the weights carry tangents.
    return jax.jvp(lambda w: mlp(w, biases, inputs), (weights,), (tangents,))


def lowrank_jvp(weights, lefts, rights, biases, inputs):
    # The factors are the jitted function's arguments, as in a training step that
    # draws new directions each time; the LowRank values exist only inside the trace.
    tangents = [qt.LowRank(left, right) for left, right in zip(lefts, rights)]
    return qt.jvp(lambda w: mlp(w, biases, inputs), (weights,), (tangents,))


def handwritten_jvp(weights, lefts, rights, biases, inputs):
    """What the LowRank rules compute, written out: `x @ (U V^T)` as `(x @ U) @ V^T`,
    and a dense tangent from the first tanh on."""
    hidden, tangent = inputs, None
    last = len(weights) - 1
    for layer, (weight, bias, left, right) in enumerate(
        zip(weights, biases, lefts, rights)
    ):
        pre = hidden @ weight + bias
        from_weight = (hidden @ left) @ right.T
        # The first layer's input has no tangent: skip the `dh @ W` term, not add 0.
        pre_tangent = from_weight if tangent is None else tangent @ weight + from_weight
        if layer == last:
            return pre, pre_tangent
        hidden = jnp.tanh(pre)
        tangent = (1 - hidden * hidden) * pre_tangent


# ---------------------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass
class Problem:
    width: int
    batch: int
    weights: list
    biases: list
    inputs: Any
    dense_tangents: list
    factors: dict[int, tuple[list, list]]  # rank -> (lefts, rights)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float):
    # NumPy rather than jax.random: on CPU each new jax.random shape is a compilation.
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale)


def make_problem(width: int, batch: int, seed: int = 0) -> Problem:
    rng = np.random.default_rng(seed)
    # 1/sqrt(width) keeps the activations O(1), so tanh is not saturated everywhere.
    scale = width**-0.5
    weights = [_normal(rng, (width, width), scale) for _ in range(LAYERS)]
    biases = [_normal(rng, (width,), 0.1) for _ in range(LAYERS)]
    inputs = _normal(rng, (batch, width), 1.0)
    dense_tangents = [_normal(rng, (width, width), scale) for _ in range(LAYERS)]
    factors = {
        rank: (
            [_normal(rng, (width, rank), scale) for _ in range(LAYERS)],
            [_normal(rng, (width, rank), 1.0) for _ in range(LAYERS)],
        )
        for rank in RANKS
    }
    return Problem(width, batch, weights, biases, inputs, dense_tangents, factors)


@dataclasses.dataclass
class Variant:
    name: str
    kind: str  # "dense", "lowrank" or "hand"
    rank: int | None
    fn: Callable
    args: tuple


def make_variants(problem: Problem) -> list[Variant]:
    p = problem
    variants = [
        Variant(
            "dense",
            "dense",
            None,
            dense_jvp,
            (p.weights, p.dense_tangents, p.biases, p.inputs),
        )
    ]
    for rank, (lefts, rights) in p.factors.items():
        args = (p.weights, lefts, rights, p.biases, p.inputs)
        variants.append(Variant(f"lowrank-r{rank}", "lowrank", rank, lowrank_jvp, args))
        variants.append(Variant(f"hand-r{rank}", "hand", rank, handwritten_jvp, args))
    return variants


# ---------------------------------------------------------------------------------------
# Deterministic figures of the compiled programs


_INSTRUCTION = re.compile(r"=\s*(\([^)]*\)|\S+)\s+([a-z][\w-]*)\(")


def hlo_summary(hlo_text: str) -> tuple[Counter, Counter]:
    """Counts of each HLO opcode (fused computations included), and of dot result
    shapes: two programs with the same dot shapes do the same matmuls."""
    opcodes: Counter = Counter()
    dot_shapes: Counter = Counter()
    for shape, opcode in _INSTRUCTION.findall(hlo_text):
        opcodes[opcode] += 1
        if opcode == "dot":
            dot_shapes[shape.split("{")[0]] += 1
    return opcodes, dot_shapes


def _flops(compiled: Any) -> float:
    cost = compiled.cost_analysis()
    # Older jax versions return a one-element list of dicts.
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


@dataclasses.dataclass
class Compiled:
    variant: Variant
    executable: Any
    flops: float
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    fallbacks: dict
    opcodes: Counter
    dot_shapes: Counter


def compile_variant(variant: Variant) -> Compiled:
    # Densifications are counted while JAX traces, so reset just before lowering.
    qt.reset_fallback_counts()
    lowered = jax.jit(variant.fn).lower(*variant.args)
    fallbacks = qt.fallback_counts()
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
    opcodes, dot_shapes = hlo_summary(compiled.as_text())
    return Compiled(
        variant=variant,
        executable=compiled,
        flops=_flops(compiled),
        temp_bytes=memory.temp_size_in_bytes,
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        fallbacks=fallbacks,
        opcodes=opcodes,
        dot_shapes=dot_shapes,
    )


def primal_flops(problem: Problem) -> float:
    """FLOPs of the forward pass alone; a JVP's tangent FLOPs are the rest."""
    p = problem
    return _flops(jax.jit(mlp).lower(p.weights, p.biases, p.inputs).compile())


@dataclasses.dataclass(frozen=True)
class AnalyticFlops:
    """The tangent math counted by hand, multiply-adds as 2 FLOPs."""

    from_weights: int  # h @ dW on every layer
    propagated: int  # dh @ W on layers 2..L
    elementwise: int  # the tangent sum and tanh'(z) * tangent

    @property
    def total(self) -> int:
        return self.from_weights + self.propagated + self.elementwise


def analytic_tangent_flops(width: int, batch: int, rank: int | None) -> AnalyticFlops:
    """`rank=None` is a dense weight tangent: `h @ dW` is a full matmul."""
    n, b, layers = width, batch, LAYERS
    # Factored: (h @ U) is 2*b*n*r and (h U) @ V^T another 2*b*r*n. Dense: 2*b*n*n.
    from_weight = 2 * b * n * n if rank is None else 4 * b * n * rank
    # tanh'(z) * t = (1 - h*h) * t is 3 elementwise FLOPs; the sum dh@W + h@dW is 1.
    elementwise = (layers - 1) * 3 * b * n + (layers - 1) * b * n
    return AnalyticFlops(
        from_weights=layers * from_weight,
        propagated=(layers - 1) * 2 * b * n * n,
        elementwise=elementwise,
    )


def max_relative_error(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ---------------------------------------------------------------------------------------
# Runtime, measured interleaved


def _time_call(executable: Any, args: tuple) -> float:
    start = time.perf_counter()
    jax.block_until_ready(executable(*args))
    return time.perf_counter() - start


def time_interleaved(compiled: list[Compiled], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of every variant, `repeats` rounds of one call each.

    Calling the variants in turn, with the order rotated each round, spreads the load
    of the shared machine over all of them instead of penalising whichever ran last.
    """
    for c in compiled:  # warm-up: first-call allocation and thread-pool start
        _time_call(c.executable, c.variant.args)
    times: dict[str, list[float]] = {c.variant.name: [] for c in compiled}
    for round_ in range(repeats):
        shift = round_ % len(compiled)
        for c in compiled[shift:] + compiled[:shift]:
            times[c.variant.name].append(_time_call(c.executable, c.variant.args))
    return times


def paired_ratio(times: dict[str, list[float]], numerator: str, denominator: str):
    """Median over rounds of the per-round ratio, and its range: a round's two calls
    ran close together, so their ratio is less exposed to load drift than the ratio
    of two medians."""
    ratios = [a / b for a, b in zip(times[numerator], times[denominator])]
    return statistics.median(ratios), min(ratios), max(ratios)


def fastest_ratio(times: dict[str, list[float]], numerator: str, denominator: str):
    """The ratio of the two fastest calls: load only ever slows a call down, so the
    fastest call of each is the least disturbed."""
    return min(times[numerator]) / min(times[denominator])


# ---------------------------------------------------------------------------------------
# Trace, lower and compile times


def _fresh(fn: Callable) -> Callable:
    # jax caches traces by function identity; a new function object forces a trace.
    return lambda *args: fn(*args)


class _Clock:
    """Wall time and this thread's CPU time. Tracing and lowering are Python on the
    calling thread, so its CPU time leaves out the time spent waiting for a core on
    a loaded machine; compiling uses XLA's threads, so only wall time means much."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def since(self, start: "_Clock") -> tuple[float, float]:
        return self.wall - start.wall, self.cpu - start.cpu


def time_trace(fn: Callable, args: tuple) -> dict[str, float]:
    """Seconds to trace, and to trace and lower (jaxpr to StableHLO), a fresh `fn`.

    `jax.jit(f).lower(...)` costs trace + lower; both are reported."""
    start = _Clock()
    traced = jax.jit(_fresh(fn)).trace(*args)
    traced_at = _Clock()
    traced.lower()
    lowered_at = _Clock()
    trace_wall, trace_cpu = traced_at.since(start)
    both_wall, both_cpu = lowered_at.since(start)
    return {
        "trace, CPU": trace_cpu,
        "trace, wall": trace_wall,
        "trace+lower, CPU": both_cpu,
        "trace+lower, wall": both_wall,
    }


def time_compile(fn: Callable, args: tuple) -> dict[str, float]:
    lowered = jax.jit(_fresh(fn)).lower(*args)
    start = time.perf_counter()
    lowered.compile()
    return {"compile, wall": time.perf_counter() - start}


def _interleaved_medians(
    measure: Callable, variants: list[Variant], repeats: int
) -> dict[str, dict[str, float]]:
    runs: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            runs[v.name].append(measure(v.fn, v.args))
    return {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in runs.items()
    }


def stage_times(variants: list[Variant], config: Config) -> dict[str, dict[str, float]]:
    """Median stage times per variant, interleaved, after one discarded trace each
    (a first trace also fills caches the variants share, such as the traces of
    `jnp` functions). Compiling needs no warm-up: XLA does not cache across
    functions here."""
    for v in variants:
        jax.jit(_fresh(v.fn)).lower(*v.args)
    traces = _interleaved_medians(time_trace, variants, config.trace_repeats)
    compiles = _interleaved_medians(time_compile, variants, config.compile_repeats)
    return {v.name: traces[v.name] | compiles[v.name] for v in variants}


def count_equations(jaxpr: Any) -> Counter:
    """Equations per primitive in a jaxpr, those of nested jaxprs included."""
    counts: Counter = Counter()
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                counts += count_equations(inner)
    return counts


@dataclasses.dataclass
class TraceProfile:
    total: float  # seconds of the profiled trace
    rules: float  # seconds inside quax_tangents' dispatch rules and fallback
    jit_quax: float  # seconds in quax's handling of `jax.jit` calls, rules included
    top: list[tuple[float, str, int]]  # (cumulative s, function, calls)


def _code_key(fn: Callable) -> tuple[str, int, str]:
    code = fn.__code__
    return code.co_filename, code.co_firstlineno, code.co_name


def _named_time(cumulative: dict, name: str) -> float:
    return sum(t for (_, _, function), t in cumulative.items() if function == name)


def trace_profile(variant: Variant, top: int = 10) -> TraceProfile:
    """Where one trace of `variant` spends its time.

    The registered rules never call each other directly, so their cumulative times
    add up without double counting; everything else is quax's and JAX's machinery.
    """
    profiler = cProfile.Profile()
    profiler.enable()
    jax.jit(_fresh(variant.fn)).trace(*variant.args)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    cumulative = {key: entry[3] for key, entry in stats.items()}
    rule_keys = {_code_key(entry.fn) for entry in RULES}
    rule_keys.add(_code_key(qt.CompressedArray.default))
    rows = []
    for (filename, _, name), (_, calls, _, seconds, _) in stats.items():
        if "/quax_tangents/" in filename or "/quax/" in filename:
            package = "quax_tangents" if "/quax_tangents/" in filename else "quax"
            rows.append(
                (seconds, f"{package}.{pathlib.Path(filename).stem}.{name}", calls)
            )
    rows.sort(reverse=True)
    return TraceProfile(
        total=max(cumulative.values()),
        rules=sum(cumulative.get(key, 0.0) for key in rule_keys),
        jit_quax=_named_time(cumulative, "jit_quax"),
        top=rows[:top],
    )


# ---------------------------------------------------------------------------------------
# One width


@dataclasses.dataclass
class WidthResult:
    problem: Problem
    compiled: list[Compiled]
    primal_flops: float
    times: dict[str, list[float]]
    errors: dict[int, float]  # rank -> max relative error, lowrank vs hand-written
    stages: dict[str, dict[str, float]]
    equations: dict[str, Counter]  # per variant: equations per primitive
    profile: TraceProfile

    def by_name(self, name: str) -> Compiled:
        return next(c for c in self.compiled if c.variant.name == name)

    def tangent_flops(self, name: str) -> float:
        return self.by_name(name).flops - self.primal_flops


def agreement(compiled: list[Compiled]) -> dict[int, float]:
    """The compressed and hand-written variants must compute the same numbers, or
    the runtime comparison would be meaningless."""
    outputs = {
        c.variant.name: c.executable(*c.variant.args)
        for c in compiled
        if c.variant.kind != "dense"
    }
    for name, (_, tangent) in outputs.items():
        if not isinstance(tangent, jax.Array):
            raise TypeError(f"{name}: expected a dense output tangent, got {tangent}")
    return {
        rank: max_relative_error(
            outputs[f"lowrank-r{rank}"][1], outputs[f"hand-r{rank}"][1]
        )
        for rank in RANKS
    }


def run_width(width: int, config: Config) -> WidthResult:
    print(f"width {width}: building inputs", flush=True)
    problem = make_problem(width, config.batch)
    variants = make_variants(problem)
    print(f"width {width}: compiling {len(variants)} variants", flush=True)
    compiled = [compile_variant(v) for v in variants]
    errors = agreement(compiled)
    print(f"width {width}: timing, {config.repeats} rounds", flush=True)
    times = time_interleaved(compiled, config.repeats)
    by_name = {v.name: v for v in variants}
    # The hand-written variant shows what tracing the factored math costs in plain
    # JAX, so the quax overhead can be told apart from the extra operations.
    compared = [
        by_name[name]
        for name in ("dense", f"lowrank-r{TRACE_RANK}", f"hand-r{TRACE_RANK}")
    ]
    print(f"width {width}: trace and compile times", flush=True)
    stages = stage_times(compared, config)
    equations = {
        v.name: count_equations(jax.jit(v.fn).trace(*v.args).jaxpr.jaxpr)
        for v in compared
    }
    return WidthResult(
        problem=problem,
        compiled=compiled,
        primal_flops=primal_flops(problem),
        times=times,
        errors=errors,
        stages=stages,
        equations=equations,
        profile=trace_profile(by_name[f"lowrank-r{TRACE_RANK}"]),
    )


# ---------------------------------------------------------------------------------------
# The report


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _gflop(n: float) -> str:
    return f"{n / 1e9:.4g}"


def _fallbacks(counts: dict) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def main_table(result: WidthResult) -> list[str]:
    rows = []
    for c in result.compiled:
        name, rank = c.variant.name, c.variant.rank
        median_ms = statistics.median(result.times[name]) * 1e3
        vs_hand = fastest_vs_hand = vs_dense = "-"
        if c.variant.kind == "lowrank":
            hand = f"hand-r{rank}"
            vs_hand = "{:.3f} [{:.2f}, {:.2f}]".format(
                *paired_ratio(result.times, name, hand)
            )
            fastest_vs_hand = f"{fastest_ratio(result.times, name, hand):.3f}"
        if c.variant.kind != "dense":
            vs_dense = "{:.3f}".format(paired_ratio(result.times, name, "dense")[0])
        analytic = analytic_tangent_flops(
            result.problem.width, result.problem.batch, rank
        ).total
        tangent = result.tangent_flops(name)
        rows.append(
            [
                name,
                f"{median_ms:.1f}",
                vs_hand,
                fastest_vs_hand,
                vs_dense,
                _mib(c.temp_bytes),
                _mib(c.argument_bytes),
                _mib(c.output_bytes),
                _gflop(c.flops),
                _gflop(tangent),
                _gflop(analytic),
                f"{tangent / analytic:.4f}",
            ]
        )
    header = [
        "variant",
        "median ms",
        "÷ hand-written [min, max]",
        "÷ hand-written, fastest calls",
        "÷ dense",
        "temp MiB",
        "args MiB",
        "output MiB",
        "GFLOP",
        "tangent GFLOP",
        "analytic tangent GFLOP",
        "tangent ÷ analytic",
    ]
    return _table(header, rows)


def detail_table(result: WidthResult) -> list[str]:
    rows = []
    for c in result.compiled:
        ops = c.opcodes
        dots = ", ".join(f"{n}x {s}" for s, n in sorted(c.dot_shapes.items()))
        rows.append(
            [
                c.variant.name,
                _fallbacks(c.fallbacks),
                str(ops["dot"]),
                str(ops["transpose"]),
                str(ops["copy"]),
                str(ops["fusion"]),
                str(sum(ops.values())),
                dots,
            ]
        )
    header = [
        "variant",
        "fallback_counts()",
        "dots",
        "transposes",
        "copies",
        "fusions",
        "HLO instructions",
        "dot result shapes",
    ]
    return _table(header, rows)


def stage_table(result: WidthResult) -> list[str]:
    dense, lowrank, hand = "dense", f"lowrank-r{TRACE_RANK}", f"hand-r{TRACE_RANK}"
    s, eqns = result.stages, result.equations

    def row(label: str, of: Callable[[str], float], fmt: str) -> list[str]:
        values = [of(name) for name in (dense, lowrank, hand)]
        return [label, *(fmt.format(v) for v in values)] + [
            f"{values[1] / values[0]:.2f}",
            f"{values[1] / values[2]:.2f}",
        ]

    rows = [
        row(stage, lambda name, stage=stage: s[name][stage] * 1e3, "{:.1f}")
        for stage in s[dense]
    ]
    rows.append(row("jaxpr equations", lambda name: eqns[name].total(), "{}"))
    return _table(
        [
            "stage (median ms)",
            "`jax.jvp`, dense",
            f"`qt.jvp`, rank {TRACE_RANK}",
            f"hand-written, rank {TRACE_RANK}",
            "`qt.jvp` ÷ `jax.jvp`",
            "`qt.jvp` ÷ hand-written",
        ],
        rows,
    )


def profile_table(result: WidthResult) -> list[str]:
    profile = result.profile
    return _table(
        ["function", "calls", "cumulative ms", "share of the trace"],
        [
            [f"`{name}`", str(calls), f"{t * 1e3:.1f}", f"{t / profile.total:.0%}"]
            for t, name, calls in profile.top
        ],
    )


@dataclasses.dataclass
class Verdict:
    target: str
    where: str
    value: float
    limit: float

    @property
    def met(self) -> bool:
        return self.value <= self.limit


def _stage_ratio(result: WidthResult, stage: str) -> float:
    stages = result.stages
    return stages[f"lowrank-r{TRACE_RANK}"][stage] / stages["dense"][stage]


def verdicts(results: list[WidthResult]) -> list[Verdict]:
    found = []
    for r in results:
        w = r.problem.width
        for rank in RANKS:
            ratio = paired_ratio(r.times, f"lowrank-r{rank}", f"hand-r{rank}")[0]
            found.append(
                Verdict(
                    "runtime ÷ hand-written", f"{w}, r={rank}", ratio, RUNTIME_TARGET
                )
            )
        for rank in RANKS:
            analytic = analytic_tangent_flops(w, r.problem.batch, rank).total
            measured = r.tangent_flops(f"lowrank-r{rank}")
            # "Within 1.2x" both ways: too few FLOPs would mean the count is wrong.
            off = max(measured / analytic, analytic / measured)
            found.append(
                Verdict(
                    "tangent FLOPs vs analytic (x off)",
                    f"{w}, r={rank}",
                    off,
                    FLOPS_TARGET,
                )
            )
        where = f"{w}, r={TRACE_RANK}"
        found.append(
            Verdict(
                "trace time ÷ `jax.jvp`: `jit(f).lower` (trace + lower), CPU",
                where,
                _stage_ratio(r, "trace+lower, CPU"),
                TRACE_TARGET,
            )
        )
        found.append(
            Verdict(
                "trace time ÷ `jax.jvp`: `jit(f).trace` alone, CPU",
                where,
                _stage_ratio(r, "trace, CPU"),
                TRACE_TARGET,
            )
        )
    return found


def verdict_table(found: list[Verdict]) -> list[str]:
    return _table(
        ["target", "width, rank", "value", "limit", "met?"],
        [
            [
                v.target,
                v.where,
                f"{v.value:.3f}",
                f"<= {v.limit}",
                "met" if v.met else "MISSED",
            ]
            for v in found
        ],
    )


def _matmuls(compiled: Compiled) -> Counter:
    """Dot result shapes with their dims sorted: `U^T h^T` (r x b) and `h U` (b x r)
    are the same matmul laid out differently."""
    return Counter(
        {
            tuple(sorted(shape.split("[")[1].rstrip("]").split(","))): count
            for shape, count in compiled.dot_shapes.items()
        }
    )


def _same_matmuls(result: WidthResult, rank: int) -> bool:
    lowrank, hand = result.by_name(f"lowrank-r{rank}"), result.by_name(f"hand-r{rank}")
    return _matmuls(lowrank) == _matmuls(hand)


_COUNTED_OPS = {
    "dot": "dots",
    "transpose": "transposes",
    "copy": "copies",
    "fusion": "fusions",
}


def _hlo_comparison(result: WidthResult, rank: int) -> str:
    lowrank, hand = result.by_name(f"lowrank-r{rank}"), result.by_name(f"hand-r{rank}")
    b, n = result.problem.batch, result.problem.width
    extra = lowrank.flops - hand.flops
    same = "the same matmuls" if _same_matmuls(result, rank) else "DIFFERENT matmuls"
    counts = ", ".join(
        f"{label} {lowrank.opcodes[op]} vs {hand.opcodes[op]}"
        for op, label in _COUNTED_OPS.items()
    )
    return (
        f"- width {n}, rank {rank}: {same} (up to result layout); {counts}; "
        f"{extra:+.0f} FLOPs ({extra / (b * n):+.0f} x batch x width); temp bytes "
        f"{lowrank.temp_bytes} vs {hand.temp_bytes}."
    )


def _versus_dense(result: WidthResult) -> str:
    dense = result.by_name("dense")
    parts = []
    for rank in RANKS:
        name = f"lowrank-r{rank}"
        flops = result.by_name(name).flops / dense.flops
        runtime = paired_ratio(result.times, name, "dense")[0]
        parts.append(f"r={rank}: FLOPs {flops:.2f}, runtime {runtime:.2f}")
    return f"- width {result.problem.width}, ÷ dense: " + "; ".join(parts) + "."


def _largest_extra_share(results: list[WidthResult]) -> float:
    return max(
        abs(r.by_name(f"lowrank-r{k}").flops - r.by_name(f"hand-r{k}").flops)
        / r.by_name(f"hand-r{k}").flops
        for r in results
        for k in RANKS
    )


def _temp_bytes_note(results: list[WidthResult]) -> str:
    differ = [
        (r.problem.width, rank)
        for r in results
        for rank in RANKS
        if r.by_name(f"lowrank-r{rank}").temp_bytes
        != r.by_name(f"hand-r{rank}").temp_bytes
    ]
    if not differ:
        return "Its temp bytes equal the hand-written program's."
    listing = ", ".join(f"{w}, r={rank}" for w, rank in differ)
    note = f"Its temp bytes differ from the hand-written program's at {listing}."
    if all(rank == 1 for _, rank in differ):
        note += (
            " At r=1 the outer product `(h U) V^T` is a broadcast multiply, not a "
            "dot, in both programs, and XLA fuses and schedules the elementwise "
            "`tanh' * tangent` step of the two differently, so a different number "
            "of batch x width buffers is live at once; the matmuls are the same."
        )
    return note


def _fastest_for(results: list[WidthResult], missed: list[Verdict]) -> str:
    by_width = {str(r.problem.width): r for r in results}
    parts = []
    for v in missed:
        width, rank = v.where.split(", r=")
        name = f"lowrank-r{rank}"
        ratio = fastest_ratio(by_width[width].times, name, f"hand-r{rank}")
        parts.append(f"{v.where}: {ratio:.3f}")
    return "; ".join(parts)


def runtime_explanation(results: list[WidthResult], found: list[Verdict]) -> list[str]:
    """Why compressed and hand-written runtimes differ, from the compiled HLO."""
    lines = [
        "Against the dense tangent, the saving is bounded: only `h @ dW` (L of the "
        "2L - 1 tangent matmuls) becomes `(h U) V^T`; from the first tanh on the "
        "tangent is dense and `dh @ W` costs what it costs in `jax.jvp`, and the "
        "primal forward is shared. FLOP ratio against runtime ratio:",
        "",
        *(_versus_dense(r) for r in results),
        "",
        "The compressed program's arguments hold `2Lnr` factor entries in place of "
        "`Ln^2` tangent entries (the args column). " + _temp_bytes_note(results),
        "",
        "Compiled HLO of `lowrank-rK` against `hand-rK` (counts include fused "
        "computations):",
        "",
    ]
    lines += [_hlo_comparison(r, rank) for r in results for rank in RANKS]
    missed = [v for v in found if v.target.startswith("runtime") and not v.met]
    lines.append("")
    if not missed:
        lines.append(
            "Every runtime ratio is within the target: the compiled programs do the "
            "same matmuls, and the few extra elementwise FLOPs come from JAX's tanh "
            "JVP rule (see the analytic section)."
        )
    elif all(_same_matmuls(r, rank) for r in results for rank in RANKS):
        lines.append(
            "Runtime misses (" + ", ".join(v.where for v in missed) + "): the two "
            "compiled programs run the same matmuls, with no extra transposes or "
            "copies, and differ only by the elementwise FLOPs listed above (at "
            f"most {_largest_extra_share(results):.2%} of the total). A ratio away "
            "from 1 here is the shared machine's load between two calls, not extra "
            "work: see the [min, max] range of the per-round ratios and the ratio "
            "of the fastest calls (" + _fastest_for(results, missed) + ") in the "
            "main table."
        )
    else:
        lines.append(
            "Runtime misses (" + ", ".join(v.where for v in missed) + "): the "
            "compiled programs differ in their matmuls (see the dot result shapes in "
            "the HLO table), so the compressed path does different work."
        )
    return lines


def _stage_breakdown(result: WidthResult) -> str:
    names = ("dense", f"lowrank-r{TRACE_RANK}", f"hand-r{TRACE_RANK}")
    s = result.stages

    def triple(of: Callable[[dict], float]) -> str:
        return " / ".join(f"{of(s[name]) * 1e3:.1f}" for name in names)

    trace = "trace, CPU"
    extra_factored = (s[names[2]][trace] - s[names[0]][trace]) * 1e3
    extra_quax = (s[names[1]][trace] - s[names[2]][trace]) * 1e3
    return (
        f"- width {result.problem.width}, ms for `jax.jvp` / `qt.jvp` / "
        f"hand-written: trace {triple(lambda t: t[trace])} (CPU); lowering alone "
        f"{triple(lambda t: t['trace+lower, CPU'] - t[trace])} (CPU); compile "
        f"{triple(lambda t: t['compile, wall'])} (wall). Of `qt.jvp`'s extra trace time, "
        f"{extra_factored:.1f} ms is what plain JAX takes to trace the factored math "
        f"itself (hand-written vs `jax.jvp`) and {extra_quax:.1f} ms is quax and "
        "the LowRank rules (`qt.jvp` vs hand-written)."
    )


def _overhead_split(result: WidthResult) -> str:
    s, trace = result.stages, "trace, CPU"
    factored = s[f"hand-r{TRACE_RANK}"][trace] - s["dense"][trace]
    quax = s[f"lowrank-r{TRACE_RANK}"][trace] - s[f"hand-r{TRACE_RANK}"][trace]
    if quax > factored:
        return (
            "Most of the extra trace time is quax and the rules: tracing the same "
            "factored math in plain JAX costs little more than `jax.jvp` (which "
            "reuses JAX's cached JVP of each `jnp` function)."
        )
    return (
        "Most of the extra trace time is the factored math itself: plain JAX "
        "traces the hand-written version nearly as slowly."
    )


def _equation_difference(result: WidthResult) -> str:
    lowrank = result.equations[f"lowrank-r{TRACE_RANK}"]
    hand = result.equations[f"hand-r{TRACE_RANK}"]
    more = (lowrank - hand) + Counter({k: -v for k, v in (hand - lowrank).items()})
    return ", ".join(f"{n:+d} `{name}`" for name, n in sorted(more.items()))


def trace_explanation(results: list[WidthResult], found: list[Verdict]) -> list[str]:
    r = results[-1]
    profile = r.profile
    ratios = "; ".join(
        f"{v.target.split(': ')[1]} at {v.where}: {v.value:.2f}x "
        f"({'met' if v.met else 'MISSED'})"
        for v in found
        if v.target.startswith("trace")
    )
    machinery = profile.total - profile.rules
    return [
        f"Ratios: {ratios}.",
        "",
        *(_stage_breakdown(result) for result in results),
        "",
        "Compiling takes about as long for all three (the compiled programs are the "
        "same size), so the overhead is in building the jaxpr: tens of ms per trace, "
        "against hundreds of ms to compile, but several times the plain trace. "
        + _overhead_split(r)
        + " `qt.jvp`'s jaxpr, against the hand-written one, has "
        f"{_equation_difference(r)} equations. The `transpose`s are the "
        "`moveaxis` of the factored product in the `dot_general` rule and the "
        "`swapaxes` of each materialisation; the extra `dot_general` is a second "
        "materialisation of `(h0 U) V^T` at the first tanh (its JVP meets the "
        "LowRank tangent twice, in `mul` and in `add`), which XLA merges again; "
        "`add_any` is how JAX's JVP sums `dh @ W` and `h @ dW`, and its tanh rule "
        "`(t + t*h) * (1 - h)` has one operation more than `(1 - h*h) * t`.",
        "",
        f"The rest, from one profiled trace at width {r.problem.width} "
        f"({profile.total * 1e3:.0f} ms under cProfile, which inflates Python-heavy "
        f"code): {profile.rules * 1e3:.0f} ms ({profile.rules / profile.total:.0%}) "
        "is inside quax_tangents' rules. The other "
        f"{machinery * 1e3:.0f} ms ({machinery / profile.total:.0%}) is quax's and "
        "JAX's machinery. `@` is `jnp.matmul`, itself a `jax.jit`: plain `jax.jvp` "
        "stages JAX's cached JVP jaxpr of each such call in one step, while quax's "
        "`jit_quax` interprets that JVP jaxpr equation by equation under the quax "
        f"trace; {profile.jit_quax * 1e3:.0f} ms "
        f"({profile.jit_quax / profile.total:.0%}) of the trace is under `jit_quax`, "
        "the rules called from it included.",
    ]


def environment(load_at_start: tuple[float, ...]) -> list[str]:
    return [
        "- versions: " + versions("jax", "jaxlib", "quax", "quax-tangents"),
        f"- backend: {jax.default_backend()} ({jax.devices()[0].device_kind})",
        machine_line(),
        load_line(load_at_start),
    ]


def analytic_section(config: Config) -> list[str]:
    return [
        "## Analytic tangent FLOPs",
        "",
        f"L = {LAYERS} layers, width n, batch b, rank r; a multiply-add is 2 FLOPs "
        "(as XLA's `cost_analysis` counts a dot); elementwise ops are 1 FLOP each.",
        "",
        "- layer 1: `h0 @ U` (2bnr) then `(h0 U) @ V^T` (2brn); the input has no "
        "tangent, so there is no `dh @ W`.",
        "- layers 2..L: the same `4bnr`, plus `dh @ W` (2bn^2) and the sum of the two "
        "(bn).",
        "- after layers 1..L-1: `tanh'(z) * t = (1 - h*h) * t`, 3bn.",
        "",
        "Total: `4Lbnr + (L-1)(2bn^2) + (L-1)(4bn)`. The dense-tangent row uses "
        "`2bn^2` in place of `4bnr` for `h @ dW`.",
        "",
        "Measured tangent FLOPs are the compiled JVP's `flops` minus the compiled "
        "primal-only forward's (which has the L forward matmuls and bias adds; tanh "
        "counts as a transcendental, not a FLOP). JAX's own tanh JVP rule computes "
        "`(t + t*h) * (1 - h)`, one elementwise op more per element than the "
        "hand-written `(1 - h*h) * t`, so the `qt.jvp` and `jax.jvp` rows sit "
        "`(L-1)bn` FLOPs above the analytic count.",
        "",
        *(
            f"- width {n}, batch {config.batch}: "
            + ", ".join(
                f"r={rank}: {analytic_tangent_flops(n, config.batch, rank).total:,}"
                for rank in RANKS
            )
            + f"; dense: {analytic_tangent_flops(n, config.batch, None).total:,}"
            for n in config.widths
        ),
    ]


def report(
    config: Config,
    results: list[WidthResult],
    elapsed: float,
    load_at_start: tuple[float, ...],
) -> str:
    found = verdicts(results)
    mode = "quick (smoke) run" if config is QUICK else "full run"
    lines = [
        "# JVP benchmark: LowRank tangents through a 4-layer tanh MLP",
        "",
        "Produced by:",
        "",
        "```",
        "python " + shlex.join(sys.argv),
        "```",
        "",
        *environment(load_at_start),
        f"- {mode}: widths {', '.join(map(str, config.widths))}, batch {config.batch}, "
        f"float32, ranks {', '.join(map(str, RANKS))}; {config.repeats} timed calls "
        f"per variant after one warm-up, interleaved; {config.trace_repeats} fresh "
        f"traces and {config.compile_repeats} fresh compilations per variant; total "
        f"wall time {elapsed:.0f} s. Few repeats, to keep the run short on a small "
        "shared machine: read the runtimes as ratios only.",
        "",
        "The network: `h = tanh(h @ W_i + b_i)` for i = 1..3, then `h @ W_4 + b_4`, "
        "hidden = input = output width. Every weight has a tangent; biases and inputs "
        "are closed over (not differentiated). Variants: `dense` is `jax.jvp` with a "
        "dense tangent per weight; `lowrank-rK` is `quax_tangents.jvp` with "
        "`qt.LowRank(U, V)` of rank K per weight; `hand-rK` is plain JAX doing the "
        "factored math, `dh_next = tanh'(z) * (dh @ W + (h @ U) @ V.T)` with `dh = 0` "
        "(skipped) on the first layer. All under `jax.jit` and "
        '`qt.fallback("silent")`.',
        "",
        "Runtime ratios are the median over rounds of the ratio of two calls in the "
        "same round, with the range over rounds in brackets (the targets use it), "
        "and the ratio of each variant's fastest call. Memory is "
        "`compiled.memory_analysis()`; GFLOP is `compiled.cost_analysis()['flops']`.",
        "",
    ]
    for r in results:
        lines += [
            f"## Width {r.problem.width}, batch {r.problem.batch}",
            "",
            *main_table(r),
            "",
            "Largest relative difference of the output tangent, `lowrank-rK` vs "
            "`hand-rK`: "
            + ", ".join(f"r={k}: {e:.1e}" for k, e in r.errors.items())
            + f". Primal-only forward: {_gflop(r.primal_flops)} GFLOP.",
            "",
            "Fallbacks counted while tracing each variant, and the compiled HLO "
            "(fused computations included):",
            "",
            *detail_table(r),
            "",
            f"Trace and lower (median of {config.trace_repeats} fresh functions) and "
            f"compile (median of {config.compile_repeats}). CPU is the tracing "
            "thread's CPU time, which leaves out waiting for a core on the loaded "
            "machine; the trace targets use it:",
            "",
            *stage_table(r),
            "",
        ]
    lines += [
        *analytic_section(config),
        "",
        "## Targets",
        "",
        *verdict_table(found),
        "",
        "## Why",
        "",
        "### Fallbacks: the tanh densifies the tangent, by design",
        "",
        "A low-rank tangent stays low-rank only up to the first nonlinearity. JAX's "
        "tanh JVP multiplies the tangent elementwise by a full matrix, which has no "
        "low-rank form, so the LowRank rules materialise `(h0 U) V^T` there: that is "
        "the `mul` and `add` counts (JAX's rule is `(t + t*h) * (1 - h)`, so the "
        "LowRank tangent meets `mul` and then `add`; XLA merges the two identical "
        "materialisations, see the dot counts). From layer 2 on, the dense `dh @ W` "
        "meets the LowRank `h @ (U V^T)` in `add_any`, whose rule for dense + LowRank "
        "gives a dense sum by design, counted once per layer. This is exactly the hand-written "
        "math; the saving is in `h @ dW`, done as `(h U) V^T`. The dense and "
        "hand-written variants hold no quax values, so nothing is counted for them.",
        "",
        "### Runtime vs hand-written",
        "",
        *runtime_explanation(results, found),
        "",
        "### Trace time",
        "",
        *trace_explanation(results, found),
        "",
        f"Profile of one trace of `lowrank-r{TRACE_RANK}` at width "
        f"{results[-1].problem.width} (cumulative time; nested, so shares overlap):",
        "",
        *profile_table(results[-1]),
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="width 256, batch 32, 2 repeats: a smoke run that takes seconds",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=DEFAULT_OUT,
        help=f"where to write the markdown results (default {DEFAULT_OUT})",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = QUICK if args.quick else FULL
    start, load_at_start = time.perf_counter(), os.getloadavg()
    # Silent: the tanh densifies by design, and the counts are reported instead.
    with qt.fallback("silent"):
        results = [run_width(width, config) for width in config.widths]
    text = report(config, results, time.perf_counter() - start, load_at_start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
