"""Bytes, error and speed of every compressor, on a synthetic and a real matrix.

Run it with

    python benchmarks/bench_compression.py

(a few minutes on two CPU cores; `--quick` for a smoke run in seconds, whose results
go to `benchmarks/results/quick/`, which git ignores). It writes
`benchmarks/results/bench_compression.md`. For each compressor at several
settings it reports the bytes ratio (`dense_nbytes / nbytes`), the relative Frobenius
error, and the compress and materialise times as ratios to a jitted dense copy
(`jnp.copy`) of the same array, measured side by side in this process: absolute times
on a shared machine mean little, ratios measured together much more. It also checks
the storage targets on a 2048x2048 float32 matrix and the error bounds that the
compressors' docstrings state.
"""

import argparse
import contextlib
import datetime
import functools
import math
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import threadpoolctl
from _report import command, cpu_model, default_out, versions
from sklearn.datasets import load_digits

import quax_tangents as qt


# (type, settings, compressor). The same settings on both matrices.
COMPRESSORS = [
    ("LowRank", "rank=1", functools.partial(qt.low_rank, rank=1)),
    ("LowRank", "rank=4", functools.partial(qt.low_rank, rank=4)),
    ("LowRank", "rank=16", functools.partial(qt.low_rank, rank=16)),
    ("LowRank", "rank=64", functools.partial(qt.low_rank, rank=64)),
    ("Sparse", "k=1%", functools.partial(qt.top_k, k=0.01)),
    ("Sparse", "k=10%", functools.partial(qt.top_k, k=0.10)),
    ("Quantized", "bits=8, block=256", functools.partial(qt.quantize, bits=8)),
    ("Quantized", "bits=4, block=256", functools.partial(qt.quantize, bits=4)),
    ("SignNorm", "per tensor", qt.sign_norm),
    ("SignNorm", "block=256", functools.partial(qt.sign_norm, block_size=256)),
]

# The storage targets on a 2048x2048 float32 matrix: (type, settings, ratio).
TARGETS = [
    ("LowRank", "rank=4", 250.0),
    ("SignNorm", "per tensor", 30.0),
    ("Quantized", "bits=8, block=256", 3.9),
    ("Quantized", "bits=4, block=256", 7.5),
]
TARGET_SIZE = 2048

# The documented LowRank guarantee: within this factor of the truncated-SVD error.
LOW_RANK_FACTOR = 1.5


# ---------------------------------------------------------------------------------
# The matrices


def decaying_matrix(n: int, decay: float = 0.9, seed: int = 0):
    """An `n x n` float32 matrix `U diag(s) V^T` with `s_i = decay**i`.

    `U` and `V` have random orthonormal columns. Only the first `terms` singular
    values are kept: `decay**terms` is far below float32 resolution, so the float32
    matrix is the same as with all `n`, and the QR of `n x terms` Gaussians is cheap.

    **Arguments:**

    - `n`: the side.
    - `decay`: the ratio of consecutive singular values.
    - `seed`: seeds NumPy's generator.

    **Returns:**

    `(matrix, singular_values)`: a float32 JAX array and the float64 singular values
    (all `n` of them, the dropped ones included).
    """
    terms = min(n, math.ceil(math.log(1e-12) / math.log(decay)))
    rng = np.random.default_rng(seed)
    u = np.linalg.qr(rng.standard_normal((n, terms)))[0]
    v = np.linalg.qr(rng.standard_normal((n, terms)))[0]
    s = decay ** np.arange(n, dtype=np.float64)
    matrix = (u * s[:terms]) @ v.T
    return jnp.asarray(matrix, jnp.float32), s


def digits_gradient(hidden: int = 512, steps: int = 100, seed: int = 0):
    """The gradient of the middle weight of a tanh MLP `64 -> hidden -> hidden -> 10`
    after `steps` full-batch SGD steps on scikit-learn's digits.

    **Arguments:**

    - `hidden`: the hidden width; the gradient is `hidden x hidden`.
    - `steps`: SGD steps (learning rate 0.1) before the gradient is taken.
    - `seed`: seeds the initialisation.

    **Returns:**

    `(gradient, final_loss)`: a float32 JAX array and a float.
    """
    digits = load_digits()
    x = jnp.asarray(digits.data / 16.0, jnp.float32)
    y = jnp.asarray(digits.target)
    rng = np.random.default_rng(seed)
    sizes = (64, hidden, hidden, 10)
    params = [
        (
            jnp.asarray(rng.standard_normal((m, n)) / np.sqrt(m), jnp.float32),
            jnp.zeros(n, jnp.float32),
        )
        for m, n in zip(sizes[:-1], sizes[1:])
    ]

    def loss(params):
        h = x
        for w, b in params[:-1]:
            h = jnp.tanh(h @ w + b)
        logits = h @ params[-1][0] + params[-1][1]
        log_p = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_p, y[:, None], 1))

    @jax.jit
    def step(params):
        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    for _ in range(steps):
        params = step(params)
    return jax.grad(loss)(params)[1][0], float(loss(params))


# ---------------------------------------------------------------------------------
# Measuring


def median_times(fns: dict, repeats: int, min_sample: float = 2e-3) -> dict:
    """Median seconds per call of each zero-argument function, measured interleaved.

    Each function is warmed up (compiled) first. A sample times enough back-to-back
    calls to last about `min_sample` seconds, each call blocked until ready; the
    functions take turns sample by sample, so that a change in the machine's load
    hits them all alike.

    **Arguments:**

    - `fns`: name -> function returning arrays (or a pytree of them).
    - `repeats`: samples per function; the median is returned.
    - `min_sample`: the target duration of one sample, in seconds.

    **Returns:**

    name -> median seconds per call.
    """
    calls = {}
    for name, fn in fns.items():
        jax.block_until_ready(fn())
        start = time.perf_counter()
        jax.block_until_ready(fn())
        once = time.perf_counter() - start
        calls[name] = max(1, min(200, math.ceil(min_sample / max(once, 1e-7))))
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                jax.block_until_ready(fn())
            samples[name].append((time.perf_counter() - start) / calls[name])
    return {name: float(np.median(times)) for name, times in samples.items()}


def relative_error(approx, exact64: np.ndarray) -> float:
    """Relative Frobenius error, in float64."""
    diff = np.asarray(approx, np.float64) - exact64
    return float(np.linalg.norm(diff) / np.linalg.norm(exact64))


def optimal_low_rank_error(singular_values: np.ndarray, rank: int) -> float:
    """The truncated-SVD (best possible) relative error at `rank`."""
    s2 = np.asarray(singular_values, np.float64) ** 2
    return float(np.sqrt(s2[rank:].sum() / s2.sum()))


def _blocks(flat: np.ndarray, size: int) -> np.ndarray:
    pad = -len(flat) % size
    return np.pad(flat, (0, pad)).reshape(-1, size)


def documented_bound(kind: str, settings: str, c, x64, dense64, singular_values):
    """What the compressor's docstring promises, and whether it holds.

    **Arguments:**

    - `kind`, `settings`: the row's type name and settings.
    - `c`: the compressed value.
    - `x64`, `dense64`: the input and `materialise(c)`, as float64 NumPy arrays.
    - `singular_values`: the singular values of the input.

    **Returns:**

    `(reference, holds, note)`: `reference` is the error the promise is measured
    against (a float), `holds` a bool, `note` a short description.
    """
    err = relative_error(dense64, x64)
    if kind == "LowRank":
        best = optimal_low_rank_error(singular_values, c.rank)
        # Up to float32 rounding: a factorisation of an (m, n) matrix that is exact
        # in exact arithmetic keeps a relative error of about n eps (a full-rank one
        # of the 64 x 64 gradient: 8.7e-7 with JAX 0.12.0.1, 1.0e-6 with 0.12.1).
        rounding = max(x64.shape[-2:]) * float(np.finfo(np.float32).eps)
        holds = err <= LOW_RANK_FACTOR * best + rounding
        quotient = f"{err / best:.3f}" if best > 0 else "n/a (exact)"
        return best, holds, f"error / optimal = {quotient} (<= {LOW_RANK_FACTOR})"
    if kind == "Sparse":
        # Exactly the dropped entries: the `size - k` smallest squared magnitudes.
        squares = np.sort(x64.ravel() ** 2)
        best = float(np.sqrt(squares[: x64.size - c.k].sum() / squares.sum()))
        return best, abs(err - best) <= 1e-5 * max(best, 1e-30), "best k-sparse"
    if kind == "Quantized":
        # |x - deq| <= scale / 2 per element, up to float32 rounding of x / scale.
        diff = _blocks(np.abs(dense64 - x64).ravel(), c.block_size)
        scales = np.abs(np.asarray(c.scales, np.float64))[:, None]
        slack = 1e-6 * np.abs(_blocks(x64.ravel(), c.block_size))
        worst = float(np.max((diff - slack) / np.where(scales > 0, scales, 1.0)))
        note = f"max abs(x - deq) / scale = {worst:.4f} (<= 0.5)"
        return float("nan"), worst <= 0.5, note
    # SignNorm: each block keeps its l2 norm and every element its sign.
    size = c.block_elems
    x_norms = np.linalg.norm(_blocks(x64.ravel(), size), axis=1)
    d_norms = np.linalg.norm(_blocks(dense64.ravel(), size), axis=1)
    norm_err = float(np.max(np.abs(d_norms - x_norms) / np.maximum(x_norms, 1e-30)))
    signs_kept = bool(np.all((dense64 >= 0) == (x64 >= 0)))
    holds = norm_err <= 1e-5 and signs_kept
    return (
        float("nan"),
        holds,
        f"block norms kept to {norm_err:.1e}, signs kept: {signs_kept}",
    )


def storage_targets() -> tuple[list[tuple], float]:
    """The issue's storage targets, from the shapes of the compressed values.

    Bytes depend only on shapes and dtypes, so `jax.eval_shape` gives them exactly
    without compressing anything.

    **Returns:**

    `(targets, signnorm_block_ratio)`: `(type, settings, target, measured, met)` per
    target, and the ratio of SignNorm with one norm per 256 elements, for context.
    """
    dense = jax.ShapeDtypeStruct((TARGET_SIZE, TARGET_SIZE), jnp.float32)
    compressors = {(kind, settings): fn for kind, settings, fn in COMPRESSORS}

    def ratio(kind, settings):
        c = jax.eval_shape(compressors[kind, settings], dense)
        assert type(c).__name__ == kind, type(c)
        return c.dense_nbytes / c.nbytes

    targets = [
        (kind, settings, target, ratio(kind, settings), ratio(kind, settings) >= target)
        for kind, settings, target in TARGETS
    ]
    return targets, ratio("SignNorm", "block=256")


def _applicable(x) -> list:
    """The compressors that accept `x` (a rank above its smaller side does not)."""
    return [
        (kind, settings, compressor)
        for kind, settings, compressor in COMPRESSORS
        if kind != "LowRank" or compressor.keywords["rank"] <= min(x.shape)
    ]


def measure(x, singular_values, repeats: int) -> tuple[list[dict], float]:
    """Every compressor on `x`: storage, error, documented bound and time ratios.

    **Arguments:**

    - `x`: a float32 matrix.
    - `singular_values`: its singular values, for the optimal LowRank error.
    - `repeats`: timing samples per function.

    **Returns:**

    `(rows, copy_seconds)`: one dict per compressor, and the median time of the
    dense copy over all groups (for scale only).
    """
    x64 = np.asarray(x, np.float64)
    copy = jax.jit(jnp.copy)
    materialise = jax.jit(qt.materialise)
    rows, copy_times = [], []
    for kind, settings, compressor in _applicable(x):
        compress = jax.jit(compressor)
        c = compress(x)
        assert type(c).__name__ == kind, type(c)
        dense64 = np.asarray(materialise(c), np.float64)
        reference, holds, note = documented_bound(
            kind, settings, c, x64, dense64, singular_values
        )
        times = median_times(
            {
                "copy": functools.partial(copy, x),
                "compress": functools.partial(compress, x),
                "materialise": functools.partial(materialise, c),
            },
            repeats,
        )
        copy_times.append(times["copy"])
        rows.append(
            dict(
                kind=kind,
                settings=settings,
                nbytes=c.nbytes,
                ratio=c.dense_nbytes / c.nbytes,
                error=relative_error(dense64, x64),
                reference=reference,
                holds=holds,
                note=note,
                compress=times["compress"] / times["copy"],
                materialise=times["materialise"] / times["copy"],
            )
        )
        print(
            f"  {kind:<9} {settings:<18} ratio {rows[-1]['ratio']:8.1f}x  "
            f"error {rows[-1]['error']:.4f}  compress {rows[-1]['compress']:8.1f}x  "
            f"materialise {rows[-1]['materialise']:6.2f}x copy",
            flush=True,
        )
    return rows, float(np.median(copy_times))


def lapack_threads(x, repeats: int) -> list[dict]:
    """`low_rank` with OpenBLAS's default thread count and with one thread.

    `low_rank` calls LAPACK (QR, SVD) through XLA's CPU custom calls. On a small,
    busy machine OpenBLAS's own threads compete with XLA's, which can dominate its
    time; this measures the compress time ratio both ways, side by side.
    """
    copy = jax.jit(jnp.copy)
    rows = []
    for kind, settings, compressor in _applicable(x):
        if kind != "LowRank":
            continue
        compress = jax.jit(compressor)
        default = median_times(
            {
                "copy": functools.partial(copy, x),
                "compress": functools.partial(compress, x),
            },
            repeats,
        )
        with threadpoolctl.threadpool_limits(1, user_api="blas"):
            single = median_times(
                {
                    "copy": functools.partial(copy, x),
                    "compress": functools.partial(compress, x),
                },
                repeats,
            )
        rows.append(
            dict(
                settings=settings,
                default=default["compress"] / default["copy"],
                single=single["compress"] / single["copy"],
            )
        )
    return rows


# ---------------------------------------------------------------------------------
# Reporting


def _machine() -> dict:
    blas = [
        f"{i['internal_api']} {i['version']} ({i['num_threads']} threads, "
        f"{pathlib.Path(i['filepath']).name})"
        for i in threadpoolctl.threadpool_info()
        if i["user_api"] == "blas"
    ]
    return dict(
        nproc=len(os.sched_getaffinity(0)),
        cpu=cpu_model(),
        platform=platform.platform(),
        blas="; ".join(blas) or "none loaded",
        backend=jax.default_backend(),
    )


def _table(rows: list[dict]) -> list[str]:
    lines = [
        "| type | settings | bytes | ratio | rel. error | reference error "
        "| documented bound | compress / copy | materialise / copy |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        reference = "" if math.isnan(r["reference"]) else f"{r['reference']:.4f}"
        verdict = "holds" if r["holds"] else "**VIOLATED**"
        lines.append(
            f"| {r['kind']} | {r['settings']} | {r['nbytes']:,} | {r['ratio']:.1f}x "
            f"| {r['error']:.4f} | {reference} | {verdict}: {r['note']} "
            f"| {r['compress']:.1f}x | {r['materialise']:.2f}x |"
        )
    return lines


def report(args, sections, targets, block_ratio, lapack, started, elapsed, load):
    """The results file, in Markdown."""
    machine = _machine()
    lines = [
        "# Compression benchmark",
        "",
        f"Produced by `{command()}` (from the repository root) on {started} in "
        f"{elapsed:.0f} s.",
        "",
        "- Versions: "
        + versions("jax", "jaxlib", "quax", "equinox", "quax-tangents")
        + ".",
        f"- Machine: `nproc` = {machine['nproc']}, CPU: {machine['cpu']}, "
        f"{machine['platform']}, JAX backend: {machine['backend']}.",
        f"- BLAS/LAPACK: {machine['blas']}. `OPENBLAS_NUM_THREADS` = "
        f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}. The tables (a) and "
        "(b) ran with OpenBLAS limited to "
        + (
            f"{args.blas_threads} thread{'s' * (args.blas_threads > 1)} "
            "(`--blas-threads`; see the last section)."
            if args.blas_threads
            else "nothing (`--blas-threads 0`)."
        ),
        f"- Load average (1 min) at start and end: {load[0]:.1f}, {load[1]:.1f}. The "
        "machine is shared: read times only as the ratios below.",
        "",
        "**Columns.** *ratio* is `dense_nbytes / nbytes`. *rel. error* is "
        "`||materialise(c) - x||_F / ||x||_F` in float64. *reference error* is the "
        "best possible error of that storage (truncated SVD for LowRank, the best "
        "k-sparse approximation for Sparse). *documented bound* checks what the "
        "compressor's docstring promises. "
        "*compress / copy* and *materialise / copy* are the median time of the "
        "jitted compressor and of the jitted `quax_tangents.materialise`, divided by "
        "the median time of a jitted `jnp.copy` of the same dense array, measured "
        f"interleaved with it ({args.repeats} samples each, after a warm-up).",
        "",
    ]
    for title, description, copy_seconds, rows in sections:
        lines += [
            f"## {title}",
            "",
            description + f" Dense copy: {copy_seconds * 1e3:.2f} ms (median).",
            "",
            *_table(rows),
            "",
        ]
    agrees = " (the same as the measured table (a))" if args.size == TARGET_SIZE else ""
    lines += [
        f"## Storage targets ({TARGET_SIZE}x{TARGET_SIZE} float32)",
        "",
        "Bytes depend only on shapes, so these come from `jax.eval_shape` of each "
        f"compressor on a {TARGET_SIZE}x{TARGET_SIZE} float32 array{agrees}.",
        "",
        "| type | settings | target | measured | |",
        "|---|---|---:|---:|---|",
    ]
    for kind, settings, target, measured, met in targets:
        lines.append(
            f"| {kind} | {settings} | >= {target}x | {measured:.2f}x | "
            f"{'met' if met else '**missed**'} |"
        )
    lines += [
        "",
        "The SignNorm target is checked on the default, one norm per tensor. With "
        f"one norm per 256 elements it is {block_ratio:.2f}x: the norms add 4 bytes "
        "per 32 bytes of sign bits.",
        "",
    ]
    lines += [
        "## LAPACK threads and `low_rank`",
        "",
        "`low_rank` runs QR and SVD through LAPACK (OpenBLAS). Compress time as a "
        "ratio to the dense copy on the synthetic matrix, with OpenBLAS's default "
        "thread count and limited to one thread (`threadpoolctl`), side by side. "
        "With the default threads, OpenBLAS's threads compete with XLA's for the "
        "cores (LAPACK runs inside XLA's custom calls), and the ratios are larger "
        "and vary several-fold from one run to the next; with one thread they are "
        "lower and steady.",
        "",
        "| settings | default threads | 1 thread |",
        "|---|---:|---:|",
        *(
            f"| {r['settings']} | {r['default']:.1f}x | {r['single']:.1f}x |"
            for r in lapack
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    """Runs every measurement, writes the results file and returns the exit status:
    1 if a storage target is missed or a documented bound does not hold."""
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split())  # the first paragraph
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run in seconds: size 256, hidden 64, 2 repeats",
    )
    parser.add_argument("--size", type=int, help="side of (a) (default 2048)")
    parser.add_argument("--hidden", type=int, help="side of (b) (default 512)")
    parser.add_argument("--repeats", type=int, help="timing samples (default 7)")
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="OpenBLAS threads for the main tables (0: OpenBLAS's default)",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        help="where to write the Markdown results (default: "
        f"{default_out(__file__, False)}, or {default_out(__file__, True)} with "
        "--quick)",
    )
    args = parser.parse_args()
    args.out = args.out or default_out(__file__, args.quick)
    defaults = dict(size=256, hidden=64, repeats=2) if args.quick else {}
    defaults = {"size": TARGET_SIZE, "hidden": 512, "repeats": 7} | defaults
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_start = os.getloadavg()[0]
    start = time.perf_counter()

    # OpenBLAS's threads, competing with XLA's, make `low_rank`'s times erratic on a
    # small machine (see `lapack_threads`), so by default the main tables limit them.
    def blas_limit():
        # A fresh context each time: threadpoolctl applies the limit on creation.
        if not args.blas_threads:
            return contextlib.nullcontext()
        return threadpoolctl.threadpool_limits(args.blas_threads, user_api="blas")

    sections = []
    # Compressors densify nothing here; stay quiet if a rule ever does.
    with qt.fallback("silent"):
        synthetic, s = decaying_matrix(args.size)
        print(f"(a) {args.size}x{args.size} matrix, singular values 0.9**i", flush=True)
        with blas_limit():
            rows, copy_a = measure(synthetic, s, args.repeats)
        sections.append(
            (
                f"(a) Synthetic {args.size}x{args.size} float32, decaying spectrum",
                f"`U diag(0.9**i) V^T` with random orthonormal `U`, `V` (seed 0); "
                f"dense {synthetic.nbytes:,} bytes.",
                copy_a,
                rows,
            )
        )
        gradient, final_loss = digits_gradient(args.hidden)
        side = args.hidden
        print(f"(b) {side}x{side} MLP gradient on digits", flush=True)
        singular_values = np.linalg.svd(gradient, compute_uv=False)
        with blas_limit():
            rows_b, copy_b = measure(gradient, singular_values, args.repeats)
        sections.append(
            (
                f"(b) Real gradient, {side}x{side} float32",
                f"Gradient of the middle weight of a tanh MLP 64 -> {side} -> {side} "
                f"-> 10 after 100 full-batch SGD steps on scikit-learn's digits "
                f"(1797 samples, loss {final_loss:.3f}); dense {gradient.nbytes:,} "
                "bytes. Its reference LowRank error comes from NumPy's SVD of it. At "
                "this size a copy takes tens of microseconds, so the fixed cost of "
                "dispatching a jitted call weighs on every time ratio.",
                copy_b,
                rows_b,
            )
        )
        print("LAPACK threads", flush=True)
        lapack = lapack_threads(synthetic, args.repeats)

    targets, block_ratio = storage_targets()
    if args.size == TARGET_SIZE:
        measured = {(r["kind"], r["settings"]): r["ratio"] for r in rows}
        for kind, settings, _, ratio, _ in targets:
            assert measured[kind, settings] == ratio, (kind, settings)
    elapsed = time.perf_counter() - start
    text = report(
        args,
        sections,
        targets,
        block_ratio,
        lapack,
        started,
        elapsed,
        (load_start, os.getloadavg()[0]),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    failed = False
    for kind, settings, target, measured, met in targets:
        print(
            f"target {kind} {settings}: >= {target}x, measured {measured:.2f}x: "
            f"{'met' if met else 'MISSED'}"
        )
        failed |= not met
    for section in sections:
        for r in section[3]:
            if not r["holds"]:
                print(
                    f"documented bound violated: {r['kind']} {r['settings']}: "
                    f"{r['note']}"
                )
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
