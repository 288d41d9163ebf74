"""How much of a gradient's range the range finder keeps: nonzero columns of a fresh
rank-`r` projector, and the squared norm it misses, against Householder QR.

The projector of `qto.galore` and `qt.projected_cotangent` comes from a randomized
range finder: a sketch `Y = G S` of `w = r + 4` columns, orthonormalised from
`w x w` Gram matrices (`quax_tangents/_core/_sharding.py`, `orthonormal_columns`),
whose weakest directions become zero columns. Two parts:

- **Sketches:** `Y = G S` for `(m, n)` matrices `G` with singular values `1 / i^p`
  and random-sign `S`, float32. Per case, `orthonormal_columns`' kept columns and
  the part of `||G||^2` outside their span, beside the same for the `Q` of
  Householder QR (NumPy, float64) of the same sketch. Deterministic.
- **A model** (`--model`): the step of `bench_scale.py` (`projected-8bit`, random
  bfloat16 weights and tokens) run once on the default device, which refreshes
  every projector; then, per stacked matrix, the nonzero columns of its projectors
  (norm above 0.5), least, mean and most over the layers.

    python benchmarks/bench_projector_rank.py                 # the sketches
    python benchmarks/bench_projector_rank.py --model 1B      # and a 1B step
    python benchmarks/bench_projector_rank.py --quick         # small sketches

Writes `results/bench_projector_rank-<platform>.md` (a quick run's to
`results/quick/`), or to `--out`.
"""

import argparse
import os
import time


# `bench_scale` turns a CPU compiler pass off unless this is set; this run keeps
# every compiler's defaults.
os.environ["BENCH_SCALE_HOIST"] = "1"

# ruff: noqa: E402
import bench_scale as bs
import jax
import jax.numpy as jnp
import numpy as np
from _llama import MODELS, init_params
from _report import add_out_argument, environment, produced_by, write_results

import quax_tangents as qt
from quax_tangents._core._sharding import orthonormal_columns


# (m, n, rank, decay p): a GaLore layer's sizes at ranks 128 and 512.
CASES = (
    (2048, 5461, 512, 0.5),
    (2048, 5461, 512, 1.0),
    (5461, 2048, 512, 1.0),
    (2048, 5461, 512, 1.5),
    (2048, 2048, 128, 1.0),
)
QUICK_CASES = ((256, 384, 32, 1.0), (256, 384, 32, 2.0))
ARM = "projected-8bit"


def graded_matrix(rng, m: int, n: int, decay: float) -> np.ndarray:
    """An `(m, n)` float64 matrix with singular values `1 / i^decay`, `i >= 1`."""
    k = min(m, n)
    u = np.linalg.qr(rng.standard_normal((m, k)))[0]
    v = np.linalg.qr(rng.standard_normal((n, k)))[0]
    return (u / (1.0 + np.arange(k)) ** decay) @ v.T


def missed(q: np.ndarray, g: np.ndarray) -> float:
    """The part of `||g||^2` outside the span of `q`'s orthonormal columns."""
    return 1 - float(np.linalg.norm(q.T @ g) ** 2 / np.linalg.norm(g) ** 2)


def sketch_row(rng, m: int, n: int, rank: int, decay: float) -> str:
    """One case's table row."""
    width = rank + 4
    g = graded_matrix(rng, m, n, decay)
    y = g @ rng.choice([-1.0, 1.0], size=(n, width))
    q = np.asarray(jax.jit(orthonormal_columns)(jnp.asarray(y, jnp.float32)))
    q = q.astype(np.float64)
    live = q[:, np.linalg.norm(q, axis=0) > 0.5]
    householder = np.linalg.qr(y)[0]
    print(f"({m}, {n}) rank {rank}, 1/i^{decay}: {live.shape[1]} of {width} kept")
    return (
        f"| ({m}, {n}) | {rank} | 1/i^{decay} | {live.shape[1]} of {width} "
        f"| {missed(live, g):.2e} | {missed(householder, g):.2e} |"
    )


def projector_columns(model: str, microbatches: int, seq: int) -> list[str]:
    """The table rows of one refresh step of `bench_scale.py`'s step for `model`."""
    config = MODELS[model]
    params = jax.jit(lambda key: init_params(config, key))(jax.random.key(0))
    state = jax.jit(lambda p: bs.init_state(config, ARM, p))(params)
    shape = (microbatches, bs.MICROBATCH, seq + 1)
    tokens = jax.random.randint(jax.random.key(1), shape, 0, config.vocab, jnp.int32)
    step = jax.jit(bs.make_step(config, ARM), donate_argnums=(0, 1))
    start = time.perf_counter()
    with qt.fallback("silent"):
        _, state, loss = step(params, state, tokens)
        jax.block_until_ready(state)
    print(f"{model}: compiled and ran in {time.perf_counter() - start:.1f} s")
    rows = []
    rank = config.rank
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if not _is_projector(leaf, rank):
            continue
        norms = np.linalg.norm(np.asarray(leaf, np.float32), axis=-2)
        live = (norms > 0.5).sum(-1)
        name = jax.tree_util.keystr(path)
        rows.append(
            f"| `{name}` | {tuple(leaf.shape)} | {live.min()} | {live.mean():.1f} "
            f"| {live.max()} | {rank} |"
        )
        print(rows[-1])
    return rows


def _is_projector(leaf, rank: int) -> bool:
    """A stack of `(m, rank)` float projectors (the 8-bit moments are integers)."""
    return (
        isinstance(leaf, jax.Array)
        and jnp.issubdtype(leaf.dtype, jnp.floating)
        and leaf.ndim == 3
        and leaf.shape[-1] == rank
        and leaf.shape[-2] != rank
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sketches only")
    parser.add_argument("--model", choices=tuple(MODELS), help="also run its step")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--seq", type=int, default=bs.SEQ, help="tokens per sequence")
    add_out_argument(parser, __file__)
    args = parser.parse_args()
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    lines = [
        *produced_by(f"Columns a fresh projector keeps, {device.platform}"),
        *environment(("jax", "jaxlib"), f"{device.platform} ({device.device_kind})"),
        "",
        "## Sketches",
        "",
        "`orthonormal_columns` of the float32 sketch `Y = G S` (`rank + 4` "
        "random-sign columns) of `G` with singular values `1 / i^p`: its columns "
        "kept (norm above 0.5), and the part of `||G||^2` outside their span, "
        "beside that of Householder QR's `Q` of the same sketch (NumPy, float64).",
        "",
        "| G | rank | singular values | kept | missed | missed by QR |",
        "|---|---:|---|---:|---:|---:|",
        *(sketch_row(rng, *case) for case in (QUICK_CASES if args.quick else CASES)),
    ]
    if args.model:
        lines += [
            "",
            f"## The {args.model} step",
            "",
            f"`bench_scale.py`'s `{ARM}` step, {args.microbatches} microbatch(es) "
            f"of {bs.MICROBATCH} sequences of {args.seq} tokens, random weights and "
            "tokens, run once (a refresh of every projector); per projector stack, "
            "the nonzero columns (norm above 0.5) of its matrices: least, mean, most.",
            "",
            "| projector | shape | least | mean | most | of |",
            "|---|---|---:|---:|---:|---:|",
            *projector_columns(args.model, args.microbatches, args.seq),
        ]
    write_results(lines, args.out, __file__, args.quick, device.platform)


if __name__ == "__main__":
    main()
