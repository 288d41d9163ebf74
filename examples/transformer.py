"""A character-level transformer, written as large JAX models are (blocks stacked
with `equinox.filter_vmap`, run by `lax.scan` over a checkpointed body), trained four
ways: dense Adam, GaLore on dense gradients, and GaLore on gradients that are never
dense.

The model is a decoder-only transformer in Equinox (token embedding, fixed
sinusoidal positions, pre-norm blocks of `eqx.nn.MultiheadAttention` and a GELU MLP,
a final layer norm and an untied output layer), trained to predict the next
character of the source of a few standard-library modules (read with `inspect`, so
every machine has the data). The arms start from the same initialisation and see
the same batches:

1. `jax.value_and_grad` + `optax.adam`;
2. `jax.value_and_grad` + `optax.contrib.galore` at rank r. GaLore takes 2-d
   weights only and has no layer axis, so it is given per-layer views: each stacked
   leaf is split into its layers before GaLore and the updates are stacked again
   (`layer_views`); every layer gets its own projector, as in arms 3 and 4;
3. `quax_tangents.optax.projected` at rank r, with the parameters marked by
   `quax_tangents.optax.mark` (outside the scan: the scan slices the marked stacked
   weights) so that each weight's gradient comes back as its projection, never
   dense. The same weights are projected as in arm 2 (the blocks' matrices and the
   output layer); the embedding table is read by a gather and trained by Adam;
4. arm 3, with the embedding table chosen by `rows=`: its gradient holds the rows
   read, and Adam updates only those rows (lazily).

Switching the step from arm 1 to arm 3 changes three lines:

```diff
-tx = optax.adam(learning_rate)
+tx = qto.projected(optax.scale_by_adam(), rank=rank, learning_rate=learning_rate, project=weights)
 def step(params, state, batch, key):
-    loss, grads = jax.value_and_grad(loss_fn)(params, static, batch)
+    loss, grads = qt.value_and_grad(lambda p: loss_fn(qto.mark(p, state, key=key), static, batch))(params)
     updates, state = tx.update(grads, state, params)
-    return optax.apply_updates(params, updates), state, loss
+    return qto.apply_updates(params, updates), state, loss
```

It prints and writes (to `--out`) `transformer.md`, the loss of each arm and the
memory of its compiled training step (`memory_analysis()`: temporary, argument and
output bytes, with the optimiser state and gradient bytes), and `transformer.png`,
the training curves. `--memory` compiles the steps of a larger model (d_model 1024,
4 layers, batches of 2 x 128) without running them and writes
`transformer_memory.md`. The checks of the comparison's targets (FLOPs, buffers,
step time) are in `benchmarks/bench_transformer.py`.

Run it with

    python examples/transformer.py --quick    # about a minute; writes to results/quick
    python examples/transformer.py            # writes results/transformer.md and .png
    python examples/transformer.py --memory   # compile only; results/transformer_memory.md
"""

import argparse
import dataclasses
import importlib
import importlib.metadata
import inspect
import math
import os
import pathlib
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from tqdm import tqdm

import quax_tangents as qt
import quax_tangents.optax as qto


matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)


DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results"
QUICK_OUT = DEFAULT_OUT / "quick"
MODULES = (
    "argparse",
    "collections",
    "dataclasses",
    "functools",
    "inspect",
    "json.decoder",
    "json.encoder",
    "textwrap",
    "typing",
)
ARMS = ("adam", "galore", "projected", "projected + sparse rows")


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int
    heads: int
    layers: int
    seq: int
    batch: int
    steps: int
    rank: int
    refresh_every: int
    learning_rate: float
    eval_batches: int
    timing_rounds: int


FULL = Config(
    d_model=128,
    heads=4,
    layers=2,
    seq=64,
    batch=16,
    steps=400,
    rank=16,
    refresh_every=100,
    learning_rate=3e-3,
    eval_batches=8,
    timing_rounds=20,
)
QUICK = dataclasses.replace(
    FULL,
    d_model=64,
    seq=40,
    batch=6,
    steps=24,
    rank=8,
    refresh_every=8,
    eval_batches=2,
    timing_rounds=0,  # step-time ratios of a smoke run are noise
)
# Weights dominate activations: 50M parameters in the blocks, 256 tokens a step,
# and each block recomputed in the backward pass.
MEMORY = dataclasses.replace(
    FULL, d_model=1024, heads=16, layers=4, seq=128, batch=2, rank=128, steps=0
)
VOCABULARY = 96  # printable ASCII and the newline: the size `encode` finds


# ---------------------------------------------------------------------------------
# Data


def load_text() -> str:
    """The source of a few standard-library modules, printable ASCII only."""
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)
    return re.sub(r"[^\x20-\x7e\n]", "?", text)


def encode(text: str) -> tuple[np.ndarray, list[str]]:
    vocabulary = sorted(set(text))
    index = {c: i for i, c in enumerate(vocabulary)}
    return np.array([index[c] for c in text], np.int32), vocabulary


def batches(tokens: np.ndarray, config: Config, count: int, seed: int) -> np.ndarray:
    """`count` batches of `seq + 1` consecutive characters, `(count, batch, seq+1)`."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - config.seq - 1, (count, config.batch))
    return tokens[starts[..., None] + np.arange(config.seq + 1)]


# ---------------------------------------------------------------------------------
# Model: blocks stacked at init, applied by `lax.scan` over a checkpointed body


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, config: Config, key: jax.Array):
        keys = jax.random.split(key, 3)
        d = config.d_model
        self.norm1 = eqx.nn.LayerNorm(d)
        self.attention = eqx.nn.MultiheadAttention(config.heads, d, key=keys[0])
        self.norm2 = eqx.nn.LayerNorm(d)
        self.mlp_in = eqx.nn.Linear(d, 4 * d, key=keys[1])
        self.mlp_out = eqx.nn.Linear(4 * d, d, key=keys[2])

    def __call__(self, x: jax.Array) -> jax.Array:
        """One sequence, `(seq, d_model)`."""
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=causal)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h)))


class Transformer(eqx.Module):
    embedding: eqx.nn.Embedding
    blocks: Block  # every array has a leading layer axis
    norm: eqx.nn.LayerNorm
    unembedding: eqx.nn.Linear

    def __init__(self, config: Config, vocabulary: int, key: jax.Array):
        k_embed, k_blocks, k_out = jax.random.split(key, 3)
        d = config.d_model
        self.embedding = eqx.nn.Embedding(vocabulary, d, key=k_embed)
        make = lambda k: Block(config, k)  # noqa: E731
        self.blocks = eqx.filter_vmap(make)(jax.random.split(k_blocks, config.layers))
        self.norm = eqx.nn.LayerNorm(d)
        self.unembedding = eqx.nn.Linear(d, vocabulary, use_bias=False, key=k_out)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits `(batch, seq, vocabulary)` of tokens `(batch, seq)`."""
        d = self.embedding.weight.shape[1]
        x = jnp.take(self.embedding.weight, tokens, axis=0)
        x = x + positions(tokens.shape[1], d)
        weights, static = eqx.partition(self.blocks, eqx.is_array)

        @jax.checkpoint  # recompute each block in the backward pass
        def layer(x: jax.Array, w: Block) -> tuple[jax.Array, None]:
            return jax.vmap(eqx.combine(w, static))(x), None

        x, _ = jax.lax.scan(layer, x, weights)
        x = jax.vmap(jax.vmap(self.norm))(x)
        return x @ self.unembedding.weight.T


def positions(seq: int, d: int) -> jax.Array:
    """Fixed sinusoidal position encodings: no parameter to train."""
    angle = np.arange(seq)[:, None] / 10000 ** (np.arange(0, d, 2) / d)
    return jnp.asarray(np.concatenate([np.sin(angle), np.cos(angle)], 1), jnp.float32)


def loss_fn(params: Any, static: Any, batch: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy of `batch` `(batch, seq + 1)`."""
    logits = eqx.combine(params, static)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def init(config: Config, vocabulary: int, seed: int) -> tuple[Any, Any]:
    """(params, static) of a fresh model: the floating arrays and the rest."""
    model = Transformer(config, vocabulary, jax.random.key(seed))
    return eqx.partition(model, eqx.is_inexact_array)


def _where(params: Any, leaves: Callable[[Any], tuple], value: bool = True) -> Any:
    """A pytree of bools with the parameters' structure: `value` at `leaves`."""
    mask = jax.tree.map(lambda _: not value, params)
    chosen = leaves(mask)
    return eqx.tree_at(leaves, mask, (value,) * len(chosen))


def projected_weights(params: Any, rank: int) -> Any:
    """The leaves projected by arms 2 to 4: the blocks' matrices (stacked, `(layers,
    m, n)`), and the output layer when its smaller side exceeds the rank. Stacked
    biases and norms, `(layers, d)`, are matrices by shape only: left out."""
    blocks = lambda p: (  # noqa: E731
        p.blocks.attention.query_proj.weight,
        p.blocks.attention.key_proj.weight,
        p.blocks.attention.value_proj.weight,
        p.blocks.attention.output_proj.weight,
        p.blocks.mlp_in.weight,
        p.blocks.mlp_out.weight,
    )
    if min(params.unembedding.weight.shape) > rank:
        return _where(params, lambda p: (*blocks(p), p.unembedding.weight))
    return _where(params, blocks)


def embedding_table(params: Any) -> Any:
    return _where(params, lambda p: (p.embedding.weight,))


# ---------------------------------------------------------------------------------
# GaLore on per-layer views of stacked leaves


def layer_views(
    make: Callable[[list], optax.GradientTransformation], params: Any, project: Any
) -> optax.GradientTransformation:
    """`make(dims)` (a transformation of a flat list of 2-d or unprojected arrays)
    on per-layer views: each leaf of `params.blocks` is split along its layer axis
    before the transformation, and the updates are stacked again. `dims` is, per
    view, `GaLoreDimensionNumbers()` where `project` is true, else `None`."""
    treedef = jax.tree.structure(params)
    stacked = treedef.flatten_up_to(_where(params, lambda p: jax.tree.leaves(p.blocks)))
    chosen = treedef.flatten_up_to(project)
    layers = jax.tree.leaves(params.blocks)[0].shape[0]

    def split(tree: Any) -> list:
        views = []
        for leaf, is_stacked in zip(treedef.flatten_up_to(tree), stacked):
            views.extend(list(leaf) if is_stacked else [leaf])
        return views

    def join(views: list) -> Any:
        leaves, i = [], 0
        for is_stacked in stacked:
            width = layers if is_stacked else 1
            part = views[i : i + width]
            leaves.append(jnp.stack(part) if is_stacked else part[0])
            i += width
        return jax.tree.unflatten(treedef, leaves)

    dims = [
        optax.contrib.GaLoreDimensionNumbers() if c else None
        for c, s in zip(chosen, stacked)
        for _ in range(layers if s else 1)
    ]
    tx = make(dims)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        views = None if params is None else split(params)
        views, state = tx.update(split(updates), state, views)
        return join(views), state

    return optax.GradientTransformation(lambda p: tx.init(split(p)), update)


# ---------------------------------------------------------------------------------
# The four arms: a training step each, step(params, state, batch, key) ->
# (params, state, loss)


@dataclasses.dataclass
class Arm:
    name: str
    tx: optax.GradientTransformation
    step: Callable
    grad: Callable  # (params, state, batch, key) -> gradients, for their bytes
    # The step compiled with the projectors kept (refresh a constant False), or None
    steady: Callable | None = None


def dense_arm(name: str, tx: optax.GradientTransformation, static: Any) -> Arm:
    def step(params, state, batch, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, static, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def grad(params, state, batch, key):
        return jax.grad(loss_fn)(params, static, batch)

    return Arm(name, tx, step, grad)


def projected_arm(name: str, tx: optax.GradientTransformation, static: Any) -> Arm:
    def step(params, state, batch, key):
        marked_loss = lambda p: loss_fn(qto.mark(p, state, key=key), static, batch)  # noqa: E731
        loss, grads = qt.value_and_grad(marked_loss)(params)
        updates, state = tx.update(grads, state, params)
        return qto.apply_updates(params, updates), state, loss

    def grad(params, state, batch, key):
        return qt.grad(lambda p: loss_fn(qto.mark(p, state, key=key), static, batch))(
            params
        )

    def steady(params, state, batch, key):
        # The refresh decision as a constant: XLA drops the refresh branch.
        return step(params, state._replace(refresh=jnp.asarray(False)), batch, key)

    return Arm(name, tx, step, grad, steady)


def make_arms(config: Config, params: Any, static: Any) -> list[Arm]:
    lr, rank, every = config.learning_rate, config.rank, config.refresh_every
    weights = projected_weights(params, rank)
    galore = layer_views(
        lambda dims: optax.contrib.galore(
            lr, rank=rank, update_proj_gap=every, weight_dimension_numbers=dims
        ),
        params,
        weights,
    )
    projected = qto.projected(
        optax.scale_by_adam(),
        rank=rank,
        learning_rate=lr,
        refresh_every=every,
        project=weights,
    )
    projected_rows = qto.projected(
        optax.scale_by_adam(),
        rank=rank,
        learning_rate=lr,
        refresh_every=every,
        project=weights,
        rows=embedding_table(params),
    )
    return [
        dense_arm(ARMS[0], optax.adam(lr), static),
        dense_arm(ARMS[1], galore, static),
        projected_arm(ARMS[2], projected, static),
        projected_arm(ARMS[3], projected_rows, static),
    ]


# ---------------------------------------------------------------------------------
# Memory of a compiled step


def tree_bytes(tree: Any) -> int:
    """Bytes of the arrays of `tree` (of the fields of compressed values)."""

    def nbytes(x: Any) -> int:
        if isinstance(x, qt.CompressedArray):
            return x.nbytes
        return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize

    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, qt.CompressedArray))
    return sum(nbytes(x) for x in leaves if hasattr(x, "shape"))


@dataclasses.dataclass
class Memory:
    temp: int
    argument: int
    output: int
    alias: int  # output bytes that reuse donated arguments
    state: int
    grads: int

    @property
    def total(self) -> int:
        return self.temp + self.argument + self.output


def compile_step(step: Callable, *inputs: Any) -> Any:
    """`step` jitted with the parameters and state donated, compiled for `inputs`
    (arrays or `jax.ShapeDtypeStruct`s)."""
    return jax.jit(step, donate_argnums=(0, 1)).lower(*inputs).compile()


def memory(arm: Arm, compiled: Any, *inputs: Any) -> Memory:
    stats = compiled.memory_analysis()
    return Memory(
        temp=stats.temp_size_in_bytes,
        argument=stats.argument_size_in_bytes,
        output=stats.output_size_in_bytes,
        alias=stats.alias_size_in_bytes,
        state=tree_bytes(inputs[1]),
        grads=tree_bytes(jax.eval_shape(arm.grad, *inputs)),
    )


# ---------------------------------------------------------------------------------
# Training


@dataclasses.dataclass
class Run:
    arm: Arm
    losses: list[float]
    val_loss: float
    seconds: float
    memory: Memory
    compiled: Any
    params: Any
    state: Any


def validation_loss(params: Any, static: Any, data: np.ndarray) -> float:
    mean = eqx.filter_jit(
        lambda p, d: jnp.mean(jax.lax.map(lambda b: loss_fn(p, static, b), d))
    )
    return float(mean(params, jnp.asarray(data)))


def train(arm: Arm, config: Config, params, static, train_data, val_data, seed) -> Run:
    state = arm.tx.init(params)
    key = jax.random.key(seed)
    inputs = (params, state, jnp.asarray(train_data[0]), key)
    compiled = compile_step(arm.step, *inputs)
    used = memory(arm, compiled, *inputs)
    params = jax.tree.map(jnp.copy, params)  # the step donates its inputs
    losses = []
    start = time.perf_counter()
    for t in tqdm(range(config.steps), desc=arm.name, leave=False):
        batch = jnp.asarray(train_data[t])
        params, state, loss = compiled(params, state, batch, jax.random.fold_in(key, t))
        losses.append(loss)
    losses = [float(v) for v in losses]
    seconds = time.perf_counter() - start
    val = validation_loss(params, static, val_data)
    return Run(arm, losses, val, seconds, used, compiled, params, state)


def time_side_by_side(runs: list[Run], batch: jax.Array, rounds: int, seed: int):
    """Median seconds per step of each arm's compiled step, the arms interleaved
    round by round so that they share the machine's state."""
    key = jax.random.key(seed)
    carried = [(r.params, r.state) for r in runs]
    samples: list[list[float]] = [[] for _ in runs]
    for _ in tqdm(range(rounds), desc="timing", leave=False):
        for i, run in enumerate(runs):
            params, state = carried[i]
            start = time.perf_counter()
            for _ in range(3):
                params, state, loss = run.compiled(params, state, batch, key)
            loss.block_until_ready()
            samples[i].append((time.perf_counter() - start) / 3)
            carried[i] = (params, state)
    return [float(np.median(s)) for s in samples]


# ---------------------------------------------------------------------------------
# Report


def environment() -> str:
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}"
        for name in ("jax", "equinox", "optax", "quax", "quax-tangents")
    )
    return (
        f"{versions}, python {platform.python_version()}; "
        f"{jax.default_backend()}, {len(os.sched_getaffinity(0))} CPU cores"
    )


def describe(config: Config, params: Any) -> str:
    count = sum(x.size for x in jax.tree.leaves(params))
    return (
        f"{config.layers} blocks stacked and scanned (each recomputed in the backward "
        f"pass), d_model {config.d_model}, {config.heads} heads, MLP "
        f"{4 * config.d_model}, vocabulary {VOCABULARY} characters; {count:,} "
        f"parameters. Batches of {config.batch} x {config.seq}; rank r = "
        f"{config.rank}, projectors refreshed every {config.refresh_every} steps."
    )


MEMORY_COLUMNS = (
    "| arm | temp bytes | argument bytes | output bytes | total | optimiser state "
    "bytes | gradient bytes |"
)


def memory_row(name: str, m: Memory) -> str:
    return (
        f"| {name} | {m.temp:,} | {m.argument:,} | {m.output:,} | {m.total:,} "
        f"| {m.state:,} | {m.grads:,} |"
    )


def _header(title: str, how: str) -> list[str]:
    """A results file's title, the command that produced it and the machine."""
    return [
        f"# {title}",
        "",
        f"Produced by{how}:",
        "",
        "```",
        "python " + shlex.join(sys.argv),
        "```",
        "",
        f"- {environment()}",
    ]


def report(runs: list[Run], ratios, config, params, chars, quick) -> str:
    lines = [
        *_header("A scanned character-level transformer trained four ways", ""),
        f"- Model: {describe(config, params)}",
        f"- Data: {chars:,} characters of the source of {', '.join(MODULES)}; "
        f"{config.steps} steps; learning rate {config.learning_rate}.",
        *(["- Quick mode: a smoke run, not a result."] if quick else []),
        "- Curves: `transformer.png`, next to this file.",
        "",
        "## Loss",
        "",
        "| arm | final training loss | validation loss | training time (s) "
        + ("| step time / adam |" if ratios else "|"),
        "|---|---|---|---|" + ("---|" if ratios else ""),
    ]
    for i, run in enumerate(runs):
        tail = float(np.mean(run.losses[-max(1, len(run.losses) // 20) :]))
        ratio = f" {ratios[i]:.2f} |" if ratios else ""
        lines.append(
            f"| {run.arm.name} | {tail:.4f} | {run.val_loss:.4f} "
            f"| {run.seconds:.1f} |{ratio}"
        )
    lines += [
        "",
        "## Memory of the compiled training step",
        "",
        "`memory_analysis()` of the step jitted with the parameters and state "
        "donated; total = temp + argument + output bytes (donated arguments that "
        "outputs reuse count on both sides). Gradient bytes count the fields of "
        "compressed values. At this size activations outweigh the weights; "
        "`transformer_memory.md` has a model where weights dominate.",
        "",
        MEMORY_COLUMNS,
        "|---|---|---|---|---|---|---|",
        *[memory_row(run.arm.name, run.memory) for run in runs],
    ]
    if ratios:
        lines += [
            "",
            "Step time: the median over rounds that interleave the arms, as a ratio "
            "to adam, on a shared machine.",
        ]
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], path: pathlib.Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4))
    for run in runs:
        losses = np.asarray(run.losses)
        window = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        axes.plot(np.arange(len(smooth)) + window, smooth, label=run.arm.name)
    axes.set(xlabel="step", ylabel="training loss (running mean)", yscale="log")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    axes.set_title("Scanned character-level transformer: four ways to train")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(out: pathlib.Path, quick: bool = False, seed: int = 0) -> list[Run]:
    """Trains the four arms and writes `transformer.md` and `transformer.png` to
    `out` (created if missing)."""
    config = QUICK if quick else FULL
    out.mkdir(parents=True, exist_ok=True)
    tokens, vocabulary = encode(load_text())
    assert len(vocabulary) == VOCABULARY, len(vocabulary)
    split = int(0.9 * len(tokens))
    train_data = batches(tokens[:split], config, config.steps, seed)
    val_data = batches(tokens[split:], config, config.eval_batches, seed + 1)
    params, static = init(config, VOCABULARY, seed)
    arms = make_arms(config, params, static)
    runs = [
        train(arm, config, params, static, train_data, val_data, seed) for arm in arms
    ]
    ratios = []
    if config.timing_rounds:
        seconds = time_side_by_side(
            runs, jnp.asarray(train_data[0]), config.timing_rounds, seed
        )
        ratios = [s / seconds[0] for s in seconds]
    text = report(runs, ratios, config, params, len(tokens), quick)
    (out / "transformer.md").write_text(text)
    plot(runs, out / "transformer.png")
    print(text)
    print(f"Wrote {out / 'transformer.md'} and the curves, {out / 'transformer.png'}.")
    return runs


# ---------------------------------------------------------------------------------
# --memory: compile only, at a size where weights dominate


@dataclasses.dataclass
class MemoryResult:
    config: Config
    params: Any
    arms: dict[str, Memory]
    steady_temp: dict[str, int]  # the projected arms compiled without refresh
    refresh_working_set: int  # the range finders' buffers, O(b (m + n) r) each


def abstract_inputs(config: Config, seed: int = 0) -> tuple[Any, Any, Any]:
    """(params, static, batch, key) without allocating the weights."""
    params, static = eqx.filter_eval_shape(init, config, VOCABULARY, seed)
    # `filter_eval_shape` keeps the static part as it is; `params` are structs.
    batch = jax.ShapeDtypeStruct((config.batch, config.seq + 1), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    return params, static, batch, key


def refresh_working_set(params: Any, weights: Any, config: Config) -> int:
    """Bytes of one refresh's range finder per projected leaf, summed: the sketch
    and basis, `(*batch, max(m, n), r + 4)` and `(*batch, min(m, n), r + 4)`, plus
    the tokens' products with them, `(b, r + 4)` on each side."""
    width = config.rank + 4
    tokens = config.batch * config.seq
    total = 0
    for leaf, chosen in zip(jax.tree.leaves(params), jax.tree.leaves(weights)):
        if chosen:
            *stack, m, n = leaf.shape
            total += math.prod(stack) * (m + n + 2 * tokens) * width * 4
    return total


def measure_memory(config: Config, seed: int = 0) -> MemoryResult:
    params, static, batch, key = abstract_inputs(config, seed)
    arms = make_arms(config, params, static)
    result, steady = {}, {}
    for arm in arms:
        if arm.name == ARMS[3]:
            continue  # the table of a character vocabulary: nothing to measure
        state = jax.eval_shape(arm.tx.init, params)
        inputs = (params, state, batch, key)
        result[arm.name] = memory(arm, compile_step(arm.step, *inputs), *inputs)
        if arm.steady is not None:
            compiled = compile_step(arm.steady, *inputs)
            steady[arm.name] = compiled.memory_analysis().temp_size_in_bytes
    working = refresh_working_set(
        params, projected_weights(params, config.rank), config
    )
    return MemoryResult(config, params, result, steady, working)


def memory_report(result: MemoryResult) -> str:
    arms = result.arms
    adam, galore, projected = arms[ARMS[0]], arms[ARMS[1]], arms[ARMS[2]]
    bound = adam.total - adam.grads
    steady = result.steady_temp[ARMS[2]]
    extra = projected.temp - steady
    lines = [
        *_header(
            "Memory of the training step of a scanned transformer",
            " (compile only: nothing is run)",
        ),
        f"- Model: {describe(result.config, result.params)}",
        "- `memory_analysis()` of each training step, jitted with the parameters and "
        "state donated and lowered on `jax.eval_shape` inputs; total = temp + "
        "argument + output bytes. Arms as in `transformer.md` (galore on per-layer "
        "views of the stacked weights).",
        "",
        MEMORY_COLUMNS,
        "|---|---|---|---|---|---|---|",
        *[memory_row(name, m) for name, m in arms.items()],
        "",
        "## Targets",
        "",
        f"- projected total at most adam's total minus adam's gradient bytes: "
        f"{projected.total:,} vs {adam.total:,} - {adam.grads:,} = {bound:,}: "
        f"{'met' if projected.total <= bound else 'missed'}.",
        f"- projected total below galore's: {projected.total:,} vs "
        f"{galore.total:,}: {'met' if projected.total < galore.total else 'missed'}.",
        f"- The refresh branch does not raise the peak beyond its own working set: "
        f"temp bytes with the refresh decision traced {projected.temp:,}, with "
        f"refresh a constant False {steady:,}; difference {extra:,}, against the "
        f"range finders' working set {result.refresh_working_set:,} "
        "(all projected leaves at once; sketch and basis of each, and the tokens' "
        "products with them): "
        f"{'met' if extra <= result.refresh_working_set else 'missed'}.",
        "",
    ]
    return "\n".join(lines)


def main_memory(out: pathlib.Path, config: Config = MEMORY) -> MemoryResult:
    out.mkdir(parents=True, exist_ok=True)
    result = measure_memory(config)
    text = memory_report(result)
    (out / "transformer_memory.md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split())  # the first paragraph
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help=f"output folder (default: {DEFAULT_OUT}, or {QUICK_OUT} with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="about a minute")
    parser.add_argument(
        "--memory", action="store_true", help="compile only: transformer_memory.md"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    default = QUICK_OUT if args.quick else DEFAULT_OUT
    if args.memory:
        main_memory(args.out or default)
    else:
        main(args.out or default, args.quick, args.seed)
