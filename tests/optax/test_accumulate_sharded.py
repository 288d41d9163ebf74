"""`accumulate_gradients(shardings=...)`: under `jax.jit` with parameters sharded
FSDP-style, the running sums of factors laid out like their weights."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import quax_tangents as qt
import quax_tangents.optax as qto
from quax_tangents._core._layout import constrain, factor_layout
from tests.helpers import assert_close
from tests.helpers.collective import (
    skip_without_devices,
)
from tests.helpers.loop_weights import layout_constraints, project_matrices, tiled_case


DEVICES = 8
RANK = 8
needs_devices = skip_without_devices(DEVICES)


# ---------------------------------------------------------------------------------------
# The layout rule


_MESH = AbstractMesh((8,), ("data",))


def _layout(spec, side, shape, rows_first=False):
    return factor_layout(NamedSharding(_MESH, spec), 3, side, shape, rows_first).spec


def test_a_factor_keeps_its_sides_axis_and_takes_the_other_on_its_rank():
    # (layers, m, n) sharded on n; a factor spanning n keeps it.
    assert _layout(P(None, None, "data"), -1, (3, 48, 16)) == P(None, "data", None)
    # Sharded on m; a factor spanning n takes m's axis on its rank.
    assert _layout(P(None, "data", None), -1, (3, 48, 16)) == P(None, None, "data")


def test_a_rank_the_axis_does_not_divide_moves_it_to_a_free_side_that_it_does():
    # Sharded on n; a sketch spanning m (unsharded), of width 12: m takes the axis.
    assert _layout(P(None, None, "data"), -2, (3, 48, 12)) == P(None, "data", None)
    # Neither divides: the rank is sharded unevenly (padded) all the same.
    assert _layout(P(None, None, "data"), -2, (3, 44, 12)) == P(None, None, "data")


def test_rows_first_puts_the_other_axis_on_the_factors_rows_where_it_divides():
    # Sharded on m; a factor spanning n (unsharded, 48 rows) takes m's axis on its
    # rows, not its rank, as `accumulate_gradients` lays its sums out under `Auto`
    # axes; where the rows are sharded already or it does not divide them, as before.
    assert _layout(P(None, "data", None), -1, (3, 48, 16), True) == P(
        None, "data", None
    )
    assert _layout(P(None, None, "data"), -1, (3, 48, 16), True) == P(
        None, "data", None
    )
    assert _layout(P(None, "data", None), -1, (3, 44, 16), True) == P(
        None, None, "data"
    )


def test_no_sharding_leaves_the_layout_to_xla():
    assert factor_layout(None, 3, -1, (3, 48, 16)) is None


# ---------------------------------------------------------------------------------------
# Bad input


def _setup():
    params = {"w": jnp.ones((2, 16, 24), jnp.float32)}
    tx = qto.projected(optax.scale_by_adam(), rank=RANK, learning_rate=1e-2)
    return params, tx.init(params)


def _loss(p, batch):  # never called: the arguments are checked first
    raise AssertionError("the shardings were not checked before tracing")


def test_shardings_of_another_structure_raise_naming_shardings():
    params, state = _setup()
    sharding = NamedSharding(jax.make_mesh((1,), ("data",)), P())
    batches = jnp.ones((2, 4, 16))
    with pytest.raises(ValueError, match="`shardings` must have the structure"):
        qto.accumulate_gradients(
            _loss, params, state, batches, shardings={"v": sharding}
        )


def test_a_partition_spec_for_a_sharding_raises_naming_named_sharding():
    params, state = _setup()
    batches = jnp.ones((2, 4, 16))
    with pytest.raises(TypeError, match="NamedSharding"):
        qto.accumulate_gradients(
            _loss, params, state, batches, shardings={"w": P(None, "data")}
        )


# ---------------------------------------------------------------------------------------
# On 8 devices


def _model(rng):
    params = {
        "up": jnp.asarray(rng.standard_normal((3, 16, 40)), jnp.float32) * 0.3,
        "down": jnp.asarray(rng.standard_normal((3, 40, 16)), jnp.float32) * 0.3,
        "head": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32) * 0.3,
    }

    def loss(p, batch):
        x, y = batch

        def layer(h, w):
            return h + jnp.tanh(h @ w["up"]) @ w["down"], None

        blocks = {k: p[k] for k in ("up", "down")}
        h = jax.lax.scan(layer, x, blocks)[0]
        return jnp.mean((h @ p["head"] - y) ** 2)

    tx = qto.projected(
        optax.scale_by_adam(),
        rank=RANK,
        learning_rate=1e-2,
        refresh_every=2,
        project=lambda p: {"up": True, "down": True, "head": False},
    )
    return params, loss, tx


def _shardings(mesh):
    return {
        "up": NamedSharding(mesh, P(None, None, "data")),  # (3, 16, 40) on n
        "down": NamedSharding(mesh, P(None, "data", None)),  # (3, 40, 16) on m
        "head": NamedSharding(mesh, P("data", None)),
    }


def _mesh(axis_type=None):
    axis_type = axis_type or jax.sharding.AxisType.Auto
    return jax.make_mesh(
        (DEVICES,), ("data",), devices=jax.devices()[:DEVICES], axis_types=(axis_type,)
    )


@needs_devices
@pytest.mark.parametrize("by_layer", [True, False])
def test_sharded_sums_give_the_unsharded_result_laid_out_like_the_weights(by_layer):
    rng = np.random.default_rng(0)
    params, loss, tx = _model(rng)
    mesh = _mesh()
    shardings = _shardings(mesh)
    key = jax.random.key(3)
    state = tx.init(params)

    def step(params, state, microbatches, shardings=None):
        _, grads = qto.accumulate_gradients(
            loss,
            params,
            state,
            microbatches,
            key=key,
            by_layer=by_layer,
            shardings=shardings,
        )
        return grads

    batch = NamedSharding(mesh, P(None, "data"))
    sharded = jax.jit(
        lambda p, s, mb: step(p, s, mb, shardings),
        in_shardings=(shardings, None, batch),
    )
    plain = jax.jit(step)

    @jax.jit
    def update(grads, state, params):  # one program, not one per operation
        updates, state = tx.update(grads, state)
        return qto.apply_updates(params, updates), state

    for _ in range(2):  # refresh, keep
        microbatches = tuple(
            jnp.asarray(rng.standard_normal((2, 16, d)), jnp.float32) for d in (16, 8)
        )
        params = jax.device_put(params, shardings)
        got = sharded(params, state, microbatches)
        expected = plain(params, state, microbatches)
        for name in params:
            assert_close(got[name], expected[name], factor=5)
        # The factors G^T P: `up` (m <= n) spans n, sharded as the weight's n;
        # `down` (m > n) spans m, sharded as the weight's m.
        laid_out = lambda x, spec: x.sharding.is_equivalent_to(  # noqa: E731
            NamedSharding(mesh, spec), x.ndim
        )
        assert laid_out(got["up"].right, P(None, "data", None))
        assert laid_out(got["down"].left, P(None, "data", None))
        assert laid_out(got["head"], P("data", None))
        params, state = update(got, state, params)


@needs_devices
def test_sharded_sums_hold_fewer_bytes_per_device_than_replicated_ones():
    rng = np.random.default_rng(1)
    params, loss, tx = _model(rng)
    mesh = _mesh()
    shardings = _shardings(mesh)
    state = tx.init(params)
    microbatches = (
        jax.ShapeDtypeStruct((2, 16, 16), jnp.float32),
        jax.ShapeDtypeStruct((2, 16, 8), jnp.float32),
    )
    batch = NamedSharding(mesh, P(None, "data"))

    def compiled(given):
        def step(p, s, mb):
            return qto.accumulate_gradients(loss, p, s, mb, shardings=given)[1]

        fn = jax.jit(step, in_shardings=(shardings, None, batch))
        return fn.lower(params, state, microbatches).compile()

    def held(c):
        m = c.memory_analysis()
        return m.output_size_in_bytes + m.temp_size_in_bytes

    assert held(compiled(shardings)) < held(compiled(None))


@needs_devices
def test_a_layout_over_an_explicit_axis_reshards():
    mesh = _mesh(jax.sharding.AxisType.Explicit)
    sharding = NamedSharding(mesh, P(None, "data"))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x: constrain(x * 2, sharding))(jnp.ones((4, 16)))
    assert out.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_array_equal(out, 2 * np.ones((4, 16)))


@needs_devices
@pytest.mark.parametrize("axis_type", ["given", "explicit", "replicated"])
def test_a_weight_spread_over_devices_is_not_laid_out_in_the_loop(axis_type):
    # XLA's partitioner gathers the operand of a layout constraint whole (the 7B
    # step of an FSDP v5e:8 slice held 4.82 GiB per chip instead of 3.16): the loop
    # carries in row-major order only the tiled weights no device axis spreads, as
    # `shardings=` or their type says. A replicated one is carried.
    rng = np.random.default_rng(5)
    params, microbatches, loss = tiled_case(rng, 2, 16)
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, learning_rate=1e-2, project=project_matrices
    )
    spec = P() if axis_type == "replicated" else P("data", None)
    explicit = axis_type == "explicit"
    mesh = _mesh(jax.sharding.AxisType.Explicit if explicit else None)
    shardings = {k: NamedSharding(mesh, spec if k == "tiled" else P()) for k in params}

    def step(p, s, mb):
        given = None if explicit else shardings
        return qto.accumulate_gradients(loss, p, s, mb, shardings=given)

    plain = jax.jit(lambda p, s, mb: qto.accumulate_gradients(loss, p, s, mb))
    expected_loss, expected = plain(params, tx.init(params), microbatches)
    params = jax.device_put(params, shardings)
    with jax.set_mesh(mesh):
        state = tx.init(params)  # under explicit axes, typed as the weights
        lowered = jax.jit(step).lower(params, state, microbatches)
        got_loss, got = lowered.compile()(params, state, microbatches)
    constrained = ["128x128xf32"] if axis_type == "replicated" else []
    assert layout_constraints(lowered.as_text()) == constrained
    assert_close(got_loss, expected_loss)
    for name in params:
        assert_close(got[name], expected[name], factor=5)


# ---------------------------------------------------------------------------------------
# Data parallel: under `jax.jit`, and inside `jax.shard_map` with `axis_name`


def _galore_step(loss, microbatches=2, axis_name=None, opt=None):
    # By default 8-bit state, refresh every other step, one power iteration: every
    # branch of the range finder runs.
    if opt is None:
        opt = qto.galore(rank=RANK, learning_rate=1e-2, refresh_every=2, iters=1)

    def step(params, state, batch):
        value, grads = opt.value_and_grad(
            loss, microbatches=microbatches, axis_name=axis_name
        )(params, state, batch)
        updates, state = opt.update(grads, state, params)
        return opt.apply(params, updates), state, value

    return opt, step


def _batch(rng):
    return tuple(
        jnp.asarray(rng.standard_normal((32, d)), jnp.float32) for d in (16, 8)
    )


def _assert_same_steps(step, expected_step, params, state, batch, steps=3):
    got = expected = (params, state)
    for _ in range(steps):  # refresh, keep, refresh
        *got, got_loss = step(*got, batch)
        *expected, expected_loss = expected_step(*expected, batch)
        assert_close(got_loss, expected_loss)
        for name in params:
            assert_close(got[0][name], expected[0][name])


@needs_devices
def test_a_batch_sharded_under_jit_gives_the_one_device_steps():
    # Replicated weights and state, the batch split over the devices by `jax.jit`.
    rng = np.random.default_rng(1)
    params, loss, _ = _model(rng)
    opt, step = _galore_step(loss)
    batch = _batch(rng)
    sharded = jax.device_put(batch, NamedSharding(_mesh(), P("data")))
    compiled = jax.jit(step)
    _assert_same_steps(
        lambda p, s, b: compiled(p, s, sharded),
        compiled,
        params,
        opt.init(params),
        batch,
    )


@needs_devices
@pytest.mark.parametrize("batch_sharded", [False, True])
def test_weights_made_before_an_explicit_mesh_give_the_one_device_steps(batch_sharded):
    # JAX's default mesh axes are explicit. Weights put on one device before
    # `jax.set_mesh` are typed on no mesh, what the step computes on the mesh.
    rng = np.random.default_rng(2)
    params, loss, _ = _model(rng)
    opt, step = _galore_step(loss)
    batch = _batch(rng)
    expected = _steps(jax.jit(step), params, opt.init(params), batch)  # no mesh
    with jax.set_mesh(_mesh(jax.sharding.AxisType.Explicit)):
        given = jax.device_put(batch, P("data")) if batch_sharded else batch
        got = _steps(jax.jit(step), params, opt.init(params), given)
    for (got_loss, got_params), (loss, expected_params) in zip(got, expected):
        assert_close(got_loss, loss)
        for name in params:
            # Three Adam steps of 8-bit state on a batch summed in another order:
            # Adam divides by the gradient's running size, which magnifies the
            # rounding of entries near zero (4.3e-5 against one float32 tolerance
            # of 2.2e-5 with JAX 0.12.0.1's CPU backend).
            assert_close(got_params[name], expected_params[name], factor=5)


def _steps(step, params, state, batch, steps=3):
    """The losses and weights of `steps` steps (refresh, keep, refresh)."""
    trajectory = []
    for _ in range(steps):
        params, state, loss = step(params, state, batch)
        trajectory.append((loss, params))
    return trajectory


def _data_parallel(step, mesh):
    return jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())
        )
    )


@needs_devices
def test_inside_shard_map_axis_name_gives_the_one_device_steps():
    # Each device takes 4 of the 32 examples in 2 microbatches; one device takes
    # all 32 in 16 microbatches of the same size. With `axis_name` the projectors
    # come from the whole batch's gradient on every device, and the state and the
    # weights come out the same everywhere (`out_specs=P()` types them so).
    rng = np.random.default_rng(4)
    params, loss, _ = _model(rng)
    opt, step = _galore_step(loss, microbatches=2, axis_name="data")
    _, whole = _galore_step(loss, microbatches=2 * DEVICES)
    mesh = _mesh()
    parallel = _data_parallel(step, mesh)
    batch = _batch(rng)
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    _assert_same_steps(
        lambda p, s, b: parallel(p, s, sharded),
        jax.jit(whole),
        params,
        opt.init(params),
        batch,
    )


@needs_devices
def test_inside_shard_map_a_row_leaf_gives_the_one_device_steps():
    # An embedding table chosen with `rows=`: each device's rows, gathered over the
    # devices (`SparseRows.all_reduce`), give the whole batch's row gradient.
    rng = np.random.default_rng(10)
    params = {
        "embed": jnp.asarray(rng.standard_normal((50, 16)), jnp.float32),
        "w": jnp.asarray(rng.standard_normal((16, 40)), jnp.float32) * 0.3,
    }

    def loss(p, batch):
        ids, y = batch
        return jnp.mean((jnp.tanh(p["embed"][ids].mean(1) @ p["w"]) - y) ** 2)

    opt = qto.galore(
        rank=4,
        learning_rate=1e-2,
        refresh_every=2,
        project=lambda p: {"embed": False, "w": True},
        rows=lambda p: {"embed": True, "w": False},
    )

    mesh = _mesh()
    batch = (
        jnp.asarray(rng.integers(0, 50, (32, 6)), jnp.int32),
        jnp.asarray(rng.standard_normal((32, 40)), jnp.float32),
    )
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    parallel = _data_parallel(_galore_step(loss, 2, "data", opt)[1], mesh)
    _assert_same_steps(
        lambda p, s, b: parallel(p, s, sharded),
        jax.jit(_galore_step(loss, 2 * DEVICES, opt=opt)[1]),
        params,
        opt.init(params),
        batch,
    )


@needs_devices
def test_inside_shard_map_the_step_sends_small_factors_once():
    # Outside the refresh's loop over matrices, the step's collectives run once per
    # step, after the loop over microbatches: the factors `(max(m, n), rank)` per
    # layer, the dense rest and the loss. A refresh all-reduces one matrix's sum at
    # a time. No collective moves a projected weight's gradient.
    rng = np.random.default_rng(5)
    params, loss, _ = _model(rng)
    opt, step = _galore_step(loss, microbatches=2, axis_name="data")
    mesh = _mesh()
    batch = jax.device_put(_batch(rng), NamedSharding(mesh, P("data")))
    compiled = _data_parallel(step, mesh).lower(params, opt.init(params), batch)
    found = qt.hlo.collectives(compiled.compile())
    per_step = [c for c in found if c.count == 1]
    refresh = [c for c in found if c.count != 1]
    assert per_step and refresh, found
    assert all(c.operand_shapes == ("f32[40,8]",) for c in refresh), refresh
    factors = 2 * 3 * 40 * RANK + 16 * 8  # up's and down's factors, the dense head
    sent = sum(c.operand_bytes for c in per_step)
    assert factors * 4 <= sent <= factors * 4 + 64, per_step
    shapes = [s for c in found for s in c.operand_shapes]
    assert not any(s.startswith(("f32[3,16,40]", "f32[3,40,16]")) for s in shapes)


@needs_devices
@pytest.mark.parametrize("where", ["batch", "params"])
def test_inside_shard_map_without_axis_name_values_that_differ_are_refused(where):
    # Each device would find its own projectors from its own share: refused with
    # the axis named and `axis_name` offered, not JAX's carry-type error.
    rng = np.random.default_rng(2)
    params, loss, _ = _model(rng)
    opt, step = _galore_step(loss)
    mesh = _mesh()
    inputs = [params, opt.init(params), _batch(rng)]
    specs = [P(), P(), P("data")]
    select = lambda p: p  # noqa: E731
    if where == "params":
        # Weights given per device: one copy per device, stacked.
        inputs[0] = jax.tree.map(lambda x: jnp.stack([x] * DEVICES), params)
        specs = [P("data"), P(), P()]
        select = lambda p: jax.tree.map(lambda x: x[0], p)  # noqa: E731
    body = jax.shard_map(
        lambda p, s, b: step(select(p), s, b)[2],
        mesh=mesh,
        in_specs=tuple(specs),
        out_specs=P(),
    )
    inputs = [
        jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(inputs, specs)
    ]
    with pytest.raises(ValueError, match=r"'data'.*jax\.shard_map.*axis_name='data'"):
        jax.jit(body)(*inputs)


def test_an_axis_name_outside_shard_map_is_refused_by_name():
    params, loss, _ = _model(np.random.default_rng(6))
    opt, step = _galore_step(loss, axis_name="data")
    with pytest.raises(NameError, match="axis_name='data'.*jax.shard_map"):
        jax.eval_shape(step, params, opt.init(params), _batch(np.random.default_rng(7)))


def test_an_axis_name_that_is_no_name_is_refused_by_name():
    params, loss, _ = _model(np.random.default_rng(11))
    opt, step = _galore_step(loss, axis_name=["data"])
    with pytest.raises(TypeError, match="`axis_name` must be a mesh axis name"):
        jax.eval_shape(
            step, params, opt.init(params), _batch(np.random.default_rng(12))
        )


def test_axis_name_and_shardings_together_are_refused():
    params, loss, tx = _model(np.random.default_rng(8))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    with pytest.raises(ValueError, match="`axis_name`.*`shardings`.*not both"):
        qto.accumulate_gradients(
            loss,
            params,
            tx.init(params),
            jax.tree.map(lambda x: x[None], _batch(np.random.default_rng(9))),
            shardings=shardings,
            axis_name="data",
        )


@needs_devices
def test_inside_shard_map_a_batch_the_same_on_every_device_runs():
    # Nothing differs per device: the step runs as on one device, without
    # `axis_name`.
    rng = np.random.default_rng(3)
    params, loss, _ = _model(rng)
    opt, step = _galore_step(loss)
    body = jax.jit(jax.shard_map(step, mesh=_mesh(), in_specs=P(), out_specs=P()))
    _assert_same_steps(body, jax.jit(step), params, opt.init(params), _batch(rng), 1)
