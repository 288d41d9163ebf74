"""Compile time of the range finder's float32 products at the highest precision: one
product against the loop over blocks of rows that a TPU lowering uses
(`quax_tangents/_core/_row_blocks.py`), on CPU or on a TPU compile.

A TPU runs a float32 product at `HIGHEST` as six bfloat16 passes, and its compiler's
time grows with the operand's rows. Each row of the results compiles one product of
a `(m, w)` float32 sketch under `jax.jit`, ahead of time, never run: the Gram matrix
`a^T a` and the product `a @ b` with a `(w, w)` `b`, at the default precision, at
`HIGHEST` as one product, and at `HIGHEST` in blocks of 256, 512 and 1024 rows. The
sketches are the 1B Llama's at rank 512 (`w = 516`): 5461 and 2048 rows.

    python benchmarks/bench_row_blocks.py                    # CPU
    python benchmarks/bench_row_blocks.py --target tpu-v5e   # one v5e chip, no TPU

A TPU target needs libtpu (`pip install "jax[tpu]"`, kept out of the test
environment). Writes `benchmarks/results/bench_row_blocks-<target>.md` (a quick
run's to `results/quick/`).
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
from _report import add_out_argument, environment, produced_by, write_results
from _targets import TARGETS, one_device, target_devices

from quax_tangents._core._row_blocks import gram_in_row_blocks, matmul_in_row_blocks


HIGHEST = jax.lax.Precision.HIGHEST
SHAPES = ((5461, 516), (2048, 516))
QUICK_SHAPES = ((600, 20),)
BLOCKS = (256, 512, 1024)


def variants(blocks: tuple[int, ...]) -> dict:
    """Per variant, the Gram matrix and the product as functions of `(a, b)`."""
    out = {
        "default": (
            lambda a, b: jnp.matmul(a.T, a),
            lambda a, b: jnp.matmul(a, b),
        ),
        "HIGHEST": (
            lambda a, b: jnp.matmul(a.T, a, precision=HIGHEST),
            lambda a, b: jnp.matmul(a, b, precision=HIGHEST),
        ),
    }
    for rows in blocks:
        out[f"HIGHEST, blocks of {rows}"] = (
            lambda a, b, rows=rows: gram_in_row_blocks(a, HIGHEST, rows),
            lambda a, b, rows=rows: matmul_in_row_blocks(a, b, HIGHEST, rows),
        )
    return out


def compile_seconds(fn, shape: tuple[int, int], device) -> float:
    """Seconds to lower and compile `fn(a, b)` for a float32 `a` of `shape` and a
    `(w, w)` `b`, on `device`."""
    sharding = one_device(device)
    m, w = shape
    a = jax.ShapeDtypeStruct((m, w), jnp.float32, sharding=sharding)
    b = jax.ShapeDtypeStruct((w, w), jnp.float32, sharding=sharding)
    start = time.perf_counter()
    jax.jit(fn).lower(a, b).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--quick", action="store_true", help="one small sketch")
    add_out_argument(parser, __file__)
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    device = target_devices(args.target)[0]
    backend = f"{args.target} ({device.device_kind})" + (
        "" if args.target == "cpu" else ", compiled ahead of time, no TPU attached"
    )
    rows = []
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        for name, (gram, product) in variants(
            BLOCKS[:1] if args.quick else BLOCKS
        ).items():
            gram_s = compile_seconds(gram, shape, device)
            product_s = compile_seconds(product, shape, device)
            print(f"{shape} {name}: gram {gram_s:.1f} s, product {product_s:.1f} s")
            rows.append(f"| {shape} | {name} | {gram_s:.1f} | {product_s:.1f} |")
    lines = [
        *produced_by(
            f"Compile time of products at the highest precision, {args.target}"
        ),
        *environment(("jax", "jaxlib"), backend, load_at_start),
        "",
        "One float32 product under `jax.jit`, lowered and compiled, never run; seconds "
        "on this machine, one run each.",
        "",
        "| sketch `a` | precision | `a^T a` s | `a @ b` s, `b` `(w, w)` |",
        "|---|---|---:|---:|",
        *rows,
    ]
    write_results(lines, args.out, __file__, args.quick, args.target)


if __name__ == "__main__":
    main()
