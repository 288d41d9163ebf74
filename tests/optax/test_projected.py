"""`quax_tangents.optax.projected` against GaLore's formula, written out here: the
update of a projected weight is `P adam(P^T G)` for a fixed projector, refreshes land
on the steps the state says, and row-sparse leaves update only the rows read."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import assert_close
from tests.helpers.fallback import projects_dense_gradients


B1, B2, EPS = 0.9, 0.999, 1e-8
RANK = 2


def _adam_reference(grads):
    """Adam's direction for a sequence of gradients, from the formula."""
    mu = nu = np.zeros_like(grads[0])
    out = []
    for t, g in enumerate(grads, start=1):
        mu = B1 * mu + (1 - B1) * g
        nu = B2 * nu + (1 - B2) * g**2
        mu_hat, nu_hat = mu / (1 - B1**t), nu / (1 - B2**t)
        out.append(mu_hat / (np.sqrt(nu_hat) + EPS))
    return out


def _orthonormal(rng, rows, cols):
    return np.linalg.qr(rng.standard_normal((rows, cols)))[0].astype(np.float32)


def _gradients(rng, shape, steps):
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(steps)]


def _marked(g, projector):
    """The gradient `projected_cotangent` gives for a fixed projector."""
    m, n = g.shape[-2:]
    small = np.swapaxes(g, -1, -2) @ projector if m <= n else g @ projector
    if m <= n:
        return qt.LowRank(jnp.asarray(projector), jnp.asarray(small), "left")
    return qt.LowRank(jnp.asarray(small), jnp.asarray(projector), "right")


def _reference_updates(grads, projector, scale=1.0):
    """`scale * P adam(P^T G)` (or its transpose for a tall weight), step by step."""
    m, n = grads[0].shape
    if m <= n:
        small = [g.T @ projector for g in grads]
        return [scale * projector @ u.T for u in _adam_reference(small)]
    small = [g @ projector for g in grads]
    return [scale * u @ projector.T for u in _adam_reference(small)]


_SCALE = 0.5
_TX = qto.projected(optax.scale_by_adam(B1, B2, EPS), rank=RANK, scale=_SCALE)
_STEP = jax.jit(_TX.update)


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (7, 7)])
def test_fixed_projector_matches_the_formula(shape):
    rng = np.random.default_rng(0)
    grads = _gradients(rng, shape, 4)
    projector = _orthonormal(rng, min(shape), RANK)
    state = _TX.init({"w": jnp.zeros(shape)})
    for g, expected in zip(grads, _reference_updates(grads, projector, _SCALE)):
        updates, state = _STEP({"w": _marked(g, projector)}, state)
        assert isinstance(updates["w"], qt.LowRank)
        assert_close(updates["w"], expected)
    assert_close(state.projector["w"], projector)
    # The state is base's state for the (max(m, n), rank) factor only.
    assert state.base_state.mu["w"].shape == (max(shape), RANK)


def _top_singular_vectors(g, rank):
    u, _, vh = np.linalg.svd(g)
    return u[:, :rank] if g.shape[0] <= g.shape[1] else vh[:rank].T


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
@projects_dense_gradients
def test_dense_gradient_projected_after_the_fact(shape):
    rng = np.random.default_rng(1)
    grads = _gradients(rng, shape, 3)
    projector = _top_singular_vectors(grads[0], RANK)
    state = _TX.init({"w": jnp.zeros(shape)})
    for g, expected in zip(grads, _reference_updates(grads, projector, _SCALE)):
        updates, state = _STEP({"w": jnp.asarray(g)}, state)
        assert isinstance(updates["w"], qt.LowRank)
        assert_close(updates["w"], expected, factor=10)


def _linear_loss(params, x):
    return jnp.sum(jnp.tanh(x @ params["w"]))


@pytest.mark.parametrize("gradient", ["unmarked", "jax.grad of marked"])
def test_a_dense_gradient_for_a_projected_leaf_is_counted_and_names_the_mark(gradient):
    # The saving is lost without a word unless a dense gradient is a densification:
    # the user forgot the mark, or took `jax.grad` of a marked loss (which computes the
    # whole gradient, then projects it).
    params = {"w": jnp.ones((6, 10)) / 10}
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 6)), jnp.float32)
    state = _TX.init(params)
    if gradient == "unmarked":
        grads = qt.grad(_linear_loss)(params, x)
    else:
        grads = jax.grad(lambda p: _linear_loss(qto.mark(p, state), x))(params)
    assert not isinstance(grads["w"], qt.CompressedArray)
    key = ("quax_tangents.optax.projected", "LowRank")
    with pytest.warns(qt.DensificationWarning, match=r"\['w'\].*optax\.mark"):
        updates, _ = _TX.update(grads, state)
    assert isinstance(updates["w"], qt.LowRank)
    assert qt.fallback_counts() == {key: 1}
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="mark"):
        _TX.update(grads, state)
    with qt.fallback("silent"):
        jax.jit(lambda g, s: _TX.update(g, s))(grads, state)
    # Counted once per trace, as every rule's densification, the refused one too.
    assert qt.fallback_counts() == {key: 3}


def test_a_marked_gradient_for_a_projected_leaf_is_not_counted():
    params = {"w": jnp.ones((6, 10)) / 10}
    x = jnp.ones((3, 6))
    state = _TX.init(params)
    grads = qt.grad(lambda p: _linear_loss(qto.mark(p, state), x))(params)
    with qt.fallback("error"):
        updates, _ = jax.jit(_TX.update)(grads, state)
    assert isinstance(updates["w"], qt.LowRank)
    assert qt.fallback_counts() == {}


@projects_dense_gradients
def test_refreshes_on_schedule_with_one_compiled_step():
    tx = qto.projected(optax.scale_by_adam(), rank=RANK, refresh_every=3)
    params = {"dense": jnp.zeros((5, 8)), "marked": jnp.zeros((9, 4))}
    state = tx.init(params)
    rng = np.random.default_rng(2)
    traces = 0

    def step(grads, state):
        nonlocal traces
        traces += 1
        return tx.update(grads, state)

    step = jax.jit(step)
    seen, refreshes = [], []
    for _ in range(7):
        shown = qto.projectors(state)
        refresh = bool(shown["marked"].refresh)
        assert bool(shown["dense"].refresh) == refresh
        refreshes.append(refresh)
        # The loss computes a fresh projector on refresh steps, else reuses it.
        marked_projector = (
            _orthonormal(rng, 4, RANK)
            if refresh
            else np.asarray(shown["marked"].matrix)
        )
        g = rng.standard_normal((9, 4)).astype(np.float32)
        grads = {
            "dense": jnp.asarray(rng.standard_normal((5, 8)), jnp.float32),
            "marked": _marked(g, marked_projector),
        }
        _, state = step(grads, state)
        seen.append(jax.tree.map(np.asarray, state.projector))
        assert_close(state.projector["marked"], marked_projector)
    assert refreshes == [True, False, False, True, False, False, True]
    assert traces == 1
    for t in range(1, 7):
        for name in ("dense", "marked"):
            changed = not np.array_equal(seen[t][name], seen[t - 1][name])
            assert changed == refreshes[t], (name, t)


@projects_dense_gradients
def test_vectors_go_through_base_unprojected():
    tx = qto.projected(optax.scale_by_adam(), rank=RANK)
    params = {"w": jnp.zeros((6, 10)), "b": jnp.zeros(10), "s": jnp.zeros((2, 3))}
    state = tx.init(params)
    assert state.projector["b"] is None and state.projector["s"] is None
    rng = np.random.default_rng(3)
    dense_state = optax.scale_by_adam().init({"b": params["b"], "s": params["s"]})
    step = jax.jit(tx.update)
    for _ in range(3):
        grads = jax.tree.map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params
        )
        updates, state = step(grads, state)
        expected, dense_state = optax.scale_by_adam().update(
            {"b": grads["b"], "s": grads["s"]}, dense_state
        )
        assert_close(updates["b"], expected["b"])
        assert_close(updates["s"], expected["s"])


# ---------------------------------------------------------------------------------------
# Row-sparse leaves


def _lazy_reference(num_rows, dim, steps):
    """Adam on the rows read only: unread rows keep their moments and get no update;
    bias correction uses the global step; a row read twice counts its summed grad."""
    mu = np.zeros((num_rows, dim))
    nu = np.zeros((num_rows, dim))
    out = []
    for t, (indices, rows) in enumerate(steps, start=1):
        g = np.zeros((num_rows, dim))
        np.add.at(g, indices, rows)
        read = np.zeros(num_rows, bool)
        read[indices] = True
        mu[read] = B1 * mu[read] + (1 - B1) * g[read]
        nu[read] = B2 * nu[read] + (1 - B2) * g[read] ** 2
        update = np.zeros((num_rows, dim))
        update[read] = (mu[read] / (1 - B1**t)) / (
            np.sqrt(nu[read] / (1 - B2**t)) + EPS
        )
        out.append((update, mu.copy()))
    return out


@projects_dense_gradients
def test_sparse_rows_update_only_the_rows_read():
    num_rows, dim = 9, 3
    tx = qto.projected(
        optax.scale_by_adam(B1, B2, EPS),
        rank=RANK,
        project={"table": False, "w": True},
    )
    params = {"table": jnp.zeros((num_rows, dim)), "w": jnp.zeros((6, 10))}
    state = tx.init(params)
    rng = np.random.default_rng(4)
    # The last step reads more rows than the table has: every row, some twice.
    index_sets = [[1, 4, 1, 7], [4, 4, 0, 2], [8, 1, 1, 1], [*range(9), 3, 3]]
    steps = [
        (np.array(i), rng.standard_normal((len(i), dim)).astype(np.float32))
        for i in index_sets
    ]
    step = jax.jit(tx.update)
    for (indices, rows), (expected, expected_mu) in zip(
        steps, _lazy_reference(num_rows, dim, steps)
    ):
        grads = {
            "table": qt.SparseRows(indices, rows, num_rows),
            "w": jnp.asarray(rng.standard_normal((6, 10)), jnp.float32),
        }
        updates, state = step(grads, state)
        assert isinstance(updates["table"], qt.SparseRows)
        assert updates["table"].k == min(len(indices), num_rows)
        assert_close(updates["table"], expected)
        assert_close(state.base_state.mu["table"], expected_mu)
    assert int(state.base_state.count) == 4


# ---------------------------------------------------------------------------------------
# What it refuses


def test_compressed_gradients_it_cannot_take_raise():
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, project={"w": True, "t": False}
    )
    state = tx.init({"w": jnp.zeros((6, 10)), "t": jnp.zeros((9, 3))})
    rows = qt.SparseRows(jnp.array([1]), jnp.ones((1, 3)), 9)
    wide = qt.SparseRows(jnp.array([1]), jnp.ones((1, 10)), 6)
    with pytest.raises(TypeError, match="SparseRows gradient for a projected"):
        tx.update({"w": wide, "t": rows}, state)
    with pytest.raises(TypeError, match="Sparse gradient for a projected"):
        tx.update({"w": qt.top_k(jnp.ones((6, 10)), 0.1), "t": rows}, state)
    with pytest.raises(TypeError, match="not the projection"):
        wrong_rank = qt.LowRank(jnp.ones((6, 3)), jnp.ones((10, 3)), "left")
        tx.update({"w": wrong_rank, "t": rows}, state)
    with pytest.raises(TypeError, match="does not project"):
        table = qt.LowRank(jnp.ones((9, 1)), jnp.ones((3, 1)))
        tx.update({"w": jnp.ones((6, 10)), "t": table}, state)
    with pytest.raises(TypeError, match=r"\['w'\]"):
        tx.init({"w": qt.LowRank(jnp.ones((6, 1)), jnp.ones((10, 1)))})


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="rank"):
        qto.projected(optax.scale_by_adam(), rank=0)
    with pytest.raises(TypeError, match="refresh_every"):
        qto.projected(optax.scale_by_adam(), rank=2, refresh_every=1.5)
    with pytest.raises(TypeError, match="base"):
        qto.projected(optax.adam, rank=2)
    with pytest.raises(ValueError, match="cannot be projected"):
        qto.projected(optax.scale_by_adam(), rank=4, project=lambda _: True).init(
            {"b": jnp.zeros(8)}
        )
    with pytest.raises(ValueError, match="holds none"):
        qto.projectors(optax.scale_by_adam().init(jnp.zeros(3)))


def test_projectors_found_inside_a_chain():
    tx = optax.chain(_TX, optax.scale(-0.1))
    state = tx.init({"w": jnp.zeros((6, 10)), "b": jnp.zeros(3)})
    shown = qto.projectors(state)
    assert shown["b"] is None
    assert shown["w"].matrix.shape == (6, RANK)
    assert bool(shown["w"].refresh)


# ---------------------------------------------------------------------------------------
# With the marks: one jitted step, the loss projecting its own gradient


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_marked_training_step_matches_the_formula(shape):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((4, shape[0])), jnp.float32)
    tx = qto.projected(optax.scale_by_adam(B1, B2, EPS), rank=RANK, refresh_every=100)

    def loss(params, projectors, y):
        w = qt.projected_cotangent(params["w"], RANK, projector=projectors["w"])
        return jnp.sum(jnp.tanh(x @ w) * y) + jnp.sum(params["b"] ** 2)

    @jax.jit
    def step(params, state, y):
        grads = qt.grad(loss)(params, qto.projectors(state), y)
        updates, state = tx.update(grads, state)
        return qto.apply_updates(params, updates), state, grads

    params = {
        "w": jnp.asarray(rng.standard_normal(shape), jnp.float32),
        "b": jnp.ones(3),
    }
    state = tx.init(params)
    ys = [
        jnp.asarray(rng.standard_normal((4, shape[1])), jnp.float32) for _ in range(3)
    ]
    dense_grads = []
    for t, y in enumerate(ys):
        dense_grads.append(
            np.asarray(jax.grad(loss)(params, qto.projectors(state), y)["w"])
        )
        before = params["w"]
        params, state, grads = step(params, state, y)
        assert isinstance(grads["w"], qt.LowRank)
        side = grads["w"].left if shape[0] <= shape[1] else grads["w"].right
        assert_close(state.projector["w"], side)
        if t == 0:
            projector = np.asarray(side)
        # The formula with the projector chosen on the first step; jax.grad gives G.
        expected = _reference_updates(dense_grads, projector)[-1]
        assert_close(params["w"] - before, expected, factor=10)
    assert bool(qto.projectors(state)["w"].refresh) is False


def test_a_low_rank_that_is_not_a_projection_is_refused_whatever_its_rank():
    # Told apart by its tag, never by its rank: factored_cotangent's LowRank of the
    # projection's rank would otherwise be read as (projector, small factor).
    x = jnp.asarray(np.random.default_rng(7).standard_normal((RANK, 6)), jnp.float32)
    w = jnp.ones((6, 10))
    factored = qt.grad(lambda w: jnp.sum(jnp.tanh(x @ qt.factored_cotangent(w))))(w)
    assert isinstance(factored, qt.LowRank) and factored.rank == RANK
    assert factored.projector_side is None
    state = _TX.init({"w": w})
    with pytest.raises(TypeError, match="not a projection"):
        _STEP({"w": factored}, state)
    with pytest.raises(TypeError, match="projector on the right"):
        wrong_side = qt.LowRank(jnp.ones((6, RANK)), jnp.ones((10, RANK)), "right")
        _STEP({"w": wrong_side}, state)


def test_rows_of_any_shape():
    tx = qto.projected(optax.scale_by_adam(B1, B2, EPS), rank=RANK)
    state = tx.init({"t": jnp.zeros((5, 2, 2))})
    rng = np.random.default_rng(6)
    steps = [(np.array([3, 1, 3]), rng.standard_normal((3, 4)).astype(np.float32))]
    ((expected, _),) = _lazy_reference(5, 4, steps)
    indices, rows = steps[0]
    grads = {"t": qt.SparseRows(indices, rows.reshape(3, 2, 2), 5)}
    updates, _ = tx.update(grads, state)
    assert_close(updates["t"], expected.reshape(5, 2, 2))
