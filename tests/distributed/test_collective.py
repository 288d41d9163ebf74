"""Compressed all-reduce inside `jax.shard_map`, the optax transformations across
devices, the collectives read from compiled HLO, and the data-parallel example.

The multi-device tests need 4 host CPU devices. JAX fixes its device count when it
starts, so `tests/conftest.py` asks XLA for 8 before it does.
"""

import functools as ft
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import quax
from jax import lax
from jax.sharding import PartitionSpec as P

import quax_tangents as qt
import quax_tangents.optax as qto
from quax_tangents._distributed._collective import orthonormalise
from quax_tangents._distributed._hlo import collectives_in_hlo
from tests.helpers import assert_close
from tests.helpers.collective import (
    AXIS,
    DEVICES,
    on_mesh,
    put,
    quadratic,
    quadratic_grad,
    relative_error,
    run_python,
    run_replicated,
    skip_without_devices,
    split,
)


ROOT = pathlib.Path(__file__).resolve().parents[2]

needs_devices = skip_without_devices()


def test_the_suite_has_eight_host_devices():
    # `tests/conftest.py` asks XLA for them. Without them every multi-device test of
    # the suite would be skipped, not failed: this one fails instead.
    assert len(jax.devices()) >= 8, jax.devices()


# ---------------------------------------------------------------------------------
# all_reduce: every method against the same computation done centrally


_COMPRESSORS = {
    "LowRank": lambda x: qt.low_rank(x, 2),
    "Sparse": lambda x: qt.top_k(x, 7),
    "Quantized": lambda x: qt.quantize(x, bits=8, block_size=16),
    "SignNorm": lambda x: qt.sign_norm(x, block_size=16),
}
# What `GatherSum` returns: the exact sum stays compressed where it has a compressed
# form.
_SUM_TYPES = {
    "LowRank": qt.LowRank,
    "Sparse": qt.Sparse,
    "Quantized": jax.Array,
    "SignNorm": jax.Array,
}


def _per_device_matrices(seed=0, shape=(12, 10)):
    return np.random.default_rng(seed).standard_normal((DEVICES, *shape), np.float32)


def _central_sum(name, xs):
    return sum(_COMPRESSORS[name](x).materialise() for x in xs)


@needs_devices
@pytest.mark.parametrize("name", list(_COMPRESSORS))
def test_gather_sum_equals_compress_then_sum(name):
    xs = _per_device_matrices()
    compressor = _COMPRESSORS[name]
    out_types = []

    def body(x):
        gather = qt.GatherSum()
        total = qt.all_reduce(compressor(x[0]), AXIS, gather)
        mean = qt.all_reduce(compressor(x[0]), AXIS, gather, mean=True)
        out_types.append(isinstance(total, _SUM_TYPES[name]))
        # A replicated value is counted once per device, as `lax.psum` counts it.
        replicated = qt.all_reduce(compressor(jnp.ones((12, 10))), AXIS, gather)
        return tuple(qt.materialise(v) for v in (total, mean, replicated))

    total, mean, replicated = on_mesh(body, P(AXIS), P())(split(xs))
    expected = _central_sum(name, xs)
    assert out_types == [True]
    assert_close(total, expected)
    assert_close(mean, expected / DEVICES)
    assert_close(replicated, DEVICES * compressor(jnp.ones((12, 10))).materialise())


@needs_devices
def test_gather_sum_without_check_vma():
    xs = _per_device_matrices(seed=1)

    def body(x):
        return {
            name: qt.materialise(qt.all_reduce(compressor(x[0]), AXIS, qt.GatherSum()))
            for name, compressor in _COMPRESSORS.items()
        }

    out = on_mesh(body, P(AXIS), P(), check_vma=False)(split(xs))
    for name in _COMPRESSORS:
        assert_close(out[name], _central_sum(name, xs))


@needs_devices
def test_majority_vote_equals_central_vote():
    xs = _per_device_matrices(seed=2, shape=(5, 7))

    def body(x):
        vote = qt.all_reduce(qt.sign_norm(x[0], 8), AXIS, qt.MajorityVote())
        assert isinstance(vote, qt.SignNorm)
        return vote.materialise()

    out = on_mesh(body, P(AXIS), P())(split(xs))
    values = [qt.sign_norm(x, 8) for x in xs]
    votes = sum(v.signs() for v in values)
    bits = jnp.packbits(votes >= 0, axis=-1, bitorder="little")
    norms = sum(v.norms for v in values)
    expected = qt.SignNorm(bits, norms, event_shape=(5, 7), block_size=8)
    assert_close(out, expected.materialise())


@needs_devices
def test_power_sum_equals_central_power_iteration():
    rng = np.random.default_rng(3)
    lefts = rng.standard_normal((DEVICES, 12, 2), np.float32)
    rights = rng.standard_normal((DEVICES, 10, 2), np.float32)
    method = qt.PowerSum(iters=2, seed=5)

    def body(left, right):
        out = qt.all_reduce(qt.LowRank(left[0], right[0]), AXIS, method)
        assert isinstance(out, qt.LowRank) and out.rank == 2
        return out.materialise()

    out = on_mesh(body, (P(AXIS), P(AXIS)), P())(split(lefts), split(rights))
    total = np.einsum("dmr,dnr->mn", lefts, rights)
    q = jax.random.normal(jax.random.key(5), (10, 2))
    for _ in range(2):
        p = orthonormalise(total @ q)
        q = total.T @ p
    assert relative_error(out, p @ q.T) < 1e-5


@needs_devices
def test_all_reduce_rejects_a_method_for_another_type():
    def body(x):
        return qt.all_reduce(qt.top_k(x[0], 3), AXIS, qt.PowerSum()).materialise()

    with pytest.raises(TypeError, match="PowerSum"):
        on_mesh(body, P(AXIS), P())(split(_per_device_matrices()))


# ---------------------------------------------------------------------------------
# lax.psum on a compressed value inside a quaxified function


def _psum_of_low_rank(rank):
    def body(x):
        return quax.quaxify(lambda v: lax.psum(v, AXIS))(qt.low_rank(x[0], rank))

    return body


def _psum_of_top_k(k):
    def body(x):
        return quax.quaxify(lambda v: lax.psum(v, AXIS))(qt.top_k(x[0], k))

    return body


@needs_devices
def test_lax_psum_under_quax_with_check_vma():
    """A LowRank's type says where its factors vary, so `lax.psum` of it (bound as
    `psum_invariant`) is the exact `all_reduce`: every device's factors side by
    side, under the rank budget. A `Sparse` gathers every device's entries while
    that receives no more than a dense all-reduce. The other types have no rule
    for it: the dense sum, counted, with `all_reduce` named in the fallback's
    message."""
    xs = _per_device_matrices()
    m, n = xs[0].shape
    assert DEVICES * 1 * (m + n) < m * n <= DEVICES * 2 * (m + n)

    qt.reset_fallback_counts()
    out = on_mesh(_psum_of_low_rank(1), P(AXIS), P())(split(xs))
    assert isinstance(out, qt.LowRank) and out.rank == DEVICES
    assert_close(out, sum(qt.materialise(qt.low_rank(x, 1)) for x in xs))
    assert qt.fallback_counts() == {}
    # Over the budget, the dense sum (exact, counted), as for a sum of LowRanks.
    with qt.fallback("silent"):
        out = on_mesh(_psum_of_low_rank(2), P(AXIS), P())(split(xs))
    assert not isinstance(out, qt.LowRank)
    assert_close(out, _central_sum("LowRank", xs))
    assert qt.fallback_counts() == {("psum_invariant", "LowRank"): 1}
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="GatherSum"):
        on_mesh(_psum_of_low_rank(2), P(AXIS), P())(split(xs))
    with qt.rank_budget(qt.Recompress()):
        out = on_mesh(_psum_of_low_rank(2), P(AXIS), P())(split(xs))
    assert isinstance(out, qt.LowRank) and out.rank < DEVICES * 2

    # `k=7`: 4 devices' 7 entries (8 bytes each) against twice the 12 x 10 float32
    # array; `k=60` receives more than that.
    assert DEVICES * 7 * 8 <= 2 * 120 * 4 < DEVICES * 60 * 8
    qt.reset_fallback_counts()
    out = on_mesh(_psum_of_top_k(7), P(AXIS), P())(split(xs))
    assert isinstance(out, qt.Sparse) and out.k == DEVICES * 7
    assert_close(out, sum(qt.materialise(qt.top_k(x, 7)) for x in xs))
    assert qt.fallback_counts() == {}
    with qt.fallback("silent"):
        dense = on_mesh(_psum_of_top_k(60), P(AXIS), P())(split(xs))
    assert not isinstance(dense, qt.Sparse)
    assert_close(dense, sum(qt.materialise(qt.top_k(x, 60)) for x in xs))
    assert qt.fallback_counts() == {("psum_invariant", "Sparse"): 1}
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="cheaper"):
        on_mesh(_psum_of_top_k(60), P(AXIS), P())(split(xs))
    signs = quax.quaxify(lambda v: lax.psum(v, AXIS))
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="all_reduce"):
        on_mesh(lambda x: signs(qt.sign_norm(x[0])), P(AXIS), P())(split(xs))


def _rows_per_device(k, num_rows=16, row_size=3):
    rng = np.random.default_rng(k)
    indices = rng.integers(0, num_rows, (DEVICES, k))
    rows = rng.standard_normal((DEVICES, k, row_size)).astype(np.float32)
    return indices, rows, num_rows


def _psum_of_rows(num_rows):
    def body(indices, rows):
        table = qt.SparseRows.build(indices[0], rows[0], num_rows)
        return quax.quaxify(lambda v: lax.psum(v, AXIS))(table)

    return body


@needs_devices
@pytest.mark.parametrize("k", [2, 8])
def test_lax_psum_of_sparse_rows_gathers_the_rows_while_cheaper(k):
    """The sum JAX inserts for an embedding's gradient in data parallel: every
    device's stored rows side by side while that receives no more than a dense
    all-reduce of the table (here `4 * 2 * (3 * 4 + 4) <= 2 * 16 * 3 * 4`); beyond
    it (`k=8`), the dense sum, exact and counted."""
    indices, rows, num_rows = _rows_per_device(k)
    expected = sum(
        qt.SparseRows(i, r, num_rows).materialise() for i, r in zip(indices, rows)
    )
    body = _psum_of_rows(num_rows)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = on_mesh(body, (P(AXIS), P(AXIS)), P())(split(indices), split(rows))
    assert_close(qt.materialise(out), expected)
    gathered = k == 2
    assert isinstance(out, qt.SparseRows) == gathered
    if gathered:
        assert out.k == DEVICES * k and qt.fallback_counts() == {}
    else:
        assert qt.fallback_counts() == {("psum_invariant", "SparseRows"): 1}
        with qt.fallback("error"), pytest.raises(qt.DensificationError, match="rows"):
            on_mesh(body, (P(AXIS), P(AXIS)), P())(split(indices), split(rows))


@needs_devices
def test_lax_psum_under_quax_densifies_without_check_vma():
    xs = _per_device_matrices()

    def body(x):
        return quax.quaxify(lambda v: lax.psum(v, AXIS))(qt.low_rank(x[0], 2))

    qt.reset_fallback_counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = on_mesh(body, P(AXIS), P(), check_vma=False)(split(xs))
    assert any(issubclass(w.category, qt.DensificationWarning) for w in caught)
    assert_close(out, _central_sum("LowRank", xs))


# ---------------------------------------------------------------------------------
# The optax transformations across devices


def _params():
    return {
        "w": jnp.zeros((30, 20)),
        "b": jnp.zeros(20),
        "kernel": jnp.zeros((3, 3, 4, 8)),
    }


def _random_grads(seed, leading=()):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: rng.standard_normal(leading + p.shape).astype(np.float32),
        _params(),
    )


@needs_devices
@pytest.mark.parametrize("iters", [1, 2])
def test_powersgd_across_devices_equals_central_powersgd(iters):
    """Three steps, each a separate call (so the state leaves and re-enters
    `shard_map` through `partition_specs`), the first dense (`start_iter=1`). The
    devices send all `P`s (and all `Q`s) in one all-reduce; the central run has
    nothing to send, so this checks the batching against per-matrix arithmetic."""
    params = _params()
    tx = qto.powersgd(2, iters=iters, start_iter=1, axis_name=AXIS, seed=1)
    central = qto.powersgd(2, iters=iters, start_iter=1, seed=1)
    specs = qto.partition_specs(jax.eval_shape(tx.init, params), AXIS)
    state = on_mesh(tx.init, P(), specs)(params)
    assert state.error["w"].shape == (DEVICES * 30, 20)

    def step(grads, state):
        grads = jax.tree.map(lambda g: g[0], grads)
        return tx.update(grads, state)

    step = on_mesh(step, (P(AXIS), specs), (P(), specs))
    central_state = central.init(params)
    central_update = jax.jit(central.update)
    for t in range(3):
        grads = _random_grads(t, (DEVICES,))
        updates, state = step(jax.tree.map(split, grads), state)
        mean = jax.tree.map(lambda g: g.mean(0), grads)
        expected, central_state = central_update(mean, central_state)
        for name in params:
            assert_close(updates[name], expected[name])
    assert_close(state.q["w"], central_state.q["w"])
    # Each device's error is its own residual; their mean is the central error.
    assert_close(
        state.error["w"].reshape(DEVICES, 30, 20).mean(0), central_state.error["w"]
    )


@needs_devices
def test_powersgd_int8_error_state_crosses_shard_map():
    """Each device keeps its own int8 error (`P(axis)` on codes and scales); the
    updates stay within the error's rounding of those of a float32 error."""
    params = _params()
    tx8 = qto.powersgd(2, error_dtype="int8", axis_name=AXIS, seed=1)
    tx = qto.powersgd(2, axis_name=AXIS, seed=1)
    specs8 = qto.partition_specs(jax.eval_shape(tx8.init, params), AXIS)
    specs = qto.partition_specs(jax.eval_shape(tx.init, params), AXIS)
    state8 = on_mesh(tx8.init, P(), specs8)(params)
    state = on_mesh(tx.init, P(), specs)(params)
    blocks = state8.error["w"].scales.shape[0] // DEVICES
    assert state8.error["w"].codes.shape == (DEVICES * blocks, 600 // blocks)

    def step(tx):
        def body(grads, state):
            return tx.update(jax.tree.map(lambda g: g[0], grads), state)

        return body

    step8 = on_mesh(step(tx8), (P(AXIS), specs8), (P(), specs8))
    step32 = on_mesh(step(tx), (P(AXIS), specs), (P(), specs))
    for t in range(3):
        grads = jax.tree.map(split, _random_grads(t, (DEVICES,)))
        updates8, state8 = step8(grads, state8)
        updates, state = step32(grads, state)
        scale = float(np.abs(updates["w"]).max())
        # The first step carries no error; later ones differ by the error's rounding.
        factor = 1.0 if t == 0 else 1e3
        assert_close(updates8["w"], updates["w"], scale=scale, factor=factor)


def _powersgd_least_squares(error_dtype, a, b, shape, *, iid):
    """600 steps of rank-1 PowerSGD and SGD (learning rate 0.1) on 4 devices, in a
    `scan` inside `shard_map` (so the state keeps one type). With `iid` each device
    draws 32 rows of the pooled data every step, as a data-parallel batch does;
    otherwise each device keeps its own rows `a[i], b[i]` (full batch)."""
    tx = optax.chain(
        qto.powersgd(1, error_dtype=error_dtype, axis_name=AXIS), optax.sgd(0.1)
    )

    def body(a, b):
        me = lax.axis_index(AXIS)

        def step(carry, t):
            w, state = carry
            if iid:
                key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), t), me)
                rows = jax.random.choice(key, a.shape[0], (32,), replace=False)
                grads = quadratic_grad(w, a[rows], b[rows])
            else:
                grads = quadratic_grad(w, a[0], b[0])
            updates, state = tx.update(grads, state, w)
            return (w + updates, state), None

        w = jnp.zeros(shape)
        (w, _), _ = lax.scan(step, (w, tx.init(w)), jnp.arange(600))
        return w

    if iid:
        pooled = (a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))
        return on_mesh(body, (P(), P()), P())(*(put(x, P()) for x in pooled))
    return on_mesh(body, (P(AXIS), P(AXIS)), P())(split(a), split(b))


@needs_devices
def test_powersgd_int8_error_converges_as_float32_on_iid_batches():
    """With batches drawn alike on every device, an int8 error converges as a float32
    one does. With a fixed, different shard per device, each device's error grows with
    the step count (its gradient differs from the mean at the optimum, and only the
    mean of the errors cancels), and the int8 rounding of it, which is dropped, stalls
    convergence: the limitation `docs/training.md` states."""
    a, b, solution = quadratic()
    found = {
        (dtype, iid): relative_error(
            _powersgd_least_squares(dtype, a, b, solution.shape, iid=iid), solution
        )
        for dtype in (None, "int8")
        for iid in (True, False)
    }
    assert found[None, True] < 0.02 and found["int8", True] < 1.1 * found[None, True]
    assert found[None, False] < 1e-5 and found["int8", False] > 1e-2, found


def _run_stream(tx, grads, params):
    """`tx` applied to a stream of per-device gradients `(steps, devices, ...)` in a
    scan on the mesh: returns the updates and the final per-device state."""
    specs = qto.partition_specs(jax.eval_shape(tx.init, params), AXIS)

    def body(grads):
        state = tx.init(params)

        def step(state, g):
            updates, state = tx.update(g[0], state)
            return state, updates

        state, updates = lax.scan(step, state, grads)
        return updates, state

    spec = P(None, AXIS)
    return on_mesh(body, spec, (P(), specs))(put(grads, spec))


@needs_devices
@pytest.mark.parametrize(
    "name, compressor",
    [
        ("top-k", lambda g: qt.top_k(g, 0.1)),
        ("sign", qt.sign_norm),
    ],
    ids=["top-k", "sign"],
)
def test_error_feedback_tracks_the_gradients(name, compressor):
    steps, shape = 60, (16, 12)
    rng = np.random.default_rng(7)
    # A drift shared by the devices plus noise: the running sum grows with t.
    drift = rng.standard_normal(shape).astype(np.float32)
    grads = drift + rng.standard_normal((steps, DEVICES, *shape)).astype(np.float32)
    params = jnp.zeros(shape)
    tx = qto.compress_updates(
        compressor,
        error_feedback=qto.ErrorFeedback(),
        axis_name=AXIS,
        method=qt.GatherSum(),
    )
    updates, state = _run_stream(tx, grads, params)
    applied = np.cumsum(np.asarray(updates), axis=0)
    true = np.cumsum(grads.mean(1), axis=0)
    errors = np.asarray(state.error).reshape(DEVICES, *shape)
    # Exactly: the applied sum is the true sum minus the devices' mean error.
    assert_close(applied[-1], true[-1] - errors.mean(0), scale=np.abs(true).max())
    # The error stays bounded: far below the running sum, which grows like t.
    gap = np.linalg.norm(applied - true, axis=(1, 2))
    assert gap.max() < 0.1 * np.linalg.norm(true[-1])
    assert gap[steps // 2 :].max() < 2 * gap[: steps // 2].max()


@needs_devices
def test_ef21_estimates_converge_to_a_fixed_gradient():
    shape = (16, 12)
    grads = np.random.default_rng(8).standard_normal((DEVICES, *shape), np.float32)
    stream = np.broadcast_to(grads, (80, DEVICES, *shape)).copy()
    tx = qto.compress_updates(
        lambda g: qt.top_k(g, 0.1), error_feedback=qto.EF21(), axis_name=AXIS
    )
    updates, state = _run_stream(tx, stream, jnp.zeros(shape))
    assert relative_error(updates[-1], grads.mean(0)) < 1e-5
    assert_close(state.aggregate, grads.mean(0))


# ---------------------------------------------------------------------------------
# Convergence on a convex quadratic


def _majority_vote_sgd(learning_rate):
    """signSGD with error feedback and a majority vote, as an optax transformation."""

    def init(params):
        return qt.device_varying(jnp.zeros_like(params), AXIS)

    def update(g, error, params=None):
        v = g + error
        c = qt.sign_norm(v)
        vote = qt.all_reduce(c, AXIS, qt.MajorityVote(), mean=True).materialise()
        return -learning_rate * vote, v - c.materialise()

    return optax.GradientTransformation(init, update)


# Relative distance to the solution after 600 steps of SGD (learning rate 0.1) on
# `tests.helpers.collective.quadratic`. Methods whose compression error cancels out
# converge to rounding: PowerSGD (its P and Q are shared, so the devices' errors
# act as one), EF21 and dense. Per-device error feedback with heterogeneous data
# stalls at a distance proportional to the learning rate; int8 without feedback at
# its rounding error; the majority vote is biased when the devices disagree.
_CONVERGENCE = {
    "dense": (
        lambda: optax.stateless(lambda u, p: qt.all_reduce(u, AXIS, mean=True)),
        1e-5,
    ),
    "powersgd-r1": (lambda: qto.powersgd(1, axis_name=AXIS), 1e-5),
    "powersgd-r2-cold-start10": (
        lambda: qto.powersgd(2, warm_start=False, start_iter=10, axis_name=AXIS),
        1e-5,
    ),
    "top-k-ef21": (
        lambda: qto.compress_updates(
            lambda g: qt.top_k(g, 0.1), error_feedback=qto.EF21(), axis_name=AXIS
        ),
        1e-5,
    ),
    "int8": (
        lambda: qto.compress_updates(
            ft.partial(qt.quantize, bits=8, block_size=32),
            error_feedback=None,
            axis_name=AXIS,
        ),
        1e-3,
    ),
    "top-k-ef": (
        lambda: qto.compress_updates(lambda g: qt.top_k(g, 0.1), axis_name=AXIS),
        2e-2,
    ),
    "sign-ef": (lambda: qto.compress_updates(qt.sign_norm, axis_name=AXIS), 2e-2),
    "low-rank-gather-ef": (
        lambda: qto.compress_updates(
            lambda g: qt.low_rank(g, 1), min_compression_rate=1.0, axis_name=AXIS
        ),
        2e-2,
    ),
}


@needs_devices
def test_every_method_converges_on_a_convex_quadratic():
    a, b, solution = quadratic()
    steps = 600

    def run(tx, a, b):
        return run_replicated(tx, quadratic_grad, a, b, solution.shape, steps)

    def body(a, b):
        out = {
            name: run(optax.chain(make(), optax.sgd(0.1)), a[0], b[0])
            for name, (make, _) in _CONVERGENCE.items()
        }
        out["majority-vote-ef"] = run(_majority_vote_sgd(0.1), a[0], b[0])
        return out

    found = on_mesh(body, (P(AXIS), P(AXIS)), P())(split(a), split(b))
    tolerances = {name: tol for name, (_, tol) in _CONVERGENCE.items()}
    tolerances["majority-vote-ef"] = 0.15
    errors = {name: relative_error(w, solution) for name, w in found.items()}
    failed = {n: e for n, e in errors.items() if not e < tolerances[n]}
    assert not failed, (failed, errors)


# ---------------------------------------------------------------------------------
# What the compiled step sends


def _mlp_params():
    return {
        "w1": jnp.zeros((32, 24)),
        "b1": jnp.zeros(24),
        "w2": jnp.zeros((24, 16)),
    }


def _mlp_loss(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.sum((h @ params["w2"]) ** 2)


_STEP_TRANSFORMS = {
    "powersgd": lambda: qto.powersgd(2, axis_name=AXIS),
    "top-k": lambda: qto.compress_updates(lambda g: qt.top_k(g, 0.05), axis_name=AXIS),
}


@ft.cache
def _step_collectives(name: str, per_device_grads: bool):
    """The collectives of one training step of a small MLP with `name`'s transform,
    with or without `device_varying` before the gradient (compiled once per pair)."""
    tx = _STEP_TRANSFORMS[name]()
    params = _mlp_params()
    specs = qto.partition_specs(jax.eval_shape(tx.init, params), AXIS)
    state = on_mesh(tx.init, P(), specs)(params)

    def step(params, state, x):
        replica = qt.device_varying(params, AXIS) if per_device_grads else params
        grads = jax.grad(_mlp_loss)(replica, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x = split(np.ones((DEVICES * 4, 32), np.float32))
    step = on_mesh(step, (P(), specs, P(AXIS)), (P(), specs))
    return qt.hlo.collectives(step, params, state, x)


_WEIGHT_SHAPES = {"f32[32,24]", "f32[24,32]", "f32[24,16]", "f32[16,24]"}


@needs_devices
@pytest.mark.parametrize("name", list(_STEP_TRANSFORMS))
def test_compressed_step_has_no_weight_shaped_all_reduce(name):
    found = _step_collectives(name, per_device_grads=True)
    reduced = {s for c in found if c.kind == "all-reduce" for s in c.operand_shapes}
    assert not reduced & _WEIGHT_SHAPES, found
    # PowerSGD sends the Ps of both matrices in one all-reduce, their Qs in another.
    assert reduced <= {"f32[24]", "f32[112]", "f32[80]"}, found


@needs_devices
def test_replicated_weight_gradient_is_all_reduced_densely_without_device_varying():
    """The reason for `device_varying`: JAX's AD all-reduces the gradient of a
    replicated weight before the transformation sees it."""
    found = _step_collectives("powersgd", per_device_grads=False)
    reduced = {s for c in found if c.kind == "all-reduce" for s in c.operand_shapes}
    assert reduced & _WEIGHT_SHAPES, found


@needs_devices
def test_powersgd_round_bytes_are_analytic():
    found = _step_collectives("powersgd", per_device_grads=True)
    sent = sum(c.operand_bytes for c in found)
    rank, itemsize = 2, 4
    matrices = rank * ((32 + 24) + (24 + 16)) * itemsize
    assert sent == matrices + 24 * itemsize
    assert all(c.kind == "all-reduce" for c in found)


@needs_devices
def test_collectives_of_a_lowered_program_show_what_it_asks_to_send():
    """bfloat16 PowerSGD rounds send `r (m + n)` bfloat16 elements per matrix and
    round; XLA's CPU compiler may run them in float32, which the compiled HLO shows."""
    rank, m, n = 4, 64, 32

    def body(left, right):
        out = qt.all_reduce(qt.LowRank(left[0], right[0]), AXIS, qt.PowerSum(iters=2))
        return out.left, out.right

    left = split(np.ones((DEVICES, m, rank), jnp.bfloat16))
    right = split(np.ones((DEVICES, n, rank), jnp.bfloat16))
    lowered = on_mesh(body, P(AXIS), P()).lower(left, right)
    program = qt.hlo.collectives(lowered)
    compiled = qt.hlo.collectives(lowered.compile())
    assert {s for c in program for s in c.operand_shapes} == {
        f"bf16[{m},{rank}]",
        f"bf16[{n},{rank}]",
    }
    assert sum(c.operand_bytes for c in program) == 2 * rank * (m + n) * 2
    assert sum(c.operand_bytes for c in compiled) in (
        2 * rank * (m + n) * 2,
        2 * rank * (m + n) * 4,
    )


_HLO = """\
HloModule jit_step, num_partitions=4

%region (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[64,4], p1: s8[1,8,16]) -> f32[64,4] {
  %p0 = f32[64,4]{1,0} parameter(0), sharding={replicated}
  %p1 = s8[1,8,16]{2,1,0} parameter(1)
  %fusion.1 = f32[24]{0} fusion(%p0), kind=kLoop, calls=%region
  %all-reduce = (f32[24]{0}, f32[64,4]{1,0}) all-reduce(%fusion.1, /*index=1*/%p0), channel_id=1, to_apply=%region
  %ag = s8[4,8,16]{2,1,0} all-gather(s8[1,8,16]{2,1,0} %p1), dimensions={0}
  %ars = f32[64,4]{1,0} all-reduce-start(%p0), to_apply=%region
  %ard = f32[64,4]{1,0} all-reduce-done(%ars)
  ROOT %out = f32[64,4]{1,0} add(%ard, %p0)
}
"""


def test_collectives_in_hlo_reads_kinds_and_operand_bytes():
    found = collectives_in_hlo(_HLO)
    assert [(c.kind, c.operand_shapes, c.operand_bytes) for c in found] == [
        ("all-reduce", ("f32[24]", "f32[64,4]"), 96 + 1024),
        ("all-gather", ("s8[1,8,16]",), 128),
        ("all-reduce", ("f32[64,4]",), 1024),
    ]


_LOOPED_HLO = """\
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]) parameter(0)
  %y = f32[8]{0} get-tuple-element(%q), index=1
  %ar = f32[8]{0} all-reduce(%y), replica_groups={}, to_apply=%add
  ROOT %t2 = (s32[], f32[8]) tuple(%i, %ar)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ag = f32[64]{0} all-gather(%x), dimensions={0}
  %w2 = (s32[], f32[8]) while(%p), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t = (s32[], f32[8]) tuple(%i, %x)
}

%unknown (u: (s32[], f32[8])) -> (s32[], f32[8]) {
  %u = (s32[], f32[8]) parameter(0)
  %z = f32[8]{0} get-tuple-element(%u), index=1
  %cp = f32[8]{0} collective-permute(%z), source_target_pairs={{0,1}}
  ROOT %t3 = (s32[], f32[8]) tuple(%i, %cp)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %once = f32[8]{0} all-reduce(%a), replica_groups={}, to_apply=%add
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"24"}}
  %again = (s32[], f32[8]) while(%t0), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"2"}}
  %w3 = (s32[], f32[8]) while(%t0), condition=%cond, body=%unknown
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_collectives_in_loops_count_once_per_iteration():
    found = {c.name: c for c in collectives_in_hlo(_LOOPED_HLO)}
    # `inner` runs 3 times per iteration of `body` (24 of them) and twice more from
    # the entry; `unknown`'s loop has no known trip count.
    assert {name: c.count for name, c in found.items()} == {
        "ar": 24 * 3 + 2,
        "ag": 24,
        "once": 1,
        "cp": None,
    }
    n = 8
    assert qt.hlo.received_bytes(found["once"], n) == 2 * (n - 1) / n * 32
    assert qt.hlo.received_bytes(found["ag"], n) == 24 * (n - 1) * 32
    assert qt.hlo.received_bytes(found["ar"], n) == pytest.approx(
        74 * 2 * (n - 1) / n * 32
    )
    assert qt.hlo.received_bytes(found["ar"], n, per="run") == 2 * (n - 1) / n * 32
    with pytest.raises(ValueError, match="unknown_trips"):
        qt.hlo.received_bytes(found["cp"], n)
    assert qt.hlo.received_bytes(found["cp"], n, per="run") == 32
    # A loop whose trip count XLA does not know counts as `unknown_trips` trips.
    bounded = {
        c.name: c.count for c in collectives_in_hlo(_LOOPED_HLO, unknown_trips=1)
    }
    assert bounded == {"ar": 24 * 3 + 2, "ag": 24, "once": 1, "cp": 1}
    twice = {c.name: c.count for c in collectives_in_hlo(_LOOPED_HLO, unknown_trips=2)}
    assert twice["cp"] == 2


_BRANCHED_HLO = """\
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%keep (k: f32[8]) -> f32[8] {
  %k = f32[8]{0} parameter(0)
  ROOT %kept = f32[8]{0} all-reduce(%k), replica_groups={}, to_apply=%add
}

%refresh (r: f32[8]) -> f32[8] {
  %r = f32[8]{0} parameter(0)
  %first = f32[8]{0} all-reduce(%r), replica_groups={}, to_apply=%add
  ROOT %second = f32[8]{0} all-reduce(%first), replica_groups={}, to_apply=%add
}

%chosen (c: f32[8]) -> f32[8] {
  %c = f32[8]{0} parameter(0)
  ROOT %picked = f32[8]{0} all-gather(%c), dimensions={0}
}

ENTRY %main (x: f32[8], i: s32[], p: pred[]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %i = s32[] parameter(1)
  %p = pred[] parameter(2)
  %y = f32[8]{0} conditional(%i, %x, %x), branch_computations={%keep, %refresh}
  ROOT %z = f32[8]{0} conditional(%p, %y, %y), true_computation=%chosen, false_computation=%keep
}
"""


@pytest.mark.parametrize("branch", [None, 0, 1])
def test_branch_counts_one_branch_of_every_conditional(branch):
    counts = {c.name: c.count for c in collectives_in_hlo(_BRANCHED_HLO, branch=branch)}
    # `%keep` is branch 0 of both conditionals, so it is called from two sites.
    expected = {
        None: {"kept": 2, "first": 1, "second": 1, "picked": 1},
        0: {"kept": 2, "first": 0, "second": 0, "picked": 0},
        1: {"kept": 0, "first": 1, "second": 1, "picked": 1},
    }[branch]
    assert counts == expected
    with pytest.raises(ValueError, match="branch"):
        qt.hlo.collectives(jax.jit(lambda x: x).lower(1.0).compile(), branch=-1)


# The form of a TPU compile's asynchronous all-gather (abridged from a compiled FSDP
# step): one collective run as a chain of fusions, its start, a fusion that overlaps
# it with other work, and its end, each holding a copy of the instruction under the
# chain's `chain_id` and the collective's `channel_id`. Two more all-gathers share a
# `channel_id` but no chain, as XLA leaves some distinct collectives: both run.
_ASYNC_CHAIN_HLO = """\
HloModule jit_step, num_partitions=8

%fused_start (param_0.1: bf16[1,256,64]) -> (bf16[1,256,64], bf16[1,2048,64], u32[]) {
  %param_0.1 = bf16[1,256,64]{1,2,0} parameter(0)
  %all-gather.1 = bf16[1,2048,64]{1,2,0} all-gather(%param_0.1), channel_id=83, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="1"}
  ROOT %custom-call.1 = (bf16[1,256,64]{1,2,0}, bf16[1,2048,64]{1,2,0}, u32[]) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.2 (param_0.2: bf16[1,256,64], param_1.2: f32[8]) -> (f32[8], bf16[1,256,64]) {
  %param_1.2 = f32[8]{0} parameter(1)
  %exp.2 = f32[8]{0} exponential(%param_1.2)
  %param_0.2 = bf16[1,256,64]{1,2,0} parameter(0)
  %all-gather.2 = bf16[1,2048,64]{1,2,0} all-gather(%param_0.2), channel_id=83, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="1"}
  ROOT %tuple.2 = (f32[8]{0}, bf16[1,256,64]{1,2,0}) tuple(%exp.2, %param_0.2)
}

%fused_done (param_0.3: bf16[1,256,64]) -> bf16[1,2048,64] {
  %param_0.3 = bf16[1,256,64]{1,2,0} parameter(0)
  %all-gather.3 = bf16[1,2048,64]{1,2,0} all-gather(%param_0.3), channel_id=83, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="1"}
  ROOT %custom-call.3 = bf16[1,2048,64]{1,2,0} custom-call(%param_0.3, %all-gather.3), custom_call_target="AsyncCollectiveDone"
}

%body (p: (s32[], bf16[1,256,64], f32[8])) -> (s32[], bf16[1,256,64], f32[8]) {
  %p = (s32[], bf16[1,256,64], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[1,256,64]{1,2,0} get-tuple-element(%p), index=1
  %x = f32[8]{0} get-tuple-element(%p), index=2
  %start = (bf16[1,256,64]{1,2,0}, bf16[1,2048,64]{1,2,0}, u32[]) fusion(%w), kind=kCustom, calls=%fused_start
  %overlap = (f32[8]{0}, bf16[1,256,64]{1,2,0}) fusion(%w, %x), kind=kCustom, calls=%async_collective_fusion.2
  %done = bf16[1,2048,64]{1,2,0} fusion(%w), kind=kCustom, calls=%fused_done
  %other = bf16[1,2048,64]{1,2,0} all-gather(%w), channel_id=84, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={1}, use_global_device_ids=true
  %another = bf16[1,2048,64]{1,2,0} all-gather(%w), channel_id=84, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={1}, use_global_device_ids=true
  ROOT %t = (s32[], bf16[1,256,64], f32[8]) tuple(%i, %w, %x)
}

ENTRY %main (a: (s32[], bf16[1,256,64], f32[8])) -> (s32[], bf16[1,256,64], f32[8]) {
  %a = (s32[], bf16[1,256,64], f32[8]) parameter(0)
  ROOT %loop = (s32[], bf16[1,256,64], f32[8]) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"24"}}
}
"""


def test_an_asynchronous_collective_chain_counts_once():
    found = collectives_in_hlo(_ASYNC_CHAIN_HLO)
    assert [(c.name, c.operand_shapes, c.count) for c in found] == [
        ("all-gather.1", ("bf16[1,256,64]",), 24),
        ("other", ("bf16[1,256,64]",), 24),
        ("another", ("bf16[1,256,64]",), 24),
    ]
    shard = 256 * 64 * 2
    assert sum(qt.hlo.received_bytes(c, 8) for c in found) == 3 * 24 * 7 * shard


@needs_devices
def test_compiled_scan_counts_its_psum_per_iteration():
    length, width = 5, 16

    def body(xs):
        def step(carry, _):
            return carry + lax.psum(carry, AXIS), None

        return lax.scan(step, xs, None, length=length)[0]

    step = on_mesh(body, P(AXIS), P(AXIS))
    xs = split(np.ones((DEVICES, width), np.float32))
    compiled = [c for c in qt.hlo.collectives(step, xs) if c.kind == "all-reduce"]
    assert [(c.operand_bytes, c.count) for c in compiled] == [(4 * width, length)]
    per_call = sum(qt.hlo.received_bytes(c, DEVICES) for c in compiled)
    assert per_call == pytest.approx(length * 2 * (DEVICES - 1) / DEVICES * 4 * width)
    # Read before XLA's passes, which annotate trip counts, the scan's count is the
    # one its counter shows, as it is in a TPU compile (which annotates none).
    lowered = qt.hlo.collectives(step.lower(xs))
    assert [c.count for c in lowered if c.kind == "all-reduce"] == [length]
    with pytest.raises(ValueError, match="unknown_trips"):
        qt.hlo.collectives(step.lower(xs), unknown_trips=-1)


def _strip_trip_counts(hlo: str) -> str:
    return re.sub(r', backend_config=\{"known_trip_count":\{"n":"\d+"\}[^\n]*', "", hlo)


@needs_devices
@pytest.mark.parametrize("unroll", [1, 2])
def test_trip_counts_from_loop_counters_match_xlas(unroll):
    # The counts read from the loops' counters, with XLA:CPU's annotations taken
    # out of the text (a TPU compile has none), equal the annotated ones: nested
    # scans over layers and microbatches, one unrolled (a stride of 2).
    def body(xs):
        def layer(carry, _):
            return carry + lax.psum(carry, AXIS), None

        def microbatch(carry, _):
            return lax.scan(layer, carry, None, length=3, unroll=unroll)[0], None

        return lax.scan(microbatch, xs, None, length=4)[0]

    step = on_mesh(body, P(AXIS), P(AXIS))
    xs = split(np.ones((DEVICES, 8), np.float32))
    hlo = step.lower(xs).compile().as_text()
    assert "known_trip_count" in hlo
    annotated = [c.count for c in collectives_in_hlo(hlo)]
    assert annotated and all(count is not None for count in annotated)
    assert [c.count for c in collectives_in_hlo(_strip_trip_counts(hlo))] == annotated


@needs_devices
def test_a_while_loop_on_a_traced_condition_has_no_count():
    def body(x):
        def cond(state):
            return state[1] < 1e3

        def grow(state):
            y, total = state
            y = lax.psum(y, AXIS) / 2
            return y, total + jnp.sum(y)

        start = lax.psum(x, AXIS)  # invariant over the axis, as the loop's carry is
        return lax.while_loop(cond, grow, (start, jnp.zeros([])))[1]

    step = on_mesh(body, P(AXIS), P())
    xs = split(np.ones((DEVICES, 8), np.float32))
    # The psum before the loop runs once; the one in it an unknown number of times.
    counts = sorted(
        (c.count is None, c.count)
        for c in qt.hlo.collectives(step, xs)
        if c.kind == "all-reduce"
    )
    assert counts == [(False, 1), (True, None)]
    inside = [c for c in qt.hlo.collectives(step, xs) if c.count is None]
    with pytest.raises(ValueError, match="trip count"):
        qt.hlo.received_bytes(inside[0], DEVICES)
    bounded = qt.hlo.collectives(step, xs, unknown_trips=7)
    assert sorted(c.count for c in bounded if c.kind == "all-reduce") == [1, 7]


# ---------------------------------------------------------------------------------
# The example


def test_data_parallel_example_quick(tmp_path):
    pytest.importorskip("sklearn", reason="the examples need the `examples` extra")
    out = tmp_path / "dp.md"
    methods = "dense,powersgd-r2,top-k-1%-ef"
    result = run_python(
        [
            str(ROOT / "examples" / "data_parallel.py"),
            "--quick",
            "--no-progress",
            "--methods",
            methods,
            "--out",
            str(out),
        ]
    )
    text = out.read_text()
    assert out.with_suffix(".png").stat().st_size > 0
    rows = {
        line.split("|")[1].strip(): line
        for line in text.splitlines()
        if line.startswith("|") and "%" in line
    }
    assert set(methods.split(",")) <= set(rows), text
    assert "all-gather" in rows["top-k-1%-ef"] and "all-gather" not in rows["dense"]
    assert "test accuracy" in result.stdout
