"""Bytes one device receives to sum a compressed gradient over 2, 4 and 8 devices, per
schedule, and the schedule that `quax_tangents.all_reduce` chooses by default.

Run it with

    python benchmarks/bench_schedule.py

(a minute or two of compilation on two CPU cores; `--quick` for a smaller matrix,
whose results go to `benchmarks/results/quick/`, which git ignores). It writes
`benchmarks/results/bench_schedule.md`. For each compressor it compiles, on meshes of
the first 2, 4 and 8 of 8 host CPU devices, the sum of one compressed matrix by the
dense ring all-reduce (`lax.psum` of the dense matrix), `GatherSum`, `TwoPhase` and
the default (`Cheapest`), and reads the bytes each device receives from the compiled
HLO (`quax_tangents.hlo.received_bytes`). Nothing is run. It checks, and exits non-zero
otherwise, that the default receives the fewest bytes of the three, never more than
the dense all-reduce, and exactly what `quax_tangents.hlo.schedule_bytes` predicts from
shapes.
"""

# JAX reads XLA_FLAGS when it first starts its CPU backend, so the device count is
# set before anything imports JAX.
# ruff: noqa: E402

import os


_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}"

import argparse
import functools as ft
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _report import add_out_argument, default_out, environment, produced_by
from jax.sharding import NamedSharding, PartitionSpec as P

import quax_tangents as qt
from quax_tangents._distributed._schedule import cheapest_schedule


AXIS = "d"
DEVICE_COUNTS = (2, 4, 8)
COMPRESSORS = {
    "int8 (quantize)": ft.partial(qt.quantize, bits=8),
    "sign (sign_norm)": qt.sign_norm,
    "top-k 1%": lambda x: qt.top_k(x, 0.01),
    "top-k 60%": lambda x: qt.top_k(x, 0.6),
    "low-rank r=4": lambda x: qt.low_rank(x, 4),
}
METHODS = {
    "gather": qt.GatherSum(),
    "two_phase": qt.TwoPhase(),
    "default": None,
}


def received(body, devices: int, shape: tuple[int, int]) -> tuple[float, list[str]]:
    mesh = jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])
    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(), check_vma=True)
    )
    xs = jax.ShapeDtypeStruct(
        (devices, *shape), jnp.float32, sharding=NamedSharding(mesh, P(AXIS))
    )
    found = qt.hlo.collectives(step, xs)
    return sum(qt.hlo.received_bytes(c, devices) for c in found), [
        c.kind for c in found
    ]


def measure(shape: tuple[int, int]) -> list[dict]:
    rows = []
    for name, compressor in COMPRESSORS.items():
        value = compressor(jnp.ones(shape))
        for n in DEVICE_COUNTS:
            dense, _ = received(lambda x: qt.all_reduce(x[0], AXIS), n, shape)
            row = {"name": name, "n": n, "dense": dense}
            for method_name, method in METHODS.items():

                def body(x, method=method, compressor=compressor):
                    out = qt.all_reduce(compressor(x[0]), AXIS, method)
                    return qt.materialise(out)

                with qt.fallback("silent"):
                    row[method_name], kinds = received(body, n, shape)
                if method_name == "two_phase" and "all-to-all" not in kinds:
                    row[method_name] = None  # no chunks: TwoPhase gathers
            row["choice"] = cheapest_schedule(value, n)
            row["predicted"] = qt.hlo.schedule_bytes(value, n)[row["choice"]]
            rows.append(row)
    return rows


def kb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e3:.1f}"


def check(row: dict) -> bool:
    options = [row[k] for k in ("dense", "gather", "two_phase") if row[k] is not None]
    return (
        row["default"] <= row["dense"]
        and row["default"] <= min(options)
        and row["default"] == row["predicted"]
    )


def report(rows: list[dict], shape: tuple[int, int]) -> tuple[str, bool]:
    lines = produced_by("Collective schedules: bytes received per device")
    lines += [
        f"One float32 `{shape[0]} x {shape[1]}` matrix, compressed on each device "
        "and summed over the devices inside `shard_map`. Kilobytes one device "
        "receives, read from the compiled HLO (all-gather: `(n - 1)` times its "
        "operand; all-to-all: `(n - 1) / n` of it; ring all-reduce: "
        "`2 (n - 1) / n` of it). `-`: the type has no chunks, so `TwoPhase` "
        "gathers. `default` is `qt.all_reduce(x, axis)` without a method, which "
        "chooses the schedule shown; `ok` means it received the fewest bytes of the "
        "three, no more than dense, and exactly what `qt.hlo.schedule_bytes` predicts.",
        "",
        "| compressor | devices | dense ring | gather | two-phase | default "
        "| chosen | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    all_ok = True
    for row in rows:
        ok = check(row)
        all_ok &= ok
        lines.append(
            f"| {row['name']} | {row['n']} | {kb(row['dense'])} | {kb(row['gather'])} "
            f"| {kb(row['two_phase'])} | {kb(row['default'])} | {row['choice']} "
            f"| {'ok' if ok else 'FAILED'} |"
        )
    lines += ["", "## Environment", ""]
    lines += environment(("jax", "jaxlib"), jax.default_backend())
    return "\n".join(lines) + "\n", all_ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller matrix")
    add_out_argument(parser, __file__)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out or default_out(__file__, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    shape = (64, 128) if args.quick else (256, 384)
    text, ok = report(measure(shape), shape)
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
