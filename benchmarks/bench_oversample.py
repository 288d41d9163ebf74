"""How much of a gradient's energy a fresh projector keeps, with and without the
range finder's oversampling.

A refresh finds the projector `P` (`rank` columns) of a weight's gradient `G` with a
randomized range finder: a sketch `G Ω`, `iters` power iterations, and a final small
SVD. With `p` extra columns in `Ω` (oversampling, 4 by default) the final SVD drops
them; with `p = 0` the sketch would have `rank` columns, the width of the pass every
step makes, so that `accumulate_gradients` could find a refresh's projector with the
step's own pass (two passes on a refresh step instead of four). This measures what
dropping the oversampling would cost: the fraction of `||G||^2` that `P P^T G` keeps,
against the truncated SVD's (the best any rank-`rank` projector keeps), for
matrices with singular values `s_i = i^-decay` and random singular vectors, the
mean over a few keys. Deterministic for fixed keys; runs in seconds on a CPU.

    python benchmarks/bench_oversample.py

Writes `benchmarks/results/bench_oversample.md` (a quick run's to `results/quick/`).
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from _report import add_out_argument, default_out, environment, produced_by

from quax_tangents._marks._projection import Finish, _range_basis


# (m, n, rank): a small test size, and the 1B model's MLP scaled down 2x on each side
# with its rank (GaLore's 1B: 2048 x 5461 at rank 512).
SHAPES = ((64, 128, 4), (256, 512, 16), (1024, 2730, 256))
QUICK_SHAPES = ((64, 128, 4),)
DECAYS = (0.5, 1.0)
ITERS = (0, 1)
OVERSAMPLES = (0, 4)
KEYS = 3


def spectrum_matrix(key, m: int, n: int, decay: float) -> jax.Array:
    """An `(m, n)` float32 matrix with singular values `i^-decay`."""
    ku, kv = jax.random.split(key)
    u, _ = jnp.linalg.qr(jax.random.normal(ku, (m, m)))
    v, _ = jnp.linalg.qr(jax.random.normal(kv, (n, m)))
    s = jnp.arange(1, m + 1, dtype=jnp.float32) ** -decay
    return (u * s) @ v.T


def kept(g: jax.Array, p: jax.Array) -> float:
    """The fraction of `||g||^2` in the span of `p`'s orthonormal columns."""
    return float(jnp.sum((p.T @ g) ** 2) / jnp.sum(g**2))


def best_kept(g: jax.Array, rank: int) -> float:
    s = jnp.linalg.svd(g, compute_uv=False)
    return float(jnp.sum(s[:rank] ** 2) / jnp.sum(s**2))


@functools.partial(jax.jit, static_argnames=("rank", "iters", "oversample"))
def _range_finder_basis(g: jax.Array, key, *, rank: int, iters: int, oversample: int):
    spec = Finish("projected", rank, iters, oversample=oversample)
    return _range_basis(lambda v: g @ v, lambda u: g.T @ u, g.shape, spec, key)


def range_finder_kept(
    g: jax.Array, rank: int, iters: int, oversample: int, key
) -> float:
    """What the projection's own range finder keeps (`quax_tangents._marks`)."""
    p = _range_finder_basis(g, key, rank=rank, iters=iters, oversample=oversample)
    return kept(g, p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the smallest shape")
    add_out_argument(parser, __file__)
    args = parser.parse_args()
    rows = []
    for m, n, rank in QUICK_SHAPES if args.quick else SHAPES:
        for decay in DECAYS:
            for iters in ITERS:
                best, found = 0.0, {p: 0.0 for p in OVERSAMPLES}
                for k in range(KEYS):
                    g_key, omega_key = jax.random.split(jax.random.key(k))
                    g = spectrum_matrix(g_key, m, n, decay)
                    best += best_kept(g, rank) / KEYS
                    for p in OVERSAMPLES:
                        found[p] += (
                            range_finder_kept(g, rank, iters, p, omega_key) / KEYS
                        )
                cells = " | ".join(f"{found[p]:.4f}" for p in OVERSAMPLES)
                loss = (found[OVERSAMPLES[-1]] - found[0]) / found[OVERSAMPLES[-1]]
                print(
                    f"{m}x{n} r{rank} decay {decay} iters {iters}: best {best:.4f}, "
                    f"oversample {OVERSAMPLES}: {cells}"
                )
                rows.append(
                    f"| {m} x {n} | {rank} | {decay} | {iters} | {best:.4f} | {cells} "
                    f"| {100 * loss:.1f}% |"
                )
    header = " | ".join(f"oversample {p}" for p in OVERSAMPLES)
    lines = [
        *produced_by("Energy a fresh projector keeps, with and without oversampling"),
        *environment(("jax", "jaxlib"), f"{jax.default_backend()}, float32"),
        "",
        "Fraction of `||G||^2` kept by `P P^T G` for `G` with singular values "
        f"`i^-decay` and random singular vectors, the mean over {KEYS} keys; *best* "
        "is the truncated SVD's. *Lost* is what oversampling 0 keeps less than "
        f"oversampling {OVERSAMPLES[-1]}, relative to it.",
        "",
        f"| shape | rank | decay | iters | best | {header} | lost |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(OVERSAMPLES) + "---:|",
        *rows,
    ]
    out = args.out or default_out(__file__, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
