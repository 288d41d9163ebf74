"""What a loop around a scanned model's gradient costs on a TPU compile: whole copies
of the weight stacks, in the layout the loop's matmuls read them in.

No `quax_tangents` here: plain JAX, so that a figure says what the compiler does,
not what the library does. The model is the attention of `bench_scale.py`'s 1B
Llama (24 layers of `q`, `k`, `v` and `o`, `(24, 2048, 2048)` bfloat16 stacks,
`lax.scan` over a checkpointed block, 2 sequences of 256 tokens); each arm is a
donated step that takes the gradient and an SGD update:

- `no loop`: the gradient once;
- `while_loop`: the gradient inside a `lax.while_loop` whose trip count is traced
  (one pass on most steps, more on some: gradient accumulation over a varying
  number of microbatches, or `quax_tangents.optax.galore`'s refresh passes, which
  its step runs in such a loop so that the model's pass is compiled once);
- `scan + cond`: the gradient in a `lax.cond` inside a `lax.scan` of 3 trips, the
  loop with a known trip count;
- `while_loop, carried row-major`: the `while_loop` arm with the weights carried by
  the loop instead of closed over, and constrained to their row-major layout
  inside it (`jax.experimental.layout.with_layout_constraint`), as
  `quax_tangents.optax.galore`'s step carries them.

Per arm: the compiled step's temporaries (`memory_analysis()`) and the weight
stacks it copies whole (the compiled HLO's `copy` of a full stack's shape). Each
step is compiled ahead of time and never run.

    python benchmarks/bench_loop_layouts.py --target tpu-v5e   # one chip, no TPU
    python benchmarks/bench_loop_layouts.py                    # XLA:CPU
    python benchmarks/bench_loop_layouts.py --quick            # small shapes, CPU

A TPU target needs libtpu (`pip install "jax[tpu]"`, kept out of the test
environment); one process can hold it at a time. Writes
`benchmarks/results/bench_loop_layouts-<target>.md` (a quick run's to
`results/quick/`), or to `--out`.
"""

import argparse
import functools
import math
import re

import jax
import jax.numpy as jnp
from _report import add_out_argument, environment, produced_by, write_results
from _targets import TARGETS, one_device, target_devices
from jax.experimental.layout import Layout, with_layout_constraint


# (layers, width, heads, batch, sequence): the 1B's attention, and a small one.
FULL = (24, 2048, 32, 2, 256)
QUICK = (2, 128, 4, 2, 16)
NAMES = ("q", "k", "v", "o")


def _block(heads: int, h: jax.Array, w: dict) -> tuple[jax.Array, None]:
    b, s, d = h.shape
    dh = d // heads
    q, k, v = ((h @ w[n]).reshape(b, s, heads, dh) for n in ("q", "k", "v"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(dh)
    attn = jax.nn.softmax(scores, axis=-1).astype(h.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, d)
    return h + out @ w["o"], None


def _loss(heads: int, params: dict, x: jax.Array) -> jax.Array:
    h, _ = jax.lax.scan(jax.checkpoint(functools.partial(_block, heads)), x, params)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _sgd(params: dict, grads: dict) -> dict:
    return jax.tree.map(lambda p, g: p - 1e-3 * g.astype(p.dtype), params, grads)


def _plus(a: dict, b: dict) -> dict:
    return jax.tree.map(jnp.add, a, b)


def no_loop(heads: int, params: dict, x: jax.Array, trips: jax.Array) -> dict:
    del trips
    return _sgd(params, jax.grad(functools.partial(_loss, heads))(params, x))


def while_loop(heads: int, params: dict, x: jax.Array, trips: jax.Array) -> dict:
    grad = jax.grad(functools.partial(_loss, heads))

    def body(carry: tuple) -> tuple:
        i, total = carry
        return i + 1, _plus(total, grad(params, x))

    zeros = jax.tree.map(jnp.zeros_like, params)
    _, total = jax.lax.while_loop(lambda c: c[0] < trips, body, (0, zeros))
    return _sgd(params, total)


def scan_cond(heads: int, params: dict, x: jax.Array, trips: jax.Array) -> dict:
    grad = jax.grad(functools.partial(_loss, heads))

    def body(total: dict, t: jax.Array) -> tuple:
        add = lambda total: _plus(total, grad(params, x))  # noqa: E731
        return jax.lax.cond(t < trips, add, lambda total: total, total), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    total, _ = jax.lax.scan(body, zeros, jnp.arange(3))
    return _sgd(params, total)


def _row_major(x: jax.Array) -> jax.Array:
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


def carried_row_major(heads: int, params: dict, x: jax.Array, trips: jax.Array) -> dict:
    grad = jax.grad(functools.partial(_loss, heads))

    def body(carry: tuple) -> tuple:
        i, weights, total = carry
        weights = jax.tree.map(_row_major, weights)
        return i + 1, weights, _plus(total, grad(weights, x))

    zeros = jax.tree.map(jnp.zeros_like, params)
    _, _, total = jax.lax.while_loop(lambda c: c[0] < trips, body, (0, params, zeros))
    return _sgd(params, total)


ARMS = {
    "no loop": no_loop,
    "while_loop": while_loop,
    "scan + cond": scan_cond,
    "while_loop, carried row-major": carried_row_major,
}


def whole_stack_copies(hlo: str, stack_shape: str) -> int:
    """The `copy` instructions of a compiled module whose result is a whole stack."""
    pattern = re.compile(rf"= {re.escape(stack_shape)}\{{[^}}]*\}} copy\(")
    return sum(1 for line in hlo.splitlines() if pattern.search(line))


def measure(arm: str, shape: tuple, device) -> tuple[float, int]:
    """`(temp GiB, whole stack copies)` of one arm's compiled step."""
    layers, width, heads, batch, seq = shape
    one = one_device(device)
    stack = jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16, sharding=one)
    params = {n: stack for n in NAMES}
    x = jax.ShapeDtypeStruct((batch, seq, width), jnp.bfloat16, sharding=one)
    trips = jax.ShapeDtypeStruct((), jnp.int32, sharding=one)
    step = jax.jit(functools.partial(ARMS[arm], heads), donate_argnums=0)
    compiled = step.lower(params, x, trips).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
    copies = whole_stack_copies(compiled.as_text(), f"bf16[{layers},{width},{width}]")
    return temp, copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes, CPU")
    add_out_argument(parser, __file__)
    args = parser.parse_args()
    target = "cpu" if args.quick else args.target
    device = target_devices(target)[0]
    shape = QUICK if args.quick else FULL
    rows = []
    for arm in ARMS:
        temp, copies = measure(arm, shape, device)
        print(f"{arm}: temp {temp:.3f} GiB, {copies} whole stack copies")
        rows.append(f"| {arm} | {temp:.3f} | {copies} |")
    backend = f"{target} ({device.device_kind})" + (
        "" if target == "cpu" else ", compiled ahead of time, no TPU attached"
    )
    layers, width, heads, batch, seq = shape
    packages = ("jax", "jaxlib") + (() if target == "cpu" else ("libtpu",))
    lines = [
        *produced_by(f"Whole copies of the weight stacks in a loop, {target}"),
        *environment(packages, backend),
        "",
        f"{layers} layers of `q`, `k`, `v`, `o` (`({layers}, {width}, {width})` "
        f"bfloat16 stacks, {heads} heads), `lax.scan` over a checkpointed block, "
        f"{batch} sequences of {seq} tokens; arms as in the script's docstring. "
        "*Whole stack copies*: `copy` instructions of the compiled step whose result "
        "is a whole stack.",
        "",
        "| arm | temp GiB | whole stack copies |",
        "|---|---:|---:|",
        *rows,
    ]
    write_results(lines, args.out, __file__, args.quick, target)


if __name__ == "__main__":
    main()
