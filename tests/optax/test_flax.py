"""Projected training of Flax models: NNX state from `nnx.split`, NNX's own
`nnx.Optimizer`, and Linen parameter dicts."""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import assert_close, random_array


nnx = pytest.importorskip("flax.nnx", reason="flax is in the `dev` extra")
linen = pytest.importorskip("flax.linen", reason="flax is in the `dev` extra")

X, Y = random_array(1, (32, 16)), random_array(2, (32, 8))


def _matrices(params):
    return jax.tree.map(lambda a: jnp.ndim(a) == 2, params)


def _tx():
    return qto.projected(
        optax.scale_by_adam(), rank=4, learning_rate=1e-2, project=_matrices
    )


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def _nnx_functional_losses(steps):
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    tx = _tx()
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        def loss_fn(p):
            return jnp.mean((nnx.merge(graphdef, qto.mark(p, state))(X) - Y) ** 2)

        loss, grads = qt.value_and_grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return qto.apply_updates(params, updates), state, loss, grads

    losses = []
    for _ in range(steps):
        params, state, loss, grads = step(params, state)
        losses.append(float(loss))
    assert isinstance(grads["up"]["kernel"].get_value(), qt.LowRank)
    return losses


def test_nnx_optimizer_trains_as_the_functional_step_does():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer):
        graphdef, params = nnx.split(model, nnx.Param)

        def loss_fn(p):
            marked = qto.mark(p, optimizer.opt_state)
            return jnp.mean((nnx.merge(graphdef, marked)(X) - Y) ** 2)

        loss, grads = qt.value_and_grad(loss_fn)(params)
        # `nnx.Optimizer.update` applies the updates with `optax.apply_updates`,
        # which adds each low-rank update to its weight densely: counted, silenced.
        with qt.fallback("silent"):
            optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer)) for _ in range(4)]
    assert losses == pytest.approx(_nnx_functional_losses(4), rel=1e-5)
    assert losses[-1] < losses[0]


def test_nnx_optimizer_with_8_bit_state_is_refused_by_name():
    # After an update, `nnx.Optimizer` writes each `LogQuantized` (a pytree held in
    # one of its variables) back as a mapping of its fields: refused, naming the
    # float state or the functional step, rather than read as a moment.
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, qto.quantized_state(optax.adam(1e-2), block_size=8), wrt=nnx.Param
    )
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    with pytest.raises(TypeError, match="state_bits=None"):
        optimizer.update(model, grads)


def test_a_densification_inside_a_flax_layer_is_reported_at_the_callers_line():
    # A projected kernel that `nnx.Einsum` reads by its diagonal (not a matmul): the
    # warning names the line of the loss that called the layer, not Flax's.
    layer = nnx.Einsum("ab,bb->ab", (8, 8), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer, nnx.Param)
    state = _tx().init(params)

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, qto.mark(p, state))(jnp.ones((3, 8))) ** 2)

    qt.reset_fallback_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qt.grad(loss)(params)
    uses = [w for w in caught if not str(w.message).startswith("`finish`")]
    assert uses and [w.filename for w in uses] == [__file__] * len(uses)


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(8)(jax.nn.gelu(linen.Dense(32)(x)))


def test_linen_params_train_with_projected_gradients():
    model = LinenMLP()
    params = model.init(jax.random.key(0), X)["params"]
    tx = _tx()
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        def loss_fn(p):
            return jnp.mean((model.apply({"params": qto.mark(p, state)}, X) - Y) ** 2)

        loss, grads = qt.value_and_grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return qto.apply_updates(params, updates), state, loss, grads

    losses = []
    for _ in range(4):
        params, state, loss, grads = step(params, state)
        losses.append(float(loss))
    assert isinstance(grads["Dense_0"]["kernel"], qt.LowRank)
    assert losses[-1] < losses[0]


def test_parameters_of_another_structure_are_still_refused():
    _, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    state = _tx().init(params)
    with pytest.raises(ValueError, match="must have the structure"):
        qto.mark({"up": params["up"]}, state)
    # The model itself where its `nnx.State` was expected: JAX's message quotes the
    # whole model; the error keeps its head.
    model = MLP(nnx.Rngs(0))
    with pytest.raises(ValueError, match="more characters") as error:
        qto.mark(model, state)
    assert len(str(error.value)) < 1000


# ---------------------------------------------------------------------------------------
# Linen layers scanned with `nn.scan`, as MaxText stacks them


class _Block(linen.Module):
    @linen.compact
    def __call__(self, x, _):
        # Attention-style kernels `(d, heads, head_dim)` and `(heads, head_dim, d)`.
        q = linen.DenseGeneral((2, 8), use_bias=False, name="query")(x)
        x = x + linen.DenseGeneral(16, axis=(-2, -1), use_bias=False, name="out")(
            jnp.tanh(q)
        )
        h = jax.nn.gelu(linen.Dense(32, use_bias=False, name="up")(x))
        return x + linen.Dense(16, use_bias=False, name="down")(h), None


class _Scanned(linen.Module):
    axis: int = 0

    @linen.compact
    def __call__(self, x):
        layers = linen.scan(
            linen.remat(_Block),
            variable_axes={"params": self.axis},
            split_rngs={"params": True},
            length=3,
        )
        x, _ = layers(name="layers")(x, None)
        return linen.Dense(8)(x)


def _stacked_kernels(params):
    return jax.tree.map(lambda a: jnp.ndim(a) >= 3, params)


def _kernel_dims(leaf):
    # The query kernel `(layers, d, heads, head_dim)` has one row dim; the output
    # kernel `(layers, heads, head_dim, d)` two.
    if jnp.ndim(leaf) == 4:
        return (1, 1) if jnp.shape(leaf)[1] == 16 else (1, 2)
    return None


def _scanned_pipeline():
    return qto.galore(
        rank=4,
        learning_rate=1e-2,
        refresh_every=10,
        project=_stacked_kernels,
        dims=_kernel_dims,
    )


def test_linen_layers_scanned_on_axis_0_match_the_dense_gradient_projected():
    model = _Scanned()
    params = model.init(jax.random.key(0), X)["params"]
    opt = _scanned_pipeline()

    def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    @jax.jit
    def step(params, state):
        loss, grads = opt.value_and_grad(loss_fn, microbatches=2)(params, state, (X, Y))
        updates, state = opt.update(grads, state, params)
        return opt.apply(params, updates), state, loss, grads

    state = opt.init(params)
    losses = []
    with qt.fallback("error"):
        for _ in range(2):
            params, state, loss, grads = step(params, state)
            losses.append(float(loss))
    assert isinstance(grads["layers"]["query"]["kernel"], qt.LowRank)
    assert grads["layers"]["query"]["kernel"].shape == (3, 16, 16)
    assert isinstance(grads["layers"]["down"]["kernel"], qt.LowRank)
    assert losses[1] < losses[0]

    # Not a refresh step: the marked step's update is that of the dense gradient,
    # projected after the fact onto the same projectors.
    _, marked = opt.value_and_grad(loss_fn)(params, state, (X, Y))
    dense = jax.grad(loss_fn)(params, (X, Y))
    with qt.fallback("silent"):
        from_dense, _ = opt.update(dense, state, params)
    from_marks, _ = opt.update(marked, state, params)

    def steps(updates):  # each update over the learning rate, dense
        low_rank = lambda u: isinstance(u, qt.LowRank)  # noqa: E731
        dense_updates = jax.tree.map(qt.materialise, updates, is_leaf=low_rank)
        return [u / 1e-2 for u in jax.tree.leaves(dense_updates)]

    for a, b in zip(steps(from_marks), steps(from_dense)):
        assert_close(a, b, factor=10.0)


def test_linen_layers_scanned_on_axis_1_are_counted_with_the_fix():
    # `variable_axes={"params": 1}` (MaxText's `param_scan_axis=1`): Flax moves the
    # layer axis to the front inside the loss, which a mark cannot follow.
    model = _Scanned(axis=1)
    params = model.init(jax.random.key(0), X)["params"]
    assert params["layers"]["up"]["kernel"].shape == (16, 3, 32)
    # The `(16, 3, 32)` kernel is seen as a stack of 16 matrices `(3, 32)`.
    mlp = lambda p: jax.tree.map(lambda a: jnp.ndim(a) == 3, p)  # noqa: E731
    opt = qto.galore(rank=2, learning_rate=1e-2, project=mlp)

    def loss_fn(p, batch):
        return jnp.mean((model.apply({"params": p}, batch[0]) - batch[1]) ** 2)

    with (
        qt.fallback("error"),
        pytest.raises(qt.DensificationError, match="variable_axes=.*'params': 0"),
    ):
        opt.value_and_grad(loss_fn)(params, opt.init(params), (X, Y))
