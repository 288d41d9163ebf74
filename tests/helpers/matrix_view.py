"""Weights stored with more dims than their matrix: the cases of the rules that mark
them through their matrix view, and a small attention block whose weights are stored
as `(d, heads, head_dim)`, stacked over layers and applied with `lax.scan`."""

import math

import jax
import jax.numpy as jnp
from hypothesis import strategies as st

from quax_tangents._marks._matrix_view import StoredView, matrix_view_p, to_matrix_p
from tests.helpers import float_dtypes, random_array, seeds
from tests.helpers.cases import Case, case
from tests.helpers.lowrank import lowrank_values


@st.composite
def stored_shapes(draw, max_batch=1):
    """`(stored, matrix, (batch_ndim, row_ndim))`: a stored shape `(*batch, *rows,
    *cols)` with one or two row dims and one or two column dims, and its matrix view
    `(*batch, prod(rows), prod(cols))`."""
    batch = tuple(
        draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, max_batch)))
    )
    rows = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 2))))
    cols = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 2))))
    stored = (*batch, *rows, *cols)
    matrix = (*batch, math.prod(rows), math.prod(cols))
    return stored, matrix, (len(batch), len(rows))


@case("matrix_view", "LowRank")
def _matrix_view():
    @st.composite
    def draw_case(draw):
        stored, matrix, _ = draw(stored_shapes())
        ct = draw(lowrank_values(shape=matrix))
        fn = lambda c: matrix_view_p.bind(c, stored=stored, batch_ndim=0)  # noqa: E731
        return Case(fn, (ct,), ct.dtype, StoredView)

    return draw_case()


@case("to_matrix", "dense")
def _to_matrix():
    @st.composite
    def draw_case(draw):
        stored, matrix, _ = draw(stored_shapes())
        w = random_array(draw(seeds()), stored, draw(float_dtypes()))
        fn = lambda w: to_matrix_p.bind(w, stored=stored, matrix=matrix)  # noqa: E731
        return Case(fn, (w,), w.dtype, jax.Array)

    return draw_case()


# ---------------------------------------------------------------------------------------
# An attention block with weights stored as (d, heads, head_dim)


D, HEADS, HEAD_DIM, LAYERS = 8, 2, 3, 2
# `projected(dims=...)` of each weight: the query `(layers, d, heads, head_dim)` is the
# stack of `(d, heads * head_dim)` matrices (tall: m > n), the output `(layers, heads,
# head_dim, d)` the stack of `(heads * head_dim, d)` matrices (wide).
DIMS = {"query": (1, 1), "out": (1, 2)}


def attention_params(seed=0, layers=LAYERS, d=D, heads=HEADS, head_dim=HEAD_DIM):
    return {
        "query": random_array(seed, (layers, d, heads, head_dim)) / 3,
        "out": random_array(seed + 1, (layers, heads, head_dim, d)) / 3,
    }


def attention_layer(x, w):
    """`x + out(softmax-free attention(x))` for `x` `(batch, seq, d)`, written as LLM
    code writes it: `einsum` with the weights as stored."""
    q = jnp.einsum("btd,dhk->bthk", x, w["query"])
    scores = jnp.einsum("bthk,bshk->bhts", q, q) / math.sqrt(q.shape[-1])
    mixed = jnp.einsum("bhts,bshk->bthk", jnp.tanh(scores), q)
    return x + jnp.einsum("bthk,hkd->btd", mixed, w["out"])


def attention_loss(params, x):
    """The mean square of the output of the stacked layers, run by a `lax.scan` over
    a checkpointed body."""

    def body(x, w):
        return attention_layer(x, w), None

    y, _ = jax.lax.scan(jax.checkpoint(body), x, params)
    return jnp.mean(y**2)


def matrix_view(array, dims):
    """`array` reshaped to the matrix view that `dims = (batch_ndim, row_ndim)`
    gives it."""
    batch_ndim, row_ndim = dims
    batch = array.shape[:batch_ndim]
    m = math.prod(array.shape[batch_ndim : batch_ndim + row_ndim])
    return array.reshape(*batch, m, -1)
