"""What the layer-by-layer projection of `qto.accumulate_gradients` and `qto.mark`
saves, by how a scanned model holds its stacked weights.

One gradient over a stack of attention-like layers run by `lax.scan` over a
checkpointed body, compiled with `by_layer=True` (the default) and `by_layer=False`,
for four layouts of the same weights. `--path accumulate` (the default) takes it
with `accumulate_gradients` over 4 microbatches; `--path mark` with
`quax_tangents.value_and_grad` of the loss with `qto.mark(params, state)`, over the
same tokens as one batch. The layouts:

- `matrices`: each weight stored `(layers, d, heads * head_dim)`;
- `per-head`: stored `(layers, d, heads, head_dim)` and viewed with `dims=(1, 1)`,
  as some public JAX models store attention weights;
- `jit around the scan`: `matrices`, with a `jax.jit` around the scan;
- `inside an outer scan`: `matrices`, the scan over the stack inside an outer scan
  (of one step) that closes over the stack, which the layer-by-layer projection
  cannot see into (it warns a `LayerByLayerWarning`).

The figure is XLA's compiled `temp` bytes (the buffers beyond inputs and outputs),
not a timing. Run it with

    python benchmarks/bench_by_layer.py                  # 8 layers, d = 512, CPU
    python benchmarks/bench_by_layer.py --shape large    # 16 layers, d = 2048
    python benchmarks/bench_by_layer.py --target tpu-v5e # one v5e chip, no TPU
    python benchmarks/bench_by_layer.py --path mark      # the marks in the loss
    python benchmarks/bench_by_layer.py --quick          # tiny (smoke run)

A TPU target needs libtpu (`pip install "jax[tpu]"`, kept out of the test
environment). The results go to
benchmarks/results/bench_by_layer-<shape>-<target>.md (`--path mark`:
bench_by_layer-mark-<shape>-<target>.md; a quick run's to
benchmarks/results/quick/, which git ignores), or to `--out`.
"""

import argparse
import dataclasses
import time
import warnings

import jax
import jax.numpy as jnp
import optax
from _report import add_out_argument, default_out, environment, produced_by
from _targets import TARGETS, one_device, target_devices

import quax_tangents as qt
import quax_tangents.optax as qto


PATHS = ("accumulate", "mark")
LAYOUTS = ("matrices", "per-head", "jit around the scan", "inside an outer scan")
MICROBATCHES = 4


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    d: int
    heads: int
    head_dim: int
    batch: int
    seq: int
    rank: int


SHAPES = {
    "small": Shape(layers=8, d=512, heads=8, head_dim=64, batch=4, seq=256, rank=32),
    # A 1B-class layer's attention projections, 16 layers.
    "large": Shape(
        layers=16, d=2048, heads=16, head_dim=128, batch=4, seq=1024, rank=256
    ),
}
QUICK = Shape(layers=2, d=32, heads=2, head_dim=8, batch=2, seq=8, rank=4)


def _matrix_layer(x, w):
    q = x @ w["wq"]  # (batch, seq, heads * head_dim)
    return x + jnp.tanh(q @ w["wo"].T), None


def _per_head_layer(x, w):
    q = jnp.einsum("btd,dnh->btnh", x, w["wq"])
    return x + jnp.tanh(jnp.einsum("btnh,dnh->btd", q, w["wo"])), None


def _model(layout: str):
    def matrices(p, x):
        return jax.lax.scan(jax.checkpoint(_matrix_layer), x, p)[0]

    def per_head(p, x):
        return jax.lax.scan(jax.checkpoint(_per_head_layer), x, p)[0]

    def nested(p, x):
        return jax.lax.scan(lambda c, _: (matrices(p, c), None), x, None, length=1)[0]

    return {
        "matrices": matrices,
        "per-head": per_head,
        "jit around the scan": jax.jit(matrices),
        "inside an outer scan": nested,
    }[layout]


def _abstract(shape: Shape, layout: str, sharding) -> tuple:
    s = shape
    stored = (
        (s.layers, s.d, s.heads, s.head_dim)
        if layout == "per-head"
        else (s.layers, s.d, s.heads * s.head_dim)
    )
    weight = jax.ShapeDtypeStruct(stored, jnp.float32, sharding=sharding)
    params = {"wq": weight, "wo": weight}
    tokens = jax.ShapeDtypeStruct(
        (MICROBATCHES, s.batch, s.seq, s.d), jnp.float32, sharding=sharding
    )
    return params, tokens


def _dims(layout: str):
    # The per-head weights' matrix view: (layers, d, heads * head_dim).
    return (lambda w: (1, 1)) if layout == "per-head" else None


def temp_bytes(
    shape: Shape, layout: str, path: str, by_layer: bool, devices: list
) -> int:
    """The compiled `temp` bytes of one gradient, taken the way `path` names."""
    sharding = one_device(devices[0])
    params, tokens = _abstract(shape, layout, sharding)
    tx = qto.projected(optax.scale_by_adam(), rank=shape.rank, dims=_dims(layout))
    state = jax.eval_shape(tx.init, params)
    state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state
    )
    model = _model(layout)

    def loss(p, x):
        return jnp.mean(model(p, x) ** 2)

    def accumulated(p, s, x):
        return qto.accumulate_gradients(loss, p, s, x, by_layer=by_layer)

    def marked(p, s, x):
        batch = x.reshape(-1, *x.shape[2:])
        marked_loss = lambda p: loss(qto.mark(p, s, by_layer=by_layer), batch)  # noqa: E731
        return qt.value_and_grad(marked_loss)(p)

    step = accumulated if path == "accumulate" else marked

    with warnings.catch_warnings():
        # The `inside an outer scan` layout warns, as it should; the table says so.
        warnings.simplefilter("ignore", qto.LayerByLayerWarning)
        compiled = jax.jit(step).lower(params, state, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--path", choices=PATHS, default="accumulate")
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    add_out_argument(parser, __file__)
    args = parser.parse_args()
    shape = QUICK if args.quick else SHAPES[args.shape]
    devices = target_devices(args.target)
    rows = []
    start = time.perf_counter()
    for layout in LAYOUTS:
        on, off = (
            temp_bytes(shape, layout, args.path, b, devices) for b in (True, False)
        )
        rows.append((layout, on, off))
    seconds = time.perf_counter() - start
    mib = 2**20
    taken = {
        "accumulate": f"`accumulate_gradients` over {MICROBATCHES} microbatches of",
        "mark": f"`qt.value_and_grad` with `qto.mark`, one batch of {MICROBATCHES} x",
    }[args.path]
    name = "accumulate_gradients" if args.path == "accumulate" else "mark"
    lines = produced_by(f"The layer-by-layer projection of `{name}`")
    lines += [
        f"One gradient by {taken} {shape.batch} x {shape.seq} "
        f"tokens, {shape.layers} scanned layers of two weights (d = {shape.d}, "
        f"{shape.heads} heads of {shape.head_dim}), rank {shape.rank}; compiled for "
        f"{args.target} ({devices[0].device_kind}). XLA's temp bytes:",
        "",
        "| layout | by_layer=True | by_layer=False | ratio |",
        "|---|---|---|---|",
    ]
    for layout, on, off in rows:
        lines.append(
            f"| {layout} | {on / mib:.2f} MiB | {off / mib:.2f} MiB | {on / off:.2f} |"
        )
    lines += ["", f"Compiled in {seconds:.0f} s in all.", ""]
    backend = (
        jax.default_backend()
        if args.target == "cpu"
        else f"{args.target}, compiled ahead of time with no TPU attached"
    )
    lines += environment(("jax", "jaxlib", "quax", "optax"), backend)
    out = args.out or default_out(__file__, args.quick)
    if args.out is None and not args.quick:
        path = "" if args.path == "accumulate" else f"-{args.path}"
        out = out.with_name(f"{out.stem}{path}-{args.shape}-{args.target}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
