"""A scanned Llama for compile-only memory figures: the configurations of the GaLore
paper's pre-training table, the model (blocks stacked, `lax.scan`, one `remat` per
block, bfloat16 weights), and its loss with or without projection marks.

Only shapes matter here: the parameters are built by `jax.eval_shape(init_params)`,
and no step is run.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

import quax_tangents as qt


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama's sizes, and the GaLore rank used with it.

    The five named configurations are those of GaLore's pre-training experiments
    (Zhao et al. 2024, Table 2 and its 7B runs), from the repository's
    `configs/llama_{60m,130m,350m,1b,7b}.json` (jiaweizzhao/GaLore); the ranks are the
    paper's (128/512, 256/768, 256/1024, 512/2048, and 1024 for 7B as in its
    `scripts/single_gpu/llama_7b.sh`).
    """

    name: str
    hidden: int
    intermediate: int
    heads: int
    layers: int
    rank: int
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


MODELS = {
    "60M": LlamaConfig("60M", 512, 1376, 8, 8, 128),
    "130M": LlamaConfig("130M", 768, 2048, 12, 12, 256),
    "350M": LlamaConfig("350M", 1024, 2736, 16, 24, 256),
    "1B": LlamaConfig("1B", 2048, 5461, 32, 24, 512),
    "7B": LlamaConfig("7B", 4096, 11008, 32, 32, 1024),
}
# The 1B model with its MLP width rounded up to a multiple of 128 (5461 -> 5504), as
# the MLP widths of public Llama models are (7B's 11008 is 86 x 128). A TPU tiles
# an array's two minor dims by (8, 128): for a `(24, 5461, 2048)` stack its default
# layout makes the layer dim minor instead, and the step copies each MLP stack into
# the per-layer layout its loop slices (1.5 GiB at 1B, for every optimiser).
VARIANTS = {"1B-5504": LlamaConfig("1B-5504", 2048, 5504, 32, 24, 512)}

# The stacked block matrices, `(layers, m, n)` each, used as `x @ w`.
MATRICES = ("q", "k", "v", "o", "gate", "up", "down")
DTYPE = jnp.bfloat16


def matrix_shape(config: LlamaConfig, name: str) -> tuple[int, int]:
    d, f = config.hidden, config.intermediate
    return {"gate": (d, f), "up": (d, f), "down": (f, d)}.get(name, (d, d))


def init_params(config: LlamaConfig, key: jax.Array) -> dict:
    """bfloat16 parameters; blocks stacked along a leading layer axis."""
    keys = iter(jax.random.split(key, 16))
    d, L = config.hidden, config.layers

    def normal(shape, fan_in):
        x = jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)
        return x.astype(DTYPE)

    blocks = {
        name: normal((L, *matrix_shape(config, name)), matrix_shape(config, name)[0])
        for name in MATRICES
    }
    blocks["attn_norm"] = jnp.ones((L, d), DTYPE)
    blocks["mlp_norm"] = jnp.ones((L, d), DTYPE)
    return {
        "embed": normal((config.vocab, d), 1),
        "blocks": blocks,
        "final_norm": jnp.ones((d,), DTYPE),
        "head": normal((d, config.vocab), d),
    }


def count_params(config: LlamaConfig) -> int:
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


# ---------------------------------------------------------------------------------------
# The model


def _rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + 1e-6)
    return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x):
    """Rotary position embedding on `(batch, seq, heads, head_dim)`."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rotated.astype(x.dtype)


def _block(config: LlamaConfig, h, w):
    b, s, d = h.shape
    heads, dh = config.heads, config.head_dim
    x = _rms_norm(h, w["attn_norm"])
    q = _rope((x @ w["q"]).reshape(b, s, heads, dh))
    k = _rope((x @ w["k"]).reshape(b, s, heads, dh))
    v = (x @ w["v"]).reshape(b, s, heads, dh)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(dh)
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, -1e30)
    attn = jax.nn.softmax(scores, axis=-1).astype(h.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, d)
    h = h + out @ w["o"]
    x = _rms_norm(h, w["mlp_norm"])
    return h + (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]


def _constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def loss(config: LlamaConfig, params: dict, tokens, projectors=None, batch=None):
    """Mean next-token cross-entropy of `tokens` `(batch, seq + 1)`.

    `batch`: a sharding of the activations along their batch dim, or None. FSDP
    code pins the residual stream to it at every block (as MaxText's and Levanter's
    activation constraints do), so that the partitioner gathers each layer's weights
    rather than the activations.

    With `projectors` (per block matrix, a `(matrix, refresh)` pair of arrays stacked
    over the layers: `(layers, min(m, n), rank)` and `(layers,)`), each layer's slice
    of every block matrix is marked with `quax_tangents.projected_cotangent` inside
    the scan body, so that under `quax_tangents.grad` its gradient comes back as the
    stacked `LowRank` factors of the projection.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    h = _constrain(params["embed"][inputs], batch)

    def body(h, layer):
        w, marks = layer
        if marks is not None:
            w = dict(w)
            for name, (matrix, refresh) in marks.items():
                projector = qt.Projector(matrix, refresh)
                w[name] = qt.projected_cotangent(
                    w[name], config.rank, projector=projector
                )
        return _constrain(_block(config, _constrain(h, batch), w), batch), None

    h, _ = jax.lax.scan(jax.checkpoint(body), h, (params["blocks"], projectors))
    h = _rms_norm(h, params["final_norm"])
    logits = (h @ params["head"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
