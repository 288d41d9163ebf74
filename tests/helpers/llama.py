"""A small Llama-style decoder block for the sharding tests, written with explicit
shardings: RMSNorm, rotary position embeddings, grouped-query attention, a SwiGLU MLP,
`jnp.einsum` projections with `out_sharding=`, `jax.sharding.reshard`, `jax.checkpoint`
per block, and a vocabulary-parallel cross-entropy inside `jax.shard_map`.

The mesh has axes `("data", "model")`, both `AxisType.Explicit`: the batch is split
over "data", the projections' hidden dims (heads, MLP, vocabulary) over "model".
Nothing here touches devices at import.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

import quax_tangents as qt


DIM, HEADS, KV_HEADS, SEQ, VOCAB, HIDDEN = 64, 4, 2, 16, 32, 128
HEAD_DIM = DIM // HEADS
BATCH = 4

# (shape, spec) of every weight; the 2-D ones are the projections that get marked.
SHAPES = {
    "embed": ((VOCAB, DIM), P()),
    "attn_norm": ((DIM,), P()),
    "wq": ((DIM, HEADS * HEAD_DIM), P(None, "model")),
    "wk": ((DIM, KV_HEADS * HEAD_DIM), P(None, "model")),
    "wv": ((DIM, KV_HEADS * HEAD_DIM), P(None, "model")),
    "wo": ((HEADS * HEAD_DIM, DIM), P("model", None)),
    "mlp_norm": ((DIM,), P()),
    "w_gate": ((DIM, HIDDEN), P(None, "model")),
    "w_up": ((DIM, HIDDEN), P(None, "model")),
    "w_down": ((HIDDEN, DIM), P("model", None)),
    "final_norm": ((DIM,), P()),
    "lm_head": ((DIM, VOCAB), P(None, "model")),
}
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")


def make_mesh(data: int = 2, model: int = 4) -> jax.sharding.Mesh:
    return jax.make_mesh(
        (data, model),
        ("data", "model"),
        axis_types=(AxisType.Explicit, AxisType.Explicit),
        devices=jax.devices()[: data * model],
    )


def init(seed: int = 0) -> dict:
    """Weights placed with their specs; call under `jax.set_mesh(mesh)`."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, (shape, spec) in SHAPES.items():
        if len(shape) == 1:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / math.sqrt(shape[0])
        params[name] = jax.device_put(value.astype(np.float32), spec)
    return params


def batch(seed: int = 1) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    labels = np.roll(tokens, -1, axis=1)
    return (
        jax.device_put(tokens, P("data", None)),
        jax.device_put(labels, P("data", None)),
    )


def projectors(params: dict, rank: int, seed: int = 2) -> dict:
    """A fixed orthonormal projector per projection, `(min(m, n), rank)`, sharded
    like the weight's smaller side."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in PROJECTIONS:
        (m, n), spec = SHAPES[name]
        side = spec[0] if m <= n else spec[1]
        q = np.linalg.qr(rng.standard_normal((min(m, n), rank)))[0]
        out[name] = jax.device_put(q.astype(np.float32), P(side, None))
    return out


def rms_norm(x, gain):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gain


def rope(x):
    """Rotary embedding of `(batch, seq, heads, head_dim)` by position."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (np.arange(half) / half))
    angle = np.arange(x.shape[1])[:, None] * freq[None, :]
    cos = jnp.asarray(np.cos(angle), x.dtype)[None, :, None, :]
    sin = jnp.asarray(np.sin(angle), x.dtype)[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _heads(x, count):
    """`(batch, seq, count * head_dim)` to `(batch, seq, count, head_dim)`, with the
    heads replicated over "model" (the key/value heads do not divide it)."""
    x = jax.sharding.reshard(x, P("data", None, None))
    return x.reshape(x.shape[0], x.shape[1], count, HEAD_DIM)


def attention(p, x):
    bsd = P("data", None, "model")
    q = jnp.einsum("bsd,dh->bsh", x, p["wq"], out_sharding=bsd)
    k = jnp.einsum("bsd,dh->bsh", x, p["wk"], out_sharding=bsd)
    v = jnp.einsum("bsd,dh->bsh", x, p["wv"], out_sharding=bsd)
    q, k, v = _heads(q, HEADS), _heads(k, KV_HEADS), _heads(v, KV_HEADS)
    q, k = rope(q), rope(k)
    # Grouped-query attention: each key/value head serves HEADS // KV_HEADS heads.
    k = jnp.repeat(k, HEADS // KV_HEADS, axis=2)
    v = jnp.repeat(v, HEADS // KV_HEADS, axis=2)
    heads = P("data", None, "model", None)
    q, k, v = (jax.sharding.reshard(t, heads) for t in (q, k, v))
    scores = jnp.einsum(
        "bqhd,bkhd->bhqk", q, k, out_sharding=P("data", "model", None, None)
    ) / math.sqrt(HEAD_DIM)
    causal = np.tril(np.ones((SEQ, SEQ), bool))
    scores = jnp.where(causal, scores, -1e9)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v, out_sharding=heads)
    out = out.reshape(out.shape[0], out.shape[1], DIM, out_sharding=bsd)
    return jnp.einsum("bsh,hd->bsd", out, p["wo"], out_sharding=P("data", None, None))


def mlp(p, x):
    bsf = P("data", None, "model")
    gate = jnp.einsum("bsd,df->bsf", x, p["w_gate"], out_sharding=bsf)
    up = jnp.einsum("bsd,df->bsf", x, p["w_up"], out_sharding=bsf)
    return jnp.einsum(
        "bsf,fd->bsd",
        jax.nn.silu(gate) * up,
        p["w_down"],
        out_sharding=P("data", None, None),
    )


@jax.checkpoint
def block(p, x):
    x = x + attention(p, rms_norm(x, p["attn_norm"]))
    return x + mlp(p, rms_norm(x, p["mlp_norm"]))


def cross_entropy(logits, labels):
    """Mean cross-entropy of vocabulary-sharded logits, inside `jax.shard_map`: each
    device holds a slice of the vocabulary of its part of the batch."""
    count = labels.size

    def local(logits, labels):
        shard = logits.shape[-1]
        top = lax.pmax(jnp.max(lax.stop_gradient(logits), axis=-1), "model")
        total = lax.psum(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1), "model")
        log_z = jnp.log(total) + top
        offset = lax.axis_index("model") * shard
        index = labels - offset
        inside = (index >= 0) & (index < shard)
        picked = jnp.take_along_axis(
            logits, jnp.clip(index, 0, shard - 1)[..., None], axis=-1
        )[..., 0]
        picked = lax.psum(jnp.where(inside, picked, 0.0), "model")
        return lax.psum(jnp.sum(log_z - picked), "data") / count

    return jax.shard_map(
        local,
        in_specs=(P("data", None, "model"), P("data", None)),
        out_specs=P(),
    )(logits, labels)


def loss(params, tokens, labels, marks=None):
    """The block's loss; `marks(name, w)` wraps every projection (the identity when
    `None`)."""
    p = dict(params)
    if marks is not None:
        p.update({name: marks(name, p[name]) for name in PROJECTIONS})
    x = p["embed"].at[tokens].get(out_sharding=P("data", None, None))
    x = block(p, x)
    x = rms_norm(x, p["final_norm"])
    logits = jnp.einsum(
        "bsd,dv->bsv", x, p["lm_head"], out_sharding=P("data", None, "model")
    )
    return cross_entropy(logits, labels)


def projected_marks(projector: dict, rank: int):
    def marks(name, w):
        return qt.projected_cotangent(w, rank, projector=projector[name])

    return marks


def project(g, projector):
    """`P P^T g` (rows) or `g Q Q^T` (columns): the dense projection of a gradient
    onto a given projector of its smaller side, on the host in float64."""
    g, projector = np.asarray(g, np.float64), np.asarray(projector, np.float64)
    m, n = g.shape
    if m <= n:
        return projector @ (projector.T @ g)
    return (g @ projector) @ projector.T


# ---------------------------------------------------------------------------------
# The scanned model: the block's weights stacked `(LAYERS, ...)`, one `lax.scan`

LAYERS = 2
STACKED = tuple(n for n in SHAPES if n not in ("embed", "final_norm", "lm_head"))


def init_stacked(seed: int = 0) -> dict:
    """The block's weights stacked over `LAYERS` (spec `P(None, *spec)`), the rest
    as in `init`; call under `jax.set_mesh(mesh)`."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, (shape, spec) in SHAPES.items():
        if name in STACKED:
            shape, spec = (LAYERS, *shape), P(None, *spec)
        if len(shape) - (name in STACKED) == 1:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / math.sqrt(shape[-2])
        params[name] = jax.device_put(value.astype(np.float32), spec)
    return params


def scanned_loss(params, batch):
    """The scanned model's loss of `batch = (tokens, labels)`."""
    tokens, labels = batch
    x = params["embed"].at[tokens].get(out_sharding=P("data", None, None))

    def body(x, layer):
        return block(layer, x), None

    x, _ = lax.scan(body, x, {name: params[name] for name in STACKED})
    x = rms_norm(x, params["final_norm"])
    logits = jnp.einsum(
        "bsd,dv->bsv", x, params["lm_head"], out_sharding=P("data", None, "model")
    )
    return cross_entropy(logits, labels)
