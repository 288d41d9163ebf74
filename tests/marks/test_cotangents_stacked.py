"""Cotangent marks on stacked weights applied with `lax.scan`, on weights cast for
compute, and in losses computed in chunks: checked against the dense gradient and
against the compiled program's buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import quax_tangents as qt
from quax_tangents._marks._sources import PHASE_DRAWN, PHASE_GIVEN, PHASE_TESTED, Phased
from tests.helpers import assert_close, random_array
from tests.helpers.stacked import (
    orthonormal,
    project,
    scanned,
    stacked_params,
    weight_buffers,
)


M, N, R = 6, 8, 2
X = random_array(5, (2, M))  # two rows: a factored gradient stays within budget
SIDES = {"w": "left", "v": "right"}
BATCHES = {"one batch dim": (3,), "two batch dims": (2, 2)}


def _projectors(batch):
    return {"w": orthonormal(3, (*batch, M, R)), "v": orthonormal(4, (*batch, M, R))}


def _mark_all(kind, projectors):
    def mark(name, w):
        if kind == "factored":
            return qt.factored_cotangent(w)
        if kind == "given":
            return qt.projected_cotangent(w, R, projector=projectors[name])
        if kind == "switch":
            projector = qt.Projector(projectors[name], jnp.asarray(False))
            return qt.projected_cotangent(w, R, projector=projector)
        return qt.projected_cotangent(w, R, key=jax.random.key(1))

    return lambda params: {name: mark(name, w) for name, w in params.items()}


def _loss(params, mark=None, remat=False):
    if mark is not None:
        params = mark(params)
    return jnp.sum(scanned(X, params, remat=remat) ** 2)


def _check_projected(grads, dense, batch, kind, projectors):
    for name, side in SIDES.items():
        grad = grads[name]
        assert isinstance(grad, qt.LowRank) and grad.batch_ndim == len(batch)
        if kind == "factored":
            assert grad.projector_side is None
            assert_close(grad, dense[name])
            continue
        assert grad.projector_side == side
        projector = grad.left if side == "left" else grad.right
        assert projector.shape == (*batch, M, R)
        if kind in ("given", "switch"):
            np.testing.assert_array_equal(projector, projectors[name])
        else:  # fresh: one orthonormal projector per slice
            gram = jnp.swapaxes(projector, -1, -2) @ projector
            assert_close(gram, jnp.broadcast_to(jnp.eye(R), gram.shape))
        assert_close(grad, project(dense[name], projector, side))


# ---------------------------------------------------------------------------------------
# Stacked weights applied with lax.scan


CASES = [
    # (kind, batch, remat): every mark with checkpointed bodies, as LLM code runs
    # them, and one plain body.
    *[
        (kind, batch, True)
        for kind in ("factored", "given", "switch", "fresh")
        for batch in BATCHES.values()
    ],
    ("given", (3,), False),
]


def _maybe_jit(grad, compiled):
    return jax.jit(grad, static_argnums=(1, 2)) if compiled else grad


@pytest.mark.parametrize("kind, batch, remat", CASES)
def test_stacked_weights_marked_outside_the_scan(kind, batch, remat):
    params, projectors = stacked_params(batch, M, N), _projectors(batch)
    mark = _mark_all(kind, projectors)
    # Compiled, as training steps run (eagerly, the checkpointed nested scans of a
    # switched projector cost ten times as much); the plain body runs eagerly.
    compiled = remat
    with qt.fallback("error"):
        grads = _maybe_jit(qt.grad(_loss), compiled)(params, mark, remat)
    dense = _maybe_jit(jax.grad(_loss), compiled)(params, None, remat)
    _check_projected(grads, dense, batch, kind, projectors)
    # Plain jax.grad with the marks computes the same projections densely.
    plain = _maybe_jit(jax.grad(_loss), compiled)(params, mark, remat)
    for name in SIDES:
        assert_close(plain[name], grads[name], factor=10.0)


@pytest.mark.parametrize("batch", BATCHES.values(), ids=BATCHES.keys())
def test_each_slice_marked_inside_the_body(batch):
    params, projectors = stacked_params(batch, M, N), _projectors(batch)

    def loss(params):
        with_projectors = {**params, "Pw": projectors["w"], "Pv": projectors["v"]}

        def mark_slice(p):
            return {
                "w": qt.projected_cotangent(p["w"], R, projector=p["Pw"]),
                "v": qt.projected_cotangent(p["v"], R, projector=p["Pv"]),
            }

        return jnp.sum(scanned(X, with_projectors, mark_slice=mark_slice) ** 2)

    with qt.fallback("error"):
        grads = qt.grad(loss)(params)
    dense = jax.grad(_loss)(params)
    _check_projected({k: grads[k] for k in SIDES}, dense, batch, "given", projectors)


V, D = 10, 4


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_stacked_tables_keep_the_rows_read(where):
    tables = random_array(0, (3, V, D))
    ids = jnp.asarray([[1, 3, 3], [0, 9, 2], [4, 4, 4]])

    def loss(tables, marked):
        if marked and where == "outside":
            tables = qt.sparse_rows_cotangent(tables)

        def body(total, layer):
            table, i = layer
            if marked and where == "inside":
                table = qt.sparse_rows_cotangent(table)
            return total + jnp.sum(jnp.sin(table[i]) * jnp.arange(D)), None

        return jax.lax.scan(body, 0.0, (tables, ids))[0]

    with qt.fallback("error"):
        grad = qt.grad(loss)(tables, True)
    assert isinstance(grad, qt.SparseRows) and grad.batch_ndim == 1
    assert grad.indices.shape == ids.shape
    assert_close(grad, jax.grad(loss)(tables, False))
    # Each slice stores its distinct rows once.
    for layer in range(3):
        stored = np.asarray(grad.indices[layer])[
            np.any(np.asarray(grad.rows[layer]) != 0, axis=-1)
        ]
        assert sorted(stored) == sorted(set(np.asarray(ids[layer]).tolist()))


def test_projector_init_for_a_stacked_weight():
    placeholder = qt.Projector.init((2, 3, N, M), R, jnp.bfloat16)
    assert placeholder.matrix.shape == (2, 3, M, R)
    assert placeholder.matrix.dtype == jnp.bfloat16 and bool(placeholder.refresh)


def test_fresh_projectors_use_one_key_per_slice():
    params = stacked_params((3,), M, N)
    grads = qt.grad(_loss)(params, _mark_all("fresh", None))
    left = np.asarray(grads["w"].left)
    # Slices see different gradients and different test matrices.
    assert not np.allclose(left[0], left[1])


# ---------------------------------------------------------------------------------------
# A loss computed in chunks: marked weights closed over by a scan body


def _chunked_loss(params, chunks, mark=None, remat=True):
    """Levanter's `batch_chunk_size`: a scan over chunks of the batch, each running
    the scanned model; the weights are closed over by the chunk scan's body."""
    if mark is not None:
        params = mark(params)

    def chunk(total, x):
        return total + jnp.sum(scanned(x, params, remat=remat) ** 2), None

    return jax.lax.scan(chunk, 0.0, chunks)[0]


@pytest.mark.parametrize("kind", ["factored", "given", "fresh"])
def test_a_chunked_loss_keeps_the_compressed_cotangent(kind):
    batch = (2,)
    params, projectors = stacked_params(batch, M, N), _projectors(batch)
    # A factored gradient holds every row of every chunk: keep it within budget.
    chunks = random_array(6, (2, 1, M) if kind == "factored" else (5, 2, M))
    mark = _mark_all(kind, projectors)
    qt.reset_fallback_counts()
    with qt.fallback("error"):
        grads = qt.grad(_chunked_loss)(params, chunks, mark)
    assert qt.fallback_counts() == {}
    if kind == "factored":
        assert grads["w"].rank == 2  # the chunks' factors side by side
    dense = jax.grad(_chunked_loss)(params, chunks)
    _check_projected(grads, dense, batch, kind, projectors)


def test_a_scan_over_microbatches_closing_over_one_marked_matrix():
    w = random_array(0, (M, N))
    p = orthonormal(3, (M, R))
    xs = random_array(1, (13, 3, M))

    def loss(w, marked):
        if marked:
            w = qt.projected_cotangent(w, R, projector=p)

        def body(total, x):
            return total + jnp.sum(jnp.tanh(x @ w) ** 2), None

        return jax.lax.scan(body, 0.0, xs)[0]

    qt.reset_fallback_counts()
    with qt.fallback("error"):
        grad = qt.grad(loss)(w, True)
    assert qt.fallback_counts() == {}
    assert grad.rank == R
    assert_close(grad, p @ (p.T @ jax.grad(loss)(w, False)))


# ---------------------------------------------------------------------------------------
# The compiled step holds no weight-shaped buffer


def _shapes(batch):
    dims = lambda s: ",".join(map(str, s))  # noqa: E731
    return [
        f"f32[{dims((*batch, M * 4, N * 4))}]",
        f"f32[{dims((M * 4, N * 4))}]",
        f"f32[{dims((*batch, N * 4, M * 4))}]",
        f"f32[{dims((N * 4, M * 4))}]",
    ]


def _big(batch):
    """Sizes where a weight-shaped buffer is unmistakable: (*batch, 24, 32)."""
    params = {
        "w": random_array(0, (*batch, M * 4, N * 4)) / 8,
        "v": random_array(1, (*batch, N * 4, M * 4)) / 8,
    }
    projectors = {
        "w": orthonormal(3, (*batch, M * 4, R)),
        "v": orthonormal(4, (*batch, M * 4, R)),
    }
    return params, projectors


def _step_loss(params, projectors, chunks, marked, chunked):
    if marked:
        params = {
            name: qt.projected_cotangent(w, R, projector=projectors[name])
            for name, w in params.items()
        }
    if chunked:
        return _chunked_loss(params, chunks)
    return jnp.sum(scanned(chunks[0], params, remat=True) ** 2)


@pytest.mark.parametrize("chunked", [False, True], ids=["one batch", "chunked"])
def test_no_weight_shaped_buffer_in_a_scanned_training_step(chunked):
    batch = (3,)
    params, projectors = _big(batch)
    chunks = random_array(2, (4, 2, M * 4))

    def step(marked):
        grad = qt.value_and_grad if marked else jax.value_and_grad
        return jax.jit(lambda p, P, c: grad(_step_loss)(p, P, c, marked, chunked))

    args = (params, projectors, chunks)
    for shape in _shapes(batch):
        assert weight_buffers(step(True), args, shape) == [], shape
    dense = [weight_buffers(step(False), args, s) for s in _shapes(batch)]
    assert all(dense), "the unmarked step should form dense weight gradients"


# ---------------------------------------------------------------------------------------
# Mixed precision


def _cast_loss(w, x, p, marked):
    if marked:
        w = qt.projected_cotangent(w, R, projector=p)
    # What a jmp policy does: compute in bf16, keep the parameter in f32.
    h = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
    return jnp.sum(jnp.tanh(h.astype(jnp.float32)) ** 2)


def test_a_mark_survives_a_cast_to_bf16():
    w, x = random_array(0, (M, N)), random_array(1, (3, M))
    p = orthonormal(3, (M, R))
    with qt.fallback("error"):
        grad = qt.grad(_cast_loss)(w, x, p, True)
    assert isinstance(grad, qt.LowRank) and grad.dtype == jnp.float32
    assert grad.projector_side == "left"
    np.testing.assert_array_equal(grad.left, p)
    dense = jax.grad(_cast_loss)(w, x, p, False)
    assert_close(grad, p @ (p.T @ dense), jnp.bfloat16)


def test_the_gradient_of_a_bf16_step_adds_no_weight_buffer():
    w, x = random_array(0, (24, 40)), random_array(1, (3, 24))
    p = orthonormal(3, (24, R))
    forward = jax.jit(lambda w: _cast_loss(w, x, p, False))
    marked = jax.jit(qt.grad(lambda w: _cast_loss(w, x, p, True)))
    plain = jax.jit(jax.grad(lambda w: _cast_loss(w, x, p, False)))
    for shape in ("f32[24,40]", "bf16[24,40]"):
        # The forward pass's compute copy (XLA on CPU runs a bf16 dot in f32, so
        # it converts the copy back) is all the marked step holds.
        seen = len(weight_buffers(forward, (w,), shape))
        assert len(weight_buffers(marked, (w,), shape)) <= seen, shape
    assert len(weight_buffers(plain, (w,), "f32[24,40]")) > len(
        weight_buffers(forward, (w,), "f32[24,40]")
    )


@pytest.mark.parametrize(
    "w_dtype, p_dtype",
    [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)],
    ids=["bf16 projector", "f32 projector"],
)
def test_a_projector_of_another_float_dtype_is_cast(w_dtype, p_dtype):
    w, x = random_array(0, (M, N), w_dtype), random_array(1, (3, M), w_dtype)
    p = orthonormal(3, (M, R)).astype(p_dtype)

    def loss(w, marked):
        if marked:
            w = qt.projected_cotangent(w, R, projector=p)
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    with qt.fallback("error"):
        grad = qt.grad(loss)(w, True)
    assert grad.dtype == w_dtype and grad.left.dtype == w_dtype
    np.testing.assert_array_equal(grad.left, p.astype(w_dtype))
    q = p.astype(w_dtype).astype(jnp.float32)
    dense = jax.grad(loss)(w, False).astype(jnp.float32)
    assert_close(grad, q @ (q.T @ dense), jnp.bfloat16)


# ---------------------------------------------------------------------------------------
# Microbatches: projections that share a projector add at the same rank


def _microbatch_loss(w, x, p):
    w = qt.projected_cotangent(w, R, projector=p)
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _microbatches():
    w, p = random_array(0, (M, N)), orthonormal(3, (M, R))
    return w, p, random_array(1, (2, 3, M))


def _dense_sum(w, p, xs):
    g = sum(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2))(w, x) for x in xs)
    return p @ (p.T @ g)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_gradients_with_one_projector_add_at_the_same_rank(jit):
    w, p, xs = _microbatches()

    def accumulate(w, p):
        grads = [qt.grad(_microbatch_loss)(w, x, p) for x in xs]
        return grads[0] + grads[1]

    total = (jax.jit(accumulate) if jit else accumulate)(w, p)
    assert total.rank == R and total.projector_side == "left"
    np.testing.assert_array_equal(total.left, p)
    assert_close(total, _dense_sum(w, p, xs))


def test_two_marks_with_one_projector_add_at_the_same_rank():
    # JAX's backward pass adds the two marks' cotangents with `add_any`.
    w, p, xs = _microbatches()

    def loss(w):
        return _microbatch_loss(w, xs[0], p) + _microbatch_loss(w, xs[1], p)

    for grad in (qt.grad(loss)(w), jax.jit(qt.grad(loss))(w)):
        assert grad.rank == R and grad.projector_side == "left"
        assert_close(grad, _dense_sum(w, p, xs))


def test_microbatches_under_vmap_share_the_projector():
    w, p, xs = _microbatches()
    grads = jax.vmap(qt.grad(_microbatch_loss), in_axes=(None, 0, None))(w, xs, p)
    assert grads.projector_side == "left" and grads.left.shape == (2, M, R)
    # The projector is the same for every microbatch: the sum is the sum of the
    # small factors (what `docs/cotangents.md` shows for vmap and scan).
    total = qt.LowRank(p, grads.right.sum(0), projector_side="left")
    np.testing.assert_array_equal(grads.left, jnp.broadcast_to(p, grads.left.shape))
    assert_close(total, _dense_sum(w, p, xs))


def test_a_scan_over_microbatches_accumulates_the_small_factor():
    w, p, xs = _microbatches()

    def accumulate(w, p):
        def body(right, x):
            return right + qt.grad(_microbatch_loss)(w, x, p).right, None

        right, _ = jax.lax.scan(body, jnp.zeros((N, R)), xs)
        return qt.LowRank(p, right, projector_side="left")

    total = jax.jit(accumulate)(w, p)
    assert_close(total, _dense_sum(w, p, xs))


# ---------------------------------------------------------------------------------------
# A matrix seen with more dims: attention heads


@pytest.mark.parametrize(
    "form",
    ["split columns", "split rows", "contract the split side", "transposed view"],
)
def test_a_reshaped_view_keeps_the_mark(form):
    d, h, k = 6, 2, 4
    x = random_array(1, (2, 3, d))
    heads = random_array(2, (2, 3, h, k))
    w = random_array(0, (h * k, d) if form == "split rows" else (d, h * k))
    p = orthonormal(3, (min(w.shape), R))

    def use(w):
        if form == "split columns":  # q = einsum("btd,dhk->bthk")
            return jnp.einsum("btd,dhk->bthk", x, w.reshape(d, h, k))
        if form == "split rows":  # the output projection of (h * k, d)
            return jnp.einsum("bthk,hkd->btd", heads, w.reshape(h, k, d))
        if form == "contract the split side":
            return jnp.einsum("bthk,dhk->btd", heads, w.reshape(d, h, k))
        return jnp.einsum("bthk,hkd->btd", heads, w.reshape(d, h, k).transpose(1, 2, 0))

    def loss(w, marked):
        if marked:
            w = qt.projected_cotangent(w, R, projector=p)
        return jnp.sum(jnp.sin(use(w)))

    with qt.fallback("error"):
        grad = qt.grad(loss)(w, True)
    g = jax.grad(loss)(w, False)
    side = "left" if w.shape[0] <= w.shape[1] else "right"
    assert grad.projector_side == side
    assert_close(grad, project(g, p, side))


def test_a_reshape_that_mixes_the_sides_is_counted():
    w = random_array(0, (6, 8))

    def loss(w):
        w = qt.factored_cotangent(w)
        return jnp.sum(jnp.sin(random_array(1, (3, 4)) @ w.reshape(4, 12)))

    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="reshape"):
        qt.grad(loss)(w)


@pytest.mark.parametrize("viewed", [False, True])
def test_a_transpose_that_moves_the_stack_says_to_stack_on_the_first_axis(viewed):
    # Flax's `nn.scan` over parameters stacked on axis 1 (three layers of (M, N)
    # stored as (M, 3, N)) moves that axis to the front before the scan. The mark
    # sees a stack of M matrices (3, N), whose stack dim the transpose moves: the
    # gradient is dense (counted), and still right.
    w = random_array(0, (M, 3, N))
    p = orthonormal(3, (M, 3, R))

    def loss(w, marked):
        if marked:
            w = qt.projected_cotangent(w, R, projector=p)
        if viewed:  # each layer's columns split in two, as attention heads
            w = w.reshape(M, 3, 2, N // 2)
        layers = jnp.moveaxis(w, 1, 0)

        def body(h, w_layer):
            y = jnp.einsum("bm,mhk->bhk" if viewed else "bm,mn->bn", h, w_layer)
            return h, jnp.sum(jnp.sin(y))

        return jnp.sum(jax.lax.scan(body, X, layers)[1])

    with (
        qt.fallback("error"),
        pytest.raises(
            qt.DensificationError, match=r"moves its stack dims \[0\].*variable_axes"
        ),
    ):
        qt.grad(loss)(w, True)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        grad = qt.grad(loss)(w, True)
    assert qt.fallback_counts()[("transpose", "Marked")] == 1
    # The mark's gradient: the dense one, projected.
    assert_close(grad, project(jax.grad(loss)(w, False), p, "left"))


@pytest.mark.parametrize("index", ["static", "traced"])
def test_a_python_loop_over_a_marked_stack_says_to_scan(index):
    # A loop over the layers in Python takes each one with `w[i]` (a `slice`, or a
    # `dynamic_slice` for a traced index): the mark sees the stack read whole, so
    # the gradient is dense (counted) and still right, and the error says to scan.
    w = random_array(0, (3, M, N))
    p = orthonormal(3, (3, M, R))

    def loss(w, marked):
        if marked:
            w = qt.projected_cotangent(w, R, projector=p)
        total = 0.0
        for i in range(3):
            layer = w[i] if index == "static" else w[jnp.asarray(i)]
            total += jnp.sum(jnp.sin(X @ layer))
        return total

    primitive = "slice" if index == "static" else "dynamic_slice"
    with (
        qt.fallback("error"),
        pytest.raises(
            qt.DensificationError,
            match=rf"`{primitive}` .*Python loop over the layers.*`jax.lax.scan`",
        ),
    ):
        qt.grad(loss)(w, True)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        grad = qt.grad(loss)(w, True)
    assert qt.fallback_counts()[(primitive, "Marked")] == 3
    assert_close(grad, project(jax.grad(loss)(w, False), p, "left"))


@settings(max_examples=10, deadline=None)
@given(st.data())
def test_the_gradient_through_any_view_matches_dense(data):
    # A (*batch, m, n) weight, reshaped to (*batch, *rows, *cols), its matrix dims
    # permuted, and contracted over one whole side in a drawn order.
    draw = data.draw
    batch = tuple(draw(st.integers(1, 2)) for _ in range(draw(st.integers(0, 1))))
    rows = draw(st.sampled_from([(4,), (2, 2)]))
    cols = draw(st.sampled_from([(6,), (2, 3), (3, 2)]))
    nb, k = len(batch), len(rows) + len(cols)
    perm = tuple(draw(st.permutations(range(k))))
    full = tuple(range(nb)) + tuple(nb + p for p in perm)
    side = draw(st.sampled_from(["rows", "cols"]))
    lo, hi = (nb, nb + len(rows)) if side == "rows" else (nb + len(rows), nb + k)
    w_c = list(
        draw(st.permutations([a for a in range(nb, nb + k) if lo <= full[a] < hi]))
    )
    w = random_array(draw(st.integers(0, 99)), (*batch, 4, 6))
    shape = tuple((*batch, *rows, *cols)[p] for p in full)
    # One row: a factored gradient of rank 1 stays within the budget.
    x = random_array(7, (*batch, 1, *(shape[a] for a in w_c)))
    x_c = tuple(range(nb + 1, x.ndim))
    dims = ((x_c, tuple(w_c)), (tuple(range(nb)), tuple(range(nb))))

    def loss(w, marked):
        if marked:
            w = qt.factored_cotangent(w)
        view = jnp.transpose(w.reshape(*batch, *rows, *cols), full)
        return jnp.sum(jnp.sin(jax.lax.dot_general(x, view, dims)))

    with qt.fallback("error"):
        grad = qt.grad(loss)(w, True)
    assert isinstance(grad, qt.LowRank) and grad.batch_ndim == nb
    assert_close(grad, jax.grad(loss)(w, False))


# ---------------------------------------------------------------------------------------
# A projection that adds into a running sum (`accumulate_gradients`' steady passes)


def _phased(rank, tested=False):
    from quax_tangents._marks._projection import Finish

    return Finish(
        "projected", rank, 0, Phased(tested=tested), "threefry2x32", 0, by_layer=True
    )


def _key_data(seed, batch):
    keys = jax.random.split(jax.random.key(seed), max(1, int(np.prod(batch))))
    return keys, jax.random.key_data(keys).reshape(*batch, 2)


def _phase_product(phase, g, projector, tests, keys, rank):
    """The dense product a `Phased` finish adds to its sum, for `g` `(*batch,
    small, large)`: `g^T P`, or the sketch `g Ω` (`g T`) in the first rows."""
    from quax_tangents._marks._projection import test_matrix

    small, large = g.shape[-2:]
    if phase == PHASE_GIVEN:
        return jnp.swapaxes(g, -1, -2) @ projector
    if phase == PHASE_DRAWN:
        draw = lambda k: test_matrix(k, (small, large), rank, 0)  # noqa: E731
        tests = jax.vmap(draw)(keys).reshape(*g.shape[:-2], large, rank)
    sketch = g @ tests
    rest = jnp.zeros((*g.shape[:-2], large - small, rank), sketch.dtype)
    return jnp.concatenate([sketch, rest], axis=-2)


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.sampled_from([(), (3,)]),
    sides=st.sampled_from([(4, 7), (7, 4)]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    phase=st.sampled_from([PHASE_GIVEN, PHASE_DRAWN, PHASE_TESTED]),
)
def test_a_phased_finish_adds_its_phases_product_to_the_sum(
    seed, batch, sides, dtype, phase
):
    # `finish` with source `Phased` on the total cotangent, an `OuterSum` or a dense
    # array, against the dense computation: the sum plus `G^T P` (`G Q` for a tall
    # weight), the projector as given; or plus the sketch `G Ω` with each slice's
    # test matrix drawn from its key as the range finder draws it (`G T` with the
    # test matrices given), in the sum's first rows.
    from quax_tangents._marks._projection import project_dense, project_outer
    from quax_tangents._types.outer import OuterSum

    m, n = sides
    small, large, rank = min(m, n), max(m, n), 2
    left = random_array(seed, (*batch, m, 5)).astype(dtype)
    right = random_array(seed + 1, (*batch, n, 5)).astype(dtype)
    projector = jnp.linalg.qr(random_array(seed + 2, (*batch, small, rank)))[0]
    projector = projector.astype(dtype)
    tests = random_array(seed + 4, (*batch, large, rank)).astype(dtype)
    total = random_array(seed + 3, (*batch, large, rank)).astype(dtype)
    keys, key_data = _key_data(seed, batch)
    dense = jnp.einsum(
        "...ik,...jk->...ij", left, right, preferred_element_type=jnp.float32
    )
    g = dense if m <= n else jnp.swapaxes(dense, -1, -2)
    product = _phase_product(
        phase, g, projector.astype(jnp.float32), tests.astype(jnp.float32), keys, rank
    )
    expected = total.astype(jnp.float32) + product
    operands = (projector, key_data, jnp.int32(phase), tests, total)
    spec = _phased(rank, tested=True)
    for got in (
        project_outer(spec, OuterSum(left, right), operands),
        project_dense(spec, dense.astype(dtype), operands),
    ):
        factor, basis = (got.right, got.left) if m <= n else (got.left, got.right)
        assert got.projector_side == ("left" if m <= n else "right")
        assert_close(basis, projector, dtype)
        assert_close(factor, expected, dtype, factor=4)


# ---------------------------------------------------------------------------------------
# A `Phased` mark on a stack that a scan slices: projected layer by layer in the
# scan's backward pass (`quax_tangents._marks._marked_scan.scan_with_projected_xs`)


def _given_into(projectors, totals, phase=PHASE_GIVEN):
    from quax_tangents._marks._cotangents import bind_mark

    batch = projectors["w"].shape[:-2]
    _, key_data = _key_data(5, batch)
    operands = lambda name: (  # noqa: E731
        projectors[name],
        key_data,
        jnp.int32(phase),
        totals[name],
    )
    return lambda params: {
        name: bind_mark(_phased(R), w, operands(name)) for name, w in params.items()
    }


def _totals(batch):
    return {"w": random_array(6, (*batch, N, R)), "v": random_array(7, (*batch, N, R))}


@pytest.mark.parametrize("remat", [True, False], ids=["remat", "plain"])
@pytest.mark.parametrize("batch", BATCHES.values(), ids=BATCHES.keys())
def test_a_given_into_stack_scanned_over_is_projected_layer_by_layer(
    batch, remat, scans_projected
):
    # The gradient is `LowRank(P, S + G^T P)` (`(S + G Q, Q)` for a tall weight)
    # slice by slice, for the dense gradient `G`, the projectors as given.
    params, projectors, totals = (
        stacked_params(batch, M, N),
        _projectors(batch),
        _totals(batch),
    )
    mark = _given_into(projectors, totals)
    with qt.fallback("error"):
        grads = jax.jit(qt.grad(_loss), static_argnums=(1, 2))(params, mark, remat)
    assert scans_projected
    dense = jax.jit(jax.grad(_loss), static_argnums=(1, 2))(params, None, remat)
    for name, side in SIDES.items():
        grad = grads[name]
        assert isinstance(grad, qt.LowRank) and grad.projector_side == side
        projector, factor = (
            (grad.left, grad.right) if side == "left" else (grad.right, grad.left)
        )
        np.testing.assert_array_equal(projector, projectors[name])
        g = dense[name] if side == "left" else jnp.swapaxes(dense[name], -1, -2)
        expected = totals[name] + jnp.swapaxes(g, -1, -2) @ projectors[name]
        assert_close(factor, expected)


@pytest.mark.parametrize("mark_kind", ["given into a sum", "given, by layer"])
def test_a_stack_projected_in_its_scan_and_used_outside_it_raises(
    mark_kind, scans_projected
):
    # The scan projects the layers' gradients, which leaves out what the other use
    # adds: refused, naming the option that serves any use.
    params = stacked_params((3,), M, N)
    if mark_kind == "given into a sum":
        mark = _given_into(_projectors((3,)), _totals((3,)))
    else:
        mark = _mark_by_layer("given", _projectors((3,)))

    def loss(params):
        marked = mark(params)
        decay = jnp.sum(marked["w"] ** 2)  # a use outside the scan
        return jnp.sum(scanned(X, marked) ** 2) + decay

    with qt.fallback("silent"), pytest.raises(ValueError) as error:
        qt.grad(loss)(params)
    assert "both scanned over" in str(error.value)
    assert "by_layer=False" in str(error.value)
    assert scans_projected


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.sampled_from([(), (3,)]),
    sides=st.sampled_from([(4, 7), (7, 4)]),
)
def test_the_layer_by_layer_primitives_match_their_dense_semantics(seed, batch, sides):
    # `projected_factor` of an `OuterSum` (its quax rule) against its dense semantics
    # on the materialised cotangent, in each phase, and `projection` (a `LowRank`
    # under quax) against the dense product of its factors.
    import quax

    from quax_tangents._marks._slices import projected_factor, projection
    from quax_tangents._types.outer import OuterSum

    m, n = sides
    small, large, rank = min(m, n), max(m, n), 2
    left = random_array(seed, (*batch, m, 5))
    right = random_array(seed + 1, (*batch, n, 5))
    projector = jnp.linalg.qr(random_array(seed + 2, (*batch, small, rank)))[0]
    total = random_array(seed + 3, (*batch, large, rank))
    outer = OuterSum(left, right)
    keys, key_data = _key_data(seed, batch)
    g = outer.materialise() if m <= n else jnp.swapaxes(outer.materialise(), -1, -2)
    for phase in (PHASE_GIVEN, PHASE_DRAWN):
        operands = (projector, key_data, jnp.int32(phase))
        fn = lambda c, operands=operands: projected_factor(  # noqa: E731
            c, operands, total, _phased(rank)
        )
        expected = fn(outer.materialise())
        assert_close(quax.quaxify(fn)(outer), expected)
        product = _phase_product(phase, g, projector, None, keys, rank)
        assert_close(expected, total + product)
    for is_left in (True, False):
        lowrank = quax.quaxify(
            lambda p, f, is_left=is_left: projection(p, f, is_left),
            filter_spec=lambda _: True,
        )(projector, total)
        assert isinstance(lowrank, qt.LowRank)
        assert lowrank.projector_side == ("left" if is_left else "right")
        assert_close(lowrank.materialise(), projection(projector, total, is_left))


def test_a_given_into_stack_keeps_no_stacked_factors(scans_projected):
    # One factor of `w`'s gradient, its output cotangent for every layer (kept as
    # `(N, rows)` per layer), is a stacked `(layers, N, rows)` buffer when the
    # projection runs after the scan (a `Given` mark) and never formed when it runs
    # layer by layer. The model is checkpointed per block: the forward pass saves
    # only the `(layers, rows, M)` block inputs.
    batch, rows = (3,), 10
    params, projectors, totals = (
        stacked_params(batch, M, N),
        _projectors(batch),
        _totals(batch),
    )
    x = random_array(9, (rows, M))

    def loss(params, projectors, totals, into):
        if into:
            marked = _given_into(projectors, totals)(params)
        else:
            marked = {
                name: qt.projected_cotangent(w, R, projector=projectors[name])
                for name, w in params.items()
            }
        return jnp.sum(scanned(x, marked, remat=True) ** 2)

    def step(into):
        return jax.jit(lambda p, P, S: qt.grad(loss)(p, P, S, into))

    stacked = f"f32[{batch[0]},{N},{rows}]"
    args = (params, projectors, totals)
    assert weight_buffers(step(False), args, stacked)
    assert not scans_projected
    assert weight_buffers(step(True), args, stacked) == []
    assert scans_projected


@pytest.mark.parametrize("batch", BATCHES.values(), ids=BATCHES.keys())
def test_a_sketch_phase_stack_scanned_over_is_sketched_layer_by_layer(
    batch, scans_projected
):
    # A `Phased` mark in its sketch phase (a refresh step's first pass): `S + G Ω`
    # (`S + G^T Ω` for a tall weight) in the sum's first rows, slice by slice, with
    # each slice's test matrix drawn from its key as the range finder draws it,
    # against the dense gradient.
    params, projectors, totals = (
        stacked_params(batch, M, N),
        _projectors(batch),
        _totals(batch),
    )
    mark = _given_into(projectors, totals, PHASE_DRAWN)
    with qt.fallback("error"):
        grads = jax.jit(qt.grad(_loss), static_argnums=(1, 2))(params, mark, True)
    assert scans_projected
    dense = jax.jit(jax.grad(_loss), static_argnums=(1, 2))(params, None, True)
    keys, _ = _key_data(5, batch)
    for name, side in SIDES.items():
        g = dense[name] if side == "left" else jnp.swapaxes(dense[name], -1, -2)
        expected = totals[name] + _phase_product(PHASE_DRAWN, g, None, None, keys, R)
        sketch = grads[name].right if side == "left" else grads[name].left
        assert_close(sketch, expected)


# ---------------------------------------------------------------------------------------
# A projection mark that is not into a sum (`Given`, `Fresh`, `Switch`, as
# `quax_tangents.optax.mark` marks a stack), asked to be projected layer by layer


def _mark_by_layer(kind, projectors, by_layer=True):
    from quax_tangents._marks._cotangents import projected_mark

    def mark(name, w):
        projector = {
            "given": projectors[name],
            "switch": qt.Projector(projectors[name], jnp.asarray(False)),
            "switch-refresh": qt.Projector(projectors[name], jnp.asarray(True)),
            "fresh": None,
        }[kind]
        key = jax.random.key(1)
        return projected_mark(w, R, projector, key, 1, 1, by_layer=by_layer)

    return lambda params: {name: mark(name, w) for name, w in params.items()}


@pytest.mark.parametrize("kind", ["given", "switch", "switch-refresh", "fresh"])
@pytest.mark.parametrize("batch", BATCHES.values(), ids=BATCHES.keys())
def test_a_stack_marked_by_layer_is_projected_in_the_scan(kind, batch, scans_projected):
    # Each layer's projector and factor, found in the scan's backward pass, are the
    # mark's own finish after the scan (the same key per slice, so the same fresh
    # projectors), and the projection of the dense gradient.
    params, projectors = stacked_params(batch, M, N), _projectors(batch)
    grad = jax.jit(qt.grad(_loss), static_argnums=(1, 2))
    with qt.fallback("error"):
        after = grad(params, _mark_by_layer(kind, projectors, by_layer=False), True)
        assert not scans_projected
        by_layer = grad(params, _mark_by_layer(kind, projectors), True)
    assert scans_projected
    for name in SIDES:
        assert by_layer[name].projector_side == after[name].projector_side
        assert_close(by_layer[name].left, after[name].left)
        assert_close(by_layer[name].right, after[name].right)
    dense = jax.jit(jax.grad(_loss), static_argnums=(1, 2))(params, None, True)
    checked = "fresh" if kind == "switch-refresh" else kind
    _check_projected(by_layer, dense, batch, checked, projectors)


def test_a_stack_marked_by_layer_keeps_no_stacked_factors(scans_projected):
    # As for a `Phased` mark: the output cotangent of `w` for every layer, a stacked
    # `(layers, N, rows)` buffer when the projection runs after the scan, is never
    # formed when each layer is projected in the scan's backward pass.
    batch, rows = (3,), 10
    params, projectors = stacked_params(batch, M, N), _projectors(batch)
    x = random_array(9, (rows, M))

    def step(by_layer):
        def loss(params, projectors):
            marked = _mark_by_layer("switch", projectors, by_layer)(params)
            return jnp.sum(scanned(x, marked, remat=True) ** 2)

        return jax.jit(qt.grad(loss))

    stacked = f"f32[{batch[0]},{N},{rows}]"
    assert weight_buffers(step(False), (params, projectors), stacked)
    assert not scans_projected
    assert weight_buffers(step(True), (params, projectors), stacked) == []
    assert scans_projected
