"""A character-level transformer trained four ways: dense Adam, GaLore on dense
gradients, and GaLore on gradients that are never dense.

The model is a small decoder-only transformer in Equinox (token embedding, fixed
sinusoidal positions, pre-norm blocks of `eqx.nn.MultiheadAttention` and a GELU MLP,
layer norm, an untied output layer), trained to predict the next character of the
source code of a few standard-library modules (read with `inspect`, so every machine
has the data). Four arms start from the same initialisation and see the same batches:

1. `jax.grad` + `optax.adam`;
2. `jax.grad` + `optax.contrib.galore` at rank r;
3. `quax_tangents.projected_cotangent` on every weight matrix that meets a matrix
   product (attention and MLP projections, the output layer) and
   `quax_tangents.optax.projected(optax.scale_by_adam())` at rank r. The embedding
   table is read by indexing, not by a product: its dense gradient is projected
   after the fact by the same optimiser, as arm 2 projects every gradient;
4. arm 3, with `quax_tangents.sparse_rows_cotangent` on the embedding table: its
   gradient holds the rows read, and Adam updates only those rows (lazily).

From each compiled training step it reports temporary bytes, optimiser-state bytes,
gradient bytes, FLOPs, the weight-shaped buffers the step computes besides its
outputs, the step time as a ratio to arm 1 (timed side by side), and the validation
loss after the last step; and it checks the targets of the comparison. It writes
`transformer.md` and `transformer.png` to `--out`.

Run it with

    python examples/transformer.py            # about ten minutes on 2 CPU cores
    python examples/transformer.py --quick    # about a minute; writes to results/quick
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
import zlib
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
# Shapes chosen so that no activation has a weight's shape: batch * seq is none of
# the weights' sides.
QUICK = dataclasses.replace(
    FULL,
    d_model=64,
    layers=1,
    seq=40,
    batch=6,
    steps=24,
    rank=8,
    refresh_every=8,
    eval_batches=2,
    timing_rounds=3,
)


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
# Model


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
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=causal)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h)))


class Transformer(eqx.Module):
    embedding: eqx.nn.Embedding
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    unembedding: eqx.nn.Linear

    def __init__(self, config: Config, vocabulary: int, key: jax.Array):
        keys = jax.random.split(key, config.layers + 2)
        d = config.d_model
        self.embedding = eqx.nn.Embedding(vocabulary, d, key=keys[0])
        self.blocks = [Block(config, k) for k in keys[1:-1]]
        self.norm = eqx.nn.LayerNorm(d)
        self.unembedding = eqx.nn.Linear(d, vocabulary, use_bias=False, key=keys[-1])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.vmap(self.embedding)(tokens) + positions(*tokens.shape, self.d_model)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.unembedding)(jax.vmap(self.norm)(x))

    @property
    def d_model(self) -> int:
        return self.embedding.weight.shape[1]


def positions(seq: int, d: int) -> jax.Array:
    """Fixed sinusoidal position encodings: no parameter to train."""
    angle = np.arange(seq)[:, None] / 10000 ** (np.arange(0, d, 2) / d)
    return jnp.asarray(np.concatenate([np.sin(angle), np.cos(angle)], 1), jnp.float32)


class Split(eqx.Module):
    """The model's arrays as a flat dict by path (optax.contrib.galore does not take
    the `None` leaves an Equinox model has), and the rest of the model."""

    static: Any
    treedef: Any = eqx.field(static=True)
    names: tuple[str, ...] = eqx.field(static=True)

    @staticmethod
    def of(model: eqx.Module) -> tuple[dict, "Split"]:
        arrays, static = eqx.partition(model, eqx.is_array)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(arrays)
        names = tuple(jax.tree_util.keystr(path) for path, _ in leaves)
        params = {name: leaf for name, (_, leaf) in zip(names, leaves)}
        return params, Split(static, treedef, names)

    def model(self, params: dict) -> Any:
        arrays = jax.tree_util.tree_unflatten(
            self.treedef, [params[name] for name in self.names]
        )
        return eqx.combine(arrays, self.static)


def loss(params: dict, split: Split, batch: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy."""
    logits = jax.vmap(split.model(params))(batch[:, :-1])
    targets = batch[:, 1:]
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, targets[..., None], -1))


def weight_paths(params: dict) -> list[str]:
    """The 2-d leaves, by path."""
    return [name for name, leaf in params.items() if jnp.ndim(leaf) == 2]


def is_embedding(path: str) -> bool:
    return path.startswith(".embedding")


# ---------------------------------------------------------------------------------
# The four arms: a training step each, all with the signature
# step(params, state, batch, key) -> (params, state, loss)


@dataclasses.dataclass
class Arm:
    name: str
    tx: optax.GradientTransformation
    step: Callable
    grad: Callable  # (params, state, batch, key) -> gradients, for their bytes
    marked: frozenset[str]  # paths whose gradient is compressed
    # The step on a step that keeps the projectors (the loss gets them as arrays):
    # what most steps run, without the refresh branch in the compiled program.
    steady: Callable


def _mark(params: dict, projectors: dict, rank: int, key: jax.Array, rows: bool):
    def mark(name: str, leaf: jax.Array, projector: Any) -> Any:
        if rows and is_embedding(name):
            return qt.sparse_rows_cotangent(leaf)
        if projector is None or is_embedding(name):
            return leaf
        leaf_key = jax.random.fold_in(key, zlib.crc32(name.encode()))
        return qt.projected_cotangent(leaf, rank, projector=projector, key=leaf_key)

    return {name: mark(name, leaf, projectors[name]) for name, leaf in params.items()}


def make_arms(config: Config, static: Split, params: dict) -> list[Arm]:
    adam = optax.adam(config.learning_rate)
    galore = optax.contrib.galore(
        config.learning_rate, rank=config.rank, update_proj_gap=config.refresh_every
    )
    base = optax.chain(
        optax.scale_by_adam(), optax.scale_by_learning_rate(config.learning_rate)
    )
    paths = weight_paths(params)
    not_table = {
        name: jnp.ndim(leaf) == 2 and not is_embedding(name)
        for name, leaf in params.items()
    }
    projected = qto.projected(
        base, rank=config.rank, refresh_every=config.refresh_every
    )
    projected_rows = qto.projected(
        base,
        rank=config.rank,
        refresh_every=config.refresh_every,
        project=not_table,
    )

    def dense(tx: optax.GradientTransformation, name: str) -> Arm:
        def step(params, state, batch, key):
            del key
            value, grads = jax.value_and_grad(loss)(params, static, batch)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        def grad(params, state, batch, key):
            return jax.grad(loss)(params, static, batch)

        return Arm(name, tx, step, grad, frozenset(), step)

    def compressed(tx: optax.GradientTransformation, name: str, rows: bool) -> Arm:
        def marked_loss(params, projectors, batch, key):
            return loss(
                _mark(params, projectors, config.rank, key, rows), static, batch
            )

        def grad(params, state, batch, key):
            projectors = qto.projectors(state)
            return qt.grad(marked_loss)(params, projectors, batch, key)

        def step(params, state, batch, key, keep=False):
            projectors = qto.projectors(state)
            if keep:
                projectors = jax.tree.map(
                    lambda p: p.matrix,
                    projectors,
                    is_leaf=lambda x: isinstance(x, qt.Projector),
                )
            value, grads = qt.value_and_grad(marked_loss)(
                params, projectors, batch, key
            )
            updates, state = tx.update(grads, state, params)
            return qto.apply_updates(params, updates), state, value

        def steady(params, state, batch, key):
            return step(params, state, batch, key, keep=True)

        marked = {p for p in paths if not is_embedding(p)}
        if rows:
            marked |= {p for p in paths if is_embedding(p)}
        return Arm(name, tx, step, grad, frozenset(marked), steady)

    return [
        dense(adam, ARMS[0]),
        dense(galore, ARMS[1]),
        compressed(projected, ARMS[2], rows=False),
        compressed(projected_rows, ARMS[3], rows=True),
    ]


# ---------------------------------------------------------------------------------
# Measuring a compiled step


def tree_bytes(tree: Any) -> int:
    def nbytes(x: Any) -> int:
        if isinstance(x, qt.CompressedArray):
            return x.nbytes
        return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize

    leaves = jax.tree_util.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, qt.CompressedArray)
    )
    return sum(nbytes(x) for x in leaves if hasattr(x, "shape"))


_INSTRUCTION = re.compile(
    r"^\s*(ROOT\s+)?%(\S+)\s*=\s*(\S+?\[[0-9,]*\]|\(.*?\))\S*\s+([\w\-]+)\((.*?)\)"
)
_SHAPE = re.compile(r"\w+\[([0-9,]*)\]")
_PASSIVE = ("parameter", "bitcast", "get-tuple-element", "tuple", "constant")


def weight_shaped_intermediates(hlo: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """Buffers of the compiled program's entry computation that have a weight's
    shape (or its transpose) and are computed from more than the program's inputs:
    weight-sized arrays the step makes along the way, such as a dense gradient.

    Not counted: the outputs (new parameters and state), and copies or re-layouts
    of the inputs (an instruction whose operands are all inputs), which the forward
    pass makes of the weights whatever the gradient.
    """
    entry = hlo[hlo.index("\nENTRY ") :]
    inputs: set[str] = set()
    outputs: set[str] = set()
    found: list[tuple[str, str]] = []
    for line in entry.splitlines()[1:]:
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        root, name, shape, opcode, operands = match.groups()
        names = re.findall(r"%([\w.\-]+)", operands)
        if root:
            outputs.update(names)
            continue
        if opcode == "parameter" or (
            opcode in ("bitcast", "copy", "transpose", "fusion")
            and names
            and all(n in inputs for n in names)
        ):
            inputs.add(name)
            continue
        if opcode in _PASSIVE:
            continue
        dims = {tuple(int(d) for d in s.split(",") if d) for s in _SHAPE.findall(shape)}
        if dims & shapes:
            found.append((name, f"{opcode} {shape}"))
    return [f"{name}: {what}" for name, what in found if name not in outputs]


@dataclasses.dataclass
class Measures:
    temp_bytes: int
    state_bytes: int
    grad_bytes: int
    flops: float  # the compiled step, every branch counted
    steady_flops: float  # a step that keeps the projectors
    steady_temp_bytes: int
    intermediates: list[str]
    grad_leaf_bytes: dict[str, int]
    grad_factor_bytes: dict[str, int]  # the larger factor of each LowRank gradient


def measure(arm: Arm, compiled: Any, params: Any, state: Any, batch, key) -> Measures:
    grads = jax.eval_shape(arm.grad, params, state, batch, key)
    steady = compiled
    if arm.steady is not arm.step:
        steady = (
            jax.jit(arm.steady, donate_argnums=(0, 1))
            .lower(params, state, batch, key)
            .compile()
        )
    leaf_bytes = {name: tree_bytes(leaf) for name, leaf in grads.items()}
    factor_bytes = {
        name: max(tree_bytes(leaf.left), tree_bytes(leaf.right))
        for name, leaf in grads.items()
        if isinstance(leaf, qt.LowRank)
    }
    shapes = {leaf.shape for leaf in params.values() if leaf.ndim == 2}
    shapes |= {s[::-1] for s in shapes}
    return Measures(
        temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
        state_bytes=tree_bytes(state),
        grad_bytes=tree_bytes(grads),
        flops=compiled.cost_analysis()["flops"],
        steady_flops=steady.cost_analysis()["flops"],
        steady_temp_bytes=steady.memory_analysis().temp_size_in_bytes,
        intermediates=weight_shaped_intermediates(compiled.as_text(), shapes),
        grad_leaf_bytes=leaf_bytes,
        grad_factor_bytes=factor_bytes,
    )


def analytic_saving(params: Any, config: Config) -> tuple[float, list[str]]:
    """FLOPs per step that arm 3 saves over arm 2 by never forming `X^T C`.

    For a weight `(m, n)` of a layer applied to `N` tokens, arm 2 forms the gradient
    `X^T C` (`2 N m n`) and projects it (`2 m n r`); arm 3 computes the projection
    from the factors, `(C P)^T X` or `(X Q)^T C` (`2 N r (m + n)`). Both apply an
    update of the same cost.
    """
    tokens = config.batch * config.seq
    r = config.rank
    total, lines = 0.0, []
    for name, leaf in params.items():
        if leaf.ndim != 2 or is_embedding(name):
            continue
        m, n = leaf.shape
        saving = 2 * tokens * m * n + 2 * m * n * r - 2 * tokens * r * (m + n)
        total += saving
        lines.append(f"{name} {m}x{n}: {saving:,.0f}")
    return total, lines


# ---------------------------------------------------------------------------------
# Training


@dataclasses.dataclass
class Run:
    arm: Arm
    losses: list[float]
    val_loss: float
    seconds: float
    measures: Measures
    compiled: Any
    params: Any
    state: Any


@eqx.filter_jit
def validation_loss(params: Any, static: Any, data: jax.Array) -> jax.Array:
    return jnp.mean(jax.lax.map(lambda b: loss(params, static, b), data))


def train(
    arm: Arm, config: Config, params: Any, static: Any, train_data, val_data, seed
):
    state = arm.tx.init(params)
    key = jax.random.key(seed)
    batch0 = jnp.asarray(train_data[0])
    compiled = (
        jax.jit(arm.step, donate_argnums=(0, 1))
        .lower(params, state, batch0, key)
        .compile()
    )
    measures = measure(arm, compiled, params, state, batch0, key)
    params = jax.tree.map(jnp.copy, params)  # the step donates its inputs
    losses = []
    start = time.perf_counter()
    for t in tqdm(range(config.steps), desc=arm.name, leave=False):
        batch = jnp.asarray(train_data[t])
        params, state, value = compiled(
            params, state, batch, jax.random.fold_in(key, t)
        )
        losses.append(value)
    losses = [float(v) for v in losses]
    seconds = time.perf_counter() - start
    val = float(validation_loss(params, static, jnp.asarray(val_data)))
    return Run(arm, losses, val, seconds, measures, compiled, params, state)


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
                params, state, value = run.compiled(params, state, batch, key)
            value.block_until_ready()
            samples[i].append((time.perf_counter() - start) / 3)
            carried[i] = (params, state)
    return [float(np.median(s)) for s in samples]


# ---------------------------------------------------------------------------------
# Report


def _environment() -> str:
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}"
        for name in ("jax", "equinox", "optax", "quax", "quax-tangents")
    )
    return (
        f"{versions}, python {platform.python_version()}; "
        f"{jax.default_backend()}, {len(os.sched_getaffinity(0))} CPU cores"
    )


@dataclasses.dataclass
class Target:
    what: str
    met: bool
    numbers: str


def check_targets(
    runs: list[Run], ratios: list[float], params: Any, config: Config
) -> list[Target]:
    galore = runs[1]
    r = config.rank
    saving, _ = analytic_saving(params, config)
    targets = []
    weights = {name: leaf for name, leaf in params.items() if leaf.ndim == 2}
    galore_projector = sum(r * max(w.shape) * 4 for w in weights.values())
    for run in runs[2:]:
        m = run.measures
        name = run.arm.name
        targets.append(
            Target(
                f"{name}: no weight-shaped buffer besides parameters and outputs",
                not m.intermediates,
                f"{len(m.intermediates)} found"
                + (": " + "; ".join(m.intermediates[:6]) if m.intermediates else ""),
            )
        )
        difference = m.state_bytes - galore.measures.state_bytes
        targets.append(
            Target(
                f"{name}: optimiser state equals arm 2's to within the projector",
                abs(difference) <= galore_projector,
                f"{m.state_bytes:,} vs {galore.measures.state_bytes:,} bytes, "
                f"difference {difference:,}; arm 2's projectors {galore_projector:,}",
            )
        )
        worst, worst_factor, detail = 0.0, 0.0, ""
        for path, w in weights.items():
            if is_embedding(path):
                continue
            bound = math.prod(w.shape) * 4 * r / min(w.shape)
            ratio = m.grad_leaf_bytes.get(path, 0) / bound
            worst_factor = max(worst_factor, m.grad_factor_bytes.get(path, 0) / bound)
            if ratio > worst:
                worst = ratio
                detail = f"{path} {w.shape}: {m.grad_leaf_bytes[path]:,} bytes"
        table = [p for p in weights if is_embedding(p)][0]
        table_bytes = m.grad_leaf_bytes[table]
        rows_read = config.batch * config.seq
        rows_bound = rows_read * (weights[table].shape[1] * 4 + 8)
        table_ok = table not in run.arm.marked or table_bytes <= rows_bound
        targets.append(
            Target(
                f"{name}: gradient bytes at most r/min(m, n) of dense per projected "
                "weight (plus the rows read, for a row-sparse table)",
                worst <= 1.0 + 1e-9 and table_ok,
                f"worst ratio to the bound: {worst:.3f} ({detail}); the factor that "
                f"is not the projector alone: {worst_factor:.3f}. The table's "
                f"gradient: {table_bytes:,} bytes; dense "
                f"{math.prod(weights[table].shape) * 4:,}; {rows_read:,} rows read "
                f"allow {rows_bound:,}",
            )
        )
        measured = galore.measures.steady_flops - m.steady_flops
        targets.append(
            Target(
                f"{name}: FLOPs below arm 2's by the saving of never forming X^T C "
                "(steps that keep the projectors)",
                m.steady_flops < galore.measures.steady_flops,
                f"{m.steady_flops:,.0f} vs {galore.measures.steady_flops:,.0f}: "
                f"measured saving {measured:,.0f}, analytic {saving:,.0f}",
            )
        )
        gap = (run.val_loss - galore.val_loss) / galore.val_loss
        targets.append(
            Target(
                f"{name}: validation loss at most 3% above arm 2's",
                gap <= 0.03,
                f"{run.val_loss:.4f} vs {galore.val_loss:.4f} ({gap:+.1%})",
            )
        )
        relative = ratios[runs.index(run)] / ratios[1]
        targets.append(
            Target(
                f"{name}: step time at most arm 2's",
                relative <= 1.0,
                f"{relative:.2f} of arm 2's",
            )
        )
    return targets


def report(runs, ratios, targets, params, config, quick, vocabulary, chars) -> str:
    saving, saving_lines = analytic_saving(params, config)
    lines = [
        "# A character-level transformer trained four ways",
        "",
        "Produced by:",
        "",
        "```",
        "python " + shlex.join(sys.argv),
        "```",
        "",
        f"- {_environment()}",
        f"- Model: {config.layers} blocks, d_model {config.d_model}, {config.heads} "
        f"heads, MLP {4 * config.d_model}, vocabulary {vocabulary} characters; "
        f"{sum(x.size for x in jax.tree_util.tree_leaves(params)):,} parameters.",
        f"- Data: {chars:,} characters of the source of {', '.join(MODULES)}; "
        f"batches of {config.batch} x {config.seq}; {config.steps} steps; learning "
        f"rate {config.learning_rate}; rank r = {config.rank}, projectors refreshed "
        f"every {config.refresh_every} steps.",
        "- Bytes and FLOPs come from the compiled training step (jitted with the "
        "parameters and state donated; `memory_analysis()`, `cost_analysis()`). "
        "Gradient bytes count the fields of compressed values. *Every branch*: the "
        "program every step runs; XLA counts the FLOPs of both branches of the "
        "projector refresh, and for arms 3 and 4 that is the range finder on the "
        "implicit gradient, run only every "
        f"{config.refresh_every} steps. *Steady step*: a step that keeps the "
        "projectors (arms 3 and 4 compiled with the projectors passed as arrays; "
        "for arms 1 and 2 the same program, as XLA counts no FLOPs for the SVD "
        "that arm 2's refresh calls).",
        "- Step time is the median over rounds that interleave the arms, as a "
        "ratio to arm 1; training time counts the training steps only, after "
        "compilation, on a shared machine.",
        *(["- Quick mode: a smoke run, not a result."] if quick else []),
        "",
        "| arm | temp bytes | temp bytes, steady step | optimiser state bytes "
        "| gradient bytes | FLOPs, steady step | FLOPs, every branch "
        "| weight-shaped intermediates | step time / arm 1 | training time (s) "
        "| final training loss | validation loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run, ratio in zip(runs, ratios):
        m = run.measures
        tail = float(np.mean(run.losses[-max(1, len(run.losses) // 20) :]))
        lines.append(
            f"| {run.arm.name} | {m.temp_bytes:,} | {m.steady_temp_bytes:,} "
            f"| {m.state_bytes:,} | {m.grad_bytes:,} | {m.steady_flops:,.0f} "
            f"| {m.flops:,.0f} | {len(m.intermediates)} "
            f"| {ratio:.2f} | {run.seconds:.1f} | {tail:.4f} | {run.val_loss:.4f} |"
        )
    lines += [
        "",
        "## Targets",
        "",
        "| target | met | numbers |",
        "|---|---|---|",
    ]
    lines += [
        f"| {t.what} | {'met' if t.met else 'missed'} | {t.numbers} |" for t in targets
    ]
    lines += [
        "",
        "Weight-shaped intermediates of arms 3 and 4 (name in the compiled HLO: "
        "what it is):",
        "",
        *[
            f"- {run.arm.name}: " + ("; ".join(run.measures.intermediates) or "none")
            for run in runs[2:]
        ],
        "",
        "## Notes",
        "",
        f"- A step reads {config.batch * config.seq:,} rows of a {vocabulary}-row "
        "table. The `SparseRows` gradient stores one entry per row read, so for a "
        "character vocabulary it is larger than the dense table; the lazy update "
        "first sums it into the distinct rows, at most min(rows read, V) of them, "
        "which here is a buffer of the table's shape (the intermediates of arm 4). "
        "Row-sparse gradients pay for tables with many more rows than a step reads.",
        "- A projected gradient is `LowRank(P, G^T P)`: the factor `G^T P` is "
        "exactly r/min(m, n) of the dense bytes, and the other factor is the "
        "projector the loss was given (on steps that keep it, the optimiser's own "
        "array passed through, not a new buffer).",
        "- Arm 3 leaves the embedding table unmarked: it is read by a gather, not a "
        "matrix product, so a projection could not avoid its dense gradient; the "
        "optimiser projects that gradient after the fact (the intermediates of "
        "arm 3).",
        "- Arms 3 and 4 draw a fresh projector with a randomized range finder on the "
        "implicit gradient; arm 2 takes the SVD of the dense gradient, and projects "
        "the other side of each weight (`optax.contrib.galore` keeps state of "
        "r x min(m, n) and a projector of max(m, n) x r; arms 3 and 4 the reverse).",
        "",
        f"Analytic FLOPs saving of never forming X^T C, per step: {saving:,.0f}",
        "",
        *[f"- {line}" for line in saving_lines],
        "",
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
    axes.set_title("Character-level transformer: four ways to train")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(out: pathlib.Path, quick: bool = False, seed: int = 0) -> list[Run]:
    """Trains the four arms and writes `transformer.md` and `transformer.png` to
    `out` (created if missing)."""
    config = QUICK if quick else FULL
    out.mkdir(parents=True, exist_ok=True)
    text = load_text()
    tokens, vocabulary = encode(text)
    split = int(0.9 * len(tokens))
    train_data = batches(tokens[:split], config, config.steps, seed)
    val_data = batches(tokens[split:], config, config.eval_batches, seed + 1)
    model = Transformer(config, len(vocabulary), jax.random.key(seed))
    params, static = Split.of(model)
    arms = make_arms(config, static, params)
    with qt.fallback("silent"):
        runs = [
            train(arm, config, params, static, train_data, val_data, seed)
            for arm in arms
        ]
        seconds = time_side_by_side(
            runs, jnp.asarray(train_data[0]), config.timing_rounds, seed
        )
    ratios = [s / seconds[0] for s in seconds]
    targets = check_targets(runs, ratios, params, config)
    text = report(
        runs, ratios, targets, params, config, quick, len(vocabulary), len(tokens)
    )
    (out / "transformer.md").write_text(text)
    plot(runs, out / "transformer.png")
    print(text)
    return runs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help=f"output folder (default: {DEFAULT_OUT}, or {QUICK_OUT} with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="about a minute")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.out or (QUICK_OUT if args.quick else DEFAULT_OUT), args.quick, args.seed)
