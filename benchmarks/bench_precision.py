"""How orthonormal a fresh projector is at each matmul precision of the
orthonormalisation, on the default device.

`orthonormal_columns` and `top_left_singular` (`quax_tangents/_core/_sharding.py`)
build a projector from `w x w` Gram matrices. A TPU runs a float32 product at the
default precision as one bfloat16 pass (a GPU, as TensorFloat-32), so a Gram matrix
so computed is off by about 3e-3 of its largest entry. The library asks for
`HIGHEST` (`_sharding.EXACT`); this script runs each case twice in one process,
with `EXACT` as shipped and set to `DEFAULT`, and reports per case:

- *orthonormality*: `max |Q^T Q - I|` over `Q`'s nonzero columns (float64, on the
  host), of `orthonormal_columns` of a float32 sketch `Y = G S` (`G` with singular
  values `1 / i`, `S` random signs, `rank + 4` columns), and of the projector
  `Q U` of the whole range finder's truncation (`U` from `top_left_singular` of
  `(G^T Q)^T`);
- *kept*: `Q`'s nonzero columns;
- *ms*: the median of 10 runs of the compiled `orthonormal_columns`, and their
  ratio;
- the check a traced projector gets (`check_orthonormal` in the program, under
  `qt.fallback("error")`): `max |P^T P - I|` of an exactly orthonormal float32 `P`
  (Householder QR in float64, rounded), against the tolerance for its shape.

On a CPU the precisions agree (a CPU computes float32 products in float32).

    python benchmarks/bench_precision.py            # the default device
    python benchmarks/bench_precision.py --quick    # small cases

Writes `results/bench_precision-<platform>.md` (a quick run's to `results/quick/`),
or to `--out`.
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from _report import add_out_argument, environment, produced_by, write_results
from bench_projector_rank import graded_matrix

from quax_tangents._core import _sharding
from quax_tangents._marks import _orthonormal


# (m, n, rank): a GaLore layer's sketch at rank 512, and a smaller one.
CASES = ((5461, 2048, 512), (2048, 5461, 512), (2048, 2048, 128))
QUICK_CASES = ((256, 384, 32),)
PRECISIONS = (("HIGHEST (shipped)", _sharding.EXACT), ("DEFAULT", None))
RUNS = 10


def _orthonormality(q: np.ndarray) -> float:
    q = q.astype(np.float64)
    live = q[:, np.linalg.norm(q, axis=0) > 0.5]
    return float(np.abs(live.T @ live - np.eye(live.shape[1])).max())


def _median_ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def _projector(y: jax.Array, g: jax.Array, rank: int) -> jax.Array:
    q = _sharding.orthonormal_columns(y)
    u = _sharding.top_left_singular((g.T @ q).T, rank)
    return _sharding.matmul(q, u, _sharding.EXACT)


def measure(y: jax.Array, g: jax.Array, rank: int) -> dict:
    """The figures of one sketch at the precision `_sharding.EXACT` names now (new
    function objects, so that each precision is traced anew)."""
    orthonormal = jax.jit(lambda y: _sharding.orthonormal_columns(y))
    q = np.asarray(orthonormal(y))
    projector = np.asarray(jax.jit(lambda y, g: _projector(y, g, rank))(y, g))
    return {
        "q": _orthonormality(q),
        "kept": int((np.linalg.norm(q, axis=0) > 0.5).sum()),
        "projector": _orthonormality(projector),
        "ms": _median_ms(orthonormal, y),
    }


def check_error(shape: tuple[int, int]) -> float:
    """`max |P^T P - I|` as the in-program check computes it, for an exactly
    orthonormal float32 `P` of `shape`."""
    rng = np.random.default_rng(1)
    p = jnp.asarray(np.linalg.qr(rng.standard_normal(shape))[0], jnp.float32)
    return float(jax.jit(lambda p: _orthonormal.orthonormality_error(p))(p))


def rows(cases) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for m, n, rank in cases:
        g64 = graded_matrix(rng, m, n, 1.0)
        y64 = g64 @ rng.choice([-1.0, 1.0], size=(n, rank + 4))
        g, y = jnp.asarray(g64, jnp.float32), jnp.asarray(y64, jnp.float32)
        figures = {}
        for name, precision in PRECISIONS:
            _sharding.EXACT = precision
            try:
                figures[name] = measure(y, g, rank)
                figures[name]["check"] = check_error((m, rank))
            finally:
                _sharding.EXACT = PRECISIONS[0][1]
        tolerance = _orthonormal.orthonormality_tolerance(jnp.float32, m)
        base = figures[PRECISIONS[0][0]]["ms"]
        for name, f in figures.items():
            out.append(
                f"| ({m}, {n}) | {rank} | {name} | {f['q']:.1e} | {f['kept']} "
                f"| {f['projector']:.1e} | {f['ms']:.2f} | {f['ms'] / base:.2f} "
                f"| {f['check']:.1e} | {tolerance:.1e} |"
            )
            print(out[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small cases only")
    add_out_argument(parser, __file__)
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    device = jax.devices()[0]
    lines = [
        *produced_by(f"Orthonormality at each matmul precision, {device.platform}"),
        *environment(
            ("jax", "jaxlib"),
            f"{device.platform} ({device.device_kind})",
            load_at_start,
        ),
        "",
        "Figures as this script's docstring describes them; each case at both "
        f"precisions in one process, *ms* the median of {RUNS} runs.",
        "",
        "| sketch of G | rank | precision | orthonormality of Q | kept of rank + 4 "
        "| orthonormality of the projector | ms | ÷ HIGHEST | check's error "
        "| check's tolerance |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows(QUICK_CASES if args.quick else CASES),
    ]
    write_results(lines, args.out, __file__, args.quick, device.platform)


if __name__ == "__main__":
    main()
