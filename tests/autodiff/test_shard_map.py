"""`jax.shard_map` and explicit shardings inside the autodiff entry points, marks on
sharded weights, and the data-parallel all-reduce of projected gradients.

These tests need 8 host CPU devices, which `tests/conftest.py` asks XLA for.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

import quax_tangents as qt
from quax_tangents._marks._matrix_view import to_matrix
from tests.helpers import assert_close, llama
from tests.helpers.collective import (
    skip_without_devices,
)


_ROWS = P("d", None)
needs_devices = skip_without_devices(8)


@pytest.fixture(autouse=True)
def _fresh_counts():
    qt.reset_fallback_counts()
    yield


def _mesh(devices: int = 4, explicit: bool = True) -> jax.sharding.Mesh:
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(
        (devices,), ("d",), axis_types=(kind,), devices=jax.devices()[:devices]
    )


def _numpy(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _cross_entropy(logits, labels):
    """Mean cross-entropy with the batch split over "d", inside `shard_map`."""
    count = labels.shape[0]

    def local(logits, labels):
        log_z = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return lax.psum(jnp.sum(log_z - picked), "d") / count

    logits = jax.sharding.reshard(logits, P("d", None))
    labels = jax.sharding.reshard(labels, P("d"))
    return jax.shard_map(local, in_specs=(P("d", None), P("d")), out_specs=P())(
        logits, labels
    )


def _problem():
    w = jnp.asarray(_numpy(0, 8, 16))
    x = jnp.asarray(_numpy(1, 32, 8))
    labels = jnp.asarray(np.arange(32) % 16, jnp.int32)
    return w, x, labels


# ---------------------------------------------------------------------------------
# shard_map inside the loss, no compressed value crossing


@needs_devices
def test_entry_points_trace_a_shard_map_inside_the_loss():
    w, x, labels = _problem()

    def loss(w):
        return _cross_entropy(x @ w, labels)

    with jax.set_mesh(_mesh()):
        # The references compiled (eagerly, they cost as much as the entry points).
        expected_value, expected = jax.jit(jax.value_and_grad(loss))(w)
        assert_close(qt.grad(loss)(w), expected)
        value, grad = jax.jit(qt.value_and_grad(loss))(w)
        assert_close(value, expected_value)
        assert_close(grad, expected)
        out, pullback = qt.vjp(loss, w)
        assert_close(pullback(jnp.ones(()))[0], expected)
        tangent = jnp.asarray(_numpy(2, 8, 16))
        _, expected_t = jax.jit(lambda t: jax.jvp(loss, (w,), (t,)))(tangent)
        _, t_out = qt.jvp(loss, (w,), (tangent,))
        assert_close(t_out, expected_t)
    assert qt.fallback_counts() == {}


@needs_devices
@pytest.mark.parametrize("source", ["given", "fresh"])
def test_marked_weight_feeding_a_shard_map(source):
    w, x, labels = _problem()
    projector = jnp.asarray(np.linalg.qr(_numpy(3, 8, 4))[0])

    def loss(w):
        if source == "given":
            w = qt.projected_cotangent(w, 4, projector=projector)
        else:
            w = qt.projected_cotangent(w, 4, key=jax.random.key(5))
        return _cross_entropy(x @ w, labels)

    with jax.set_mesh(_mesh()):
        grad = jax.jit(qt.grad(loss))(w)
        dense = jax.jit(jax.grad(loss))(w)
    assert isinstance(grad, qt.LowRank)
    assert_close(grad, dense)
    if source == "given":
        assert np.array_equal(np.asarray(grad.left), np.asarray(projector))
    assert qt.fallback_counts() == {}


@needs_devices
def test_a_weight_stored_with_head_dims_marked_through_its_matrix_view():
    # A `(d, heads, head_dim)` weight, replicated, with the batch sharded: the
    # gradient is the LowRank of the `(d, heads * head_dim)` view.
    w, x, labels = _problem()
    stored = w.reshape(8, 4, 4)
    projector = jnp.asarray(np.linalg.qr(_numpy(3, 8, 4))[0])

    def loss(stored, marked=True):
        if marked:
            matrix = to_matrix(stored, (8, 16))
            stored = qt.projected_cotangent(matrix, 4, projector=projector).reshape(
                stored.shape
            )
        logits = jnp.einsum("bd,dhk->bhk", x, stored).reshape(32, 16)
        return _cross_entropy(logits, labels)

    with jax.set_mesh(_mesh()), qt.fallback("error"):
        grad = jax.jit(qt.grad(loss))(stored)
        dense = jax.jit(jax.grad(lambda s: loss(s, False)))(stored).reshape(8, 16)
    assert isinstance(grad, qt.LowRank) and grad.shape == (8, 16)
    assert_close(grad, projector @ (projector.T @ dense))


# ---------------------------------------------------------------------------------
# Compressed values crossing the boundary


def _doubled(spec, out_spec=None):
    out_spec = spec if out_spec is None else out_spec

    def fn(w):
        w = jax.sharding.reshard(w, spec)
        return jax.shard_map(lambda a: 2.0 * a, in_specs=spec, out_specs=out_spec)(w)

    return fn


@needs_devices
@pytest.mark.parametrize("spec", [P(), P("d", None), P(None, "d")])
def test_lowrank_tangent_crosses_field_by_field(spec):
    w = jnp.asarray(_numpy(0, 8, 16))
    tangent = qt.low_rank(jnp.asarray(_numpy(1, 8, 16)), 2)
    with jax.set_mesh(_mesh()):
        _, t_out = qt.jvp(_doubled(spec), (w,), (tangent,))
    assert isinstance(t_out, qt.LowRank)
    assert t_out.rank == 2
    assert_close(t_out, 2.0 * tangent.materialise())
    assert qt.fallback_counts() == {}


def _scaled_per_device(spec, column_vector):
    def fn(w):
        w = jax.sharding.reshard(w, spec)

        def body(a):
            scale = (lax.axis_index("d") + 1.0).astype(a.dtype)
            if column_vector:
                scale = scale * jnp.arange(1.0, a.shape[0] + 1.0)[:, None]
            return a * scale

        return jax.shard_map(body, in_specs=spec, out_specs=spec)(w)

    return fn


@needs_devices
@pytest.mark.parametrize("spec", [P("d", None), P(None, "d")])
def test_lowrank_scaled_per_device_stays_lowrank(spec):
    """A scalar that differs per device scales the factor that is already split
    over the devices: still one pair of global factors."""
    w = jnp.asarray(_numpy(0, 8, 16))
    tangent = qt.low_rank(jnp.asarray(_numpy(1, 8, 16)), 2)
    block = np.repeat(np.arange(1.0, 5.0), 2 if spec[0] else 4)
    scale = block[:, None] if spec[0] else block[None, :]
    with jax.set_mesh(_mesh()):
        _, t_out = qt.jvp(_scaled_per_device(spec, False), (w,), (tangent,))
    assert isinstance(t_out, qt.LowRank)
    assert_close(t_out, scale * np.asarray(tangent.materialise()))
    assert qt.fallback_counts() == {}


@needs_devices
def test_lowrank_leaving_with_a_factor_that_varies_elsewhere_is_materialised():
    """Column blocks whose rows are scaled differently on each device: the left
    factor differs per device though the spec does not split rows, so no pair of
    global factors holds the result. It leaves dense (counted), and right."""
    w = jnp.asarray(_numpy(0, 8, 16))
    tangent = qt.low_rank(jnp.asarray(_numpy(1, 8, 16)), 2)
    scale = np.arange(1.0, 9.0)[:, None] * np.repeat(np.arange(1.0, 5.0), 4)[None, :]
    with jax.set_mesh(_mesh()), qt.fallback("silent"):
        _, t_out = qt.jvp(_scaled_per_device(P(None, "d"), True), (w,), (tangent,))
    assert not isinstance(t_out, qt.LowRank)
    assert_close(t_out, scale * np.asarray(tangent.materialise()))
    assert any(key[0] == "shard_map" for key in qt.fallback_counts())


@needs_devices
def test_other_types_with_a_sharded_spec_are_materialised_and_counted():
    tangent = qt.top_k(jnp.asarray(_numpy(1, 8, 16)), 5)

    def doubled(w, spec=_ROWS):
        return jax.shard_map(lambda a: 2.0 * a, in_specs=spec, out_specs=spec)(w)

    with jax.set_mesh(_mesh()), qt.fallback("silent"):
        w = jax.device_put(_numpy(0, 8, 16), P("d", None))
        _, t_out = qt.jvp(doubled, (w,), (tangent,))
    assert_close(t_out, 2.0 * tangent.materialise())
    assert [key[0] for key in qt.fallback_counts()] == ["shard_map"]
    with qt.fallback("error"), jax.set_mesh(_mesh()):
        with pytest.raises(Exception, match="shard_map"):
            qt.jvp(doubled, (w,), (tangent,))
    # Replicated, every type crosses whole.
    qt.reset_fallback_counts()
    with jax.set_mesh(_mesh()):
        w = jax.device_put(_numpy(0, 8, 16), P())
        _, t_out = qt.jvp(lambda w: doubled(w, P()), (w,), (tangent,))
    assert isinstance(t_out, qt.Sparse)
    assert_close(t_out, 2.0 * tangent.materialise())
    assert qt.fallback_counts() == {}


# ---------------------------------------------------------------------------------
# A Llama-style block on a ("data", "model") mesh with explicit axes


@needs_devices
def test_llama_block_projected_gradients_on_a_data_model_mesh():
    rank = 4
    with jax.set_mesh(llama.make_mesh()):
        params = llama.init()
        tokens, labels = llama.batch()
        projector = llama.projectors(params, rank)
        marks = llama.projected_marks(projector, rank)

        def marked(params):
            return llama.loss(params, tokens, labels, marks)

        value, grads = jax.jit(qt.value_and_grad(marked))(params)
        dense_path = jax.jit(jax.grad(marked))(params)
        expected_value, unmarked = jax.jit(jax.value_and_grad(llama.loss))(
            params, tokens, labels
        )
    assert_close(value, expected_value)
    for name in llama.PROJECTIONS:
        g = grads[name]
        assert isinstance(g, qt.LowRank) and g.rank == rank, name
        (m, n), spec = llama.SHAPES[name]
        # The factors are sharded as the weight is: each on its own side.
        assert jax.typeof(g.left).sharding.spec[0] == spec[0], name
        assert jax.typeof(g.right).sharding.spec[0] == spec[1], name
        assert_close(g, dense_path[name])
        assert_close(g, llama.project(unmarked[name], projector[name]))
    for name in set(params) - set(llama.PROJECTIONS):
        assert_close(grads[name], unmarked[name])
    assert qt.fallback_counts() == {}


def _switched_loss(params, refresh, tokens, labels, given):
    """The block's loss with every projection marked by a `Projector` whose refresh
    flag is an argument, as a training step passes it: one compiled program serves
    both flags."""

    def marks(name, w):
        projector = qt.Projector(given[name], refresh)
        return qt.projected_cotangent(
            w, given[name].shape[-1], projector=projector, key=jax.random.key(7)
        )

    return llama.loss(params, tokens, labels, marks)


_switched_grad = jax.jit(qt.grad(_switched_loss))
_switched_dense_grad = jax.jit(jax.grad(_switched_loss))


@needs_devices
@pytest.mark.parametrize("refresh", [True, False])
def test_llama_block_fresh_and_switched_projectors(refresh):
    rank = 4
    with jax.set_mesh(llama.make_mesh()):
        params = llama.init()
        args = (jnp.asarray(refresh), *llama.batch(), llama.projectors(params, rank))
        grads = _switched_grad(params, *args)
        dense_path = _switched_dense_grad(params, *args)
        given = args[-1]
    for name in llama.PROJECTIONS:
        g = grads[name]
        (m, n), _ = llama.SHAPES[name]
        projector = g.left if m <= n else g.right
        p = np.asarray(projector, np.float64)
        assert np.abs(p.T @ p - np.eye(rank)).max() < 5e-6, name
        if not refresh:
            assert np.array_equal(p, np.asarray(given[name])), name
        assert_close(g, dense_path[name], factor=10)
    assert qt.fallback_counts() == {}


# ---------------------------------------------------------------------------------
# Data parallel: the all-reduce of projected gradients moves the small factor


def _data_parallel(devices, m, n, rank, given, check_vma=True):
    """Per-device projected gradients of a least-squares-like loss, all-reduced;
    returns the result, the expected projection and the received-bytes ratio
    against the dense all-reduce of the same gradient."""
    mesh = _mesh(devices)
    w = jnp.asarray(_numpy(0, m, n))
    x = jnp.asarray(_numpy(1, devices * 4, m))
    projector = jnp.asarray(np.linalg.qr(_numpy(2, min(m, n), rank))[0])

    def loss(w, x, mark):
        if mark is not None:
            w = qt.projected_cotangent(w, rank, **mark)
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    def projected(w, x, p):
        mark = dict(projector=p) if given else dict(key=jax.random.key(4))
        g = qt.grad(lambda w: loss(w, x, mark))(qt.device_varying(w, "d"))
        return qt.all_reduce(g, "d")

    def dense(w, x):
        g = jax.grad(lambda w: loss(w, x, None))(qt.device_varying(w, "d"))
        return lax.psum(g, "d")

    specs = dict(out_specs=P(), check_vma=check_vma)
    with jax.set_mesh(mesh):
        args = (
            jax.device_put(w, P()),
            jax.device_put(x, P("d", None)),
            jax.device_put(projector, P()),
        )
        step = jax.jit(jax.shard_map(projected, in_specs=(P(), P("d"), P()), **specs))
        dense_step = jax.jit(jax.shard_map(dense, in_specs=(P(), P("d")), **specs))
        total = step(*args)
        ratio = sum(
            qt.hlo.received_bytes(c, devices) for c in qt.hlo.collectives(step, *args)
        ) / sum(
            qt.hlo.received_bytes(c, devices)
            for c in qt.hlo.collectives(dense_step, *args[:2])
        )
    full = np.asarray(jax.grad(lambda w: loss(w, x, None))(w), np.float64)
    return total, llama.project(full, projector), ratio


@needs_devices
@pytest.mark.parametrize("devices", [2, 4, 8])
@pytest.mark.parametrize("shape", [(16, 24), (24, 16)])
def test_projected_all_reduce_moves_only_the_device_varying_factor(devices, shape):
    m, n = shape
    rank = 4
    total, expected, ratio = _data_parallel(devices, m, n, rank, given=True)
    assert isinstance(total, qt.LowRank) and total.rank == rank
    assert_close(total, expected)
    assert ratio == pytest.approx(rank / min(m, n))


@needs_devices
def test_projected_all_reduce_with_device_varying_projectors_gathers():
    """A fresh projector is computed from each device's own gradient: it varies,
    so the exact gather path runs (rank `devices * r`)."""
    total, _, _ = _data_parallel(4, 16, 24, 2, given=False)
    assert isinstance(total, qt.LowRank) and total.rank == 4 * 2


@needs_devices
def test_projected_all_reduce_without_check_vma_gathers():
    """Without `check_vma` nothing says the projector is shared: exact gather."""
    total, expected, _ = _data_parallel(4, 16, 24, 2, given=True, check_vma=False)
    assert isinstance(total, qt.LowRank) and total.rank == 4 * 2
    assert_close(total, expected)


def _replicated_weight_problem(rank):
    """A weight to replicate, a batch to split by rows, and an orthonormal projector
    of `rank` columns for the weight's cotangent. Two rows per device: the sum over
    the devices of the weight's cotangent terms (gathered, `devices * rows * (m + n)`
    numbers) receives less than a dense all-reduce of the `m x n` weight's."""
    w = jnp.asarray(_numpy(0, 8, 16))
    x = jnp.asarray(_numpy(1, 8, 8))
    projector = jnp.asarray(np.linalg.qr(_numpy(2, 8, rank))[0])
    return w, x, projector


def _tanh_square_sum(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _over_batch_rows(body, w, x):
    """`body(w, rows of x)` in `shard_map`: `w` replicated, `x` split over "d"."""
    x_split = jax.sharding.reshard(x, P("d", None))
    return jax.shard_map(body, in_specs=(P(), P("d", None)), out_specs=P())(w, x_split)


def _compressed_and_dense_grads(loss, w):
    """`qt.grad(loss)(w)` and `jax.grad(loss)(w)`, both compiled, on the mesh."""
    with jax.set_mesh(_mesh()):
        return jax.jit(qt.grad(loss))(w), jax.jit(jax.grad(loss))(w)


@needs_devices
@pytest.mark.parametrize("vary", [False, True])
def test_mark_inside_the_shard_map_body(vary):
    """A mark inside the body on a replicated weight; with `device_varying`, JAX's AD
    sums the per-device cotangents (`psum_invariant`), which a projected `LowRank`
    with a shared projector does by summing one factor: rank `r` either way."""
    rank = 4
    w, x, projector = _replicated_weight_problem(rank)

    def loss(w):
        def body(w, x):
            if vary:
                w = qt.device_varying(w, "d")
            w = qt.projected_cotangent(w, rank, projector=projector)
            return lax.psum(_tanh_square_sum(w, x), "d")

        return _over_batch_rows(body, w, x)

    grad, dense_path = _compressed_and_dense_grads(loss, w)
    full = jax.grad(_tanh_square_sum)(w, x)
    assert isinstance(grad, qt.LowRank) and grad.rank == rank
    assert_close(grad, dense_path)
    assert_close(grad, llama.project(full, projector))
    assert qt.fallback_counts() == {}


@needs_devices
def test_marked_weight_used_inside_the_shard_map_body():
    """The mark outside, the product inside the body: the marked weight crosses
    replicated (`P()`) field by field and its cotangent still comes back low-rank."""
    rank = 4
    w, x, projector = _replicated_weight_problem(rank)

    def loss(w):
        w = qt.projected_cotangent(w, rank, projector=projector)

        def body(w, x):
            return lax.psum(_tanh_square_sum(w, x), "d")

        return _over_batch_rows(body, w, x)

    grad, dense_path = _compressed_and_dense_grads(loss, w)
    assert isinstance(grad, qt.LowRank) and grad.rank == rank
    assert_close(grad, dense_path)
    assert qt.fallback_counts() == {}
