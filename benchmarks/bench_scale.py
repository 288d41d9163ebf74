"""Compiled memory of a training step of real-size Llama models, per optimiser.

The models are the Llama configurations of the GaLore paper's pre-training table
(60M, 130M, 350M, 1B, 7B; vocabulary 32000), written as a scanned model (blocks
stacked, `lax.scan`, one `remat` per block) with bfloat16 weights, sequence length
256. One step accumulates the gradients of `ACCUMULATION` microbatches of
`MICROBATCH` sequences, then updates. The arms:

- `adam`: `optax.adam`, bfloat16 state (the paper's BF16 baseline);
- `adam-8bit`: `qto.quantized_state(optax.adam)`;
- `galore`: `optax.contrib.galore` at the paper's rank (dense gradients, projected
  after the fact);
- `projected`: `qto.galore(..., state_bits=None)`'s plain step: `qto.projected` on
  gradients that come back projected, from `qt.projected_cotangent` marks on the
  block matrices, accumulated over the microbatches;
- `projected-8bit`: `qto.galore`'s plain step with its defaults (8-bit state);
- `projected-8bit-clip` (with `--arms` only): the same with `max_grad_norm=1.0`, the
  gradients clipped to a global norm;
- `projected-8bit-adamw` (with `--arms` only): the same with `max_grad_norm=1.0` and
  `weight_decay=0.1`, the usual LLM optimiser (`optax.adamw` after a clip);
- `projected-8bit-all` (with `--arms` only): the same with `project=None`, its
  default: every matrix projected, the embedding table (read by a gather) and the
  head included, where the other arms project the block matrices as the paper does;
- `marks-8bit` (with `--accumulation 1` only): the step of one microbatch with the
  pieces put together by hand, without `qto.galore`: marks in the loss,
  `qt.value_and_grad`, `qto.layerwise` around the 8-bit projected Adam (without it,
  `qto.quantized_state` refuses to decode a whole stack's state).

Each step is compiled with the parameters and the optimiser state donated, and never
run: `jax.jit(step, donate_argnums=(0, 1)).lower(...).compile().memory_analysis()`,
on abstract inputs from `jax.eval_shape`. These are XLA's buffer assignment on CPU,
not a GPU's measured peak.

    python benchmarks/bench_scale.py          # every model and arm, and FSDP on 8 devices
    python benchmarks/bench_scale.py --quick  # the 60M model only (smoke run)

CPU and TPU side by side (`results/bench_scale_targets.md`): `--target` compiles the
given models and arms for this CPU or for one chip of a TPU generation (its 8-chip
slice with `--devices 8`) ahead of time, with no TPU attached. A TPU target needs
libtpu, from `pip install "jax[tpu]"` (keep it out of the test environment: with it
installed, JAX looks for a TPU first), and one process at a time can hold it:

    python benchmarks/bench_scale.py --target tpu-v5e --models 1B \
        --arms adam projected-8bit --accumulation 4

On one TPU chip, `--layouts auto` lets the compiler choose the layouts of the
parameters and the state (`jax.experimental.layout.Layout.AUTO`) instead of those a
plain `jax.jit` takes them in; the results put such rows in a table of their own.

XLA on CPU hoists a float32 copy of every stacked bfloat16 weight out of the scan
(`while-loop-invariant-code-motion`); no GPU compiler does. This script turns that pass
off, in `XLA_FLAGS`, before JAX starts, and reports one model with it on too.

To estimate another model, import the script's folder and call `estimate`:

    PYTHONPATH=benchmarks python -c "
    import bench_scale as b
    c = b.LlamaConfig('mine', hidden=3072, intermediate=8192, heads=24, layers=28, rank=768)
    print(b.estimate(c, 'projected-8bit').total / 2**30, 'GiB')"
"""

import os
import sys

from _targets import TARGETS, is_tpu_target, one_device, target_devices


# Trips over the microbatches of a projected refresh step (`iters=0`): the sketch,
# the product with its basis, and the step's own pass.
REFRESH_TRIPS = 3
_NO_HOIST = "--xla_disable_hlo_passes=while-loop-invariant-code-motion"
_DEVICES = "--xla_force_host_platform_device_count=8"


def _set_xla_flags() -> None:
    """Must run before JAX initialises its backend; a second `--with-hoisting` process
    measures with the pass on. A TPU target keeps the TPU compiler's defaults (the
    CPU-only pass and host device count do not apply to it)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if is_tpu_target(sys.argv[1:]):
        return
    if os.environ.get("BENCH_SCALE_HOIST") != "1" and _NO_HOIST not in flags:
        flags += " " + _NO_HOIST
    if "xla_force_host_platform_device_count" not in flags:
        flags += " " + _DEVICES
    os.environ["XLA_FLAGS"] = flags.strip()


_set_xla_flags()

# ruff: noqa: E402
import argparse
import dataclasses
import functools
import json
import math
import subprocess
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optax.contrib
from _llama import (
    MATRICES,
    MODELS,
    VARIANTS,
    LlamaConfig,
    count_params,
    init_params,
    loss,
    matrix_shape,
)
from _report import (
    add_out_argument,
    command,
    default_out,
    environment,
    machine_line,
    produced_by,
    versions,
    versions_lines,
)
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

import quax_tangents as qt
import quax_tangents.optax as qto


SEQ = 256
MICROBATCH = 2  # sequences per microbatch (per device in the FSDP step)
ACCUMULATION = 4  # microbatches per step
LEARNING_RATE = 1e-3
GALORE_SCALE = 0.25  # the paper's alpha
REFRESH_EVERY = 200  # the paper's update_proj_gap
FSDP_DEVICES = 8
ARMS = ("adam", "adam-8bit", "galore", "projected", "projected-8bit")
# The step of one microbatch, no accumulation, with the pieces put together by
# hand; measured with `--accumulation 1`.
SIMPLE_ARM = "marks-8bit"
# `qto.galore`'s defaults with the gradients clipped to a global norm of 1.0.
CLIP_ARM = "projected-8bit-clip"
# The usual LLM optimiser, `optax.chain(optax.clip_by_global_norm(1.0),
# optax.adamw(lr, weight_decay=0.1))`, as `qto.galore` takes it.
ADAMW_ARM = "projected-8bit-adamw"
# `qto.galore` with `project=None`: every matrix, the embedding and the head too.
ALL_ARM = "projected-8bit-all"
GIB = 2**30


# ---------------------------------------------------------------------------------------
# The optimisers. Every arm is one transformation of the whole parameter tree, as a
# user writes it; `qto.layerwise` runs the 8-bit arms' updates one layer's slice (and
# one slice of the embedding's and the head's rows) at a time.


def _block_matrices(params: dict) -> dict:
    """`project=`: the stacked block matrices, nothing else."""
    return {
        **{name: False for name in _top(params)},
        "blocks": {name: name in MATRICES for name in params["blocks"]},
    }


def _top(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k != "blocks"}


def _per_layer(tx):
    """`tx` on each layer's slice of the stacked leaves in turn, in a `lax.scan`:
    its state is initialised per layer and stacked (`jax.vmap`). For
    `optax.contrib.galore`, which decides with `lax.cond` whether to take an SVD, a
    decision that `vmap` would turn into an SVD of every layer at every step, and
    which takes matrices (`qto.layerwise` gives it `(1, m, n)` slices)."""

    def update(updates, state, params=None):
        def body(_, layer):
            return None, tx.update(*layer)

        _, (updates, state) = jax.lax.scan(body, None, (updates, state, params))
        return updates, state

    return optax.GradientTransformation(jax.vmap(tx.init), update)


def _galore(config: LlamaConfig):
    """`optax.contrib.galore` on the block matrices, layer by layer, and
    `optax.adam` on the other leaves."""
    galore = optax.contrib.galore(
        LEARNING_RATE,
        rank=config.rank,
        update_proj_gap=REFRESH_EVERY,
        scale=GALORE_SCALE,
    )
    return optax.partition(
        {"galore": _per_layer(galore), "adam": optax.adam(LEARNING_RATE)},
        lambda params: jax.tree.map(
            lambda flag: "galore" if flag else "adam", _block_matrices(params)
        ),
    )


def pipeline(config: LlamaConfig, arm: str) -> qto.GaLore:
    """The projected arms: `qto.galore` with its defaults (8-bit state unless the
    arm is `projected`), as a user writes it."""
    return qto.galore(
        rank=config.rank,
        learning_rate=LEARNING_RATE,
        refresh_every=REFRESH_EVERY,
        scale=GALORE_SCALE,
        project=None if arm == ALL_ARM else _block_matrices,
        state_bits=None if arm == "projected" else 8,
        max_grad_norm=1.0 if arm in (CLIP_ARM, ADAMW_ARM) else None,
        weight_decay=0.1 if arm == ADAMW_ARM else 0.0,
    )


def _simple(config: LlamaConfig):
    """The `marks-8bit` arm's transformation: the pieces put together by hand
    (`qto.projected` around an 8-bit `optax.adam`, one layer at a time), as a user
    who switches from `optax.adam` without `qto.galore` writes it once
    `qto.quantized_state` has refused the same without `qto.layerwise`."""
    return qto.layerwise(
        qto.projected(
            qto.quantized_state(optax.adam(LEARNING_RATE)),
            rank=config.rank,
            refresh_every=REFRESH_EVERY,
            scale=GALORE_SCALE,
            project=_block_matrices,
        ),
        layers=config.layers,
    )


def transformation(config: LlamaConfig, arm: str, params: Any = None):
    """The arm's transformation of the whole parameter tree (`params`, abstract, for
    the pipeline's, whose layer count it reads)."""
    adam = optax.adam(LEARNING_RATE)
    if arm == "adam":
        return adam
    if arm == "adam-8bit":
        return qto.layerwise(qto.quantized_state(adam), layers=config.layers)
    if arm == "galore":
        return _galore(config)
    if arm == SIMPLE_ARM:
        return _simple(config)
    if params is None:
        params = jax.eval_shape(
            functools.partial(init_params, config), jax.random.key(0)
        )
    return pipeline(config, arm).transformation(params)


def init_state(config: LlamaConfig, arm: str, params: dict):
    if arm.startswith("projected"):
        return pipeline(config, arm).init(params)
    return transformation(config, arm).init(params)


# ---------------------------------------------------------------------------------------
# Gradients, accumulated over the microbatches


def dense_gradients(config: LlamaConfig, params: dict, tokens, activations=None):
    """Mean loss and gradients over the microbatches `tokens[i]`, accumulated in the
    parameters' dtype."""

    def body(carry, batch):
        total, acc = carry
        value, grads = jax.value_and_grad(
            functools.partial(loss, config, batch=activations)
        )(params, batch)
        return (total + value, jax.tree.map(jnp.add, acc, grads)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (total, acc), _ = jax.lax.scan(body, (jnp.zeros([]), zeros), tokens)
    count = tokens.shape[0]
    return total / count, jax.tree.map(lambda g: (g / count).astype(g.dtype), acc)


# ---------------------------------------------------------------------------------------
# The step


def make_step(config: LlamaConfig, arm: str, activations=None, shardings=None):
    """The step: the mean gradient over the microbatches, the update, the new
    parameters. The projected arms take the library's own path:
    `qto.accumulate_gradients` marks the stacked block matrices (`qto.mark`,
    before the model's scan over layers) and adds the microbatches' small factors
    up in place; `qto.apply_updates` adds the `LowRank` updates into the donated
    weights. `activations`: the FSDP step's sharding of the activations' batch dim;
    `shardings`: its parameters' shardings, which lay the running sums of factors out
    like the weights (`accumulate_gradients(shardings=...)`).
    """
    loss_fn = functools.partial(loss, config, batch=activations)
    if arm.startswith("projected"):
        opt = pipeline(config, arm)

        def step(params, state, tokens):
            # The plain step of `qto.galore`: the microbatches are the batch's
            # leading dim split `accumulation` ways.
            batch = tokens.reshape(-1, tokens.shape[-1])
            value, grads = opt.value_and_grad(
                loss_fn, microbatches=tokens.shape[0], shardings=shardings
            )(params, state, batch)
            updates, state = opt.update(grads, state, params)
            return opt.apply(params, updates), state, value

        return step
    tx = transformation(config, arm)

    def step(params, state, tokens):
        if arm == SIMPLE_ARM:
            # One microbatch: the marks applied in the loss, `qt.value_and_grad`.
            value, grads = qt.value_and_grad(
                lambda p: loss_fn(qto.mark(p, state), tokens[0])
            )(params)
        else:
            value, grads = dense_gradients(config, params, tokens, activations)
        updates, state = tx.update(grads, state, params)
        return qto.apply_updates(params, updates), state, value

    return step


# ---------------------------------------------------------------------------------------
# Compiling and measuring


def _bytes(tree: Any) -> int:
    # A `LowRank` counts its two factors (its guard leaf holds no bytes).
    leaves = jax.tree.leaves(
        tree,
        is_leaf=lambda x: isinstance(x, qt.LowRank),
    )
    arrays = [
        a
        for x in leaves
        for a in ((x.left, x.right) if isinstance(x, qt.LowRank) else (x,))
    ]
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One compiled step's memory (bytes), from `memory_analysis()`, and the parts
    computed from shapes.

    - `argument`, `output`, `alias`, `temp`: XLA's figures; `total` is
        `argument + output - alias + temp`, every buffer the step holds.
    - `weights`, `state`: the parameters' and the optimiser state's bytes (inputs,
        donated, so the outputs reuse them).
    - `gradients`: one microbatch's gradient (for the projected arms, the `LowRank`
        factors and the dense gradients of the other leaves); `accumulator` the same
        again, carried across the microbatches, except the projected factors, which
        are added into their sum in place.
    - `activations`: what the remat'd scan saves (each block's input) plus the float32
        logits and their gradient.
    - `devices`, `received`: for a sharded step, the device count and the bytes one
        device receives per step (collectives inside loops counted once per
        iteration), counting a refresh of the projectors on every step; 1 and 0
        otherwise. `received_keep`: the same on a step that keeps the projectors.
    - `layouts`: `"default"` (the layouts `jax.jit` gives the parameters and the
        state) or `"auto"` (chosen by the compiler, `Layout.AUTO`).
    """

    model: str
    arm: str
    argument: int
    output: int
    alias: int
    temp: int
    weights: int
    state: int
    gradients: int
    accumulator: int
    activations: int
    fallbacks: int
    compile_s: float
    devices: int = 1
    received: float = 0.0
    received_keep: float = 0.0
    target: str = "cpu"
    accumulation: int = ACCUMULATION
    layouts: str = "default"

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp


def _abstract_inputs(
    config: LlamaConfig, arm: str, batch: int, accumulation: int, seq: int
):
    params = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    state = jax.eval_shape(functools.partial(init_state, config, arm), params)
    tokens = jax.ShapeDtypeStruct((accumulation, batch, seq + 1), jnp.int32)
    return params, state, tokens


def _gradient_bytes(config, arm, params, state, tokens) -> tuple[int, int]:
    """One microbatch's gradient bytes (for the projected arms, the factors other
    than the projector, and the dense leaves), and those of the accumulator: the
    same, but for the projected arms only the dense leaves' (the projected factors
    are added into their sum in place, one buffer)."""

    def grads(params, state, tokens):
        one = tokens[:1]
        if arm.startswith("projected"):
            return qto.accumulate_gradients(
                functools.partial(loss, config), params, state, one
            )[1]
        return dense_gradients(config, params, one)[1]

    with qt.fallback("silent"):
        shapes = jax.eval_shape(grads, params, state, tokens)
    leaves = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, qt.LowRank))
    dense = [x for x in leaves if not isinstance(x, qt.LowRank)]
    # A projected gradient's projector is the state's own array, counted there.
    projectors = [
        x.left if x.projector_side == "left" else x.right
        for x in leaves
        if isinstance(x, qt.LowRank)
    ]
    one = _bytes(shapes) - _bytes(projectors)
    return one, (_bytes(dense) if arm.startswith("projected") else one)


def _fsdp_spec(shape: tuple[int, ...], devices: int) -> P:
    """Shards the largest axis divisible by `devices` other than the first (a
    stacked layer axis, or the rows that `qto.layerwise` slices: slicing a sharded
    axis would gather the whole array on every device), the first only when no
    other axis divides."""
    candidates = [
        (axis > 0, size, axis)
        for axis, size in enumerate(shape)
        if size % devices == 0 and not (axis == 0 and len(shape) >= 3)
    ]
    if not candidates:
        return P()
    _, _, axis = max(candidates)
    return P(*([None] * axis + ["data"]))


def _shardings(tree: Any, mesh, devices: int) -> Any:
    return jax.tree.map(
        lambda x: NamedSharding(mesh, _fsdp_spec(x.shape, devices)), tree
    )


LAYOUTS_AUTO_ONLY = (
    "`layouts='auto'` (`--layouts auto`) is for one TPU chip (a `tpu-*` target, one "
    "device): XLA:CPU lays each shape out one way, and the FSDP step's layouts follow "
    "its shardings."
)


def estimate(
    config: LlamaConfig,
    arm: str,
    *,
    batch: int = MICROBATCH,
    accumulation: int = ACCUMULATION,
    seq: int = SEQ,
    devices: int = 1,
    target: str = "cpu",
    layouts: str = "default",
) -> Estimate:
    """Compiles one training step of the scanned Llama `config` with the optimiser
    `arm` and returns its memory, without running it or allocating its weights.

    **Arguments:**

    - `config`: a [`LlamaConfig`][] (`MODELS[...]` or your own sizes and rank).
    - `arm`: one of `"adam"`, `"adam-8bit"`, `"galore"`, `"projected"`,
        `"projected-8bit"`.
    - `batch`: sequences per microbatch (per device when `devices > 1`).
    - `accumulation`: microbatches whose gradients one step accumulates.
    - `seq`: tokens per sequence.
    - `devices`: above 1, an FSDP-style step on that many devices of a 1-d mesh:
        parameters and state sharded on their largest divisible axis (never the layer
        axis), microbatches split; JAX must see that many devices.
    - `target`: a key of `TARGETS`: `"cpu"`, or a TPU generation compiled ahead of
        time without a TPU (one chip, or its 8-chip slice for `devices=8`).
    - `layouts`: `"default"`, the layouts a plain `jax.jit(step)` takes its
        parameters and state in; or `"auto"` (one TPU chip only): the compiler
        chooses them (`jax.experimental.layout.Format(Layout.AUTO)` for the
        parameters and the state, in and out), as a step does whose weights and
        state are then built in those layouts (`compiled.input_formats`, see
        `docs/llm.md`).

    **Returns:**

    An `Estimate`: XLA's argument, output, alias and temp bytes (per device), their
    `total`, and the parts computed from shapes.
    """
    if layouts not in ("default", "auto"):
        raise ValueError(f'`layouts` must be "default" or "auto", got {layouts!r}')
    if layouts == "auto" and (devices != 1 or target == "cpu"):
        raise ValueError(LAYOUTS_AUTO_ONLY)
    params, state, tokens = _abstract_inputs(
        config, arm, batch * devices, accumulation, seq
    )
    if arm == SIMPLE_ARM and accumulation != 1:
        raise ValueError(f"the `{SIMPLE_ARM}` arm is the step of one microbatch")
    jit_kwargs: dict = {"donate_argnums": (0, 1)}
    activations = param_shardings = None
    chips = target_devices(target, devices)
    if devices == 1 and target != "cpu":
        one = one_device(chips[0])
        chosen = one if layouts == "default" else Format(Layout.AUTO, one)
        jit_kwargs.update(
            in_shardings=(chosen, chosen, one), out_shardings=(chosen, chosen, one)
        )
    if devices > 1:
        mesh = jax.make_mesh(
            (devices,),
            ("data",),
            devices=chips[:devices],
            axis_types=(jax.sharding.AxisType.Auto,),
        )
        activations = NamedSharding(mesh, P("data"))
        shardings = (
            _shardings(params, mesh, devices),
            _shardings(state, mesh, devices),
            NamedSharding(mesh, P(None, "data", None)),
        )
        param_shardings = shardings[0]
        jit_kwargs.update(
            in_shardings=shardings,
            out_shardings=(shardings[0], shardings[1], NamedSharding(mesh, P())),
        )
    step = make_step(config, arm, activations, param_shardings)
    qt.reset_fallback_counts()
    start = time.perf_counter()
    with qt.fallback("silent"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers")
        compiled = jax.jit(step, **jit_kwargs).lower(params, state, tokens).compile()
    elapsed = time.perf_counter() - start
    fallbacks = sum(qt.fallback_counts().values())
    memory = compiled.memory_analysis()
    gradients, accumulator = _gradient_bytes(config, arm, params, state, tokens)
    activations = (
        config.layers * batch * seq * config.hidden * 2  # block inputs, bf16
        + 2 * batch * seq * config.vocab * 4  # f32 logits and their gradient
    )
    received = received_keep = 0.0
    if devices > 1:
        # Each collective's count is the product of its loops' trip counts. The
        # projected step's passes are the trips of one loop over (trip,
        # microbatch) whose count XLA does not know: `accumulation` on a step that
        # keeps the projectors, whose switches all take their branch 0 (the
        # product with the given projector, no range finder's step); three times
        # as many on a refresh, counted here as three such passes: its sketch and
        # range finder's steps take other branches, which one count over the
        # loop cannot tell apart. Adam's step counts the same either way.
        received, received_keep = (
            sum(
                qt.hlo.received_bytes(c, devices)
                for c in qt.hlo.collectives(
                    compiled, unknown_trips=trips * accumulation, branch=branch
                )
            )
            for trips, branch in ((REFRESH_TRIPS, 0), (1, 0))
        )
    return Estimate(
        config.name,
        arm,
        memory.argument_size_in_bytes,
        memory.output_size_in_bytes,
        memory.alias_size_in_bytes,
        memory.temp_size_in_bytes,
        _bytes(params) // devices,
        _bytes(state) // devices,
        gradients // devices,
        accumulator // devices if accumulation > 1 else 0,
        activations,
        fallbacks,
        elapsed,
        devices,
        received,
        received_keep,
        target,
        accumulation,
        layouts,
    )


def step_pieces(config: LlamaConfig, arm: str, params, state, tokens) -> dict:
    """The arm's step in pieces, each a program of its own: a name (`gradients`,
    `update`, `apply`, `update_apply`) to `(function, arguments, donate_argnums)`,
    on the step's (abstract) inputs. The gradients are `qto.accumulate_gradients`'s
    for the projected arms (what `GaLore.value_and_grad` runs) and the dense ones
    for the others; the state is donated as in the step (a refresh writes the new
    projectors over the old ones), and the weights to the apply."""
    if arm == SIMPLE_ARM:
        raise ValueError(
            f"The `{SIMPLE_ARM}` step's gradient comes from marks in its loss, not "
            "from a piece of its own: pick a projected arm or a dense one."
        )
    tx = transformation(config, arm)
    loss_fn = functools.partial(loss, config)

    def gradients(params, state, tokens):
        if arm.startswith("projected"):
            return qto.accumulate_gradients(loss_fn, params, state, tokens)
        return dense_gradients(config, params, tokens)

    def update(grads, state, params):
        return tx.update(grads, state, params)

    def apply(updates, params):
        return qto.apply_updates(params, updates)

    def update_apply(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return qto.apply_updates(params, updates), state

    with qt.fallback("silent"):
        grads = jax.eval_shape(gradients, params, state, tokens)[1]
        updates = jax.eval_shape(update, grads, state, params)[0]
    return {
        "gradients": (gradients, (params, state, tokens), (1,)),
        "update": (update, (grads, state, params), (1,)),
        "apply": (apply, (updates, params), (1,)),
        "update_apply": (update_apply, (grads, state, params), (1, 2)),
    }


def estimate_parts(
    config: LlamaConfig, arm: str, target: str = "cpu"
) -> dict[str, float]:
    """A projected arm's step in four compiled pieces, each its `temp` bytes (the
    buffers XLA adds beyond inputs and outputs): `gradients`
    (`qto.accumulate_gradients` over the microbatches, the state donated), `update`
    (the transformation's `update`, its state donated), `apply`
    (`qto.apply_updates`, the parameters donated) and `update_apply` (`update`
    then `qto.apply_updates`, state and parameters donated), compiled for `target`
    (one chip). It attributes the step's total to its parts."""
    inputs = _abstract_inputs(config, arm, MICROBATCH, ACCUMULATION, SEQ)
    pieces = step_pieces(config, arm, *inputs)
    jit_kwargs = {}
    if target != "cpu":
        one = one_device(target_devices(target, 1)[0])
        jit_kwargs = {"in_shardings": one, "out_shardings": one}
    found = {}
    with qt.fallback("silent"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers")
        for name, (fn, args, donate) in pieces.items():
            start = time.perf_counter()
            jitted = jax.jit(fn, donate_argnums=donate, **jit_kwargs)
            compiled = jitted.lower(*args).compile()
            found[name] = compiled.memory_analysis().temp_size_in_bytes
            found[f"{name}_compile_s"] = time.perf_counter() - start
    return found


def _estimate_in_fresh_process(model: str, arm: str, hoist: bool) -> Estimate:
    """`estimate` in a new Python process, whose XLA flags are read afresh (with
    `hoist`, the loop-invariant code motion pass stays on)."""
    env = dict(os.environ, BENCH_SCALE_HOIST="1" if hoist else "0")
    if hoist:
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(_NO_HOIST, "")
    out = subprocess.run(
        [sys.executable, __file__, "--one", model, arm],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return Estimate(**json.loads(out.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------------------------------
# Report


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _find(results: list[Estimate], model: str, arm: str, devices: int = 1) -> Estimate:
    return next(
        r for r in results if (r.model, r.arm, r.devices) == (model, arm, devices)
    )


def _arms(results: list[Estimate]) -> list[str]:
    return [
        arm for arm in ARMS if any(r.arm == arm and r.devices == 1 for r in results)
    ]


def model_table(results: list[Estimate], models: list[str]) -> list[str]:
    lines = [
        "| model | params | arm | argument | output | alias | temp | **total** | "
        "total ÷ adam | weights | optimiser state | gradients (one microbatch) | "
        "accumulator | activations (est.) | rest of temp | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in models:
        adam = _find(results, model, "adam")
        count = count_params(MODELS[model])
        for arm in _arms(results):
            r = _find(results, model, arm)
            rest = r.temp - r.gradients - r.accumulator - r.activations
            lines.append(
                f"| {model} | {count / 1e6:.0f}M | {arm} | {_gib(r.argument)} "
                f"| {_gib(r.output)} | {_gib(r.alias)} | {_gib(r.temp)} "
                f"| **{_gib(r.total)}** | {r.total / adam.total:.3f} "
                f"| {_gib(r.weights)} | {_gib(r.state)} | {_gib(r.gradients)} "
                f"| {_gib(r.accumulator)} | {_gib(r.activations)} | {_gib(rest)} "
                f"| {r.compile_s:.0f} |"
            )
    return lines


def target_rows(results: list[Estimate], models: list[str]) -> list[str]:
    lines = [
        "| model | target | value | verdict |",
        "|---|---|---|---|",
    ]
    for model in models:
        if model not in ("1B", "7B"):
            continue
        ours = _find(results, model, "projected-8bit")
        adam = _find(results, model, "adam")
        galore = _find(results, model, "galore")
        ratio = ours.total / adam.total
        rows = [
            ("projected-8bit total <= 0.45x adam's", f"{ratio:.3f}x", ratio <= 0.45),
            (
                "projected-8bit total <= galore's (same rank)",
                f"{_gib(ours.total)} vs {_gib(galore.total)} GiB",
                ours.total <= galore.total,
            ),
        ]
        if model == "7B":
            rows.append(
                (
                    "projected-8bit total <= 24 GiB on one device",
                    f"{_gib(ours.total)} GiB",
                    ours.total <= 24 * GIB,
                )
            )
        for target, value, met in rows:
            lines.append(
                f"| {model} | {target} | {value} | {'met' if met else 'MISSED'} |"
            )
    return lines


def breakdown(results: list[Estimate], models: list[str]) -> list[str]:
    """Where each target model's bytes go, for the target arm and BF16 Adam, in
    units of the bfloat16 weights."""
    lines = []
    for model in models:
        if model not in ("1B", "7B"):
            continue
        for arm in ("adam", "projected-8bit"):
            r = _find(results, model, arm)
            w = r.weights
            rest = r.total - r.weights - r.state - r.gradients - r.accumulator
            rest -= r.activations
            parts = [
                ("weights", r.weights),
                ("optimiser state", r.state),
                ("one microbatch's gradients", r.gradients),
                ("accumulator", r.accumulator),
                ("activations", r.activations),
                ("the rest", rest),
            ]
            text = ", ".join(f"{name} {_gib(v)} ({v / w:.2f})" for name, v in parts)
            lines.append(
                f"- {model} `{arm}`: total {_gib(r.total)} GiB ({r.total / w:.2f} "
                f"weights) = {text}."
            )
    return lines


# The projected-8bit totals (4 microbatches) of the CPU-tuned path this plain one
# replaced: bfloat16 carried as uint16 bits, "not before" ties, a refresh in a loop of
# zero or one trips, a multiply-reduce `apply_updates` (commit 5962a85, `python
# benchmarks/bench_scale.py --target TARGET --models MODEL --arms projected-8bit`),
# in GiB, per target.
TUNED_TOTALS = {
    "1B": {"cpu": 4.85, "tpu-v5e": 10.81, "tpu-v5p": 10.44},
    "7B": {"cpu": 23.20, "tpu-v5p": 35.31},
}


def peak_bytes(config: LlamaConfig) -> dict[str, int]:
    """Bytes, from shapes, of what the projected step holds beyond its arguments
    at least: the running sums of the factors, in bfloat16, and one layer's block
    weights in float32 (a layer's work in `update` and `apply_updates`)."""
    shapes = [matrix_shape(config, name) for name in MATRICES]
    return {
        "sums": sum(2 * config.layers * max(s) * config.rank for s in shapes),
        "layer": sum(4 * s[0] * s[1] for s in shapes),
    }


def _parts_line(model: str, r: Estimate, parts: dict) -> str:
    p = {k: v / GIB for k, v in parts.items()}
    return (
        f"- **{model}, by piece** (`python benchmarks/bench_scale.py --parts "
        f"{model} {r.arm}`: the temp bytes of each piece compiled alone): "
        f"`qto.accumulate_gradients` {p['gradients']:.2f} GiB, the transformation's "
        f"`update` {p['update']:.2f} GiB, `qto.apply_updates` "
        f"{p.get('apply', float('nan')):.2f} GiB, `update` then `qto.apply_updates` "
        f"{p['update_apply']:.2f} GiB."
    )


def why(results: list[Estimate], models: list[str], extra: dict) -> list[str]:
    """What the projected arms do, and where their bytes go, with this run's
    numbers."""
    if "7B" not in models:
        return []
    r = _find(results, "7B", "projected-8bit")
    adam = _find(results, "7B", "adam")
    eight = _find(results, "7B", "adam-8bit")
    config = MODELS["7B"]
    floor = r.weights + r.state + r.gradients + r.activations
    peak = peak_bytes(config)
    tuned = "; ".join(
        f"{m}: " + ", ".join(f"{t} {v:.2f} GiB" for t, v in TUNED_TOTALS[m].items())
        for m in ("1B", "7B")
        if m in models
    )
    lines = [
        "- **The library's path, written plainly.** `qto.accumulate_gradients` "
        "adds each microbatch's projection into a running sum of the small "
        "factors: the backward pass of the model's scan over layers projects each "
        "layer's gradient as it is made and adds it into that layer's slice of the "
        "sum, so that one layer's factors are alive at a time. Every pass is a "
        "trip of one loop around one compiled pass: a refresh step adds up the "
        "sketches, then the products with their orthonormal basis, whose small "
        "SVD gives the new projectors; then the step's own pass gives the "
        "factors. `qto.layerwise` "
        "runs the 8-bit "
        "transformation one layer's slice at a time; `qto.apply_updates` adds each "
        "layer's `left @ right.T` (a float32 matmul) into its slice of the donated "
        f"weight. The running sums are {_gib(peak['sums'])} GiB at 7B and one "
        f"layer's block weights in float32 {_gib(peak['layer'])} GiB (from shapes). "
        "The CPU-tuned path this replaced (bfloat16 carried as its bits, ordering "
        "ties, a refresh loop of zero or one trips, a multiply-reduce apply) "
        f"held {tuned} (`TUNED_TOTALS`): less on CPU, more on each TPU compile.",
    ]
    for model, parts in sorted(extra.get("parts", {}).items()):
        if model in models:
            lines.append(_parts_line(model, _find(results, model, r.arm), parts))
    return lines + [
        "- **The floor.** Weights, 8-bit state, one copy of the gradients and the "
        f"saved activations come to {_gib(floor)} GiB at 7B, "
        f"{floor / adam.total:.3f}x of BF16 Adam's total, before a temporary: "
        "0.45x leaves "
        f"{_gib(0.45 * adam.total - floor)} GiB for everything else, and 24 GiB "
        f"leaves {_gib(24 * GIB - floor)} GiB: the bfloat16 weights and the 8-bit state "
        f"alone are {_gib(r.weights + r.state)} GiB, the gradients (factors, "
        f"and the dense embedding and head) {_gib(r.gradients)} GiB.",
        "- **8-bit Adam on dense gradients** (`adam-8bit`, `qto.layerwise` around "
        f"`qto.quantized_state(optax.adam)`): {_gib(eight.total)} GiB at 7B, "
        f"{eight.total / adam.total:.3f}x of BF16 Adam's; its state is half, and "
        "`layerwise` keeps the decoded state and the updates to one slice. "
        "`galore` holds dense gradients, an accumulator and dense updates, so its "
        "total is BF16 Adam's.",
    ]


def _fsdp_ratio(results: list[Estimate], model: str) -> float | None:
    sharded = [r for r in results if r.model == model and r.devices > 1]
    arms = {r.arm: r.total for r in sharded}
    if "adam" not in arms or "projected-8bit" not in arms:
        return None
    return arms["projected-8bit"] / arms["adam"]


def unsharded_part(single: float, per_device: float, devices: int) -> float:
    """The part `F` of a step's bytes that does not shrink with the devices, from
    `per_device = F + (single - F) / devices`: what every device holds whole (the
    weights it gathers for a layer's matmuls, activations) rather than its share."""
    return (per_device - single / devices) / (1 - 1 / devices)


def fsdp_table(results: list[Estimate]) -> list[str]:
    lines = [
        "| model | arm | devices | total per device GiB | ÷ adam's | falls by | "
        "held whole per device GiB | received per device, step that keeps the "
        "projectors GiB | received per device, refresh step (three passes) GiB | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.devices == 1:
            continue
        adam = _find(results, r.model, "adam", r.devices)
        single = [
            x for x in results if (x.model, x.arm, x.devices) == (r.model, r.arm, 1)
        ]
        falls = whole = "n/a"
        if single:
            falls = f"{single[0].total / r.total:.1f}x"
            whole = _gib(unsharded_part(single[0].total, r.total, r.devices))
        lines.append(
            f"| {r.model} | {r.arm} | {r.devices} | {_gib(r.total)} "
            f"| {r.total / adam.total:.3f} | {falls} | {whole} "
            f"| {_gib(r.received_keep)} | {_gib(r.received)} | {r.compile_s:.0f} |"
        )
    return lines


def plot(results: list[Estimate], models: list[str], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [count_params(MODELS[m]) for m in models]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in _arms(results):
        totals = [_find(results, m, arm).total / GIB for m in models]
        ax.plot(sizes, totals, marker="o", label=arm)
    ax.axhline(24, color="grey", linestyle=":", label="24 GiB")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sizes, models)
    ax.set_xlabel("Llama model (GaLore paper's configurations)")
    ax.set_ylabel("compiled step total, GiB (XLA on CPU)")
    ax.set_title(
        f"One training step: seq {SEQ}, {ACCUMULATION} x {MICROBATCH} sequences, bf16"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# Running


QUICK_MODELS = ["60M"]
FULL_MODELS = list(MODELS)
FSDP_MODELS = ["1B", "7B"]
FSDP_ARMS = ("adam", "projected-8bit")
HOIST_MODEL, HOIST_ARM = "1B", "adam"


# A quick run compiles the target pair only: each compile takes 20 to 60 s on CPU.
QUICK_ARMS = ("adam", "projected-8bit")


def run(
    models: list[str], fsdp: bool, hoist: bool, log, arms=ARMS
) -> tuple[list[Estimate], dict]:
    results = []
    for model in models:
        for arm in arms:
            results.append(estimate(MODELS[model], arm))
            log(results[-1])
    if fsdp:
        for model in FSDP_MODELS:
            for arm in FSDP_ARMS:
                results.append(estimate(MODELS[model], arm, devices=FSDP_DEVICES))
                log(results[-1])
    extra = {}
    if hoist:
        extra["hoisted"] = dataclasses.asdict(
            _estimate_in_fresh_process(HOIST_MODEL, HOIST_ARM, hoist=True)
        )
    return results, extra


def report(
    results: list[Estimate],
    extra: dict,
    models: list[str],
    quick: bool,
    elapsed: float,
    png: str,
) -> str:
    lines = [
        *produced_by("Memory of a Llama training step, per optimiser, compiled only"),
        *environment(
            ("jax", "jaxlib", "optax", "quax", "quax-tangents"),
            f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
        ),
        f"- {'quick (smoke) run: the 60M model only' if quick else 'full run'}; "
        f"total wall time {elapsed:.0f} s.",
        "",
        "**These figures are XLA's buffer assignment on CPU "
        "(`compiled.memory_analysis()`), not a GPU's measured peak.** No step is run: "
        "each is `jax.jit(step, donate_argnums=(0, 1)).lower(*inputs).compile()` on "
        "abstract inputs from `jax.eval_shape`, with the parameters and the optimiser "
        "state donated. Compiled with "
        f"`XLA_FLAGS={_NO_HOIST}`: XLA on CPU hoists a float32 copy of every stacked "
        "bfloat16 weight out of the scan, which no GPU compile does (both are reported "
        "for one model below).",
        "",
        "Models: the Llama configurations of the GaLore paper's pre-training table "
        "(Zhao et al., *GaLore: Memory-Efficient LLM Training by Gradient Low-Rank "
        "Projection*, 2024, Table 2), hidden size, intermediate size, heads and layers "
        "as in the repository's `configs/llama_60m.json`, `llama_130m.json`, "
        "`llama_350m.json`, `llama_1b.json` and `llama_7b.json` (github.com/"
        "jiaweizzhao/GaLore); vocabulary 32000; ranks as in the paper: 128, 256, 256, "
        "512 and, for 7B, 1024 (`scripts/single_gpu/llama_7b.sh`). "
        f"Sequence length {SEQ}; each step accumulates the gradients of "
        f"{ACCUMULATION} microbatches of {MICROBATCH} sequences (accumulated in "
        "bfloat16), then updates. Written as a scanned model: blocks stacked, "
        "`lax.scan`, `jax.checkpoint` per block, bfloat16 weights.",
        "",
        "Arms: `adam` is `optax.adam` with bfloat16 state (the paper's BF16 "
        "baseline); `adam-8bit` is `qto.layerwise(qto.quantized_state(optax.adam(...)))`; `galore` is "
        "`optax.contrib.galore` at the same rank (dense gradients, projected after the "
        "fact, layer by layer); `projected` is the library's own path: "
        "`qto.accumulate_gradients` marks the stacked block matrices (`qto.mark`, "
        "before the model's scan) and adds the microbatches' small factors up in "
        "place, `qto.layerwise(qto.projected(optax.scale_by_adam(), "
        "learning_rate=...))` updates the stacked leaves one layer at a time "
        "(GaLore's scale 0.25, refresh every 200 steps; the embedding, final norm "
        "and head by its Adam), and `qto.apply_updates` adds the updates; "
        "`projected-8bit` puts `qto.quantized_state` inside `layerwise` (the "
        "embedding's and head's moments 8-bit too). In the other arms the embedding, final norm and "
        "head are updated by `optax.adam` (8-bit with `adam-8bit`), as in the paper.",
        "",
        "## Targets",
        "",
        *target_rows(results, models),
        "",
        "Where the bytes go, in GiB (and in units of the bfloat16 weights), from "
        "shapes; *the rest* is what XLA's total holds beyond them:",
        "",
        *breakdown(results, models),
        "",
        "## Where the projected arms' bytes go",
        "",
        *why(results, models, extra),
        "",
        "## Per model and arm (GiB)",
        "",
        *model_table(results, models),
        "",
        "*Total* is argument + output − alias + temp: every buffer the step holds. "
        "Weights, optimiser state, gradients and activations are computed from "
        "shapes: *gradients* is one microbatch's (for the projected arms the "
        "`LowRank` factors other than the projector, which is the optimiser "
        "state's own array, and the dense gradients of the embedding, norms and "
        "head), *accumulator* the same again (for the projected "
        "arms the dense leaves' only: their factors are added up in place), *activations* the "
        "block inputs the remat'd scan saves plus the float32 logits and their "
        "gradient. *Rest of temp* is temp minus those three: the optimiser's "
        "intermediates, the updates, and buffers that XLA on CPU keeps in float32 "
        "(see below).",
        "",
        f"![total bytes per arm against model size]({png})",
        "",
    ]
    if "hoisted" in extra:
        h = Estimate(**extra["hoisted"])
        plain = _find(results, h.model, h.arm)
        lines += [
            "## Loop-invariant code motion on CPU",
            "",
            f"The {h.model} `{h.arm}` step compiled with the pass on (XLA's default on "
            f"CPU) holds {_gib(h.total)} GiB (temp {_gib(h.temp)}); with it off, as "
            f"above, {_gib(plain.total)} GiB (temp {_gib(plain.temp)}). The difference "
            "is the float32 copies of the stacked weights hoisted out of the scan.",
            "",
        ]
    if any(r.devices > 1 for r in results):
        lines += [
            f"## FSDP-style data parallel on {FSDP_DEVICES} host devices",
            "",
            "Parameters and optimiser state sharded on their largest axis divisible by "
            f"{FSDP_DEVICES} other than the first (the layer axis, or the rows that "
            "`qto.layerwise` slices), each microbatch split over the "
            f"devices ({MICROBATCH} sequences per device), `jax.jit` with those "
            "shardings (XLA's SPMD partitioner). Bytes per device from "
            "`memory_analysis()`; bytes received per device per step from the "
            "compiled HLO, each collective's `quax_tangents.hlo.received_bytes` times the "
            "trip counts of the loops around it.",
            "",
            *fsdp_table(results),
            "",
            "These are XLA's own choices of collectives for the given shardings, "
            "with the model's activations pinned to the batch sharding at every "
            "block (`with_sharding_constraint`, as FSDP model code does, so that "
            "the partitioner gathers each layer's weights rather than the "
            "activations); on CPU it promotes bfloat16 collectives to float32. The "
            "projected-8bit step is the library's path as above, given the "
            "parameters' shardings (`qto.accumulate_gradients(..., shardings=...)`, "
            "the tree given to `jax.jit`): the running sums of factors, a refresh "
            "step's bases and new projectors are laid out like their weights (the "
            "rank dim takes the weight's mesh axis where the factor's own dim has "
            "none), and the partitioner adds each layer's factors into the device's "
            "share. Per device it holds "
            + ", ".join(
                f"{_fsdp_ratio(results, m):.2f}x of BF16 Adam's at {m}"
                for m in FSDP_MODELS
                if _fsdp_ratio(results, m) is not None
            )
            + ". *Falls by* is the one-device total over the per-device total "
            f"({FSDP_DEVICES} would be perfect), and *held whole per device* the "
            "part `F` that does not shrink with the devices, from `per device = F + "
            f"(one device - F) / {FSDP_DEVICES}`: both arms hold about the same `F` "
            "(each layer's weights gathered for its matmuls, the head gathered and "
            "its float32 copy on CPU, the activations), and the rest of each falls "
            f"{FSDP_DEVICES}-fold; the projected arm's *falls by* is the smaller "
            "because its total is, not because more of it is held whole. XLA on CPU "
            "all-reduces each layer's factors whole before keeping the device's "
            "share (neither arm's compiled step has a reduce-scatter). Received "
            "bytes are read from the compiled HLO, on a step that keeps the "
            "projectors (199 steps in 200 here: one trip over the microbatches, "
            "every switch on its branch 0, `qt.hlo.collectives(..., branch=0)`) and "
            "for a refresh step's three passes counted as three such trips (its "
            "sketch and range finder's steps take other branches, which one count "
            "over the loop cannot tell apart); Adam's step has no such branch. "
            "They are all-reduces of whole factors where a GPU's compiler would "
            "reduce-scatter.",
            "",
        ]
    return "\n".join(lines)


def _commands(saved: dict) -> str:
    """The commands that produced the figures, when they ran in parts."""
    return (
        "Figures from:\n\n```\n"
        + "\n".join(saved.get("commands", {}).values())
        + "\n```"
    )


def _log(r: Estimate) -> None:
    print(
        f"{r.model:>5} {r.arm:>15} devices {r.devices}: total {_gib(r.total)} GiB, "
        f"temp {_gib(r.temp)} GiB, compiled in {r.compile_s:.0f} s",
        flush=True,
    )


# ---------------------------------------------------------------------------------------
# CPU and TPU compiles side by side (`--target`)


def _target_key(r: dict) -> tuple:
    return (
        r["model"],
        r["accumulation"],
        r["devices"],
        r["arm"],
        r["target"],
        layouts_of(r),
    )


def layouts_of(r: dict) -> str:
    """A saved row's layouts (rows saved before `--layouts` have the default)."""
    return r.get("layouts", "default")


def _default_layouts(runs: list[dict]) -> list[dict]:
    return [r for r in runs if layouts_of(r) == "default"]


def _estimate(r: dict) -> Estimate:
    return Estimate(**{k: v for k, v in r.items() if k not in ("command", "versions")})


def targets_table(runs: list[dict]) -> list[str]:
    """One row per model, step and arm; per target its total, its ratio to BF16
    Adam's total on the same target and step (compiled with the same versions;
    blank otherwise), its temp and its compile time."""
    runs = _default_layouts(runs)
    targets = [t for t in TARGETS if any(r["target"] == t for r in runs)]
    found = {_target_key(r)[:5]: r for r in runs}
    rows = sorted(
        {k[:4] for k in found},
        key=lambda k: (_model_order(k[0]), -k[1], k[2], _arm_order(k[3])),
    )
    header = "| model | microbatches | devices | arm | " + " | ".join(
        f"{t} GiB | {t} ÷ adam | {t} temp | {t} compile s" for t in targets
    )
    lines = [header + " |", "|" + "---|" * (4 + 4 * len(targets))]
    for model, accumulation, devices, arm in rows:
        cells = [model, str(accumulation), str(devices), f"`{arm}`"]
        for t in targets:
            r = found.get((model, accumulation, devices, arm, t))
            adam = found.get((model, accumulation, devices, "adam", t))
            if r is None:
                cells += ["", "", "", ""]
                continue
            e = _estimate(r)
            # A ratio only to Adam's compile by the same versions.
            same = adam and adam.get("versions") == r.get("versions")
            ratio = f"{e.total / _estimate(adam).total:.3f}" if same else ""
            cells += [_gib(e.total), ratio, _gib(e.temp), f"{e.compile_s:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def fsdp_targets_table(runs: list[dict]) -> list[str]:
    """The FSDP rows (more than one device): per target and arm, the bytes each chip
    holds and the bytes each chip receives per step, read from the compiled HLO's
    collectives, on a step that keeps the projectors and on a refresh step."""
    rows = [r for r in _default_layouts(runs) if r["devices"] > 1]
    rows.sort(
        key=lambda r: (
            r["target"],
            _model_order(r["model"]),
            r["devices"],
            _arm_order(r["arm"]),
        )
    )
    lines = [
        "| target | model | devices | arm | GiB per chip | ÷ adam | received per "
        "chip per step, GiB | on a refresh step (three passes) | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    found = {_target_key(r)[:5]: r for r in rows}
    for r in rows:
        e = _estimate(r)
        adam = found.get(
            (r["model"], r["accumulation"], r["devices"], "adam", r["target"])
        )
        ratio = ""
        if adam:
            ratio = f"{e.total / _estimate(adam).total:.3f}"
        lines.append(
            f"| {e.target} | {e.model} | {e.devices} | `{e.arm}` | {_gib(e.total)} | "
            f"{ratio} | {_gib(e.received_keep)} | {_gib(e.received)} | "
            f"{e.compile_s:.0f} |"
        )
    return lines


def layouts_table(runs: list[dict]) -> list[str]:
    """The rows compiled with the compiler's layouts (`--layouts auto`), each beside
    the same step's total with the default layouts, each ratio to BF16 Adam's
    compiled the same way."""
    found = {_target_key(r): r for r in runs}
    rows = sorted(
        (r for r in runs if layouts_of(r) == "auto"),
        key=lambda r: (
            r["target"],
            _model_order(r["model"]),
            -r["accumulation"],
            _arm_order(r["arm"]),
        ),
    )
    lines = [
        "| target | model | microbatches | arm | GiB, compiler's layouts | ÷ adam "
        "| temp | compile s | GiB, default layouts | ÷ adam |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def total_and_ratio(key: tuple) -> tuple[str, str]:
        r = found.get(key)
        adam = found.get((*key[:3], "adam", *key[4:]))
        if r is None:
            return "", ""
        e = _estimate(r)
        ratio = f"{e.total / _estimate(adam).total:.3f}" if adam else ""
        return _gib(e.total), ratio

    for r in rows:
        e = _estimate(r)
        key = _target_key(r)
        auto_total, auto_ratio = total_and_ratio(key)
        default_total, default_ratio = total_and_ratio((*key[:5], "default"))
        lines.append(
            f"| {e.target} | {e.model} | {e.accumulation} | `{e.arm}` | {auto_total} | "
            f"{auto_ratio} | {_gib(e.temp)} | {e.compile_s:.0f} | {default_total} | "
            f"{default_ratio} |"
        )
    return lines


def _model_order(model: str) -> int:
    return list({**MODELS, **VARIANTS}).index(model)


def _arm_order(arm: str) -> int:
    order = (*ARMS, CLIP_ARM, ADAMW_ARM, ALL_ARM, SIMPLE_ARM)
    return order.index(arm) if arm in order else len(order)


# The packages whose versions a run of the targets records with its rows.
_TARGET_PACKAGES = ("jax", "jaxlib", "optax", "quax", "quax-tangents")


def _run_versions(target: str) -> str:
    """The versions a run of the targets records with its rows (libtpu's too for a
    TPU target): runs made with different versions may share the results file."""
    return versions(*_TARGET_PACKAGES, *(() if target == "cpu" else ("libtpu",)))


def render_targets(saved: dict) -> str:
    runs = saved["runs"]
    commands = sorted({r["command"] for r in runs})
    return "\n".join(
        [
            "# Memory of a Llama training step on CPU and TPU compiles, side by side",
            "",
            "Produced by these runs (each row below is from one of them):",
            "",
            "```",
            *commands,
            "```",
            "",
            *versions_lines(runs),
            "- backend: CPU, and TPU compiled ahead of time with no TPU attached "
            "(`jax.experimental.topologies`, libtpu from `jax[tpu]`)",
            machine_line(),
            "",
            "Each step is compiled only, never run, as in `bench_scale.md`: "
            "`jax.jit(step, donate_argnums=(0, 1), in_shardings=..., "
            "out_shardings=...).lower(*abstract inputs).compile().memory_analysis()`; "
            "*GiB* is argument + output − alias + temp. A TPU target with one device "
            "is one chip of a 2x2 topology (`SingleDeviceSharding` for every input "
            "and output); with 8, the 8-chip slice, FSDP as in `bench_scale.md`. "
            "CPU compiles use `bench_scale.md`'s flags (the loop-invariant code "
            "motion pass off); TPU compiles the TPU compiler's defaults. "
            "*Compile s* is the wall time of `lower` and `compile`, on 2 shared CPU "
            "cores: compare it only within one run.",
            "",
            f"Arms as in `bench_scale.md`; `projected` and `projected-8bit` are "
            f"`qto.galore`'s plain step (`opt.value_and_grad(loss, microbatches=k)`, "
            f"`opt.update`, `opt.apply`); `{SIMPLE_ARM}` is the step of one "
            "microbatch written without `qto.galore`: `qt.value_and_grad` of the "
            "loss with `qto.mark(params, state)`, "
            "`qto.layerwise(qto.projected(qto.quantized_state(optax.adam(lr)), "
            "rank=...), layers=L)`, `qto.apply_updates` (the same without "
            "`qto.layerwise` is refused by `qto.quantized_state`).",
            "",
            *targets_table(runs),
            "",
            *(
                [
                    f"FSDP on an 8-chip slice (`--devices {FSDP_DEVICES}`): parameters "
                    "and state sharded on their largest divisible axis, microbatches "
                    "split, as in `bench_scale.md`. Bytes received per chip are the "
                    "sum over the compiled HLO's collectives (`qt.hlo.collectives`, "
                    "`qt.hlo.received_bytes`; a TPU compile's asynchronous "
                    "collective, a chain of fusions that each repeat its instruction, "
                    "counted once), on a step that keeps the projectors "
                    "(199 steps in 200: one trip over the microbatches, every switch "
                    "on its branch 0) and for a refresh step's three passes, counted "
                    "as three such trips (its sketch and range finder's steps take "
                    "other branches, which one count over the loop cannot tell "
                    "apart).",
                    "",
                    *fsdp_targets_table(runs),
                    "",
                ]
                if any(r["devices"] > 1 for r in runs)
                else []
            ),
            *(
                [
                    "With the compiler's layouts (`--layouts auto`, one TPU chip): "
                    "the parameters and the optimiser state laid out as the compiler "
                    "chooses (`jax.jit(step, in_shardings=(auto, auto, ...), "
                    "out_shardings=(auto, auto, ...))` with `auto = "
                    "jax.experimental.layout.Format(Layout.AUTO)`; a step run so "
                    "puts its inputs in `compiled.input_formats` first), Adam's "
                    "compiled the same way. The default layouts are the ones "
                    "`jax.jit(step)` takes its inputs in, as in the tables above.",
                    "",
                    *layouts_table(runs),
                    "",
                ]
                if any(layouts_of(r) == "auto" for r in runs)
                else []
            ),
            *(
                [
                    "Refused by the compiler (the step does not fit the chip):",
                    "",
                    *(
                        f"- {r['model']} `{r['arm']}`, {r['accumulation']} "
                        f"microbatches, {r['devices']} device(s), {r['target']}: "
                        f"`{r['error']}` (`{r['command']}`)"
                        for r in saved["refused"]
                    ),
                    "",
                ]
                if saved.get("refused")
                else []
            ),
        ]
    )


def _refusal_key(r: dict) -> tuple:
    steps = ("model", "arm", "target", "accumulation", "devices")
    return (*(r[k] for k in steps), layouts_of(r))


def run_targets(args) -> None:
    out = args.out or (default_out(__file__, False).with_name("bench_scale_targets.md"))
    raw = out.with_suffix(".json")

    def load() -> dict:
        # Read afresh before each write: a CPU and a TPU run may share the file.
        return json.loads(raw.read_text()) if raw.exists() else {"runs": []}

    saved = load()
    arms = args.arms or list(QUICK_ARMS)
    configs = {**MODELS, **VARIANTS}
    for model in args.models or QUICK_MODELS:
        for arm in arms:
            try:
                e = estimate(
                    configs[model],
                    arm,
                    accumulation=args.accumulation,
                    devices=args.devices,
                    target=args.target,
                    layouts=args.layouts,
                )
            except jax.errors.JaxRuntimeError as error:
                # The TPU compiler refuses a program whose temporaries exceed the
                # chip's memory (CPU compiles never do): say so in the results.
                if "RESOURCE_EXHAUSTED" not in str(error):
                    raise
                refusal = {
                    "model": model,
                    "arm": arm,
                    "target": args.target,
                    "accumulation": args.accumulation,
                    "devices": args.devices,
                    "layouts": args.layouts,
                    "error": str(error).splitlines()[0],
                    "command": command(),
                }
                print(f"{model} {arm} on {args.target}: {refusal['error']}")
                saved = load()
                # A refusal replaces the earlier one of the same step and target
                # (whose message may differ, from another compiler version).
                saved["refused"] = [
                    r
                    for r in saved.get("refused", [])
                    if _refusal_key(r) != _refusal_key(refusal)
                ] + [refusal]
                raw.write_text(json.dumps(saved, indent=1))
                continue
            _log(e)
            row = {
                **dataclasses.asdict(e),
                "command": command(),
                "versions": _run_versions(args.target),
            }
            saved = load()
            saved["runs"] = [
                r for r in saved["runs"] if _target_key(r) != _target_key(row)
            ] + [row]
            raw.write_text(json.dumps(saved, indent=1))
    out.write_text(render_targets(saved))
    print(f"wrote {out}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 60M model only")
    parser.add_argument(
        "--one",
        nargs=2,
        metavar=("MODEL", "ARM"),
        help="compile one model and arm and print its Estimate as JSON",
    )
    parser.add_argument(
        "--parts",
        nargs=2,
        metavar=("MODEL", "ARM"),
        help="a projected arm's step in pieces (gradients, update, update and apply): "
        "the temp bytes of each, as JSON",
    )
    parser.add_argument(
        "--part",
        choices=("single", "fsdp"),
        help="run only the single-device part (with the hoisting comparison) or the "
        "FSDP part, and merge it into the results' JSON; then render the report",
    )
    parser.add_argument(
        "--render", action="store_true", help="render the report from the saved JSON"
    )
    parser.add_argument(
        "--target",
        choices=tuple(TARGETS),
        help="compile for this target (a TPU without one: needs `jax[tpu]`), for "
        "--models and --arms, and merge the figures into "
        "results/bench_scale_targets.json and .md (CPU and TPU side by side)",
    )
    parser.add_argument(
        "--models", nargs="+", choices=(*MODELS, *VARIANTS), help="with --target"
    )
    parser.add_argument(
        "--arms", nargs="+", choices=(*ARMS, CLIP_ARM, ADAMW_ARM, ALL_ARM, SIMPLE_ARM)
    )
    parser.add_argument(
        "--accumulation",
        type=int,
        default=ACCUMULATION,
        help=f"microbatches per step, with --target (default {ACCUMULATION})",
    )
    parser.add_argument(
        "--devices", type=int, default=1, help="with --target: 1, or 8 for FSDP"
    )
    parser.add_argument(
        "--layouts",
        choices=("default", "auto"),
        default="default",
        help="with --target tpu-* and one device: `auto` lets the compiler choose the "
        "parameters' and the state's layouts (default: those `jax.jit` takes)",
    )
    add_out_argument(parser, __file__)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.layouts == "auto" and (args.target in (None, "cpu") or args.devices != 1):
        raise SystemExit(LAYOUTS_AUTO_ONLY)
    if args.target and not args.parts:
        run_targets(args)
        return
    if args.parts:
        model, arm = args.parts
        parts = estimate_parts(MODELS[model], arm, args.target or "cpu")
        print(json.dumps(parts))
        if args.target in (None, "cpu"):
            # Kept with the CPU results (the report's "by piece" lines); `--render`
            # writes them out.
            raw = (args.out or default_out(__file__, False)).with_suffix(".json")
            saved = json.loads(raw.read_text())
            saved.setdefault("extra", {}).setdefault("parts", {})[model] = parts
            raw.write_text(json.dumps(saved, indent=1))
        return
    if args.one:
        model, arm = args.one
        print(json.dumps(dataclasses.asdict(estimate(MODELS[model], arm))))
        return
    out = args.out or default_out(__file__, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    models = QUICK_MODELS if args.quick else FULL_MODELS
    raw = out.with_suffix(".json")
    saved = (
        json.loads(raw.read_text())
        if raw.exists() and (args.part or args.render)
        else {}
    )
    if not args.render:
        start = time.perf_counter()
        single = args.part in (None, "single")
        fsdp = args.part in (None, "fsdp") and not args.quick
        results, extra = run(
            models if single else [],
            fsdp=fsdp,
            hoist=single and not args.quick,
            log=_log,
            arms=QUICK_ARMS if args.quick else ARMS,
        )
        elapsed = time.perf_counter() - start
        kept = [
            r
            for r in saved.get("results", [])
            if (r["devices"] > 1) != fsdp or (single and fsdp)
        ]
        saved = {
            "results": kept + [dataclasses.asdict(r) for r in results],
            "extra": {**saved.get("extra", {}), **extra},
            "elapsed": {**saved.get("elapsed", {}), (args.part or "all"): elapsed},
            "commands": {**saved.get("commands", {}), (args.part or "all"): command()},
        }
        raw.write_text(json.dumps(saved, indent=1))
    results = [Estimate(**r) for r in saved["results"]]
    extra, elapsed = saved["extra"], sum(saved["elapsed"].values())
    report_models = [
        m for m in models if any(r.model == m and r.devices == 1 for r in results)
    ]
    png = out.with_suffix(".png")
    plot(results, report_models, png)
    text = report(results, extra, report_models, args.quick, elapsed, png.name)
    out.write_text(
        text.replace("\n\n", "\n\n" + _commands(saved) + "\n\n", 1)
        if args.part or args.render
        else text
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
