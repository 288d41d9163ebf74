"""`quax_tangents.optax.projected` on the leaves of large JAX models: stacked layers
projected per slice (against a loop over the slices), every form of `project=` that
`optax.masked` takes, `dims=`, and the learning rate given to `projected` itself."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import assert_close, random_array
from tests.helpers.fallback import projects_dense_gradients
from tests.helpers.matrix_view import DIMS, D, attention_loss, attention_params


RANK = 2
_ADAM = optax.scale_by_adam()


def _orthonormal(rng, *shape):
    x = rng.standard_normal(shape)
    return np.linalg.qr(x)[0].astype(np.float32)


def _projection(g, projector):
    """The `LowRank` that `projected_cotangent` gives for a fixed projector, for a
    gradient `(*batch, m, n)` and a projector `(*batch, min(m, n), r)`."""
    m, n = g.shape[-2:]
    if m <= n:
        small = np.swapaxes(g, -1, -2) @ projector
        return qt.LowRank(jnp.asarray(projector), jnp.asarray(small), "left")
    return qt.LowRank(jnp.asarray(g @ projector), jnp.asarray(projector), "right")


def _slices(batch):
    return list(np.ndindex(*batch))


def _name(index):
    return "w" + "_".join(map(str, index))


@pytest.mark.parametrize(
    "shape", [(3, 6, 10), (3, 10, 6), (2, 3, 6, 10)], ids=["wide", "tall", "2-batch"]
)
@pytest.mark.parametrize("marked", [True, False], ids=["LowRank", "dense"])
@projects_dense_gradients
def test_stacked_leaf_equals_a_loop_over_its_slices(shape, marked):
    rng = np.random.default_rng(0)
    batch, (m, n) = shape[:-2], shape[-2:]
    tx = qto.projected(_ADAM, rank=RANK, learning_rate=0.1, scale=0.5)
    stacked_state = tx.init({"w": jnp.zeros(shape)})
    assert stacked_state.projector["w"].shape == (*batch, min(m, n), RANK)
    assert stacked_state.base_state.mu["w"].shape == (*batch, max(m, n), RANK)
    loop_state = tx.init({_name(i): jnp.zeros((m, n)) for i in _slices(batch)})
    step = jax.jit(tx.update)
    projector = _orthonormal(rng, *batch, min(m, n), RANK)
    for _ in range(3):
        g = rng.standard_normal(shape).astype(np.float32)
        if marked:
            stacked = {"w": _projection(g, projector)}
            loop = {_name(i): _projection(g[i], projector[i]) for i in _slices(batch)}
        else:
            stacked = {"w": jnp.asarray(g)}
            loop = {_name(i): jnp.asarray(g[i]) for i in _slices(batch)}
        updates, stacked_state = step(stacked, stacked_state)
        expected, loop_state = step(loop, loop_state)
        update = updates["w"]
        assert isinstance(update, qt.LowRank) and update.batch_ndim == len(batch)
        for i in _slices(batch):
            # The SVD's signs may differ per slice; the update does not depend on them.
            assert_close(update.materialise()[i], expected[_name(i)], factor=10)
            assert_close(
                np.abs(stacked_state.projector["w"][i]),
                np.abs(loop_state.projector[_name(i)]),
                factor=10,
            )


def test_stacked_projection_of_the_wrong_rank_or_side_names_the_stack():
    tx = qto.projected(_ADAM, rank=RANK)
    state = tx.init({"w": jnp.zeros((3, 6, 10))})
    with pytest.raises(TypeError, match="projector on the right"):
        tx.update(
            {"w": qt.LowRank(jnp.ones((3, 6, 2)), jnp.ones((3, 10, 2)), "right")}, state
        )
    with pytest.raises(TypeError, match=r"a stack \[3\] of \(6, 10\) matrices"):
        tx.update(
            {"w": qt.LowRank(jnp.ones((3, 6, 3)), jnp.ones((3, 10, 3)), "left")}, state
        )


def test_a_leaf_that_cannot_be_projected_says_what_would_work():
    tx = qto.projected(_ADAM, rank=4, project=lambda _: True)
    with pytest.raises(ValueError, match=r"\['b'\].*fewer than 2 dims"):
        tx.init({"b": jnp.zeros(8)})
    with pytest.raises(
        ValueError, match=r"smaller side 4 does not exceed `rank=4`.*dims="
    ):
        tx.init({"w": jnp.zeros((2, 4, 32))})
    # A projected gradient for a leaf left out names `project=` and `dims=`, and the
    # stacked leaf that the old message sent in a circle is projected by default.
    left_out = qto.projected(_ADAM, rank=RANK, project={"w": False})
    state = left_out.init({"w": jnp.zeros((2, 6, 10))})
    grad = _projection(
        np.ones((2, 6, 10), np.float32), np.ones((2, 6, RANK), np.float32)
    )
    with pytest.raises(TypeError, match="does not project.*`project=`.*`dims=`"):
        left_out.update({"w": grad}, state)
    default = qto.projected(_ADAM, rank=RANK).init({"w": jnp.zeros((2, 6, 10))})
    assert default.projector["w"].shape == (2, 6, RANK)


# ---------------------------------------------------------------------------------------
# project=: every form optax.masked takes


def _model():
    return eqx.nn.MLP(6, 4, 10, 2, key=jax.random.key(0))


def _plan_of(state):
    return jax.tree.map(
        lambda p: p is not None, state.projector, is_leaf=lambda x: x is None
    )


def test_project_as_a_pytree_callable_prefix_or_module_selects_the_same_leaves():
    params = {"a": jnp.zeros((6, 10)), "b": {"c": jnp.zeros((8, 5)), "d": jnp.zeros(4)}}
    expected = {"a": True, "b": {"c": False, "d": False}}
    forms = [
        {"a": True, "b": False},  # a prefix
        {"a": True, "b": {"c": False, "d": False}},
        lambda p: {"a": True, "b": jax.tree.map(lambda _: False, p["b"])},
    ]
    for form in forms:
        state = qto.projected(_ADAM, rank=RANK, project=form).init(params)
        assert _plan_of(state) == expected


@projects_dense_gradients
def test_project_as_an_equinox_module_of_bools():
    params = eqx.filter(_model(), eqx.is_array)
    mask = jax.tree.map(lambda x: x.ndim == 2 and x.shape[0] > RANK, params)
    tx = qto.projected(_ADAM, rank=RANK, learning_rate=0.1, project=mask)
    state = tx.init(params)
    projected = [p for p in jax.tree.leaves(state.projector)]
    assert [p.shape for p in projected] == [(6, RANK), (10, RANK), (4, RANK)]
    grads = jax.tree.map(lambda x: jnp.ones_like(x), params)
    updates, state = jax.jit(tx.update)(grads, state)
    model = qto.apply_updates(_model(), updates)
    assert isinstance(model, eqx.nn.MLP)
    assert isinstance(updates.layers[0].weight, qt.LowRank)
    # Selecting by a callable on the module does the same.
    by_callable = qto.projected(_ADAM, rank=RANK, project=lambda p: mask).init(params)
    assert jax.tree.structure(by_callable.projector) == jax.tree.structure(
        state.projector
    )


def test_a_leafwise_callable_is_told_that_project_sees_the_whole_tree():
    with pytest.raises(TypeError, match="whole parameter tree"):
        qto.projected(_ADAM, rank=RANK, project=lambda x: x.ndim == 2).init(
            {"w": jnp.zeros((6, 10))}
        )


@pytest.mark.parametrize(
    "per_leaf", [lambda x: getattr(x, "ndim", 0) == 2, lambda x: True]
)
def test_a_leafwise_callable_that_runs_on_the_tree_is_refused(per_leaf):
    # A module or a dict has no `ndim` of 2: written per leaf, the callable returns
    # one bool for the whole tree, which would choose every leaf or none.
    with pytest.raises(TypeError, match="single bool"):
        qto.projected(_ADAM, rank=RANK, project=per_leaf).init(_model())


def test_rows_and_project_on_one_leaf_raise():
    tx = qto.projected(_ADAM, rank=RANK, project={"t": True}, rows={"t": True})
    with pytest.raises(ValueError, match="Both `project` and `rows`"):
        tx.init({"t": jnp.zeros((9, 6))})


# ---------------------------------------------------------------------------------------
# dims=: a weight that is logically a matrix with more dims


@pytest.mark.parametrize(
    "shape, dims", [((6, 2, 5), (0, 1)), ((3, 6, 2, 5), (1, 1)), ((10, 2, 3), (0, 2))]
)
@projects_dense_gradients
def test_dims_projects_the_matrix_view(shape, dims):
    rng = np.random.default_rng(1)
    batch_ndim, row_ndim = dims
    batch = shape[:batch_ndim]
    rows = int(np.prod(shape[batch_ndim : batch_ndim + row_ndim]))
    view = (*batch, rows, -1)
    tx = qto.projected(_ADAM, rank=RANK, learning_rate=0.1, dims={"w": dims})
    reference = qto.projected(_ADAM, rank=RANK, learning_rate=0.1)
    param = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    state = tx.init({"w": param})
    ref_state = reference.init({"w": param.reshape(view)})
    for _ in range(2):
        g = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        updates, state = tx.update({"w": g}, state)
        expected, ref_state = reference.update({"w": g.reshape(view)}, ref_state)
        assert_close(updates["w"], expected["w"], factor=10)
        new = qto.apply_updates({"w": param}, updates)["w"]
        assert new.shape == shape
        assert_close(
            new,
            (param.reshape(view) + expected["w"].materialise()).reshape(shape),
            factor=10,
        )


@projects_dense_gradients
def test_a_step_on_marked_viewed_leaves_equals_the_step_on_dense_gradients():
    params = attention_params()
    x = random_array(4, (2, 4, D))
    tx = qto.projected(
        _ADAM, rank=RANK, learning_rate=0.1, dims=DIMS, refresh_every=100
    )
    # A first step on dense gradients sets the projectors (an SVD per layer); the
    # next keeps them, so that both arms below project onto the same ones.
    state = tx.init(params)
    updates, state = tx.update(jax.grad(attention_loss)(params, x), state)
    params = qto.apply_updates(params, updates)
    assert not bool(state.refresh)

    def marked_step(params, state):
        grads = qt.grad(lambda p: attention_loss(qto.mark(p, state), x))(params)
        updates, state = tx.update(grads, state)
        return qto.apply_updates(params, updates), state

    def dense_step(params, state):
        updates, state = tx.update(jax.grad(attention_loss)(params, x), state)
        return qto.apply_updates(params, updates), state

    with qt.fallback("error"):
        got, got_state = jax.jit(marked_step)(params, state)
    want, want_state = jax.jit(dense_step)(params, state)
    for name in DIMS:
        assert got[name].shape == params[name].shape
        assert_close(got[name], want[name], factor=10)
        assert_close(got_state.projector[name], want_state.projector[name])
        assert_close(got_state.base_state.mu[name], want_state.base_state.mu[name])


def test_bad_dims_raise():
    with pytest.raises(ValueError, match="batch_ndim, row_ndim"):
        qto.projected(_ADAM, rank=RANK, dims=lambda _: (1, 2)).init(
            {"w": jnp.zeros((4, 6, 8))}
        )


# ---------------------------------------------------------------------------------------
# learning_rate


def _three_leaves(rng):
    return {
        "w": jnp.asarray(rng.standard_normal((6, 10)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(10), jnp.float32),
    }


@pytest.mark.parametrize(
    "learning_rate",
    [0.05, optax.linear_schedule(0.1, 0.01, 3)],
    ids=["float", "schedule"],
)
@projects_dense_gradients
def test_learning_rate_equals_scale_by_learning_rate_inside_base(learning_rate):
    rng = np.random.default_rng(2)
    params = {**_three_leaves(rng), "t": jnp.zeros((9, 3))}
    project = {"w": True, "b": False, "t": False}
    own = qto.projected(_ADAM, rank=RANK, learning_rate=learning_rate, project=project)
    inside = qto.projected(
        optax.chain(_ADAM, optax.scale_by_learning_rate(learning_rate)),
        rank=RANK,
        project=project,
    )
    own_state, inside_state = own.init(params), inside.init(params)
    for t in range(4):
        grads = {
            **jax.tree.map(
                lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32),
                _three_leaves(rng),
            ),
            "t": qt.SparseRows(jnp.array([t, 2]), jnp.ones((2, 3)), 9),
        }
        got, own_state = jax.jit(own.update)(grads, own_state)
        expected, inside_state = jax.jit(inside.update)(grads, inside_state)
        for name in params:
            assert_close(got[name], expected[name])
        assert type(got["w"]) is qt.LowRank and type(got["t"]) is qt.SparseRows


def test_learning_rate_must_be_a_number_or_schedule():
    with pytest.raises(TypeError, match="learning_rate"):
        qto.projected(_ADAM, rank=RANK, learning_rate="0.1")
