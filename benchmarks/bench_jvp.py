"""JVP of a 4-layer tanh MLP with a tangent on every weight, three ways.

- `dense`: plain `jax.jvp` with a dense tangent on every weight;
- `lowrank-r<k>`: `quax_tangents.jvp` with a rank-k `LowRank` tangent on every weight;
- `hand-r<k>`: the same factored math written directly in JAX,
  `dh_next = tanh'(z) * (dh @ W + (h @ U) @ V.T)`.

Everything runs under `jax.jit` and `quax_tangents.fallback("silent")`, in one process.
Runtimes are reported as ratios of variants timed interleaved, because the machine is
shared; compiled FLOPs and memory are deterministic and reported as they are.

    python benchmarks/bench_jvp.py          # widths 2048 and 4096, batch 256, 5 repeats
    python benchmarks/bench_jvp.py --quick  # width 256, batch 32, 2 repeats (smoke run)

The results go to benchmarks/results/bench_jvp.md (a quick run's to
benchmarks/results/quick/, which git ignores), or to `--out`. The measurements are in
`_jvp_measure.py`, the report's tables and prose in `_jvp_report.py`.
"""

import argparse
import os
import time

from _jvp_measure import FULL, QUICK, run_width
from _jvp_report import report
from _report import add_out_argument, default_out

import quax_tangents as qt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="width 256, batch 32, 2 repeats: a smoke run that takes seconds",
    )
    add_out_argument(parser, __file__)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = QUICK if args.quick else FULL
    out = args.out or default_out(__file__, args.quick)
    start, load_at_start = time.perf_counter(), os.getloadavg()
    # Silent: the tanh densifies by design, and the counts are reported instead.
    with qt.fallback("silent"):
        results = [run_width(width, config) for width in config.widths]
    text = report(config, results, time.perf_counter() - start, load_at_start)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
