"""The targets of the transformer example's comparison, checked on its compiled
training steps: gradient and optimiser-state bytes, FLOPs, temporary bytes, and (in
the full run) step time, for the arms of `examples/transformer.py` (dense Adam,
`optax.contrib.galore` on per-layer views, `qto.projected` on marked weights, and
the same with a row-sparse embedding), on its scanned model.

Run it with

    python benchmarks/bench_transformer.py            # the example's full size, timed
    python benchmarks/bench_transformer.py --quick    # the quick size, no timing
"""

import argparse
import dataclasses
import importlib.util
import math
import os
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _report import add_out_argument, default_out, environment, produced_by

import quax_tangents as qt


EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "transformer.py"


def load_example() -> Any:
    """`examples/transformer.py` as a module (its folder is not a package)."""
    spec = importlib.util.spec_from_file_location("transformer_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class Measured:
    name: str
    temp: int
    state: int
    grads: Any  # the gradient's shapes (compressed values as such)
    flops: float  # the step with the projectors kept
    compiled: Any
    inputs: tuple


def measure(example: Any, config: Any) -> list[Measured]:
    params, static = example.init(config, example.VOCABULARY, 0)
    arms = example.make_arms(config, params, static)
    batch = jnp.zeros((config.batch, config.seq + 1), jnp.int32)
    key = jax.random.key(0)
    results = []
    for arm in arms:
        state = arm.tx.init(params)
        inputs = (params, state, batch, key)
        compiled = example.compile_step(arm.step, *inputs)
        steady = compiled
        if arm.steady is not None:
            steady = example.compile_step(arm.steady, *inputs)
        results.append(
            Measured(
                arm.name,
                compiled.memory_analysis().temp_size_in_bytes,
                example.tree_bytes(state),
                jax.eval_shape(arm.grad, *inputs),
                float(steady.cost_analysis()["flops"]),
                compiled,
                inputs,
            )
        )
    return results


def time_ratios(results: list[Measured], rounds: int) -> list[float]:
    """Median seconds per step of each arm, interleaved round by round, as a
    ratio to the first arm's."""
    carried = [jax.tree.map(jnp.copy, r.inputs[:2]) for r in results]
    samples: list[list[float]] = [[] for _ in results]
    for _ in range(rounds):
        for i, r in enumerate(results):
            params, state = carried[i]
            start = time.perf_counter()
            for _ in range(3):
                params, state, loss = r.compiled(params, state, *r.inputs[2:])
            loss.block_until_ready()
            samples[i].append((time.perf_counter() - start) / 3)
            carried[i] = (params, state)
    medians = [float(np.median(s)) for s in samples]
    return [m / medians[0] for m in medians]


def factor_ratio(grads: Any, params: Any, weights: Any) -> float:
    """The largest, over projected leaves, of the bytes of the gradient's factor
    that is not the projector, over `r / min(m, n)` of the dense gradient's."""
    worst = 0.0
    is_compressed = lambda x: isinstance(x, qt.CompressedArray)  # noqa: E731
    leaves = jax.tree.leaves(grads, is_leaf=is_compressed)
    for g, w, chosen in zip(leaves, jax.tree.leaves(params), jax.tree.leaves(weights)):
        if not chosen:
            continue
        assert isinstance(g, qt.LowRank), type(g)
        factor = g.right if g.projector_side == "left" else g.left
        *_, m, n = w.shape
        rank = factor.shape[-1]
        bound = w.size * 4 * rank / min(m, n)
        worst = max(worst, factor.size * 4 / bound)
    return worst


def report(example: Any, config: Any, results: list[Measured], ratios) -> str:
    params = results[0].inputs[0]
    weights = example.projected_weights(params, config.rank)
    by = {r.name: r for r in results}
    galore = by["galore"]
    galore_projectors = sum(
        config.rank * max(w.shape[-2:]) * 4 * math.prod(w.shape[:-2])
        for w, c in zip(jax.tree.leaves(params), jax.tree.leaves(weights))
        if c
    )
    lines = [
        *produced_by("The transformer example's targets"),
        *environment(
            ("jax", "equinox", "optax", "quax"), jax.default_backend(), os.getloadavg()
        ),
        f"- Model: {example.describe(config, params)}",
        "- Compiled steps of `examples/transformer.py` (parameters and state "
        "donated). FLOPs: `cost_analysis()` of the step compiled with the projectors "
        "kept (XLA counts a scan body once: one layer's FLOPs, in every arm alike).",
        "- At this size activations outweigh the weights; the memory targets are "
        "checked where weights dominate: `python examples/transformer.py --memory` "
        "(`examples/results/transformer_memory.md`).",
        "",
        "| arm | temp bytes | optimiser state bytes | gradient bytes | FLOPs, steady "
        "step |" + (" step time / adam |" if ratios else ""),
        "|---|---|---|---|---|" + ("---|" if ratios else ""),
    ]
    for i, r in enumerate(results):
        tail = f" {ratios[i]:.2f} |" if ratios else ""
        lines.append(
            f"| {r.name} | {r.temp:,} | {r.state:,} | "
            f"{example.tree_bytes(r.grads):,} | {r.flops:,.0f} |{tail}"
        )
    lines += ["", "| target | arm | numbers | met |", "|---|---|---|---|"]
    for r in results[2:]:
        ratio = factor_ratio(r.grads, params, weights)
        rows = [
            (
                "the factor of each projected gradient that is not the projector "
                "is r / min(m, n) of the dense gradient",
                f"largest ratio {ratio:.3f}",
                abs(ratio - 1.0) < 1e-9,
            ),
            (
                "optimiser state at most galore's plus galore's projectors",
                f"{r.state:,} vs {galore.state:,} + {galore_projectors:,}",
                r.state <= galore.state + galore_projectors,
            ),
            (
                "FLOPs below galore's (never forming X^T C)",
                f"{r.flops:,.0f} vs {galore.flops:,.0f}",
                r.flops < galore.flops,
            ),
        ]
        if ratios:
            relative = ratios[results.index(r)] / ratios[1]
            rows.append(
                (
                    "step time at most galore's",
                    f"{relative:.2f} of galore's",
                    relative <= 1.0,
                )
            )
        lines += [
            f"| {what} | {r.name} | {numbers} | {'met' if met else 'missed'} |"
            for what, numbers, met in rows
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick size, untimed")
    add_out_argument(parser, __file__)
    args = parser.parse_args(argv)
    example = load_example()
    config = example.QUICK if args.quick else example.FULL
    results = measure(example, config)
    ratios = time_ratios(results, config.timing_rounds) if config.timing_rounds else []
    out = args.out or default_out(__file__, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(example, config, results, ratios))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
