"""`quax_tangents.optax.mark`: the marks a `projected` state calls for, applied to
Equinox models as they are, inside the loss."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import assert_close, random_array
from tests.helpers.collective import skip_without_devices
from tests.helpers.matrix_view import (
    DIMS,
    HEAD_DIM,
    HEADS,
    LAYERS,
    D,
    attention_loss,
    attention_params,
    matrix_view,
)
from tests.helpers.stacked import project, weight_buffers


RANK = 2


class Net(eqx.Module):
    embedding: eqx.nn.Embedding
    hidden: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(20, 6, key=k1)
        self.hidden = eqx.nn.Linear(6, 10, key=k2)
        self.out = eqx.nn.Linear(10, 5, key=k3)

    def __call__(self, ids):
        h = jax.vmap(self.embedding)(ids)
        return jax.vmap(self.out)(jnp.tanh(jax.vmap(self.hidden)(h)))


def _loss(params, static, batch):
    ids, y = batch
    model = eqx.combine(params, static)
    return jnp.mean((model(ids) - y) ** 2)


def _batch(seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 20, 7)), jnp.asarray(
        rng.standard_normal((7, 5)), jnp.float32
    )


def _setup(**kwargs):
    params, static = eqx.partition(Net(jax.random.key(0)), eqx.is_inexact_array)
    rows = jax.tree.map(lambda _: False, params)
    rows = eqx.tree_at(lambda p: p.embedding.weight, rows, True)
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, learning_rate=1e-2, rows=rows, **kwargs
    )
    return params, static, tx


def test_mark_gives_the_gradients_projected_takes_and_a_step_runs():
    params, static, tx = _setup(refresh_every=2)
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch, key):
        marked_loss = lambda p, b: _loss(qto.mark(p, state, key=key), static, b)  # noqa: E731
        loss, grads = qt.value_and_grad(marked_loss)(params, batch)
        updates, state = tx.update(grads, state)
        return qto.apply_updates(params, updates), state, grads

    for t in range(3):
        before = state
        dense = jax.grad(_loss)(params, static, _batch(t))
        params, state, grads = step(params, state, _batch(t), jax.random.key(t))
        assert isinstance(grads.embedding.weight, qt.SparseRows)
        assert isinstance(grads.hidden.bias, jax.Array)
        for layer in (grads.hidden, grads.out):
            assert isinstance(layer.weight, qt.LowRank) and layer.weight.projector_side
        # hidden (10, 6) is tall: projector Q (6, r) on the right; out (5, 10) wide.
        q, p = grads.hidden.weight.right, grads.out.weight.left
        assert_close(state.projector.hidden.weight, q)
        assert_close(state.projector.out.weight, p)
        assert_close(grads.hidden.weight, dense.hidden.weight @ q @ q.T)
        assert_close(grads.out.weight, p @ p.T @ dense.out.weight)
        assert_close(grads.embedding.weight, dense.embedding.weight)
        if not bool(before.refresh):  # kept: exactly the state's projector
            assert_close(q, before.projector.hidden.weight)


def test_mark_splits_one_key_per_projected_leaf():
    params, static, tx = _setup()
    state = tx.init(params)
    key = jax.random.key(5)
    # One key per projected leaf, split from `key`, as `rbg` keys (two of `key`'s
    # implementation's words each).
    data = jax.random.key_data(jax.random.split(key, (2, 2))).reshape(2, -1)[:, :4]
    hidden_key, out_key = jax.random.wrap_key_data(data, impl="rbg")
    shown = qto.projectors(state)

    def marked(w, projector, key):
        # `qto.mark`'s default: no power iteration and no oversampling, as
        # accumulation.
        return qt.projected_cotangent(
            w, RANK, projector=projector, key=key, iters=0, oversample=0
        )

    def by_hand(p, batch):
        p = eqx.tree_at(
            lambda p: (p.embedding.weight, p.hidden.weight, p.out.weight),
            p,
            (
                qt.sparse_rows_cotangent(p.embedding.weight),
                marked(p.hidden.weight, shown.hidden.weight, hidden_key),
                marked(p.out.weight, shown.out.weight, out_key),
            ),
        )
        return _loss(p, static, batch)

    got = qt.grad(lambda p, b: _loss(qto.mark(p, state, key=key), static, b))(
        params, _batch(0)
    )
    expected = qt.grad(by_hand)(params, _batch(0))
    arrays = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))  # noqa: E731
    for a, b in zip(arrays(got), arrays(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mark_takes_the_whole_module_and_a_chained_state():
    params, static, tx = _setup()
    chain = optax.chain(tx)
    state = chain.init(params)
    model = eqx.combine(params, static)
    marked = qto.mark(model, state)  # non-array leaves pass through
    assert isinstance(marked, Net)
    with pytest.raises(ValueError, match="holds none"):
        qto.mark(params, optax.scale_by_adam().init(params))


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(6, 12, key=k1)
        self.down = eqx.nn.Linear(12, 6, key=k2)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class Scanned(eqx.Module):
    blocks: Block

    def __init__(self, key, layers=3):
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(key, layers))

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(h, weights):
            return jax.vmap(eqx.combine(weights, static))(h), None

        return jax.lax.scan(layer, x, dynamic)[0]


def test_mark_on_a_scanned_equinox_model():
    params, static = eqx.partition(Scanned(jax.random.key(1)), eqx.is_inexact_array)
    # Stacked biases are (layers, d): matrices by shape, so select the weights.
    weights = lambda p: (p.blocks.up.weight, p.blocks.down.weight)  # noqa: E731
    project = eqx.tree_at(weights, jax.tree.map(lambda _: False, params), (True, True))
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, learning_rate=1e-2, project=project
    )
    state = tx.init(params)
    assert state.projector.blocks.up.weight.shape == (3, 6, RANK)
    assert state.projector.blocks.up.bias is None
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6)), jnp.float32)

    def loss(p):
        return jnp.sum(eqx.combine(p, static)(x) ** 2)

    def step(params, state):
        grads = qt.grad(lambda p: loss(qto.mark(p, state)))(params)
        updates, state = tx.update(grads, state)
        return qto.apply_updates(params, updates), state, grads

    step = jax.jit(step)
    for _ in range(2):
        before = state
        dense = jax.grad(loss)(params)
        params, state, grads = step(params, state)
        g = grads.blocks.up.weight  # (3, 12, 6): tall, projected on its columns
        assert isinstance(g, qt.LowRank) and g.batch_ndim == 1
        q = g.right
        assert_close(g, dense.blocks.up.weight @ q @ jnp.swapaxes(q, -1, -2))
        if not bool(before.refresh):
            assert_close(q, before.projector.blocks.up.weight)


# ---------------------------------------------------------------------------------------
# Weights stored with more dims than their matrix (`dims=`)


def _projected_view(g, dense, dims):
    """Checks that `g` is the projection of `dense`'s matrix view, and returns its
    projector."""
    view = matrix_view(dense, dims)
    assert isinstance(g, qt.LowRank) and g.shape == view.shape
    assert g.batch_ndim == dims[0]
    projector = g.left if g.projector_side == "left" else g.right
    assert_close(g, project(view, projector, g.projector_side))
    return projector


def test_a_leaf_viewed_with_dims_is_marked_through_its_matrix_view():
    params = {"qkv": random_array(0, (6, 2, 5)), "w": random_array(1, (6, 10))}
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, dims={"qkv": (0, 1), "w": None}
    )
    state = tx.init(params)
    x = random_array(2, (3, 6))

    def loss(p):
        return jnp.sum(jnp.tanh(x @ p["w"])) + jnp.sum(
            jnp.tanh(jnp.einsum("bd,dhk->bhk", x, p["qkv"]))
        )

    with qt.fallback("error"):
        grads = qt.grad(lambda p: loss(qto.mark(p, state)))(params)
    dense = jax.grad(loss)(params)
    assert isinstance(grads["w"], qt.LowRank)
    _projected_view(grads["qkv"], dense["qkv"], (0, 1))
    updates, _ = tx.update(grads, state)
    assert updates["qkv"].shape == (6, 10)  # the matrix view
    assert qto.apply_updates(params, updates)["qkv"].shape == (6, 2, 5)
    # Plain `jax.grad` of the marked loss: the same projection, dense, as stored.
    plain = jax.grad(lambda p: loss(qto.mark(p, state)))(params)["qkv"]
    assert plain.shape == (6, 2, 5)
    assert_close(plain.reshape(6, 10), grads["qkv"])


def test_stacked_attention_weights_get_their_projected_gradients():
    params = attention_params()
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, learning_rate=1e-2, dims=DIMS, refresh_every=2
    )
    state = tx.init(params)
    x = random_array(3, (2, 4, D))

    @jax.jit
    def step(params, state, key):
        marked = lambda p: attention_loss(qto.mark(p, state, key=key), x)  # noqa: E731
        loss, grads = qt.value_and_grad(marked)(params)
        updates, new_state = tx.update(grads, state)
        return qto.apply_updates(params, updates), new_state, loss, grads

    for t in range(3):  # refresh, keep, refresh
        before = state
        expected_loss, dense = jax.value_and_grad(attention_loss)(params, x)
        with qt.fallback("error"):
            params, state, loss, grads = step(params, state, jax.random.key(t))
        assert_close(loss, expected_loss)
        for name, dims in DIMS.items():
            projector = _projected_view(grads[name], dense[name], dims)
            if not bool(before.refresh):
                assert_close(projector, before.projector[name])
        assert params["query"].shape == (LAYERS, D, HEADS, HEAD_DIM)


def test_a_dense_use_of_a_viewed_leaf_is_counted():
    params = attention_params()
    state = qto.projected(optax.scale_by_adam(), rank=RANK, dims=DIMS).init(params)
    x = random_array(3, (2, 4, D))

    def loss(p):  # weight decay on the stored weight: a dense cotangent
        return attention_loss(p, x) + 1e-3 * jnp.sum(p["query"] ** 2)

    # A stack used outside its scan is not projected layer by layer.
    marked = lambda p: loss(qto.mark(p, state, by_layer=False))  # noqa: E731
    with qt.fallback("error"), pytest.raises(qt.DensificationError):
        qt.grad(marked)(params)
    with pytest.warns(qt.DensificationWarning):
        grads = qt.grad(marked)(params)
    # Still the projection of the whole gradient, in the matrix view.
    _projected_view(grads["query"], jax.grad(loss)(params)["query"], DIMS["query"])


def test_a_scan_over_a_dim_of_one_viewed_matrix_is_counted():
    # Layers stored on the second axis `(d, layers, f)` (Flax's `nn.scan` with
    # `variable_axes={"params": 1}`), viewed with `dims=(0, 1)` as one `(d, layers
    # * f)` matrix, then moved to the front and scanned over: the scan slices a dim
    # of the matrix, not a stack dim. The weight is used whole, its gradient
    # computed dense (counted, naming the layout to use) and then projected.
    d, layers, f = 6, 2, 5
    params = {"w": random_array(0, (d, layers, f))}
    dims = {"w": (0, 1)}
    state = qto.projected(optax.scale_by_adam(), rank=RANK, dims=dims).init(params)
    x = random_array(1, (3, d))

    def loss(p):
        def layer(h, w):
            return jnp.tanh(h @ jnp.pad(w, ((0, 0), (0, d - f)))), None

        return jnp.sum(jax.lax.scan(layer, x, jnp.moveaxis(p["w"], 1, 0))[0] ** 2)

    marked = lambda p: loss(qto.mark(p, state, by_layer=False))  # noqa: E731
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="axis"):
        qt.grad(marked)(params)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        grads = qt.grad(marked)(params)
    assert qt.fallback_counts()[("scan", "Marked")] == 1
    _projected_view(grads["w"], jax.grad(loss)(params)["w"], dims["w"])


def _attention_steps():
    """Compiled gradient steps of a scanned attention model whose weights are stored
    as `(d, heads, head_dim)`, large enough that their shapes are unmistakable:
    marked by `qto.mark`, unmarked, and the gradient of the input alone (which reads
    the weights in the backward pass as every step does, transposed for the input's
    cotangent, but forms no weight gradient)."""
    params = attention_params(layers=3, d=24, heads=4, head_dim=5)
    state = qto.projected(optax.scale_by_adam(), rank=RANK, dims=DIMS).init(params)
    x = random_array(3, (2, 3, 24))
    marked = jax.jit(qt.grad(lambda p: attention_loss(qto.mark(p, state), x)))
    dense = jax.jit(jax.grad(lambda p: attention_loss(p, x)))
    inputs_only = jax.jit(jax.grad(lambda x, p: attention_loss(p, x)))
    return (marked, (params,)), (dense, (params,)), (inputs_only, (x, params))


# Every dense shape of the two weights' gradients, stacked or per layer, stored or
# in the matrix view.
_ATTENTION_SHAPES = [
    f"f32[{layers}{s}]"
    for layers in ("3,", "")
    for s in ("24,4,5", "4,5,24", "24,20", "20,24")
]


def test_no_weight_shaped_buffer_for_viewed_leaves():
    steps = _attention_steps()
    with qt.fallback("error"):
        found = [
            [len(weight_buffers(fn, args, s)) for s in _ATTENTION_SHAPES]
            for fn, args in steps
        ]
    marked, dense, inputs_only = found
    assert all(m <= i for m, i in zip(marked, inputs_only)), (marked, inputs_only)
    assert sum(dense) > sum(inputs_only), "the unmarked step forms weight gradients"


# ---------------------------------------------------------------------------------------
# A scanned model's stacks, projected layer by layer in the scan's backward pass


def _stacked_setup():
    params = {
        "emb": random_array(0, (D, D)),
        "w": random_array(1, (LAYERS, D, 2 * D)) / 4,
        "v": random_array(2, (LAYERS, 2 * D, D)) / 4,
    }
    project = {"emb": False, "w": True, "v": True}
    tx = qto.projected(optax.adam(1e-2), rank=RANK, project=project)
    return params, tx


def _scanned_loss(params, x):
    def body(h, wv):
        w, v = wv
        return h + jnp.tanh(h @ w) @ v, None

    h, _ = jax.lax.scan(
        jax.checkpoint(body), x @ params["emb"], (params["w"], params["v"])
    )
    return jnp.sum(h**2)


def test_a_scanned_stack_is_projected_layer_by_layer(scans_projected):
    # The default (`by_layer=True`) gives what the marks' own finish gives after the
    # scan (`by_layer=False`), on a refresh step and on a step that keeps the
    # projectors, and the projection of the dense gradient.
    params, tx = _stacked_setup()
    x = random_array(3, (5, D))

    def gradients(params, state, by_layer):
        marked = lambda p: _scanned_loss(qto.mark(p, state, by_layer=by_layer), x)  # noqa: E731
        return qt.grad(marked)(params)

    state = tx.init(params)
    dense = jax.grad(_scanned_loss)(params, x)
    for refresh in (True, False):
        # Traced again each time, to count the scans that project.
        grads = jax.jit(lambda *a: gradients(*a), static_argnums=2)
        after = grads(params, state, False)
        assert not scans_projected
        by_layer = grads(params, state, True)
        assert scans_projected
        scans_projected.clear()
        for name in ("w", "v"):
            g = by_layer[name]
            assert isinstance(g, qt.LowRank) and g.batch_ndim == 1
            assert g.projector_side == after[name].projector_side
            assert_close(g.left, after[name].left)
            assert_close(g.right, after[name].right)
            projector = g.left if g.projector_side == "left" else g.right
            assert_close(g, project(dense[name], projector, g.projector_side))
            if not refresh:
                np.testing.assert_array_equal(projector, state.projector[name])
        assert bool(state.refresh) == refresh
        _, state = tx.update(after, state, params)


def test_a_scanned_refresh_writes_over_the_given_projectors():
    # XLA:CPU's compiled step, state donated: the backward scan reads each layer's
    # given projector from the stack it writes the layer's new one over, so the
    # state's stack of projectors becomes the scan's own, with no copy of it (a
    # copy holds the old stack and the new at once: every layer's projectors
    # twice, on the 7B step 1.75 GiB). The same gradients as the marks' own finish.
    params, tx = _stacked_setup()
    x = random_array(3, (5, D))

    def step(params, state):
        grads = qt.grad(lambda p: _scanned_loss(qto.mark(p, state), x))(params)
        updates, state = tx.update(grads, state, params)
        return qto.apply_updates(params, updates), state

    state = tx.init(params)
    for name in ("w", "v"):
        stack = state.projector[name]
        shape = f"f32[{','.join(map(str, stack.shape))}]"
        copies = [
            line
            for line in jax.jit(step, donate_argnums=(0, 1))
            .lower(params, state)
            .compile()
            .as_text()
            .splitlines()
            if f"= {shape}" in line and " copy(" in line
        ]
        assert not copies, copies
    by_layer = jax.jit(qt.grad(lambda p: _scanned_loss(qto.mark(p, state), x)))
    after = jax.jit(
        qt.grad(lambda p: _scanned_loss(qto.mark(p, state, by_layer=False), x))
    )
    for current in (state, tx.update(after(params), state, params)[1]):
        state = current  # a refresh step, then one that keeps the projectors
        got, expected = by_layer(params), after(params)
        for name in ("w", "v"):
            assert_close(got[name].left, expected[name].left)
            assert_close(got[name].right, expected[name].right)


def test_a_stack_used_outside_its_scan_asks_for_by_layer_false():
    params, tx = _stacked_setup()
    state, x = tx.init(params), random_array(3, (5, D))

    def loss(p, by_layer):
        marked = qto.mark(p, state, by_layer=by_layer)
        return _scanned_loss(marked, x) + jnp.sum(marked["w"] ** 2)

    with qt.fallback("silent"):
        with pytest.raises(ValueError, match="by_layer=False"):
            qt.grad(loss)(params, True)
        grads = qt.grad(loss)(params, False)
    dense = jax.grad(lambda p: _scanned_loss(p, x) + jnp.sum(p["w"] ** 2))(params)
    g = grads["w"]
    assert_close(g, project(dense["w"], g.left, "left"))


def test_by_layer_must_be_a_bool():
    params, tx = _stacked_setup()
    with pytest.raises(TypeError, match="by_layer"):
        qto.mark(params, tx.init(params), by_layer=1)


def _data_parallel(loss, params, tx, batch, axis_name, steps=2):
    """The marked gradients of `steps` steps of a data-parallel `shard_map` on 4
    devices (replicated weights, the batch split, the mean loss), the compiled
    step's collectives, and the same gradients on one device."""
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])

    def gradients(params, state, *batch):  # on one device, the whole batch
        return qt.value_and_grad(lambda p: loss(qto.mark(p, state), *batch))(params)

    def per_device(params, state, *batch):
        def marked(p):
            mean = loss(qto.mark(p, state, axis_name=axis_name), *batch)
            return jax.lax.pmean(mean, "data")

        return qt.value_and_grad(marked)(params)

    step = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P(), *(P("data") for _ in batch)),
            out_specs=P(),
        )
    )
    sharded = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in batch]
    state = tx.init(params)
    results = []
    for _ in range(steps):  # a refresh step, then one that keeps the projectors
        got = step(params, state, *sharded)
        expected = jax.jit(gradients)(params, state, *batch)
        results.append((got, expected))
        updates, state = tx.update(expected[1], state, params)
        params = qto.apply_updates(params, updates)
    collectives = qt.hlo.collectives(step.lower(params, state, *sharded).compile())
    return results, collectives


def test_mark_axis_name_must_be_bound():
    params = {"w": jnp.ones((8, 6))}
    tx = qto.projected(optax.scale_by_adam(), rank=2, learning_rate=1e-2)
    with pytest.raises(NameError, match="axis_name='data'.*inside the body"):
        qto.mark(params, tx.init(params), axis_name="data")


def _refreshed_every_other_step(rank, **selection):
    """Adam on projected gradients, a refresh step then one that keeps them."""
    return qto.projected(
        optax.scale_by_adam(),
        rank=rank,
        learning_rate=1e-2,
        refresh_every=2,
        **selection,
    )


def _linear_setup(tokens_per_device):
    params = {"w": random_array(0, (64, 48)) * 0.1, "b": jnp.zeros(48)}
    tx = _refreshed_every_other_step(4, project=lambda p: {"w": True, "b": False})
    x = random_array(1, (4 * tokens_per_device, 64))
    y = random_array(2, (4 * tokens_per_device, 48))

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    return loss, params, tx, (x, y)


def _assert_same_gradients(results):
    for (value, grads), (expected_value, expected) in results:
        assert_close(value, expected_value)
        got, want = qt.materialise(grads), qt.materialise(expected)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert_close(g, w)


def _weight_bytes(params):
    return params["w"].size * params["w"].dtype.itemsize


@skip_without_devices(4)
def test_marks_with_axis_name_sum_the_projected_factor_over_the_devices():
    # Each device projects its own gradient (on a refresh step, with the products
    # that find the projector summed), then only the projected factor moves: the
    # same gradients as on one device, and no collective of a weight-sized array.
    loss, params, tx, batch = _linear_setup(tokens_per_device=32)
    with qt.fallback("error"):
        results, collectives = _data_parallel(loss, params, tx, batch, "data")
    _assert_same_gradients(results)
    assert isinstance(results[0][0][1]["w"], qt.LowRank)
    assert max(c.operand_bytes for c in collectives) < _weight_bytes(params) / 4
    assert {c.kind for c in collectives} == {"all-reduce"}


@skip_without_devices(4)
@pytest.mark.parametrize("tokens_per_device", [2, 32])
def test_marks_without_axis_name_gather_the_terms_or_sum_densely(tokens_per_device):
    # Without `axis_name` JAX's sum over the devices comes before the projection:
    # every device's terms (the tokens' factors) are gathered while that receives
    # less than a dense all-reduce, and beyond that the dense gradients are summed,
    # counted, with a message that names `axis_name`.
    loss, params, tx, batch = _linear_setup(tokens_per_device)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        results, collectives = _data_parallel(loss, params, tx, batch, None, steps=1)
    _assert_same_gradients(results)
    largest = max(c.operand_bytes for c in collectives)
    dense = ("psum_invariant", "OuterSum") in qt.fallback_counts()
    assert dense == (tokens_per_device == 32)
    assert (largest >= _weight_bytes(params)) == dense
    if dense:
        with pytest.raises(qt.DensificationError, match="axis_name"):
            with qt.fallback("error"):
                _data_parallel(loss, params, tx, batch, None, steps=1)


@skip_without_devices(4)
@pytest.mark.parametrize("axis_name", ["data", None])
def test_marks_in_shard_map_on_a_scanned_stack(axis_name):
    # Stacked layers under `lax.scan`, each layer's gradient projected in the
    # scan's backward pass: with `axis_name` on each device before the sum, with
    # only the projected factors crossing; without, JAX's sum comes first (the
    # scan's own backward pass sums the layers' projections of a replicated
    # stack, its range finder's products summed on a refresh step).
    layers, d = 3, 16
    params = {"w": random_array(3, (layers, d, d)) * 0.2}
    tx = _refreshed_every_other_step(2)
    x = random_array(4, (4 * 8, d))

    def loss(p, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])
        return jnp.mean(h**2)

    with qt.fallback("error" if axis_name else "silent"):
        results, collectives = _data_parallel(loss, params, tx, (x,), axis_name)
    _assert_same_gradients(results)
    if axis_name is not None:
        assert max(c.operand_bytes for c in collectives) < _weight_bytes(params) / 4


@skip_without_devices(4)
@pytest.mark.parametrize("axis_name", ["data", None])
def test_marks_in_shard_map_keep_an_embeddings_gradient_rows(axis_name):
    # A replicated table read at each device's tokens (`rows=`): JAX's sum over
    # the devices of its gradient gathers the rows read, a few per device, instead
    # of summing tables; the projected weight beside it as in the tests above.
    params = {"embed": random_array(5, (64, 16)), "w": random_array(6, (16, 12))}
    tx = _refreshed_every_other_step(
        2,
        project=lambda p: {"embed": False, "w": True},
        rows=lambda p: {"embed": True, "w": False},
    )
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 64, 4 * 2))

    def loss(p, tokens):
        return jnp.mean(jnp.tanh(p["embed"][tokens] @ p["w"]) ** 2)

    qt.reset_fallback_counts()
    with qt.fallback("error" if axis_name else "silent"):
        results, collectives = _data_parallel(loss, params, tx, (tokens,), axis_name)
    _assert_same_gradients(results)
    for (_, grads), _ in results:
        assert isinstance(grads["embed"], qt.SparseRows)
        assert grads["embed"].k == 4 * 2
    table = params["embed"].size * params["embed"].dtype.itemsize
    assert max(c.operand_bytes for c in collectives) < table / 4
    assert ("psum_invariant", "SparseRows") not in qt.fallback_counts()
