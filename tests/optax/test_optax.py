"""The optax transformations on one device: which leaves they compress, error
feedback, PowerSGD's arithmetic, and states that `jit` and `scan` accept.

Their behaviour across devices is in `tests/distributed/test_collective.py`.
"""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import quax_tangents as qt
import quax_tangents.optax as qto
from quax_tangents._distributed._collective import orthonormalise
from tests.helpers import assert_close


def _params():
    return {
        "w": jnp.zeros((30, 20)),
        "b": jnp.zeros(20),
        "small": jnp.zeros((2, 3)),
        "kernel": jnp.zeros((3, 3, 4, 8)),
    }


def _grads(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), _params()
    )


def _top_k(g):
    return qt.top_k(g, 0.1)


# ---------------------------------------------------------------------------------
# Which leaves are compressed


def test_compress_skips_vectors_and_leaves_that_save_too_little():
    tx = qto.compress_updates(_top_k)
    state = tx.init(_params())
    # (2, 3): k=1 stores 8 bytes of 24, a rate of 3; with the default 2.0 it is kept.
    assert {k for k, v in state.error.items() if v is not None} == {
        "w",
        "small",
        "kernel",
    }
    strict = qto.compress_updates(_top_k, min_compression_rate=4.0)
    assert strict.init(_params()).error["small"] is None
    grads = _grads()
    updates, _ = jax.jit(strict.update)(grads, strict.init(_params()))
    assert_close(updates["b"], grads["b"])
    assert_close(updates["small"], grads["small"])
    assert_close(updates["w"], _top_k(grads["w"]).materialise())


def test_compress_skips_leaves_the_compressor_rejects():
    # Rank 4 does not fit a (2, 3) matrix: `low_rank` raises, so the leaf is skipped.
    tx = qto.compress_updates(lambda g: qt.low_rank(g, 4), min_compression_rate=1.0)
    state = tx.init(_params())
    assert state.error["small"] is None and state.error["w"] is not None


@pytest.mark.parametrize(
    "filter",
    [
        {"w": True, "b": True, "small": False, "kernel": False},
        lambda updates: jax.tree.map(lambda leaf: leaf.shape == (30, 20), updates),
    ],
    ids=["pytree", "callable"],
)
def test_compress_filter(filter):
    tx = qto.compress_updates(_top_k, filter=filter)
    state = tx.init(_params())
    assert [k for k, v in state.error.items() if v is not None] == ["w"]
    grads = _grads()
    updates, _ = tx.update(grads, state)
    assert_close(updates["kernel"], grads["kernel"])


def test_compress_filter_may_be_a_prefix():
    params = {"dense": _params(), "frozen": {"w": jnp.zeros((30, 20))}}
    tx = qto.compress_updates(_top_k, filter={"dense": True, "frozen": False})
    state = tx.init(params)
    assert state.error["frozen"]["w"] is None
    assert state.error["dense"]["w"] is not None


def test_powersgd_skips_vectors_small_matrices_and_ranks_too_large():
    tx = qto.powersgd(4)
    state = tx.init(_params())
    chosen = {k for k, v in state.q.items() if v is not None}
    # kernel: a (36, 8) matrix, 288 >= 2 * 4 * 44 = 352 is false: dense.
    assert chosen == {"w"}
    assert qto.powersgd(2).init(_params()).q["kernel"].shape == (8, 2)


# ---------------------------------------------------------------------------------
# Error feedback


def _stream(steps, shape, seed=0):
    rng = np.random.default_rng(seed)
    drift = rng.standard_normal(shape)
    return jnp.asarray(drift + rng.standard_normal((steps, *shape)), jnp.float32)


def _run(tx, grads):
    def step(state, g):
        updates, state = tx.update(g, state)
        return state, updates

    return jax.jit(lambda gs: lax.scan(step, tx.init(gs[0]), gs))(grads)


@pytest.mark.parametrize(
    "compressor",
    [_top_k, qt.sign_norm, ft.partial(qt.quantize, bits=4, block_size=16)],
    ids=["top-k", "sign", "int4"],
)
def test_error_feedback_sum_of_updates_tracks_sum_of_gradients(compressor):
    grads = _stream(60, (16, 12))
    state, updates = _run(qto.compress_updates(compressor), grads)
    applied, true = jnp.cumsum(updates, 0), jnp.cumsum(grads, 0)
    # Exactly: what was applied is what was asked for minus the carried error.
    assert_close(applied[-1], true[-1] - state.error, scale=float(jnp.abs(true).max()))
    gap = jnp.linalg.norm(applied - true, axis=(1, 2))
    assert gap.max() < 0.15 * jnp.linalg.norm(true[-1])
    assert gap[30:].max() < 2 * gap[:30].max()


def test_without_error_feedback_the_update_is_the_compressed_gradient():
    grads = _grads()
    tx = qto.compress_updates(qt.sign_norm, error_feedback=None)
    state = tx.init(_params())
    assert state == qto.CompressState(None, None, None)
    updates, _ = tx.update(grads, state)
    assert_close(updates["w"], qt.sign_norm(grads["w"]).materialise())


def test_ef21_estimate_converges_to_a_fixed_gradient():
    grads = jnp.broadcast_to(_stream(1, (16, 12))[0], (60, 16, 12))
    state, updates = _run(
        qto.compress_updates(_top_k, error_feedback=qto.EF21()), grads
    )
    assert_close(updates[-1], grads[0])
    assert_close(state.estimate, grads[0])
    assert state.aggregate is None


# ---------------------------------------------------------------------------------
# PowerSGD


def test_powersgd_step_is_one_power_iteration_with_error_feedback():
    tx = qto.powersgd(2, seed=3)
    grads = _grads()
    state = tx.init(_params())
    q0 = state.q["w"]
    updates, new_state = jax.jit(tx.update)(grads, state)
    p = orthonormalise(grads["w"] @ q0)
    q = grads["w"].T @ p
    assert_close(updates["w"], p @ q.T)
    assert_close(new_state.q["w"], q)
    assert_close(new_state.error["w"], grads["w"] - p @ q.T)
    # The convolution kernel is viewed as a (36, 8) matrix.
    assert updates["kernel"].shape == (3, 3, 4, 8)
    assert_close(updates["b"], grads["b"])
    assert int(new_state.count) == 1
    # The next step starts from the stored Q and adds the carried error.
    grads2 = _grads(1)
    updates2, _ = jax.jit(tx.update)(grads2, new_state)
    m = grads2["w"] + new_state.error["w"]
    p = orthonormalise(m @ q)
    assert_close(updates2["w"], p @ (m.T @ p).T)


def test_powersgd_without_warm_start_or_error_feedback_keeps_no_state():
    tx = qto.powersgd(2, warm_start=False, error_feedback=False)
    state = tx.init(_params())
    assert state.q is None and state.error is None
    grads = _grads()
    first, state = jax.jit(tx.update)(grads, state)
    second, _ = jax.jit(tx.update)(grads, state)
    # A new Q each step: same gradient, different (equally valid) approximations.
    assert not np.allclose(first["w"], second["w"])


def test_powersgd_start_iter_is_dense_first():
    tx = qto.powersgd(2, start_iter=2)
    grads = _grads()
    state = tx.init(_params())
    update = jax.jit(tx.update)
    for _ in range(2):
        updates, state = update(grads, state)
        assert_close(updates["w"], grads["w"])
        assert not np.any(state.error["w"])
    updates, state = update(grads, state)
    assert jnp.linalg.matrix_rank(updates["w"]) == 2


@pytest.mark.parametrize("rank", [1, 2])
def test_powersgd_low_ranks_are_numerically_safe(rank):
    rng = np.random.default_rng(0)
    u, v = rng.standard_normal((30, 1)), rng.standard_normal((1, 20))
    tx = qto.powersgd(rank)
    update = jax.jit(tx.update)
    # 1e-20: the squares of the entries underflow float32, the entries do not.
    for w in (np.zeros((30, 20)), u @ v, 1e-20 * u @ v):
        grads = {"w": jnp.asarray(w, jnp.float32)}
        updates, state = update(grads, tx.init(grads))
        assert np.all(np.isfinite(updates["w"])) and np.all(np.isfinite(state.q["w"]))
        assert_close(updates["w"], grads["w"], scale=max(np.abs(w).max(), 1e-20))


def test_orthonormalise_zero_and_dependent_columns():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((12, 1))
    p = jnp.asarray(np.concatenate([a, 2 * a, np.zeros((12, 1))], 1), jnp.float32)
    q = orthonormalise(p)
    assert np.all(np.isfinite(q))
    assert_close(jnp.linalg.norm(q[:, 0]), 1.0)
    # The dependent column is rounding noise made orthogonal, or zero; never NaN.
    assert abs(float(q[:, 0] @ q[:, 1])) < 1e-5
    assert not np.any(q[:, 2])
    full = orthonormalise(jnp.asarray(rng.standard_normal((50, 6)), jnp.float32))
    assert_close(full.T @ full, jnp.eye(6))


def test_powersgd_half_precision():
    grads = {"w": jnp.asarray(_grads()["w"], jnp.bfloat16)}
    tx = qto.powersgd(2)
    updates, state = jax.jit(tx.update)(grads, tx.init(grads))
    assert updates["w"].dtype == jnp.bfloat16 and state.error["w"].dtype == jnp.bfloat16
    assert state.q["w"].dtype == jnp.float32


def _layers(depth, width=16):
    return [
        {"w": jnp.zeros((width, width)), "b": jnp.zeros(width)} for _ in range(depth)
    ]


def _layers_loss(params, x):
    for layer in params:
        x = jnp.tanh(x @ layer["w"] + layer.get("b", 0.0))
    return jnp.sum(x**2)


def _lowered_step(tx, params):
    """A data-parallel step with `tx`, lowered (not compiled) on a one-device mesh:
    the lowered program lists the collectives it asks for, whatever the device count."""
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    specs = qto.partition_specs(jax.eval_shape(tx.init, params), "data")
    state = jax.eval_shape(
        jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs), params
    )

    def step(params, state, x):
        grads = jax.grad(_layers_loss)(qt.device_varying(params, "data"), x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.shard_map(
        step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)
    )
    x = jax.ShapeDtypeStruct(
        (4, 16), jnp.float32, sharding=NamedSharding(mesh, P("data"))
    )
    return jax.jit(step).lower(params, state, x)


@pytest.mark.parametrize("iters", [1, 2])
def test_powersgd_asks_for_two_all_reduces_per_round_whatever_the_depth(iters):
    """All `P`s share one all-reduce per round, all `Q`s another, all biases one;
    the bytes are those of one all-reduce per matrix."""
    rank, depth, width = 2, 12, 16
    tx = qto.powersgd(rank, iters=iters, axis_name="data", min_compression_rate=1.0)
    found = qt.hlo.collectives(_lowered_step(tx, _layers(depth, width)))
    assert [c.kind for c in found] == ["all-reduce"] * (2 * iters + 1), found
    factors = iters * depth * rank * (width + width)
    assert sum(c.operand_bytes for c in found) == 4 * (factors + depth * width)


def test_powersgd_batches_per_dtype():
    params = _layers(3) + [{"w": jnp.zeros((16, 16), jnp.bfloat16)}]
    tx = qto.powersgd(2, axis_name="data", min_compression_rate=1.0)
    found = qt.hlo.collectives(_lowered_step(tx, params))
    # P and Q of the float32 matrices, of the bfloat16 matrix, and the biases.
    assert len(found) == 5, found
    assert sum("bf16" in s for c in found for s in c.operand_shapes) == 2, found


def test_powersgd_int8_error_state_is_a_quarter_of_float32():
    params = _params()
    dense = qto.powersgd(2).init(params).error
    int8 = qto.powersgd(2, error_dtype="int8").init(params).error
    assert isinstance(int8["w"], qt.Quantized) and int8["b"] is None
    size = sum(x.nbytes for x in jax.tree.leaves(dense))
    assert sum(x.nbytes for x in jax.tree.leaves(int8)) <= 0.3 * size


def test_powersgd_int8_error_is_the_error_rounded_per_block():
    """The update is unchanged (the error starts at zero); the stored error is the
    float error up to half a step of its block's scale."""
    tx = qto.powersgd(2, seed=3)
    tx8 = qto.powersgd(2, seed=3, error_dtype="int8")
    grads = _grads()
    updates, state = jax.jit(tx.update)(grads, tx.init(_params()))
    updates8, state8 = jax.jit(tx8.update)(grads, tx8.init(_params()))
    for name in ("w", "kernel"):
        assert_close(updates8[name], updates[name])
        stored = state8.error[name]
        exact = np.asarray(state.error[name]).reshape(-1)
        blocks = stored.scales.shape[-1]
        padded = np.pad(exact, (0, blocks * stored.block_size - exact.size))
        bound = np.repeat(
            np.abs(padded.reshape(blocks, -1)).max(1) / 254, stored.block_size
        )
        found = np.asarray(stored.materialise()).reshape(-1)
        assert np.all(np.abs(found - exact) <= bound[: exact.size] * (1 + 1e-5))


# ---------------------------------------------------------------------------------
# Composition with optax, jit and scan


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: qto.powersgd(4),
        lambda: qto.powersgd(4, error_dtype="int8"),
        lambda: qto.compress_updates(_top_k, error_feedback=qto.EF21()),
        lambda: qto.compress_updates(qt.sign_norm),
    ],
    ids=["powersgd", "powersgd-int8-error", "top-k-ef21", "sign-ef"],
)
def test_chained_with_adam_in_a_scan_converges(make_tx):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((64, 30)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((64, 20)), jnp.float32)
    solution = jnp.linalg.lstsq(jnp.concatenate([a, jnp.ones((64, 1))], 1), b)[0]
    tx = optax.chain(make_tx(), optax.adam(optax.cosine_decay_schedule(1e-2, 1500)))
    params = {"w": jnp.zeros((30, 20)), "b": jnp.zeros(20)}

    def loss(p):
        return 0.5 * jnp.mean((a @ p["w"] + p["b"] - b) ** 2)

    def step(carry, _):
        params, state = carry
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return (optax.apply_updates(params, updates), state), None

    (params, state), _ = jax.jit(lambda c: lax.scan(step, c, length=1500))(
        (params, tx.init(params))
    )
    best = float(loss({"w": solution[:30], "b": solution[30]}))
    assert float(loss(params)) - best < 1e-4 * best


# ---------------------------------------------------------------------------------
# Arguments and sharding specs


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="`error_feedback` must be `qto.ErrorFeedback"):
        qto.compress_updates(_top_k, error_feedback="both")
    with pytest.raises(TypeError, match=r"an instance: `qto.EF21\(\)`"):
        qto.compress_updates(_top_k, error_feedback=qto.EF21)
    with pytest.raises(ValueError, match="min_compression_rate"):
        qto.compress_updates(_top_k, min_compression_rate=0)
    with pytest.raises(TypeError, match="compressor"):
        qto.compress_updates(lambda g: g).init(_params())
    with pytest.raises(ValueError, match="rank"):
        qto.powersgd(0)
    with pytest.raises(TypeError, match="iters"):
        qto.powersgd(2, iters=1.5)
    with pytest.raises(ValueError, match="start_iter"):
        qto.powersgd(2, start_iter=-1)
    with pytest.raises(ValueError, match="error_dtype"):
        qto.powersgd(2, error_dtype="float16")
    with pytest.raises(ValueError, match="error_feedback=False"):
        qto.powersgd(2, error_feedback=False, error_dtype="int8")
    with pytest.raises(TypeError, match="filter"):
        qto.compress_updates(
            _top_k, filter={"w": 1, "b": 1, "small": 1, "kernel": 1}
        ).init(_params())


def test_update_with_an_unbound_axis_explains():
    tx = qto.powersgd(2, axis_name="data")
    with pytest.raises(NameError, match="shard_map"):
        tx.update(_grads(), tx.init(_params()))


def test_partition_specs_of_a_chain():
    tx = optax.chain(
        qto.powersgd(2, axis_name="data"),
        qto.compress_updates(_top_k, error_feedback=qto.EF21(), axis_name="data"),
        qto.powersgd(2, error_dtype="int8", axis_name="data"),
        optax.adam(1e-3),
    )
    specs = qto.partition_specs(jax.eval_shape(tx.init, _params()), "data")
    powersgd_specs, compress_specs, int8_specs, adam_specs = specs
    # Each field of a quantised error is per device.
    assert isinstance(int8_specs.error["w"], qt.Quantized)
    assert int8_specs.error["w"].codes == P("data")
    assert int8_specs.error["w"].scales == P("data")
    assert powersgd_specs.count == P()
    assert powersgd_specs.q["w"] == P() and powersgd_specs.q["b"] is None
    assert powersgd_specs.error["w"] == P("data")
    assert compress_specs.estimate["w"] == P("data")
    assert compress_specs.aggregate["w"] == P()
    assert all(s == P() for s in jax.tree.leaves(adam_specs))
