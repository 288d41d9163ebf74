"""`qto.galore`: the pipeline's plain step is the library's fast composition (the same
numbers, the same compiled memory), with one microbatch or many, and it refuses bad
arguments by name."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import assert_close


LAYERS, D, F, BATCH = 3, 8, 14, 8


def _params():
    rng = np.random.default_rng(0)
    return {
        "blocks": {
            "up": jnp.asarray(rng.standard_normal((LAYERS, D, F)), jnp.float32) * 0.3,
            "down": jnp.asarray(rng.standard_normal((LAYERS, F, D)), jnp.float32) * 0.3,
        },
        "head": jnp.asarray(rng.standard_normal((D, D)), jnp.float32) * 0.3,
    }


def _batch(seed):
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.standard_normal((BATCH, D)), jnp.float32),
        jnp.asarray(rng.standard_normal((BATCH, D)), jnp.float32),
    )


def loss_fn(params, batch):
    x, y = batch

    def layer(h, w):
        return h + jnp.tanh(h @ w["up"]) @ w["down"], None

    h, _ = jax.lax.scan(jax.checkpoint(layer), x, params["blocks"])
    return jnp.mean((h @ params["head"] - y) ** 2)


def _blocks(params):
    return {"blocks": {"up": True, "down": True}, "head": False}


OPT = qto.galore(rank=2, learning_rate=1e-2, refresh_every=2, project=_blocks)


def _pipeline_step(opt, microbatches=1):
    def step(params, state, batch):
        loss, grads = opt.value_and_grad(loss_fn, microbatches=microbatches)(
            params, state, batch
        )
        updates, state = opt.update(grads, state, params)
        return opt.apply(params, updates), state, loss

    return jax.jit(step)


def _composed_step(microbatches=1):
    """The composition by hand: what the pipeline stands for."""
    tx = qto.layerwise(
        qto.quantized_state(
            qto.projected(
                optax.scale_by_adam(),
                rank=2,
                learning_rate=1e-2,
                refresh_every=2,
                project=_blocks,
            )
        ),
        layers=LAYERS,
    )

    def step(params, state, batch):
        split = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)
        loss, grads = qto.accumulate_gradients(loss_fn, params, state, split)
        updates, state = tx.update(grads, state, params)
        return qto.apply_updates(params, updates), state, loss

    return tx, jax.jit(step)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_plain_step_is_the_composed_step(microbatches):
    params = _params()
    tx, composed = _composed_step(microbatches)
    ours = _pipeline_step(OPT, microbatches)
    state_a = state_b = OPT.init(params)
    params_a = params_b = params
    for seed in range(3):  # refresh, keep, refresh
        params_a, state_a, loss_a = ours(params_a, state_a, _batch(seed))
        params_b, state_b, loss_b = composed(params_b, state_b, _batch(seed))
        assert float(loss_a) == float(loss_b)
        for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
            np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(tx.init(params)) == jax.tree.structure(state_a)


def test_microbatches_give_the_full_batch_gradient():
    params = _params()
    state = OPT.init(params)
    batch = _batch(0)
    for _ in range(2):  # refresh, keep
        _, whole = jax.jit(OPT.value_and_grad(loss_fn))(params, state, batch)
        _, split = jax.jit(OPT.value_and_grad(loss_fn, microbatches=4))(
            params, state, batch
        )
        for name in ("up", "down"):
            assert isinstance(split["blocks"][name], qt.LowRank)
            assert_close(split["blocks"][name], whole["blocks"][name], factor=5)
        assert_close(split["head"], whole["head"], factor=5)
        _, state = OPT.update(whole, state, params)


def test_the_plain_step_compiles_to_the_composed_steps_memory():
    # XLA:CPU's buffer assignment, compiled only: the pipeline and the hand
    # composition are one program.
    params = _params()
    state = OPT.init(params)
    batch = _batch(0)
    _, composed = _composed_step(2)

    def memory(step):
        compiled = step.lower(params, state, batch).compile()
        analysis = compiled.memory_analysis()
        return analysis.temp_size_in_bytes + analysis.output_size_in_bytes

    assert memory(_pipeline_step(OPT, 2)) == memory(composed)


def test_the_optax_view_runs_in_a_chain():
    params = _params()
    state = OPT.init(params)
    _, grads = jax.jit(OPT.value_and_grad(loss_fn))(params, state, _batch(0))
    tx = optax.chain(OPT.transformation(params))
    updates, _ = tx.update(grads, tx.init(params), params)
    expected, _ = OPT.update(grads, state, params)
    for a, b in zip(
        jax.tree.leaves(jax.tree.map(qt.materialise, updates, is_leaf=_is_lowrank)),
        jax.tree.leaves(jax.tree.map(qt.materialise, expected, is_leaf=_is_lowrank)),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_optax_view_of_abstract_parameters_is_the_same():
    # Built from `jax.eval_shape`'s parameters, before any weight exists.
    params = _params()
    state = OPT.init(params)
    _, grads = jax.jit(OPT.value_and_grad(loss_fn))(params, state, _batch(0))
    abstract = jax.eval_shape(_params)
    tx = OPT.transformation(abstract)
    updates, _ = tx.update(grads, tx.init(params), params)
    expected, _ = OPT.transformation(params).update(grads, state, params)
    for a, b in zip(
        jax.tree.leaves(jax.tree.map(qt.materialise, updates, is_leaf=_is_lowrank)),
        jax.tree.leaves(jax.tree.map(qt.materialise, expected, is_leaf=_is_lowrank)),
    ):
        np.testing.assert_array_equal(a, b)
    # And its state's shapes, as `opt.init` gives them from arrays.
    assert jax.tree.map(jax.typeof, jax.eval_shape(OPT.init, abstract)) == jax.tree.map(
        jax.typeof, state
    )


def _is_lowrank(x):
    return isinstance(x, qt.LowRank)


def test_its_methods_jit_with_a_tree_of_bools():
    # `project=` as a dict (unhashable): `jax.jit(opt.init)` and `jax.jit(opt.update)`
    # hash the pipeline's static fields.
    opt = qto.galore(rank=2, learning_rate=1e-2, project=_blocks(_params()))
    params = _params()
    state = jax.jit(opt.init)(params)
    _, grads = jax.jit(opt.value_and_grad(loss_fn))(params, state, _batch(0))
    updates, _ = jax.jit(opt.update)(grads, state, params)
    expected, _ = OPT.update(grads, OPT.init(params), params)
    for a, b in zip(
        jax.tree.leaves(jax.tree.map(qt.materialise, updates, is_leaf=_is_lowrank)),
        jax.tree.leaves(jax.tree.map(qt.materialise, expected, is_leaf=_is_lowrank)),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert opt.project == _blocks(params)


class _EquinoxNet(eqx.Module):
    """Equinox's own layers, with leaves that are not arrays: the MLP's activation
    function, the attention's dropout rate and flag."""

    attention: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.attention = eqx.nn.MultiheadAttention(2, D, key=keys[0])
        self.mlp = eqx.nn.MLP(D, D, F, 1, key=keys[1])
        self.head = eqx.nn.Linear(D, 1, key=keys[2])

    def __call__(self, x):
        x = x + self.attention(x, x, x)
        return jax.vmap(self.head)(x + jax.vmap(self.mlp)(x))


def _net_loss(net, batch):
    x, y = batch
    return jnp.mean(
        (jax.vmap(net)(x.reshape(-1, 4, D)) - y[:, :1].reshape(-1, 4, 1)) ** 2
    )


def _matrices(params):
    return jax.tree.map(lambda x: x.ndim == 2 and min(x.shape) > 2, params)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_whole_equinox_model_steps_as_its_arrays_do(microbatches):
    # As `eqx.filter_value_and_grad` takes a whole model: the leaves that are not
    # arrays reach the loss as they are, and the arrays step as the partitioned
    # model's do.
    opt = qto.galore(rank=2, learning_rate=1e-2, refresh_every=2, project=_matrices)
    net = _EquinoxNet(jax.random.key(0))
    params, static = eqx.partition(net, eqx.is_array)

    def whole_step(net, state, batch):
        loss, grads = opt.value_and_grad(_net_loss, microbatches=microbatches)(
            net, state, batch
        )
        updates, state = opt.update(grads, state, net)
        return opt.apply(net, updates), state, loss

    def partitioned_loss(params, batch):
        return _net_loss(eqx.combine(params, static), batch)

    def partitioned_step(params, state, batch):
        loss, grads = opt.value_and_grad(partitioned_loss, microbatches=microbatches)(
            params, state, batch
        )
        updates, state = opt.update(grads, state, params)
        return opt.apply(params, updates), state, loss

    whole_step, partitioned_step = eqx.filter_jit(whole_step), jax.jit(partitioned_step)
    state, expected_state = opt.init(net), opt.init(params)
    for t in range(3):
        net, state, loss = whole_step(net, state, _batch(t))
        params, expected_state, expected = partitioned_step(
            params, expected_state, _batch(t)
        )
        np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert net.mlp.activation is static.mlp.activation
    assert net.attention.dropout.p == static.attention.dropout.p
    for a, b in zip(
        jax.tree.leaves(eqx.filter(net, eqx.is_array)), jax.tree.leaves(params)
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_float_state_when_asked():
    opt = qto.galore(rank=2, learning_rate=1e-2, project=_blocks, state_bits=None)
    assert isinstance(OPT.init(_params()), qto.QuantizedState)
    assert isinstance(opt.init(_params()), qto.ProjectedState)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rank": 0}, ValueError, "`rank`"),
        ({"rank": 2.0}, TypeError, "`rank`"),
        ({"rank": True}, TypeError, "`rank`"),
        ({"rank": 2, "state_bits": 4}, ValueError, "`state_bits`"),
        ({"rank": 2, "iters": -1}, ValueError, "`iters`"),
        ({"rank": 2, "base": optax.adam}, TypeError, "`base`"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        qto.galore(**kwargs)


def test_a_state_that_is_not_this_pipelines_is_refused_by_name():
    params = _params()
    state = OPT.init(params)
    grad_fn = OPT.value_and_grad(loss_fn)
    with pytest.raises(ValueError, match="opt.init"):
        grad_fn(params, optax.adam(1e-2).init(params), _batch(0))
    with pytest.raises(ValueError, match=r"\(params, state, \.\.\.\)"):
        grad_fn(state, params, _batch(0))
    multi = optax.MultiSteps(OPT.transformation(params), 2).init(params)
    with pytest.raises(TypeError, match="microbatches=k"):
        grad_fn(params, multi, _batch(0))
    # A float state handed to the 8-bit pipeline (a checkpoint of another run).
    _, grads = grad_fn(params, state, _batch(0))
    float_state = qto.galore(
        rank=2, learning_rate=1e-2, project=_blocks, state_bits=None
    ).init(params)
    with pytest.raises(TypeError, match="state_bits=None"):
        OPT.update(grads, float_state, params)


def test_a_numpy_integer_rank_is_taken():
    opt = qto.galore(rank=np.int64(2), learning_rate=1e-2, project=_blocks)
    assert opt.rank == 2 and type(opt.rank) is int


def test_a_direction_without_a_learning_rate_is_refused():
    # `optax.scale_by_adam()` gives Adam's direction: with no learning rate, each
    # step would climb the loss.
    with pytest.raises(ValueError, match="Pass `learning_rate=`"):
        qto.galore(rank=2)
    with pytest.raises(ValueError, match="Pass `learning_rate=`"):
        qto.galore(optax.scale_by_lion(), rank=2)


@pytest.mark.parametrize("make", [qto.galore, qto.projected])
def test_a_learning_rate_twice_is_refused(make):
    with pytest.raises(ValueError, match="already holds a learning rate"):
        make(optax.adam(1e-2), rank=2, learning_rate=1e-2)


class _Unhashable:
    """A callable that cannot be hashed, as an `eqx.Module` holding an array."""

    __hash__ = None

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def test_an_unhashable_base_is_probed_too():
    adam = optax.scale_by_adam()
    base = optax.GradientTransformation(_Unhashable(adam.init), adam.update)
    qto.galore(base, rank=2, learning_rate=1e-2)
    with pytest.raises(ValueError, match="Pass `learning_rate=`"):
        qto.galore(base, rank=2)


def test_a_base_that_holds_the_learning_rate_descends():
    # `optax.adam(lr)` steps down the gradient itself: taken with no
    # `learning_rate`. A warmup from 0 (a first step of 0, which tells nothing) is
    # taken either way.
    qto.galore(optax.adam(optax.linear_schedule(0.0, 1e-2, 4)), rank=2)
    qto.galore(rank=2, learning_rate=optax.linear_schedule(0.0, 1e-2, 4))
    params = _params()
    opt = qto.galore(optax.adam(1e-2), rank=2, project=_blocks)
    state = opt.init(params)
    loss, grads = opt.value_and_grad(loss_fn)(params, state, _batch(0))
    updates, state = opt.update(grads, state, params)
    assert loss_fn(opt.apply(params, updates), _batch(0)) < loss


def test_a_batch_that_microbatches_do_not_divide_is_named():
    params = _params()
    state = OPT.init(params)
    with pytest.raises(ValueError, match="`microbatches=3`"):
        OPT.value_and_grad(loss_fn, microbatches=3)(params, state, _batch(0))


def test_a_selector_that_chooses_no_leaf_is_refused_at_init():
    nothing = jax.tree.map(lambda _: False, _params())
    opt = qto.galore(rank=2, learning_rate=1e-2, project=nothing)
    with pytest.raises(ValueError, match="chose no leaf"):
        opt.init(_params())


def test_a_rank_that_no_matrix_exceeds_is_refused_naming_the_largest_side():
    params = _params()
    side = max(min(x.shape[-2:]) for x in jax.tree.leaves(params) if x.ndim >= 2)
    opt = qto.galore(rank=side, learning_rate=1e-2)
    with pytest.raises(ValueError, match=rf"`rank={side}`.* is {side}.*smaller `rank`"):
        opt.init(params)


def test_a_batch_leaf_without_a_batch_dim_is_named():
    params = _params()
    state = OPT.init(params)
    with pytest.raises(ValueError, match="0-d leaf"):
        OPT.value_and_grad(lambda p, b: loss_fn(p, b[0]))(
            params, state, (_batch(0), jnp.float32(1.0))
        )
