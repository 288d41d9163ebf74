"""`qto.clip_by_global_norm` and `qto.galore(max_grad_norm=...)`: the clip of
`optax.clip_by_global_norm` on the arrays compressed gradients represent, computed
without a dense gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import AxisType, PartitionSpec as P

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import assert_close, random_array, seeds
from tests.helpers.collective import skip_without_devices
from tests.helpers.lowrank import lowrank_values
from tests.helpers.rows import rows_values
from tests.optax.test_galore import _batch, _blocks, _params, loss_fn


def _compressed(x):
    return isinstance(x, (qt.LowRank, qt.SparseRows))


def _dense(tree):
    return jax.tree.map(qt.materialise, tree, is_leaf=_compressed)


@st.composite
def _low_rank(draw):
    """A `LowRank`, maybe stacked; tagged as a projection (its projector factor
    orthonormal, as the tag promises) or not."""
    value = draw(lowrank_values(dtype=jnp.float32, projector_side=None))
    side = draw(st.sampled_from([None, "left", "right"]))
    projector = None if side is None else getattr(value, side)
    if projector is None or projector.shape[-2] < projector.shape[-1]:
        return value
    orthonormal = jnp.linalg.qr(projector)[0]
    left, right = (
        (orthonormal, value.right) if side == "left" else (value.left, orthonormal)
    )
    return qt.LowRank(left, right, projector_side=side)


@st.composite
def _gradients(draw):
    """A tree of a `LowRank` (maybe stacked), a `SparseRows` with duplicate rows
    likely, and a dense leaf, in float32."""
    return {
        "low_rank": draw(_low_rank()),
        "rows": draw(rows_values(num_rows=5, row_size=3, dtype=jnp.float32, k=4)),
        "dense": random_array(draw(seeds()), (3, 2)),
    }


# Jitted: one compile per example's shapes, where run op by op each shape compiles
# many.
@functools.partial(jax.jit, static_argnums=1)
def _clipped(grads, max_norm):
    clip = qto.clip_by_global_norm(max_norm)
    return clip.update(grads, clip.init(grads))[0]


@settings(max_examples=15, deadline=None)
@given(_gradients(), st.sampled_from([0.1, 1.0, 1e3]))
def test_the_clip_is_optax_clip_on_the_dense_gradients(grads, max_norm):
    with qt.fallback("error"):  # nothing dense
        clipped = _clipped(grads, max_norm)
    dense = _dense(grads)
    expected, _ = optax.clip_by_global_norm(max_norm).update(dense, optax.EmptyState())
    for name in grads:
        assert type(clipped[name]) is type(grads[name])
        assert_close(clipped[name], expected[name], factor=4)
    # The projector of a projected gradient is kept as it is.
    low_rank, was = clipped["low_rank"], grads["low_rank"]
    assert low_rank.projector_side == was.projector_side
    if was.projector_side is not None:
        kept = getattr(was, was.projector_side)
        np.testing.assert_array_equal(getattr(low_rank, was.projector_side), kept)


def test_the_clip_runs_under_jit_and_scales_only_above_the_limit():
    grads = {"w": qt.LowRank(jnp.ones((4, 1)), jnp.full((3, 1), 2.0)), "b": jnp.ones(2)}
    norm = float(np.sqrt(4 * 3 * 4.0 + 2))
    clip = jax.jit(
        lambda g, c: qto.clip_by_global_norm(c).update(g, None)[0], static_argnums=1
    )
    below = clip(grads, 2 * norm)
    above = clip(grads, norm / 2)
    assert_close(below["w"], qt.materialise(grads["w"]))
    assert_close(above["w"], qt.materialise(grads["w"]) / 2)
    assert_close(above["b"], grads["b"] / 2)


@pytest.mark.parametrize(
    "bad, error",
    [(0.0, ValueError), (-1.0, ValueError), ("1", TypeError), (True, TypeError)],
)
def test_a_bad_limit_is_refused_by_name(bad, error):
    with pytest.raises(error, match="`max_norm`"):
        qto.clip_by_global_norm(bad)
    with pytest.raises(error, match="`max_grad_norm`"):
        qto.galore(rank=2, max_grad_norm=bad)


def test_galore_clips_all_the_gradients_together_before_the_layer_loop():
    params = _params()
    plain = qto.galore(rank=2, learning_rate=1e-2, refresh_every=4, project=_blocks)
    value_and_grad, update = (
        jax.jit(plain.value_and_grad(loss_fn)),
        jax.jit(plain.update),
    )
    state = plain.init(params)
    # A second step: Adam's first is the sign of the gradient whatever its scale.
    _, grads = value_and_grad(params, state, _batch(0))
    _, state = update(grads, state, params)
    _, grads = value_and_grad(params, state, _batch(1))
    norm = float(qt.norm(grads))
    clipping = qto.galore(
        rank=2,
        learning_rate=1e-2,
        refresh_every=4,
        project=_blocks,
        max_grad_norm=norm / 10,
    )
    assert jax.tree.structure(clipping.init(params)) == jax.tree.structure(state)
    with qt.fallback("error"):
        ours, _ = jax.jit(clipping.update)(grads, state, params)
    # The whole tree scaled by one factor, not each layer's slice by its own.
    expected, _ = update(
        jax.tree.map(lambda g: g / 10, grads, is_leaf=_compressed), state, params
    )
    unclipped, _ = update(grads, state, params)
    ours, expected, unclipped = (
        jax.tree.leaves(_dense(tree)) for tree in (ours, expected, unclipped)
    )
    for a, b in zip(ours, expected):
        assert_close(a, b, factor=10)
    change = max(float(jnp.max(jnp.abs(a - c))) for a, c in zip(ours, unclipped))
    assert change > 1e-4  # 1e-2 steps: the clip moves them


def test_a_base_that_reads_the_parameters_is_refused_naming_the_default():
    params = _params()
    opt = qto.galore(optax.adamw(1e-3, weight_decay=0.1), rank=2, project=_blocks)
    state = opt.init(params)
    _, grads = opt.value_and_grad(loss_fn)(params, state, _batch(0))
    with pytest.raises(
        ValueError, match=r"reads the parameters.*scale_by_adam.*weight_decay="
    ):
        opt.update(grads, state, params)


@skip_without_devices(2)
def test_the_clip_of_rows_sharded_along_the_stored_rows():
    mesh = jax.make_mesh(
        (2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )
    rows = qt.SparseRows(jnp.array([1, 1, 3, 0]), jnp.arange(8.0).reshape(4, 2), 5)
    dense = qt.materialise(rows)
    with jax.set_mesh(mesh):
        shard = lambda x: jax.device_put(x, P("data"))  # noqa: E731
        sharded = qt.SparseRows.build(shard(rows.indices), shard(rows.rows), 5)
        clip = jax.jit(qto.clip_by_global_norm(1.0).update)
        clipped, _ = clip({"t": sharded}, optax.EmptyState())
        got = np.asarray(clipped["t"].rows)
    # The stored rows scaled by the norm of the array they make up (row 1 twice).
    assert isinstance(clipped["t"], qt.SparseRows)
    assert_close(got, rows.rows / jnp.linalg.norm(dense))
