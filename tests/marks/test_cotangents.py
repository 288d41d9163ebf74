"""Cotangents that are born compressed: `factored_cotangent`, `projected_cotangent`
and `sparse_rows_cotangent`, checked against dense reference math."""

import re

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import quax_tangents as qt
from tests.helpers import assert_close, heads, random_array


M, N = 12, 16  # weights are (M, N) or, for the m > n cases, (N, M)
RANK = 2


def _orthonormal(seed, rows, cols):
    return jnp.linalg.qr(random_array(seed, (rows, cols)))[0]


# Each form: (the other operand's shape for a weight (m, n), the product).
FORMS = {
    "x @ w": (lambda m, n: (2, m), lambda x, w: x @ w),
    "w @ x": (lambda m, n: (n, 2), lambda x, w: w @ x),
    "einsum btd,dh": (
        lambda m, n: (1, 3, m),
        lambda x, w: jnp.einsum("btd,dh->bth", x, w),
    ),
    "x @ w.T": (lambda m, n: (2, n), lambda x, w: x @ w.T),
    "vmap(w @ x)": (lambda m, n: (3, n), lambda x, w: jax.vmap(lambda v: w @ v)(x)),
}


def _form_loss(form, shape, mark):
    x_shape, product = FORMS[form]
    x = random_array(1, x_shape(*shape))
    return lambda w: jnp.sum(jnp.sin(product(x, mark(w))))


def _dense_gradient(form, shape, w):
    return jax.grad(_form_loss(form, shape, lambda w: w))(w)


def _projection(g, grad):
    """`P P^T G` (m <= n) or `G Q Q^T`, with the projector taken from `grad`."""
    m, n = g.shape
    if m <= n:
        return grad.left @ (grad.left.T @ g)
    return (g @ grad.right) @ grad.right.T


# ---------------------------------------------------------------------------------------
# factored_cotangent


@pytest.mark.parametrize("form", FORMS)
def test_factored_cotangent_is_the_exact_gradient(form):
    w = random_array(0, (M, N))
    loss = _form_loss(form, (M, N), qt.factored_cotangent)
    with qt.fallback("error"):
        grad = qt.grad(loss)(w)
    assert isinstance(grad, qt.LowRank)
    # One outer product per row contracted: the product's rows.
    rows = np.prod(FORMS[form][0](M, N)) // (
        M if form in ("x @ w", "einsum btd,dh") else N
    )
    assert grad.rank == rows
    assert_close(grad, _dense_gradient(form, (M, N), w))
    assert_close(jax.grad(loss)(w), _dense_gradient(form, (M, N), w))


# ---------------------------------------------------------------------------------------
# projected_cotangent


@pytest.mark.parametrize("shape", [(M, N), (N, M)], ids=["m<=n", "m>n"])
@pytest.mark.parametrize("form", FORMS)
def test_projection_with_a_given_projector(form, shape):
    w = random_array(0, shape)
    projector = _orthonormal(3, min(shape), RANK)
    mark = lambda w: qt.projected_cotangent(w, RANK, projector=projector)  # noqa: E731
    loss = _form_loss(form, shape, mark)
    with qt.fallback("error"):
        grad = qt.grad(loss)(w)
    assert isinstance(grad, qt.LowRank) and grad.rank == RANK
    factor = grad.left if shape[0] <= shape[1] else grad.right
    np.testing.assert_array_equal(factor, projector)
    g = _dense_gradient(form, shape, w)
    p = projector
    expected = p @ (p.T @ g) if shape[0] <= shape[1] else (g @ p) @ p.T
    assert_close(grad, expected)
    # Plain jax.grad with the same mark computes the same numbers densely.
    assert_close(jax.grad(loss)(w), expected)


@pytest.mark.parametrize("shape", [(M, N), (N, M)], ids=["m<=n", "m>n"])
@pytest.mark.parametrize("form", ["x @ w", "w @ x", "einsum btd,dh"])
def test_projection_with_a_fresh_projector(form, shape):
    w = random_array(0, shape)
    key = jax.random.key(7)
    mark = lambda w: qt.projected_cotangent(w, RANK, key=key, iters=2)  # noqa: E731
    loss = _form_loss(form, shape, mark)
    with qt.fallback("error"):
        grad = qt.grad(loss)(w)
    assert isinstance(grad, qt.LowRank) and grad.rank == RANK
    basis = grad.left if shape[0] <= shape[1] else grad.right
    assert_close(basis.T @ basis, jnp.eye(RANK))
    g = _dense_gradient(form, shape, w)
    assert_close(grad, _projection(g, grad))
    assert_close(jax.grad(loss)(w), grad)


def test_a_fresh_projector_spans_a_gradient_of_low_enough_rank():
    # G = X^T C has rank 2 here, so a rank-3 projection loses nothing.
    w = random_array(0, (M, N))
    loss = _form_loss("x @ w", (M, N), lambda w: qt.projected_cotangent(w, 3))
    with qt.fallback("error"):
        grad = qt.grad(loss)(w)
    assert_close(grad, _dense_gradient("x @ w", (M, N), w))


def _switch_loss(w, matrix, refresh):
    projector = qt.Projector(matrix, refresh)
    x = random_array(1, (2, M))
    marked = qt.projected_cotangent(w, RANK, projector=projector, key=jax.random.key(7))
    return jnp.sum(jnp.sin(x @ marked))


_switch_grad = jax.jit(qt.grad(_switch_loss))


def test_projector_refresh_is_data_in_one_jitted_step():
    w = random_array(0, (M, N))
    given = _orthonormal(3, M, RANK)
    kept = _switch_grad(w, given, jnp.asarray(False))
    refreshed = _switch_grad(w, given, jnp.asarray(True))
    np.testing.assert_array_equal(kept.left, given)
    fresh = qt.grad(
        lambda w: jnp.sum(
            jnp.sin(
                random_array(1, (2, M))
                @ qt.projected_cotangent(w, RANK, key=jax.random.key(7))
            )
        )
    )(w)
    assert_close(refreshed, fresh)
    assert not np.allclose(refreshed.left, given)
    assert _switch_grad._cache_size() == 1


def test_projector_init_asks_for_a_refresh():
    placeholder = qt.Projector.init((N, M), RANK, jnp.float32)
    assert placeholder.matrix.shape == (M, RANK) and bool(placeholder.refresh)


def test_linear_under_vmap_and_attention_projections():
    key = jax.random.key(0)
    linear = eqx.nn.Linear(N, M, key=key)  # weight (M, N)
    attention = eqx.nn.MultiheadAttention(2, M, inference=True, key=key)
    x = random_array(1, (3, N))
    names = ("query_proj", "key_proj", "value_proj", "output_proj")
    projectors = {
        name: _orthonormal(i, M, RANK) for i, name in enumerate(("linear", *names))
    }

    def mark(weight, name):
        return qt.projected_cotangent(weight, RANK, projector=projectors[name])

    def loss(linear, attention, marked):
        if marked:
            linear = eqx.tree_at(
                lambda m: m.weight, linear, mark(linear.weight, "linear")
            )
            weights = lambda a: [getattr(a, n).weight for n in names]  # noqa: E731
            attention = eqx.tree_at(
                weights,
                attention,
                [mark(getattr(attention, n).weight, n) for n in names],
            )
        h = jax.vmap(linear)(x)
        return jnp.sum(jnp.tanh(attention(h, h, h)))

    with qt.fallback("error"):
        grads = qt.grad(loss, argnums=(0, 1))(linear, attention, True)
    dense = eqx.filter_grad(lambda models: loss(*models, False))((linear, attention))
    pairs = [(grads[0].weight, dense[0].weight, projectors["linear"])]
    pairs += [
        (getattr(grads[1], n).weight, getattr(dense[1], n).weight, projectors[n])
        for n in names
    ]
    for grad, g, p in pairs:
        assert isinstance(grad, qt.LowRank)
        np.testing.assert_array_equal(grad.left, p)
        assert_close(grad, p @ (p.T @ g))


def _decay_loss(w, x, marked):
    if marked:
        w = qt.projected_cotangent(w, RANK)
    return jnp.sum(jnp.sin(x @ w)) + 0.5 * jnp.sum(w**2)


def test_a_sum_without_a_projected_form_is_counted_and_projects_the_total():
    w, x = random_array(0, (M, N)), random_array(1, (2, M))
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        grad = qt.grad(_decay_loss)(w, x, True)
    # The cause (a use that is not a matmul), the sum, and the dense total.
    assert qt.fallback_counts() == {
        ("integer_pow", "Marked"): 1,
        ("add_any", "OuterSum"): 1,
        ("finish", "Marked"): 1,
    }
    assert isinstance(grad, qt.LowRank)
    total = jax.grad(_decay_loss)(w, x, False)
    assert_close(grad, _projection(total, grad))
    assert_close(jax.grad(_decay_loss)(w, x, True), grad)


# Uses of a marked weight that give it a dense cotangent, and the primitive that does.
DENSE_USES = {
    "weight decay": (lambda w: 0.5 * jnp.sum(w**2), "integer_pow"),
    "a reshape the mark cannot follow": (
        lambda w: jnp.sum(jnp.sin(w.reshape(-1))),
        "reshape",
    ),
    "a contraction of both dims": (
        lambda w: jnp.einsum("mn,mn->", w, w),
        "dot_general",
    ),
}


@pytest.mark.parametrize("use", DENSE_USES)
def test_every_dense_cotangent_of_a_mark_is_counted(use):
    fn, primitive = DENSE_USES[use]
    w = random_array(0, (M, N))
    p = _orthonormal(3, M, RANK)

    def loss(w, marked):
        if marked:
            w = qt.projected_cotangent(w, RANK, projector=p)
        return fn(w)

    with qt.fallback("error"), pytest.raises(qt.DensificationError):
        qt.grad(loss)(w, True)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        grad = qt.grad(loss)(w, True)
    # The use that made it dense, and the dense total the mark finished, even when
    # nothing else was added to it.
    counts = qt.fallback_counts()
    assert counts[(primitive, "Marked")] >= 1 and counts[("finish", "Marked")] == 1
    g = jax.grad(loss)(w, False)
    assert_close(grad, p @ (p.T @ g))


@settings(max_examples=10)
@given(
    rows=st.integers(2, 30),
    cols=st.integers(2, 12),
    reads=st.integers(1, 12),
    rank_fraction=st.floats(0.0, 1.0),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    given_projector=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_projected_table_read_by_row_gathers_is_projected_from_the_rows(
    rows, cols, reads, rank_fraction, dtype, given_projector, seed
):
    # An embedding table chosen by `project=`: its gradient is projected from the
    # rows read, never as a table, and equals the projection of the dense gradient
    # (the same table read by a one-hot matmul, whose cotangent is an outer sum).
    rank = 1 + int(rank_fraction * (min(rows, cols) - 1))
    table = random_array(seed, (rows, cols)).astype(dtype)
    ids = jax.random.randint(jax.random.key(seed), (reads,), -1, rows)  # -1: the last
    h = random_array(seed + 1, (reads, cols))
    side = min(rows, cols)
    projector = _orthonormal(seed + 2, side, rank) if given_projector else None

    def mark(w):
        key = jax.random.key(seed + 3)
        return qt.projected_cotangent(w, rank, projector=projector, key=key)

    def gathered(w):
        return jnp.sum(jnp.sin(mark(w)[ids]) * h)

    def one_hot(w):
        read = jax.nn.one_hot(ids % rows, rows, dtype=w.dtype) @ mark(w)
        return jnp.sum(jnp.sin(read) * h)

    with qt.fallback("error"):  # jitted: one compile per example, not one per op
        grad = jax.jit(qt.grad(gathered))(table)
        expected = jax.jit(qt.grad(one_hot))(table)
    assert isinstance(grad, qt.LowRank) and grad.dtype == dtype
    assert_close(qt.materialise(grad), qt.materialise(expected), factor=50)


def test_two_matmuls_of_one_weight_add_up_without_densifying():
    w = random_array(0, (M, N))
    x, y = random_array(1, (2, M)), random_array(2, (N, 3))
    p = _orthonormal(3, M, RANK)

    def loss(w, marked):
        if marked:
            w = qt.projected_cotangent(w, RANK, projector=p)
        return jnp.sum(jnp.sin(x @ w)) + jnp.sum(jnp.cos(w @ y))

    with qt.fallback("error"):
        grad = qt.grad(loss)(w, True)
    g = jax.grad(loss)(w, False)
    assert_close(grad, p @ (p.T @ g))


def test_vjp_returns_projected_cotangents():
    w, x = random_array(0, (M, N)), random_array(1, (2, M))
    p = _orthonormal(3, M, RANK)
    out, pullback = qt.vjp(
        lambda w: x @ qt.projected_cotangent(w, RANK, projector=p), w
    )
    ct = random_array(4, out.shape)
    (grad,) = pullback(ct)
    assert isinstance(grad, qt.LowRank)
    assert_close(grad, p @ (p.T @ (x.T @ ct)))


def test_a_function_without_marks_is_traced_once():
    calls = []

    def loss(w):
        calls.append(1)
        return jnp.sum(w**2)

    qt.grad(loss)(random_array(0, (3, 3)))
    assert len(calls) == 1


def test_densifications_before_the_retrace_are_not_counted_twice():
    w, x = random_array(0, (M, N)), random_array(1, (2, M))
    lowrank = qt.low_rank(random_array(2, (2, M)), 1)

    def loss(w, t):
        # `t + x` densifies a LowRank once per trace.
        return jnp.sum(jnp.sin((t + x) @ qt.projected_cotangent(w, RANK)))

    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        qt.grad(loss)(w, lowrank)
    assert qt.fallback_counts() == {("add", "LowRank"): 1}


def test_a_mark_inside_jit_within_the_loss():
    w, x = random_array(0, (M, N)), random_array(1, (2, M))
    p = _orthonormal(3, M, RANK)

    @jax.jit
    def inner(w):
        return x @ qt.projected_cotangent(w, RANK, projector=p)

    with qt.fallback("error"):
        grad = qt.grad(lambda w: jnp.sum(inner(w)))(w)
    assert isinstance(grad, qt.LowRank)
    assert_close(grad, p @ (p.T @ jax.grad(lambda w: jnp.sum(x @ w))(w)))


def _marked_loss(kind):
    """A fresh loss with a mark of `kind` (fresh, so that no jit cache holds it), its
    argument, and the type `quax_tangents.grad` returns."""
    if kind == "rows":
        ids = jnp.asarray([3, 7, 3])

        def loss(table):
            return jnp.sum(jnp.sin(qt.sparse_rows_cotangent(table)[ids]))

        return loss, random_array(0, (20, 4)), qt.SparseRows
    x = random_array(1, (2, M))
    mark = {
        "projected": lambda w: qt.projected_cotangent(w, RANK),
        "factored": qt.factored_cotangent,
    }[kind]

    def loss(w):
        return jnp.sum(jnp.sin(x @ mark(w)))

    return loss, random_array(0, (M, N)), qt.LowRank


@pytest.mark.parametrize("kind", ["projected", "factored", "rows"])
@pytest.mark.parametrize("first", ["quax_tangents.grad", "jax.grad"])
def test_jit_and_either_grad_in_either_order(kind, first):
    loss, w, compressed = _marked_loss(kind)
    expected_compressed, expected_dense = qt.grad(loss)(w), jax.grad(loss)(w)
    jitted = jax.jit(loss)
    with qt.fallback("error"):
        if first == "jax.grad":
            dense = jax.grad(jitted)(w)
            grad = qt.grad(jitted)(w)
        else:
            grad = qt.grad(jitted)(w)
            dense = jax.grad(jitted)(w)
    assert isinstance(grad, compressed)
    assert isinstance(dense, jax.Array)
    assert_close(grad, expected_compressed)
    assert_close(dense, expected_dense)
    # The cached traces serve other transformations too.
    _, pullback = jax.vjp(jitted, w)
    assert_close(pullback(jnp.ones(()))[0], expected_dense)
    batch = jnp.stack([w, 2 * w])
    by_row = jnp.stack([jax.grad(loss)(v) for v in batch])
    assert_close(jax.vmap(jax.grad(jitted))(batch), by_row)


@pytest.mark.parametrize("kind", ["projected", "factored", "rows"])
def test_a_bound_mark_differentiates_as_the_dense_identity(kind):
    # A trace that holds `mark_p` itself (as an entry point's trace does), reached by
    # plain JAX: linearised and transposed, it finishes the cotangent densely.
    from quax_tangents._marks import _cotangents

    loss, w, _ = _marked_loss(kind)
    expected = jax.grad(loss)(w)
    with _cotangents._trace_mode("inner"):
        _cotangents._state.mode = "inner"
        try:
            jaxpr = jax.make_jaxpr(loss)(w)
        finally:
            _cotangents._state.mode = None
    assert _cotangents.mark_p in {e.primitive for e in jaxpr.eqns}
    replay = lambda w: jax.extend.core.jaxpr_as_fun(jaxpr)(w)[0]  # noqa: E731
    assert_close(jax.grad(replay)(w), expected)
    _, pullback = jax.vjp(replay, w)
    assert_close(pullback(jnp.ones(()))[0], expected)
    batch = jnp.stack([w, 2 * w])
    assert_close(jax.vmap(replay)(batch), jax.vmap(loss)(batch))
    assert_close(
        jax.vmap(jax.grad(replay))(batch), jnp.stack([jax.grad(loss)(v) for v in batch])
    )
    # Forward mode is what it is for the custom_vjp identity: refused alike.
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(replay, (w,), (w,))
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(loss, (w,), (w,))


# ---------------------------------------------------------------------------------------
# sparse_rows_cotangent

V, D = 20, 4
IDS = jnp.asarray([[3, 7, 3], [0, 7, 19]])


READS = {
    "take": lambda table, ids: jnp.take(table, ids, axis=0),
    "index": lambda table, ids: table[ids],
    "Embedding": lambda table, ids: jax.vmap(jax.vmap(eqx.nn.Embedding(weight=table)))(
        ids
    ),
    # One scalar read at a time: a dynamic_slice each, not a gather.
    "Embedding, scalar": lambda table, ids: jnp.stack(
        [eqx.nn.Embedding(weight=table)(i) for i in ids.ravel()]
    ).reshape(ids.shape + (table.shape[1],)),
}


@pytest.mark.parametrize("read", READS)
def test_sparse_rows_cotangent_stores_each_row_read_once(read):
    table = random_array(0, (V, D))

    def loss(table, marked):
        if marked:
            table = qt.sparse_rows_cotangent(table)
        return jnp.sum(jnp.sin(READS[read](table, IDS)) * jnp.arange(D))

    with qt.fallback("error"):
        grad = qt.grad(loss)(table, True)
    assert isinstance(grad, qt.SparseRows)
    dense = jax.grad(loss)(table, False)
    assert_close(grad, dense)
    assert_close(jax.grad(loss)(table, True), dense)
    rows_read = IDS.size
    assert grad.k <= rows_read
    assert grad.nbytes <= rows_read * (D * 4 + 8)
    # Distinct rows are stored once; the padding rows are zero.
    stored = np.asarray(grad.indices)[np.any(np.asarray(grad.rows) != 0, axis=1)]
    assert sorted(stored) == sorted(set(np.asarray(IDS).ravel().tolist()))


@pytest.mark.parametrize("mode", ["fill", "clip"])
def test_out_of_bounds_reads_match_plain_jax(mode):
    table = random_array(0, (V, D))
    ids = jnp.asarray([2, V + 3, -V - 1, 2])

    def loss(table, marked):
        if marked:
            table = qt.sparse_rows_cotangent(table)
        rows = jnp.take(table, ids, axis=0, mode=mode, fill_value=0.0)
        return jnp.sum(jnp.sin(rows) * jnp.arange(D))

    with qt.fallback("error"):
        grad = qt.grad(loss)(table, True)
    assert isinstance(grad, qt.SparseRows)
    assert_close(grad, jax.grad(loss)(table, False))


def test_a_tied_table_adds_a_dense_term_counted():
    table = random_array(0, (V, D))
    h = random_array(1, (3, D))

    def loss(table, marked):
        if marked:
            table = qt.sparse_rows_cotangent(table)
        return jnp.sum(jnp.sin(table[IDS])) + jnp.sum(jnp.tanh(h @ table.T))

    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        grad = qt.grad(loss)(table, True)
    assert qt.fallback_counts() == {
        ("dot_general", "Marked"): 1,
        ("add_any", "SparseRows"): 1,
        ("finish", "Marked"): 1,
    }
    assert_close(grad, jax.grad(loss)(table, False))


@pytest.mark.parametrize("read", READS)
def test_every_row_read_of_a_projected_table_keeps_it_compressed(read):
    table = random_array(0, (V, D))
    projector = _orthonormal(1, D, RANK)  # V > D: the projection of G's columns

    def loss(table, marked):
        if marked:
            table = qt.projected_cotangent(table, RANK, projector=projector)
        return jnp.sum(jnp.sin(READS[read](table, IDS)) * jnp.arange(D))

    with qt.fallback("error"):
        grad = qt.grad(loss)(table, True)
    g = jax.grad(loss)(table, False)
    assert_close(qt.materialise(grad), (g @ projector) @ projector.T)
    compiled = jax.jit(qt.grad(loss), static_argnums=1)
    assert _produced(compiled, (table, True), f"f32[{V},{D}]") == []


def test_a_per_head_weight_contracted_over_its_stack_dim_names_the_matrix_layout():
    # A (d, heads, head_dim) weight marked in its own dims is a stack of d matrices;
    # `einsum("sd,dnh->snh")` contracts d. The error says so and names the fixes,
    # not `quax.register`; silently, the gradient is still exact (counted).
    model = heads.HeadsLM(jax.random.key(0))
    batch = jnp.asarray(np.random.default_rng(0).integers(0, heads.VOCAB, (2, 5)))

    def loss(model, marked):
        if marked:
            wq = qt.projected_cotangent(model.blocks[0].wq, 1, key=jax.random.key(1))
            model = eqx.tree_at(lambda m: m.blocks[0].wq, model, wq)
        return heads.loss(model, batch)

    with (
        qt.fallback("error"),
        pytest.raises(qt.DensificationError) as error,
    ):
        qt.grad(loss)(model, True)
    message = str(error.value)
    assert "stack [16] of (2, 8) matrices" in message
    assert "(d, heads * head_dim)" in message and "accumulate_gradients" in message
    assert "quax.register" not in message
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        grad = qt.grad(loss)(model, True).blocks[0].wq
    assert qt.fallback_counts()[("dot_general", "Marked")] == 1
    assert grad.shape == model.blocks[0].wq.shape


# ---------------------------------------------------------------------------------------
# No buffer of the weight's shape in the compiled gradient


def _produced(jitted, args, shape):
    """Compiled HLO instructions, other than parameters, whose result is `shape`
    (XLA:CPU's, this suite's backend)."""
    pattern = re.compile(r"\s*(ROOT )?%\S+ = " + re.escape(shape) + r"[{ ]")
    lines = jitted.lower(*args).compile().as_text().splitlines()
    return [line for line in lines if pattern.match(line) and "parameter(" not in line]


def _hlo_losses():
    x = random_array(1, (2, 3, 24))
    p = _orthonormal(3, 24, RANK)

    def matmul(mark):
        return lambda w: jnp.sum(jnp.tanh(jnp.einsum("btd,dh->bth", x, mark(w))))

    return {
        "factored": matmul(qt.factored_cotangent),
        "projected": matmul(lambda w: qt.projected_cotangent(w, RANK)),
        "given": matmul(lambda w: qt.projected_cotangent(w, RANK, projector=p)),
        "switch": matmul(
            lambda w: qt.projected_cotangent(
                w, RANK, projector=qt.Projector(p, jnp.sum(w) > 0)
            )
        ),
        "plain": matmul(lambda w: w),
    }


@pytest.mark.parametrize("mark", ["factored", "projected", "given", "switch"])
def test_no_weight_shaped_buffer_in_the_compiled_gradient(mark):
    w = random_array(0, (24, 40))
    losses = _hlo_losses()
    assert _produced(jax.jit(qt.grad(losses[mark])), (w,), "f32[24,40]") == []
    assert _produced(jax.jit(jax.grad(losses["plain"])), (w,), "f32[24,40]") != []


def test_no_table_shaped_buffer_in_the_compiled_gradient():
    table = random_array(0, (64, 8))

    def loss(table, marked):
        if marked:
            table = qt.sparse_rows_cotangent(table)
        return jnp.sum(jnp.sin(table[IDS]))

    marked = jax.jit(qt.grad(loss), static_argnums=1)
    plain = jax.jit(jax.grad(loss), static_argnums=1)
    assert _produced(marked, (table, True), "f32[64,8]") == []
    assert _produced(plain, (table, False), "f32[64,8]") != []


# ---------------------------------------------------------------------------------------
# Bad input


def test_bad_inputs_have_clear_errors():
    w = jnp.ones((4, 6))
    with pytest.raises(ValueError, match="`rank`=5 is larger than 4"):
        qt.projected_cotangent(w, 5)
    with pytest.raises(ValueError, match="`projector` has shape \\(6, 2\\)"):
        qt.projected_cotangent(w, 2, projector=jnp.ones((6, 2)))
    with pytest.raises(TypeError, match="`projector` has dtype int32"):
        qt.projected_cotangent(w, 2, projector=jnp.ones((4, 2), jnp.int32))
    with pytest.raises(ValueError, match="`projector` has shape \\(4, 2\\)"):
        qt.projected_cotangent(jnp.ones((3, 4, 6)), 2, projector=jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="`shape` must be \\(\\*batch, m, n\\)"):
        qt.Projector.init((4,), 2, jnp.float32)
    with pytest.raises(ValueError, match="`w` must be a matrix or a stack"):
        qt.factored_cotangent(jnp.ones(3))
    with pytest.raises(TypeError, match="`table` has dtype int32"):
        qt.sparse_rows_cotangent(jnp.ones((4, 6), jnp.int32))
    with pytest.raises(TypeError, match="`Projector.refresh` must be a bool scalar"):
        qt.Projector(jnp.ones((4, 2)), jnp.ones(2, bool))
    with pytest.raises(ValueError, match="`iters` must be a non-negative int"):
        qt.projected_cotangent(w, 2, iters=-1)
