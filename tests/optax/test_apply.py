"""`apply_updates` with compressed updates, its compiled buffers, and `lift`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import assert_close
from tests.helpers.collective import skip_without_devices
from tests.helpers.compilers import converts_slices_in_loops


def _low_rank(rng, m, n, r, dtype=jnp.float32):
    return qt.LowRank(
        jnp.asarray(rng.standard_normal((m, r)), dtype),
        jnp.asarray(rng.standard_normal((n, r)), dtype),
    )


@pytest.mark.parametrize("rank", [3, 70])
def test_apply_updates_equals_dense(rank):
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.standard_normal((80, 90)), jnp.float32),
        "t": jnp.asarray(rng.standard_normal((7, 4)), jnp.float32),
        "b": jnp.ones(4, jnp.bfloat16),
        "none": None,
    }
    updates = {
        "w": _low_rank(rng, 80, 90, rank),
        "t": qt.SparseRows(jnp.array([2, 5, 2]), jnp.ones((3, 4)), 7),
        "b": jnp.full(4, 0.5, jnp.float32),
        "none": None,
    }
    out = jax.jit(qto.apply_updates)(params, updates)
    expected = optax.apply_updates(params, qt.materialise(updates))
    assert out["none"] is None
    assert out["b"].dtype == jnp.bfloat16
    for name in ("w", "t", "b"):
        assert_close(out[name], expected[name])


def test_an_update_in_a_matrix_view_added_by_optax_is_refused_by_name():
    # `projected(dims=...)` gives a `(d, heads, head_dim)` weight's update as a
    # `(d, heads * head_dim)` LowRank: only `qto.apply_updates` reshapes it.
    rng = np.random.default_rng(2)
    params = {"w": jnp.zeros((6, 2, 5))}
    updates = {"w": _low_rank(rng, 6, 10, 2)}
    for add in (optax.apply_updates, lambda p, u: p["w"] + u["w"]):
        with pytest.raises(TypeError, match="quax_tangents.optax.apply_updates"):
            add(params, updates)
    expected = qt.materialise(updates["w"]).reshape(6, 2, 5)
    assert_close(qto.apply_updates(params, updates)["w"], expected)


def test_apply_updates_casts_to_the_parameter_dtype():
    rng = np.random.default_rng(1)
    params = {"w": jnp.zeros((6, 5), jnp.bfloat16)}
    out = qto.apply_updates(params, {"w": _low_rank(rng, 6, 5, 2)})
    assert out["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=converts_slices_in_loops)]
)
def test_stacked_low_rank_update_holds_one_matrix_product_at_a_time(dtype):
    # Holds on XLA:CPU (this suite's backend), for bfloat16 from JAX 0.11 (see
    # `converts_slices_in_loops`); `benchmarks/bench_scale.py --parts`
    # measures the same for TPU. The stack is updated one matrix at a time, in the
    # donated parameter's buffer: the temporaries are one matrix's float32 work (its
    # product, its factors), the same for 4 layers as for 16, at any rank.
    m, n = 64, 128

    def temp_bytes(layers, rank):
        w = jax.ShapeDtypeStruct((layers, m, n), dtype)
        update = jax.eval_shape(
            lambda: qt.LowRank(
                jnp.zeros((layers, m, rank), dtype), jnp.zeros((layers, n, rank), dtype)
            )
        )
        compiled = (
            jax.jit(qto.apply_updates, donate_argnums=(0,)).lower(w, update).compile()
        )
        return compiled.memory_analysis().temp_size_in_bytes

    for rank in (8, 70, 200):
        one_matrix = (m * n + (m + n) * rank) * 4
        assert temp_bytes(4, rank) == temp_bytes(16, rank) <= 2 * one_matrix, rank


def test_high_rank_stacked_update_equals_dense():
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((2, 20, 30)), jnp.bfloat16)
    left = jnp.asarray(rng.standard_normal((2, 20, 100)), jnp.bfloat16)
    right = jnp.asarray(rng.standard_normal((2, 30, 100)), jnp.bfloat16)
    out = jax.jit(qto.apply_updates)(w, qt.LowRank(left, right))
    dense = w.astype(jnp.float32) + jnp.einsum(
        "bmr,bnr->bmn", left.astype(jnp.float32), right.astype(jnp.float32)
    )
    assert out.dtype == jnp.bfloat16
    # Summed in float32, then rounded once to bfloat16.
    assert_close(
        out.astype(jnp.float32), dense.astype(jnp.bfloat16).astype(jnp.float32)
    )


def test_apply_updates_shape_mismatch_raises():
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError, match="cannot be applied"):
        qto.apply_updates({"w": jnp.zeros((5, 5))}, {"w": _low_rank(rng, 6, 5, 1)})


def test_other_compressed_updates_are_counted():
    qt.reset_fallback_counts()
    update = qt.top_k(jnp.arange(12.0).reshape(3, 4), 0.25)
    with qt.fallback("silent"):
        out = qto.apply_updates(jnp.ones((3, 4)), update)
    assert_close(out, 1 + qt.materialise(update))
    assert qt.fallback_counts()[("apply_updates", "Sparse")] == 1


# ---------------------------------------------------------------------------------------
# lift, and the silent case it answers


def test_plain_sgd_refuses_a_compressed_gradient_and_names_the_fix():
    # What `lift` exists for: optax maps over the fields, and scaling both factors
    # would give lr^2 * g instead of -lr * g. The guard leaf makes the map fail, in
    # JAX's own error, with a message that names the fix.
    rng = np.random.default_rng(3)
    g = _low_rank(rng, 6, 5, 2)
    tx = optax.sgd(0.1)
    with pytest.raises(TypeError, match=r"quax_tangents\.optax\.lift\(tx\)"):
        tx.update(g, tx.init(g))


@pytest.mark.parametrize("make", [lambda: optax.sgd(0.1), lambda: optax.adam(0.01)])
def test_lift_equals_the_dense_optimiser(make):
    rng = np.random.default_rng(4)
    params = {"w": jnp.zeros((6, 5)), "t": jnp.zeros((7, 3)), "b": jnp.zeros(3)}
    lifted, dense = qto.lift(make()), make()
    lifted_state, dense_state = lifted.init(params), dense.init(params)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        for _ in range(2):
            grads = {
                "w": _low_rank(rng, 6, 5, 2),
                "t": qt.SparseRows(jnp.array([1, 1, 6]), jnp.ones((3, 3)), 7),
                "b": jnp.asarray(rng.standard_normal(3), jnp.float32),
            }
            updates, lifted_state = lifted.update(grads, lifted_state, params)
            expected, dense_state = dense.update(
                qt.materialise(grads), dense_state, params
            )
            for name in params:
                assert_close(updates[name], expected[name])
    counts = qt.fallback_counts()
    assert counts[("lift", "LowRank")] == 2
    assert counts[("lift", "SparseRows")] == 2


def test_lift_follows_the_fallback_policy():
    tx = qto.lift(optax.sgd(0.1))
    g = qt.LowRank(jnp.ones((3, 1)), jnp.ones((2, 1)))
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="lift"):
        tx.update(g, tx.init(jnp.zeros((3, 2))))


@skip_without_devices(2)
@pytest.mark.parametrize("decay", [None, 0.5])
def test_rows_sharded_along_the_stored_rows_added_into_a_sharded_table(decay):
    # A batch's rows come sharded on the data axis, the table on its own rows: the
    # update keeps the table's layout, with weight decay or without.
    mesh = jax.make_mesh(
        (2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )
    rows = qt.SparseRows(jnp.array([1, 1, 3, 0]), jnp.arange(8.0).reshape(4, 2), 6)
    table = jnp.arange(12.0).reshape(6, 2)
    keep = 1.0 if decay is None else 1.0 - decay
    with jax.set_mesh(mesh):
        shard = lambda x: jax.device_put(x, P("data"))  # noqa: E731
        update = qt.SparseRows.build(shard(rows.indices), shard(rows.rows), 6)
        if decay is not None:
            update = qto.Decayed(update, jnp.float32(decay))
        applied = jax.jit(qto.apply_updates)(shard(table), update)
    np.testing.assert_array_equal(applied, table * keep + qt.materialise(rows))
    assert jax.typeof(applied).sharding.spec == P("data", None)


@skip_without_devices(2)
def test_a_stack_made_before_an_explicit_mesh_takes_factors_typed_on_it():
    # Weights put on one device before `jax.set_mesh` are typed on no mesh; what the
    # step computes under the mesh (the factors here) is typed on it. Adding the
    # factors' product into each matrix of the stack in place mixes the two.
    rng = np.random.default_rng(3)
    stack = jnp.asarray(rng.standard_normal((3, 6, 5)), jnp.float32)
    left = rng.standard_normal((3, 6, 2))
    right = rng.standard_normal((3, 5, 2))
    mesh = jax.make_mesh(
        (2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )
    with jax.set_mesh(mesh):
        update = qt.LowRank(jnp.asarray(left, jnp.float32), jnp.asarray(right))
        applied = jax.jit(qto.apply_updates)(stack, update)
    expected = stack + np.einsum("lmr,lnr->lmn", left, right)
    assert_close(applied, expected)
