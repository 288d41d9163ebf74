"""A small Equinox decoder whose attention weights are stored per head, `(d, heads,
head_dim)`, and applied by `jnp.einsum` (queries `"sd,dnh->snh"`, output
`"snh,dnh->sd"`), as some public JAX models store them; the blocks are a Python list,
each model call takes one sequence, and the attention core is its own `jax.jit`.

`weights(p)` lists the projection weights, the per-head ones first.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax


DIM, HEADS, HEAD_DIM, HIDDEN, VOCAB, LAYERS = 16, 2, 8, 24, 20, 2


@jax.jit
def _causal_attention(q, k, v):
    logits = jnp.einsum("qnh,knh->nqk", q, k) / jnp.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones(logits.shape[-2:], bool))
    weights = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    return jnp.einsum("nqk,knh->qnh", weights, v)


def _init(key, shape):
    return jax.random.normal(key, shape) / jnp.sqrt(shape[0])


class HeadsBlock(eqx.Module):
    wq: jax.Array  # (d, heads, head_dim)
    wv: jax.Array  # (d, heads, head_dim)
    wo: jax.Array  # (d, heads, head_dim), contracted over (heads, head_dim)
    up: jax.Array  # (d, hidden)
    down: jax.Array  # (hidden, d)

    def __init__(self, key):
        kq, kv, ko, ku, kd = jax.random.split(key, 5)
        self.wq = _init(kq, (DIM, HEADS, HEAD_DIM))
        self.wv = _init(kv, (DIM, HEADS, HEAD_DIM))
        self.wo = _init(ko, (DIM, HEADS, HEAD_DIM)) / 2
        self.up = _init(ku, (DIM, HIDDEN))
        self.down = _init(kd, (HIDDEN, DIM))

    def __call__(self, xs):  # (seq, d)
        q = jnp.einsum("sd,dnh->snh", xs, self.wq)
        v = jnp.einsum("sd,dnh->snh", xs, self.wv)
        xs = xs + jnp.einsum("snh,dnh->sd", _causal_attention(q, q, v), self.wo)
        return xs + jax.nn.silu(xs @ self.up) @ self.down


class HeadsLM(eqx.Module):
    embedding: jax.Array
    blocks: list
    head: jax.Array

    def __init__(self, key):
        ke, kb, kh = jax.random.split(key, 3)
        self.embedding = jax.random.normal(ke, (VOCAB, DIM))
        self.blocks = [HeadsBlock(k) for k in jax.random.split(kb, LAYERS)]
        self.head = _init(kh, (DIM, VOCAB))

    def __call__(self, tokens):  # (seq,) -> (seq, vocabulary)
        xs = self.embedding[tokens]
        for block in self.blocks:
            xs = block(xs)
        return xs @ self.head


def loss(model, batch):
    """Mean next-token cross-entropy of a `(batch, seq + 1)` array of token ids."""
    logits = jax.vmap(model)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def per_head_weights(model):
    return [w for b in model.blocks for w in (b.wq, b.wv, b.wo)]


def weights(model):
    matrices = [w for b in model.blocks for w in (b.up, b.down)]
    return per_head_weights(model) + matrices + [model.head]


def project(model):
    """`project=` for `qto.projected`: every projection weight."""
    no = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(weights, no, [True] * len(weights(model)))


def dims(leaf):
    """`dims=` for `qto.projected`: a per-head weight as its `(d, heads * head_dim)`
    matrix."""
    return (0, 1) if leaf.ndim == 3 else None


def stacked_per_head(key):
    """`{"wq", "wo"}`, each `(LAYERS, d, heads, head_dim)`: the per-head weights of
    all layers stacked, for `scanned_loss`."""
    kq, ko = jax.random.split(key)
    shape = (LAYERS, DIM, HEADS, HEAD_DIM)
    return {
        "wq": jax.random.normal(kq, shape) / 4,
        "wo": jax.random.normal(ko, shape) / 4,
    }


def scanned_loss(params, x):
    """The layers of `stacked_per_head` run by `lax.scan` over a checkpointed body,
    on `x` `(batch, seq, d)`."""

    @jax.checkpoint
    def layer(h, w):
        q = jnp.einsum("bsd,dnh->bsnh", h, w["wq"])
        return h + jnp.einsum("bsnh,dnh->bsd", jnp.tanh(q), w["wo"]), None

    return jnp.mean(jax.lax.scan(layer, x, params)[0] ** 2)
