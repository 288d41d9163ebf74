"""Compile time of a symmetric eigendecomposition: `jnp.linalg.eigh` against the
library's `symmetric_eigh`, on CPU or on a TPU compile; with `--run`, their run
time and accuracy on this machine's own device.

The projection's range finder takes eigendecompositions of `(rank + 4)`-row Gram
matrices. On a TPU, `jnp.linalg.eigh` above 256 rows is a QDWH divide and conquer
whose program is large; `symmetric_eigh` lowers to a block Jacobi method built on
the native 256-row kernel there, and to `jnp.linalg.eigh` elsewhere (see
`quax_tangents/_core/_eigh.py`). Each row compiles one float32 `(w, w)`
eigendecomposition under `jax.jit`, ahead of time, and never runs it.

    python benchmarks/bench_eigh.py                    # CPU
    python benchmarks/bench_eigh.py --target tpu-v5e   # one v5e chip, no TPU
    python benchmarks/bench_eigh.py --run              # run on the attached device

`--run` times each function, compiled, on two kinds of Gram matrix: a general one
(`A^T A` of a Gaussian `A`, as a refresh's first orthonormalisation round and its
truncation take) and one near the identity (as the later rounds take), and reports
its relative residual `|V diag(l) V^T - G| / |G|` and `max |V^T V - I|`, in float64
on the host.

A TPU target needs libtpu (`pip install "jax[tpu]"`, kept out of the test
environment); one process can hold it at a time. Writes
`benchmarks/results/bench_eigh-<target>.md`, or `bench_eigh-run-<platform>.md` with
`--run` (a quick run's to `results/quick/`).
"""

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _report import add_out_argument, environment, produced_by, write_results
from _targets import TARGETS, one_device, target_devices

from quax_tangents._core._eigh import symmetric_eigh


SIZES = (132, 256, 257, 516, 1028)  # rank + 4 for the GaLore ranks 128 to 1024
QUICK_SIZES = (132, 257)


def compile_seconds(fn, w: int, device) -> float:
    """Seconds to lower and compile `fn` of one float32 `(w, w)` matrix for
    `device`."""
    sharding = one_device(device)
    matrix = jax.ShapeDtypeStruct((w, w), jnp.float32, sharding=sharding)
    start = time.perf_counter()
    jax.jit(fn).lower(matrix).compile()
    return time.perf_counter() - start


def gram_matrices(w: int) -> dict:
    """The two kinds of `(w, w)` matrix a refresh decomposes (see the module's
    docstring)."""
    a = jax.random.normal(jax.random.key(0), (4 * w, w), jnp.float32)
    general = jnp.matmul(a.T, a, precision=jax.lax.Precision.HIGHEST)
    near = jnp.eye(w) + 1e-3 * general / jnp.max(jnp.abs(general))
    return {"general": general, "near the identity": near}


def run_milliseconds(fn, matrix, repeats: int) -> float:
    """The median of `repeats` timed calls of compiled `fn`, after a first call."""
    jax.block_until_ready(fn(matrix))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(matrix))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def errors(matrix, values, vectors) -> tuple[float, float]:
    """The relative residual and the orthogonality of `(values, vectors)`."""
    g, lam, v = (np.asarray(x, np.float64) for x in (matrix, values, vectors))
    residual = np.linalg.norm(v @ np.diag(lam) @ v.T - g) / np.linalg.norm(g)
    return float(residual), float(np.abs(v.T @ v - np.eye(len(lam))).max())


def run_rows(sizes: tuple[int, ...], repeats: int) -> list[str]:
    rows = []
    for w in sizes:
        for kind, matrix in gram_matrices(w).items():
            for name, fn in (
                ("jnp.linalg.eigh", jnp.linalg.eigh),
                ("symmetric_eigh", symmetric_eigh),
            ):
                compiled = jax.jit(fn)
                ms = run_milliseconds(compiled, matrix, repeats)
                residual, orthogonality = errors(matrix, *compiled(matrix))
                print(
                    f"w={w} {kind} {name}: {ms:.1f} ms, {residual:.1e}, {orthogonality:.1e}"
                )
                rows.append(
                    f"| {w} | {kind} | `{name}` | {ms:.1f} | {residual:.1e} | "
                    f"{orthogonality:.1e} |"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--quick", action="store_true", help="two small sizes")
    parser.add_argument(
        "--run",
        action="store_true",
        help="time and check both functions on this machine's device (not --target)",
    )
    add_out_argument(parser, __file__)
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    if args.run:
        run_main(args, load_at_start)
        return
    device = target_devices(args.target)[0]
    backend = f"{args.target} ({device.device_kind})" + (
        "" if args.target == "cpu" else ", compiled ahead of time, no TPU attached"
    )
    rows = []
    for w in QUICK_SIZES if args.quick else SIZES:
        plain = compile_seconds(jnp.linalg.eigh, w, device)
        ours = compile_seconds(symmetric_eigh, w, device)
        print(f"w={w}: jnp.linalg.eigh {plain:.1f} s, symmetric_eigh {ours:.1f} s")
        rows.append(f"| {w} | {plain:.1f} | {ours:.1f} |")
    lines = [
        *produced_by(f"Compile time of a symmetric eigendecomposition, {args.target}"),
        *environment(("jax", "jaxlib"), backend, load_at_start),
        "",
        "One float32 `(w, w)` eigendecomposition under `jax.jit`, lowered and "
        "compiled, never run; seconds on this machine.",
        "",
        "| w | `jnp.linalg.eigh` s | `symmetric_eigh` s |",
        "|---:|---:|---:|",
        *rows,
    ]
    write_results(lines, args.out, __file__, args.quick, args.target)


def run_main(args, load_at_start) -> None:
    device = jax.devices()[0]
    sizes = QUICK_SIZES if args.quick else SIZES
    rows = run_rows(sizes, repeats=3 if args.quick else 20)
    lines = [
        *produced_by(f"Run time of a symmetric eigendecomposition, {device.platform}"),
        *environment(
            ("jax", "jaxlib"),
            f"{device.platform} ({device.device_kind})",
            load_at_start,
        ),
        "",
        "One float32 `(w, w)` eigendecomposition under `jax.jit`, run on the device: "
        "the median of the timed calls after a first one, in milliseconds; the "
        "relative residual `|V diag(l) V^T - G| / |G|` and `max |V^T V - I|`, in "
        "float64 on the host. *General*: `A^T A` of a Gaussian `(4w, w)` `A`; *near "
        "the identity*: `I + 1e-3 G / max |G|`.",
        "",
        "| w | matrix | function | ms | residual | `max abs(V^T V - I)` |",
        "|---:|---|---|---:|---:|---:|",
        *rows,
    ]
    write_results(lines, args.out, __file__, args.quick, f"run-{device.platform}")


if __name__ == "__main__":
    main()
