"""Compile time of a symmetric eigendecomposition: `jnp.linalg.eigh` against the
library's `symmetric_eigh`, on CPU or on a TPU compile.

The projection's range finder takes eigendecompositions of `(rank + 4)`-row Gram
matrices. On a TPU, `jnp.linalg.eigh` above 256 rows is a QDWH divide and conquer
whose program is large; `symmetric_eigh` lowers to a block Jacobi method built on
the native 256-row kernel there, and to `jnp.linalg.eigh` elsewhere (see
`quax_tangents/_core/_eigh.py`). Each row compiles one float32 `(w, w)`
eigendecomposition under `jax.jit`, ahead of time, and never runs it.

    python benchmarks/bench_eigh.py                    # CPU
    python benchmarks/bench_eigh.py --target tpu-v5e   # one v5e chip, no TPU

A TPU target needs libtpu (`pip install "jax[tpu]"`, kept out of the test
environment); one process can hold it at a time. Writes
`benchmarks/results/bench_eigh-<target>.md` (a quick run's to `results/quick/`).
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
from _report import add_out_argument, environment, produced_by, write_results
from _targets import TARGETS, target_devices

from quax_tangents._core._eigh import symmetric_eigh


SIZES = (132, 256, 257, 516, 1028)  # rank + 4 for the GaLore ranks 128 to 1024
QUICK_SIZES = (132, 257)


def compile_seconds(fn, w: int, device) -> float:
    """Seconds to lower and compile `fn` of one float32 `(w, w)` matrix for
    `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    matrix = jax.ShapeDtypeStruct((w, w), jnp.float32, sharding=sharding)
    start = time.perf_counter()
    jax.jit(fn).lower(matrix).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--quick", action="store_true", help="two small sizes")
    add_out_argument(parser, __file__)
    args = parser.parse_args()
    load_at_start = os.getloadavg()
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


if __name__ == "__main__":
    main()
