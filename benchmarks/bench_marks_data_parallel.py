"""Data parallel with the marks written by hand, on an 8-chip slice: the bytes each
chip receives per step for the gradient of an embedding and a scanned stack of
layers.

Inside `jax.shard_map`, with the weights replicated and the batch split over the
chips, three ways to take the gradient of the mean loss (`lax.pmean`):

- `jax.value_and_grad`: JAX's own, dense: an all-reduce of every weight's gradient;
- `qto.mark(params, state)`: JAX's sum over the chips comes before the marks'
    projection, of every token's factors of each gradient; where gathering them
    would receive more than a dense all-reduce, the dense gradients are summed
    (counted as densifications, the *densified* column);
- `qto.mark(params, state, axis_name="data")`: each chip projects its own gradient,
    and the sum moves the projected factors only.

The model is an embedding table read at each chip's tokens, then a stack of MLP
layers under `lax.scan` (`h + gelu(h @ up) @ down`), bfloat16 weights;
`qto.projected(optax.scale_by_adam(), rank=RANK)` projects both stacks and updates
the table by rows (`rows=`: its gradient is a `SparseRows` of the rows read, which
the sum over chips gathers while that receives less than a dense all-reduce). Bytes
come from the compiled program's collectives (`qt.hlo.collectives`,
`qt.hlo.received_bytes`) on a step that keeps the projectors (every switch on its
branch 0). Each step is compiled ahead of time for the slice, never run.

    python benchmarks/bench_marks_data_parallel.py --target tpu-v5e
    python benchmarks/bench_marks_data_parallel.py            # 8 host CPU devices
    python benchmarks/bench_marks_data_parallel.py --quick    # small, 8 host devices

A TPU target needs libtpu (`pip install "jax[tpu]"`); one process can hold it at a
time. Writes `benchmarks/results/bench_marks_data_parallel-<target>.md` (a quick
run's to `results/quick/`), or to `--out`.
"""

import os
import sys

from _targets import TARGETS, is_tpu_target, target_devices


DEVICES = 8
if not is_tpu_target(sys.argv):
    # The CPU target: 8 host devices, asked for before JAX starts.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={DEVICES}"
    )

# ruff: noqa: E402
import argparse
import warnings

import jax
import jax.numpy as jnp
import optax
from _report import add_out_argument, environment, produced_by, write_results
from jax.sharding import NamedSharding, PartitionSpec as P

import quax_tangents as qt
import quax_tangents.optax as qto


# (layers, width, hidden, tokens per chip, rank, vocabulary)
SIZES = (4, 1024, 4096, 2048, 128, 32000)
QUICK_SIZES = (2, 64, 256, 64, 8, 4096)


def _loss(params, tokens):
    def layer(h, w):
        up, down = w
        return h + jax.nn.gelu(h @ up) @ down, None

    x = params["embed"][tokens]
    h, _ = jax.lax.scan(layer, x, (params["up"], params["down"]))
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _dense(params, state, x):
    del state
    return jax.value_and_grad(lambda p: jax.lax.pmean(_loss(p, x), "data"))(params)


def _marked(axis_name):
    def step(params, state, x):
        def marked(p):
            loss = _loss(qto.mark(p, state, axis_name=axis_name), x)
            return jax.lax.pmean(loss, "data")

        return qt.value_and_grad(marked)(params)

    return step


ARMS = {
    "jax.value_and_grad": _dense,
    "qto.mark(params, state)": _marked(None),
    'qto.mark(params, state, axis_name="data")': _marked("data"),
}


def measure(target: str, sizes: tuple) -> list[tuple[str, float, int]]:
    """Per arm: MiB one chip receives per step, and densifications counted."""
    layers, width, hidden, tokens, rank, vocab = sizes
    mesh = jax.make_mesh(
        (DEVICES,), ("data",), devices=target_devices(target, DEVICES)[:DEVICES]
    )
    replicated = NamedSharding(mesh, P())

    def abstract(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
            tree,
        )

    params = {
        "embed": jax.ShapeDtypeStruct((vocab, width), jnp.bfloat16),
        "up": jax.ShapeDtypeStruct((layers, width, hidden), jnp.bfloat16),
        "down": jax.ShapeDtypeStruct((layers, hidden, width), jnp.bfloat16),
    }
    tx = qto.projected(
        optax.scale_by_adam(),
        rank=rank,
        learning_rate=1e-3,
        project=lambda p: {"embed": False, "up": True, "down": True},
        rows=lambda p: {"embed": True, "up": False, "down": False},
    )
    state = jax.eval_shape(tx.init, params)
    x = jax.ShapeDtypeStruct(
        (DEVICES * tokens,), jnp.int32, sharding=NamedSharding(mesh, P("data"))
    )
    rows = []
    for name, fn in ARMS.items():
        qt.reset_fallback_counts()
        with qt.fallback("silent"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step = jax.shard_map(
                fn, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P()
            )
            compiled = (
                jax.jit(step).lower(abstract(params), abstract(state), x).compile()
            )
        collectives = qt.hlo.collectives(compiled, unknown_trips=1, branch=0)
        received = sum(qt.hlo.received_bytes(c, DEVICES) for c in collectives)
        densified = sum(qt.fallback_counts().values())
        print(f"{name}: {received / 2**20:.2f} MiB, {densified} densified")
        rows.append((name, received / 2**20, densified))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes")
    add_out_argument(parser, __file__)
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    sizes = QUICK_SIZES if args.quick else SIZES
    rows = measure(args.target, sizes)
    layers, width, hidden, tokens, rank, vocab = sizes
    backend = args.target + (
        "" if args.target == "cpu" else ", compiled ahead of time, no TPU attached"
    )
    dense = rows[0][1]
    packages = ("jax", "jaxlib", "optax") + (
        () if args.target == "cpu" else ("libtpu",)
    )
    lines = [
        *produced_by(f"Data parallel with the marks, {args.target}"),
        *environment(packages, backend, load_at_start),
        "",
        f"{DEVICES} devices; an embedding `({vocab}, {width})` (`rows=`), then "
        f"{layers} layers of `up` `({width}, {hidden})` and `down` `({hidden}, "
        f"{width})`, bfloat16, under `lax.scan`; {tokens} tokens per device; rank "
        f"{rank}. Received: MiB per device per step, on a step that keeps the "
        "projectors.",
        "",
        "| gradient | received MiB | ÷ dense | densified |",
        "|---|---:|---:|---:|",
        *(
            f"| `{name}` | {mib:.2f} | {mib / dense:.3f} | {count} |"
            for name, mib, count in rows
        ),
    ]
    write_results(lines, args.out, __file__, args.quick, args.target)


if __name__ == "__main__":
    main()
