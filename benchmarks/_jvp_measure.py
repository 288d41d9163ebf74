"""The measurements of `bench_jvp.py`: the network, the three JVP variants, and what
is read from their compiled programs (FLOPs, memory, HLO), their runtimes (as ratios
of calls timed interleaved), and their trace, lower and compile times.

`_jvp_report.py` turns the results into the Markdown report.
"""

import cProfile
import dataclasses
import pathlib
import pstats
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import quax_tangents as qt
from quax_tangents._core._registry import RULES


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


def _module_name(filename: str) -> str | None:
    """The dotted module name of a file of quax_tangents or quax, sub-packages included
    (`quax_tangents._autodiff._ad` for `.../quax_tangents/_autodiff/_ad.py`); `None`
    for a file of any other package."""
    for package in ("quax_tangents", "quax"):
        marker = f"/{package}/"
        if marker in filename:
            inside = pathlib.PurePath(filename.rsplit(marker, 1)[1]).with_suffix("")
            return ".".join((package, *inside.parts))
    return None


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
        module = _module_name(filename)
        if module is not None:
            rows.append((seconds, f"{module}.{name}", calls))
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
