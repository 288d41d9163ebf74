"""Encoders and decoders against hand-written `jnp` doing the same work.

For `sign_norm` (blocks of 256, and one block per tensor), `quantize` (8 and 4 bits,
blocks of 256) and `top_k` (1% of the entries), and for `qt.materialise` of each
result, this times the library call, jitted, against a hand-written `jnp` function
that computes the same arrays bit for bit (checked here, on the benchmark's input and
on one whose squares overflow float32), with the same overflow safety: the sign
baseline scales each block by a power of two read from the bits of its largest
magnitude, one multiply per element.

Run it with

    python benchmarks/bench_encoders.py          # 1024 x 1024 and 4096 x 4096 float32
    python benchmarks/bench_encoders.py --quick  # 64 x 64, few repeats (smoke run)

The machine is shared, so times are only compared as ratios: the two variants are
called alternately after a warm-up, a round's ratio is the median over its pairs of
adjacent calls, and the rounds give the spread. Target: every
ratio at most 1.5. The results go to benchmarks/results/bench_encoders.md (a quick
run's to benchmarks/results/quick/, which git ignores), or to `--out`. The script
exits non-zero when a baseline's output differs from the library's.
"""

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _report import add_out_argument, default_out, environment, produced_by
from jax import lax

import quax_tangents as qt


BLOCK = 256
TOP_K_FRACTION = 0.01
TARGET_RATIO = 1.5


# ---------------------------------------------------------------------------------
# Hand-written baselines: plain jnp on the flat array split into blocks.


def _blocks(x: jax.Array, block: int) -> jax.Array:
    flat = x.reshape(-1).astype(jnp.float32)
    pad = -flat.size % block
    return (
        jnp.pad(flat, (0, pad)).reshape(-1, block) if pad else flat.reshape(-1, block)
    )


def _unblock(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return blocks.reshape(-1)[: math.prod(shape)].reshape(shape)


def sign_norm_baseline(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Packed sign bits and overflow-safe l2 norms of blocks of `block` elements."""
    blocks = _blocks(x, block)
    bits = jnp.packbits(blocks >= 0, axis=-1, bitorder="little")
    # One block: reductions to a scalar, which XLA compiles to faster loops than a
    # reduction along one long row.
    axis = None if blocks.shape[0] == 1 else -1
    largest = jnp.max(jnp.abs(blocks), axis=axis, keepdims=True)
    # The exponent e of the largest magnitude (as `frexp` gives it), clipped so that
    # 2**-e and 2**e are normal; scaling by them is exact.
    e = jnp.clip((lax.bitcast_convert_type(largest, jnp.int32) >> 23) - 126, -125, 125)
    down = lax.bitcast_convert_type((127 - e) << 23, jnp.float32)
    up = lax.bitcast_convert_type((127 + e) << 23, jnp.float32)
    unit = blocks * down
    norms = jnp.sqrt(jnp.sum(unit * unit, axis=axis, keepdims=True)) * up
    return bits, norms.reshape(-1)


def sign_norm_unscaled(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Packed sign bits and plain l2 norms, `sqrt(sum(b * b))`: NOT overflow-safe
    (a block with a magnitude above about 1.8e19 gets an infinite norm). For the
    cost of the safety only."""
    blocks = _blocks(x, block)
    bits = jnp.packbits(blocks >= 0, axis=-1, bitorder="little")
    return bits, jnp.sqrt(jnp.sum(blocks * blocks, axis=-1))


def sign_norm_decode_baseline(
    bits: jax.Array, norms: jax.Array, shape: tuple[int, ...], block: int
) -> jax.Array:
    """`sign * norm / sqrt(n_b)`, `n_b` the real elements of each block."""
    size = math.prod(shape)
    counts = np.minimum(block, size - np.arange(norms.shape[0]) * block)
    magnitude = norms / np.sqrt(counts).astype(np.float32)
    positive = jnp.unpackbits(bits, axis=-1, bitorder="little")[:, :block]
    values = jnp.where(positive != 0, magnitude[:, None], -magnitude[:, None])
    return _unblock(values, shape)


def quantize_baseline(
    x: jax.Array, bits: int, block: int
) -> tuple[jax.Array, jax.Array]:
    """Codes rounded to nearest and `max|block| / qmax` scales."""
    qmax = 127 if bits == 8 else 7
    blocks = _blocks(x, block)
    scales = jnp.max(jnp.abs(blocks), axis=-1) / qmax
    codes = jnp.round(blocks / jnp.where(scales > 0, scales, 1.0)[:, None])
    codes = codes.astype(jnp.int8)
    if bits == 4:
        pairs = codes.reshape(codes.shape[0], -1, 2) & 0xF
        codes = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)
    return codes, scales


def dequantize_baseline(
    codes: jax.Array, scales: jax.Array, shape: tuple[int, ...], bits: int
) -> jax.Array:
    """`code * scale`, with 4-bit codes sign-extended from their nibbles."""
    if bits == 4:
        signed = lax.bitcast_convert_type(codes, jnp.int8)
        nibbles = jnp.stack([(signed << 4) >> 4, signed >> 4], axis=-1)
        codes = nibbles.reshape(codes.shape[0], -1)
    return _unblock(codes.astype(jnp.float32) * scales[:, None], shape)


def top_k_baseline(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    flat = x.reshape(-1)
    _, indices = lax.top_k(jnp.abs(flat), k)
    return indices, flat[indices]


def top_k_decode_baseline(
    indices: jax.Array, values: jax.Array, shape: tuple[int, ...]
) -> jax.Array:
    # Adds, as `Sparse` does (its indices may repeat in general).
    return (
        jnp.zeros(math.prod(shape), values.dtype).at[indices].add(values).reshape(shape)
    )


# ---------------------------------------------------------------------------------
# Cases: the library call, the baseline, and how to read the library's output.


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    ours: Callable[[jax.Array], Any]  # x -> compressed value
    baseline: Callable[[jax.Array], tuple[jax.Array, ...]]
    fields: Callable[[Any], tuple[jax.Array, ...]]  # compressed value -> arrays
    decode: Callable[[tuple[jax.Array, ...], tuple[int, ...]], jax.Array]


def cases(size: int) -> list[Case]:
    k = max(1, round(TOP_K_FRACTION * size * size))
    shape_blocks = (size * size,)  # one block per tensor
    sign_fields = lambda s: (s.bits, s.norms)  # noqa: E731
    quant_fields = lambda q: (q.codes, q.scales)  # noqa: E731
    return [
        Case(
            f"sign_norm, block {BLOCK}",
            lambda x: qt.sign_norm(x, block_size=BLOCK),
            lambda x: sign_norm_baseline(x, BLOCK),
            sign_fields,
            lambda f, shape: sign_norm_decode_baseline(*f, shape, BLOCK),
        ),
        Case(
            "sign_norm, per tensor",
            qt.sign_norm,
            lambda x: sign_norm_baseline(x, x.size),
            sign_fields,
            lambda f, shape: sign_norm_decode_baseline(*f, shape, shape_blocks[0]),
        ),
        Case(
            f"quantize 8-bit, block {BLOCK}",
            lambda x: qt.quantize(x, bits=8, block_size=BLOCK),
            lambda x: quantize_baseline(x, 8, BLOCK),
            quant_fields,
            lambda f, shape: dequantize_baseline(*f, shape, 8),
        ),
        Case(
            f"quantize 4-bit, block {BLOCK}",
            lambda x: qt.quantize(x, bits=4, block_size=BLOCK),
            lambda x: quantize_baseline(x, 4, BLOCK),
            quant_fields,
            lambda f, shape: dequantize_baseline(*f, shape, 4),
        ),
        Case(
            f"top_k, k = {TOP_K_FRACTION:.0%}",
            lambda x: qt.top_k(x, k),
            lambda x: top_k_baseline(x, k),
            lambda s: (s.indices, s.values),
            lambda f, shape: top_k_decode_baseline(*f, shape),
        ),
    ]


# ---------------------------------------------------------------------------------
# Agreement and timing


def agree(case: Case, x: jax.Array) -> list[str]:
    """What differs between the library and the baseline on `x`, encoded and
    decoded (bit for bit); empty when nothing does."""
    value = jax.jit(case.ours)(x)
    ours = case.fields(value)
    theirs = jax.jit(case.baseline)(x)
    problems = [
        f"{case.name}: encoded field {i} differs on {x.shape}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
        if a.dtype != b.dtype or not np.array_equal(np.asarray(a), np.asarray(b))
    ]
    decoded = jax.jit(qt.materialise)(value)
    by_hand = jax.jit(lambda f: case.decode(f, x.shape))(ours)
    if not np.array_equal(np.asarray(decoded), np.asarray(by_hand)):
        problems.append(f"{case.name}: decoded values differ on {x.shape}")
    return problems


def overflow_input(size: int) -> jax.Array:
    """Magnitudes near 1e36, whose squares overflow float32 (block norms do not)."""
    return jax.random.normal(jax.random.key(1), (size, size), jnp.float32) * 1e36


def time_pair(
    ours: Callable[[], Any], baseline: Callable[[], Any], calls: int, rounds: int
) -> tuple[float, float, list[float]]:
    """Median seconds per call of each (over all rounds), and each round's median of
    the ratios of adjacent calls (the two alternate, after a warm-up): two calls in a
    row see about the same load from other jobs, so their ratio is steadier than
    either time."""
    for _ in range(2):
        jax.block_until_ready(ours())
        jax.block_until_ready(baseline())
    all_ours, all_base, ratios = [], [], []
    for _ in range(rounds):
        pairs = []
        for i in range(calls):
            times = {}
            order = [("ours", ours), ("base", baseline)]
            for label, fn in order if i % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                jax.block_until_ready(fn())
                times[label] = time.perf_counter() - start
            pairs.append(times["ours"] / times["base"])
            all_ours.append(times["ours"])
            all_base.append(times["base"])
        ratios.append(float(np.median(pairs)))
    return float(np.median(all_ours)), float(np.median(all_base)), ratios


@dataclasses.dataclass(frozen=True)
class Row:
    what: str
    size: int
    ours_ms: float
    base_ms: float
    ratios: list[float]

    @property
    def ratio(self) -> float:
        return float(np.median(self.ratios))


def measure(case: Case, size: int, calls: int, rounds: int) -> list[Row]:
    x = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    encode = jax.jit(case.ours)
    by_hand = jax.jit(case.baseline)
    value = encode(x)
    fields = case.fields(value)
    materialise = jax.jit(qt.materialise)
    decode_by_hand = jax.jit(lambda f: case.decode(f, x.shape))
    rows = []
    for what, ours, base in (
        ("encode", lambda: encode(x), lambda: by_hand(x)),
        ("decode", lambda: materialise(value), lambda: decode_by_hand(fields)),
    ):
        ours_s, base_s, ratios = time_pair(ours, base, calls, rounds)
        rows.append(
            Row(f"{case.name}: {what}", size, 1e3 * ours_s, 1e3 * base_s, ratios)
        )
        print(f"{rows[-1].what}, {size}: {rows[-1].ratio:.2f}x", flush=True)
    return rows


def safety_cost(size: int, calls: int, rounds: int) -> Row:
    """`sign_norm` (blocks of 256) against `sign_norm_unscaled`: what the overflow
    safety costs."""
    x = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    encode = jax.jit(lambda a: qt.sign_norm(a, block_size=BLOCK))
    unscaled = jax.jit(lambda a: sign_norm_unscaled(a, BLOCK))
    ours_s, base_s, ratios = time_pair(
        lambda: encode(x), lambda: unscaled(x), calls, rounds
    )
    row = Row(
        f"sign_norm, block {BLOCK}: encode", size, 1e3 * ours_s, 1e3 * base_s, ratios
    )
    print(f"safety cost, {size}: {row.ratio:.2f}x", flush=True)
    return row


def calls_for(case: Case, size: int, quick: bool) -> int:
    if quick:
        return 3
    if size >= 4096:
        # `top_k` of 16M entries takes about half a second a call.
        return 5 if case.name.startswith("top_k") else 15
    return 41


# ---------------------------------------------------------------------------------
# Report


def table(rows: list[Row], quick: bool) -> list[str]:
    lines = [
        "| encoder / decoder | size | library (ms) | baseline (ms) | ratio (median "
        "over rounds) | spread (min - max) | target <= 1.5x |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        verdict = (
            "(smoke run)" if quick else ("met" if r.ratio <= TARGET_RATIO else "MISSED")
        )
        lines.append(
            f"| {r.what} | {r.size} x {r.size} | {r.ours_ms:.3f} | {r.base_ms:.3f} | "
            f"{r.ratio:.2f}x | {min(r.ratios):.2f} - {max(r.ratios):.2f} | {verdict} |"
        )
    return lines


def report(
    rows: list[Row],
    safety: list[Row],
    sizes: tuple[int, ...],
    rounds: int,
    quick: bool,
    seconds: float,
    load_at_start: tuple[float, ...],
) -> str:
    lines = [
        *produced_by("Encoders and decoders against hand-written jnp"),
        *environment(
            ("jax", "jaxlib", "quax-tangents"), jax.default_backend(), load_at_start
        ),
        f"- {'quick (smoke) run' if quick else 'full run'}: float32 inputs of "
        + ", ".join(f"{s} x {s}" for s in sizes)
        + f" (standard normal), {rounds} round(s); total wall time {seconds:.0f} s.",
        "",
        "Library: the public call under `jax.jit` (`qt.sign_norm`, `qt.quantize`, "
        "`qt.top_k`), and `jax.jit(qt.materialise)` of its result. Baseline: "
        "hand-written `jnp` computing the same arrays, bit for bit (checked on this "
        "input and on one whose squares overflow float32), with the same overflow "
        "safety. The two are called alternately after a warm-up; times are medians "
        "over all calls, a round's ratio is the median over its pairs of adjacent "
        "calls of library time over baseline time, and the table gives the median "
        "of the rounds' ratios and their spread.",
        "",
        *table(rows, quick),
        "",
        "## What the overflow safety costs",
        "",
        "The same library call against a baseline without it: packed signs and "
        "plain norms `sqrt(sum(b * b))`, whose squares overflow for magnitudes above "
        "about 1.8e19 (so it does not meet the library's contract; the target does "
        "not apply).",
        "",
        "| library vs unscaled norms | size | library (ms) | unscaled (ms) | ratio "
        "(median over rounds) | spread (min - max) |",
        "|---|---|---:|---:|---:|---|",
        *(
            f"| {r.what} | {r.size} x {r.size} | {r.ours_ms:.3f} | {r.base_ms:.3f} | "
            f"{r.ratio:.2f}x | {min(r.ratios):.2f} - {max(r.ratios):.2f} |"
            for r in safety
        ),
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split())  # the first paragraph
    )
    parser.add_argument(
        "--quick", action="store_true", help="64 x 64, 3 calls, one round (seconds)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of timing (default 3)"
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1024, 4096],
        help="side lengths of the square inputs (default 1024 4096)",
    )
    add_out_argument(parser, __file__)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out or default_out(__file__, args.quick)
    start, load_at_start = time.perf_counter(), os.getloadavg()
    sizes = (64,) if args.quick else tuple(args.sizes)
    rounds = 1 if args.quick else args.rounds
    problems = []
    for case in cases(64):
        problems += agree(case, overflow_input(64))
    rows, safety = [], []
    for size in sizes:
        for case in cases(size):
            x = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
            problems += agree(case, x)
            rows += measure(case, size, calls_for(case, size, args.quick), rounds)
        safety.append(
            safety_cost(size, calls_for(cases(size)[0], size, args.quick), rounds)
        )
    text = report(
        rows,
        safety,
        sizes,
        rounds,
        args.quick,
        time.perf_counter() - start,
        load_at_start,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    if problems:
        sys.exit("The baselines disagree with the library:\n" + "\n".join(problems))


if __name__ == "__main__":
    main()
