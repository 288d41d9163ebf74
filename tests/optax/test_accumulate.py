"""`quax_tangents.optax.accumulate_gradients`: microbatches give the full batch's
projected gradient (same fresh projector on refresh steps), and the scan carries the
small factors only; `optax.MultiSteps` around `projected`."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import quax

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import assert_close, heads, random_array
from tests.helpers.fallback import projects_dense_gradients
from tests.helpers.loop_weights import layout_constraints, project_matrices, tiled_case
from tests.helpers.matrix_view import (
    DIMS,
    D,
    attention_loss,
    attention_params,
    matrix_view,
)
from tests.helpers.stacked import scanned, stacked_params, weight_buffers


RANK = 2
K, B = 4, 6


def _params(rng):
    return {
        "wide": jnp.asarray(rng.standard_normal((8, 12)), jnp.float32) * 0.4,
        "tall": jnp.asarray(rng.standard_normal((12, 7)), jnp.float32) * 0.4,
        "table": jnp.asarray(rng.standard_normal((15, 8)), jnp.float32),
        "bias": jnp.zeros(7),
    }


def _loss(params, batch):
    ids, x, y = batch
    h = jnp.tanh((x + params["table"][ids]) @ params["wide"])
    return jnp.mean((h @ params["tall"] + params["bias"] - y) ** 2)


def _batches(rng):
    ids = jnp.asarray(rng.integers(0, 15, (K, B)))
    x = jnp.asarray(rng.standard_normal((K, B, 8)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((K, B, 7)), jnp.float32)
    return ids, x, y


def _full(microbatches):
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), microbatches)


_TX = qto.projected(
    optax.scale_by_adam(),
    rank=RANK,
    learning_rate=1e-2,
    refresh_every=2,
    rows={"wide": False, "tall": False, "table": True, "bias": False},
)


def test_the_models_pass_is_traced_once():
    # The loop over (trip, microbatch) replays the one trace that gives its carry's
    # shapes: `loss_fn`'s Python runs once per step, on a refresh step with power
    # iterations as on any (twice before, the first only for the shapes).
    rng = np.random.default_rng(0)
    params = _params(rng)
    state = _TX.init(params)
    calls = []

    def loss(params, batch):
        calls.append(None)
        return _loss(params, batch)

    jax.jit(
        lambda p, s, b: qto.accumulate_gradients(
            loss, p, s, b, key=jax.random.key(0), iters=1
        )
    ).lower(params, state, _batches(rng))
    assert len(calls) == 1


@pytest.mark.parametrize("iters", [0, 1])
def test_microbatches_give_the_full_batch_projected_gradient(iters):
    rng = np.random.default_rng(0)
    params = _params(rng)
    state = _TX.init(params)
    key = jax.random.key(7)

    @jax.jit
    def accumulated(params, state, microbatches):
        return qto.accumulate_gradients(
            _loss, params, state, microbatches, key=key, iters=iters
        )

    @jax.jit
    def full_batch(params, state, batch):
        marked = lambda p: _loss(qto.mark(p, state, key=key, iters=iters), batch)  # noqa: E731
        return qt.value_and_grad(marked)(params)

    refreshes = []
    for _ in range(3):  # refresh, keep, refresh
        microbatches = _batches(rng)
        loss, grads = accumulated(params, state, microbatches)
        expected_loss, expected = full_batch(params, state, _full(microbatches))
        refreshes.append(bool(state.refresh))
        assert_close(loss, expected_loss)
        for name in ("wide", "tall"):
            g, e = grads[name], expected[name]
            assert isinstance(g, qt.LowRank) and g.projector_side == e.projector_side
            assert_close(g, e, factor=5)
            side = "left" if g.projector_side == "left" else "right"
            assert_close(getattr(g, side), getattr(e, side), factor=5)
        assert isinstance(grads["table"], qt.SparseRows)
        assert_close(grads["table"], expected["table"])
        assert_close(grads["bias"], expected["bias"])
        updates, state = _TX.update(grads, state)
        params = qto.apply_updates(params, updates)
    assert refreshes == [True, False, True]


def test_aux_is_stacked_over_the_microbatches():
    rng = np.random.default_rng(1)
    params = _params(rng)
    state = _TX.init(params)
    microbatches = _batches(rng)

    def with_aux(p, batch):
        return _loss(p, batch), batch[1].sum()

    (loss, aux), _ = qto.accumulate_gradients(
        with_aux, params, state, microbatches, has_aux=True
    )
    assert_close(aux, microbatches[1].sum(axis=(1, 2)))
    each = [
        _loss(params, jax.tree.map(lambda a, i=i: a[i], microbatches)) for i in range(K)
    ]
    assert_close(loss, np.mean(each))


def _while_carries(hlo: str) -> list[list[str]]:
    """The element shapes of every `while` loop's carry in a compiled program
    (XLA:CPU's, this suite's backend)."""
    carries = []
    for line in hlo.splitlines():
        match = re.search(r"=\s*\((.*)\)\s+while\(", line)
        if match:
            carries.append(re.findall(r"[a-z0-9]+\[[0-9,]*\]", match.group(1)))
    return carries


def test_the_scan_carries_no_weight_shaped_accumulator():
    rng = np.random.default_rng(2)
    params = {k: v for k, v in _params(rng).items() if k != "table"}
    tx = qto.projected(optax.scale_by_adam(), rank=RANK, learning_rate=1e-2)
    state = tx.init(params)
    ids, x, y = _batches(rng)
    microbatches = (ids, x, y)

    def loss(p, batch):
        _, x, y = batch
        return jnp.mean((jnp.tanh(x @ p["wide"]) @ p["tall"] + p["bias"] - y) ** 2)

    def ours(params, state, microbatches):
        return qto.accumulate_gradients(loss, params, state, microbatches)

    def dense(params, state, microbatches):  # what a leafwise accumulator carries
        def body(total, batch):
            return jax.tree.map(jnp.add, total, jax.grad(loss)(params, batch)), None

        return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), microbatches)[0]

    # Shapes where the range finder's width (rank + 4) is below each smaller side.
    weights = {"f32[8,12]", "f32[12,8]", "f32[12,7]", "f32[7,12]"}

    def weight_shaped(fn):
        hlo = jax.jit(fn).lower(params, state, microbatches).compile().as_text()
        scans = [
            c for c in _while_carries(hlo) if "f32[4,6,8]" in c
        ]  # over microbatches
        assert scans
        return max(sum(s in weights for s in carry) for carry in scans)

    # The weights themselves ride in the carry (loop invariants): one per weight.
    # A dense accumulator would add one more per weight.
    assert weight_shaped(dense) == 4
    assert weight_shaped(ours) == 2


def test_tiled_weights_ride_the_loop_row_major_to_the_same_gradient():
    # The trips' loop carries the weights whose default layout is row-major on a
    # TPU too, and keeps them row-major inside it (libtpu 0.0.52 copies a stack it
    # only reads into its matmuls' layout, whole, before the loop); the others it
    # closes over. Either way the gradient is the full batch's.
    rng = np.random.default_rng(11)
    params, microbatches, loss = tiled_case(rng, K, B)
    tx = qto.projected(
        optax.scale_by_adam(),
        rank=RANK,
        learning_rate=1e-2,
        refresh_every=2,
        project=project_matrices,
    )
    state = tx.init(params)
    key = jax.random.key(3)

    @jax.jit
    def accumulated(params, state, microbatches):
        return qto.accumulate_gradients(loss, params, state, microbatches, key=key)

    @jax.jit
    def full_batch(params, state, batch):
        marked = lambda p: loss(qto.mark(p, state, key=key), batch)  # noqa: E731
        return qt.value_and_grad(marked)(params)

    lowered = accumulated.lower(params, state, microbatches).as_text()
    assert layout_constraints(lowered) == ["128x128xf32"]
    for _ in range(2):  # a refresh, then a step that keeps the projectors
        value, grads = accumulated(params, state, microbatches)
        expected_value, expected = full_batch(params, state, _full(microbatches))
        assert_close(value, expected_value)
        for name in ("tiled", "ragged"):
            assert_close(grads[name], expected[name], factor=5)
        assert_close(grads["bias"], expected["bias"])
        updates, state = tx.update(grads, state)
        params = qto.apply_updates(params, updates)


# ---------------------------------------------------------------------------------------
# optax.MultiSteps


@projects_dense_gradients
def test_multi_steps_on_dense_gradients_raises_naming_accumulate_gradients():
    # MultiSteps masks the inner updates leafwise (a multiply by a bool); on the
    # LowRank updates of `projected` that is arithmetic on their fields, which the
    # guard leaf refuses, with a message that names the supported way.
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.standard_normal((6, 10)), jnp.float32)}
    base = qto.projected(optax.scale_by_adam(), rank=RANK, learning_rate=0.1)
    multi = optax.MultiSteps(base, every_k_schedule=K)
    multi_state = multi.init(params)
    g = {"w": jnp.asarray(rng.standard_normal((6, 10)), jnp.float32)}
    with pytest.raises(TypeError, match="accumulate_gradients"):
        multi.update(g, multi_state, params)


@projects_dense_gradients
def test_multi_steps_on_marked_gradients_raises_naming_accumulate_gradients():
    params = {"w": jnp.zeros((6, 10))}
    multi = optax.MultiSteps(
        qto.projected(optax.scale_by_adam(), rank=RANK), every_k_schedule=K
    )
    state = multi.init(params)
    with pytest.raises(TypeError, match="accumulate_gradients"):
        qto.mark(params, state)
    with pytest.raises(TypeError, match="accumulate_gradients"):
        qto.projectors(state)
    # Projected gradients made by hand do not pass silently either: MultiSteps's
    # accumulator is shaped like the parameters, not like a LowRank.
    p = jnp.asarray(np.linalg.qr(np.ones((6, RANK)) + np.eye(6, RANK))[0], jnp.float32)
    grads = {"w": qt.LowRank(p, jnp.ones((10, RANK)), "left")}
    with pytest.raises((TypeError, ValueError)):
        multi.update(grads, state, params)


def _user_loop_case():
    rng = np.random.default_rng(4)
    params = {"w": jnp.asarray(rng.standard_normal((24, 20)), jnp.float32) * 0.3}
    tx = qto.projected(optax.scale_by_adam(), rank=RANK, learning_rate=0.1)
    x = jnp.asarray(rng.standard_normal((K, B, 24)), jnp.float32)

    def loss(p, xb):
        return jnp.sum(jnp.tanh(xb @ p["w"]) ** 2)

    return params, tx, tx.init(params), x, loss


def test_a_mean_over_a_vmap_axis_of_marked_gradients_names_accumulate_gradients():
    # vmap copies the projector along its axis, so the mean concatenates K
    # projections (rank K * RANK): no longer one projection, and refused by name.
    params, tx, state, x, loss = _user_loop_case()

    def mean_grads(params, state, x):
        marked = lambda p, xb: loss(qto.mark(p, state), xb)
        grads = jax.vmap(lambda xb: qt.grad(marked)(params, xb))(x)
        return quax.quaxify(lambda g: jax.tree.map(lambda a: a.mean(0), g))(grads)

    grads = jax.jit(mean_grads)(params, state, x)
    assert grads["w"].rank == K * RANK and grads["w"].projector_side is None
    with pytest.raises(TypeError, match="accumulate_gradients"):
        tx.update(grads, state, params)
    # Over the budget it densifies, counted, with the same pointer (traced anew: a
    # jitted function's cache does not key on the fallback mode).
    with qt.rank_budget(max_rank=RANK), qt.fallback("error"):
        with pytest.raises(qt.DensificationError, match="accumulate_gradients"):
            mean_grads(params, state, x)


def _scan_of_marked_gradients(state, params, x, loss):
    """Levanter-style accumulation: a `lax.scan` whose carry adds each microbatch's
    marked gradient."""
    marked = lambda p, xb: loss(qto.mark(p, state), xb)

    def body(acc, xb):
        grads = qt.grad(marked)(params, xb)
        return quax.quaxify(lambda a, g: jax.tree.map(jnp.add, a, g))(acc, grads), None

    return jax.lax.scan(body, qt.grad(marked)(params, x[0]), x[1:])[0]


def test_a_scan_carry_of_marked_gradients_on_a_refresh_step_names_the_fix():
    # Each microbatch draws its own projector: no sum of projections keeps a rank.
    params, tx, state, x, loss = _user_loop_case()
    with pytest.raises(jax.errors.JaxRuntimeError, match="accumulate_gradients"):
        _scan_of_marked_gradients(state, params, x, loss)


def test_a_scan_carry_of_marked_gradients_keeps_the_rank_with_a_kept_projector():
    params, tx, state, x, loss = _user_loop_case()
    _, state = tx.update(
        qt.grad(lambda p: loss(qto.mark(p, state), x[0]))(params), state, params
    )
    assert not bool(state.refresh)
    total = _scan_of_marked_gradients(state, params, x, loss)
    assert total["w"].rank == RANK and total["w"].projector_side is not None
    marked = qt.grad(lambda p, xb: loss(qto.mark(p, state), xb))
    expected = sum(marked(params, xb)["w"].materialise() for xb in x)
    assert_close(total["w"], expected, factor=4)


def test_stacked_weights_accumulate_to_the_full_batch_projected_gradient():
    rng = np.random.default_rng(4)
    params = {
        "up": jnp.asarray(rng.standard_normal((3, 8, 14)), jnp.float32) * 0.3,
        "down": jnp.asarray(rng.standard_normal((3, 14, 8)), jnp.float32) * 0.3,
    }
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, learning_rate=1e-2, refresh_every=2
    )
    state = tx.init(params)
    key = jax.random.key(1)

    def loss(p, batch):
        x, y = batch

        def layer(h, w):
            return h + jnp.tanh(h @ w["up"]) @ w["down"], None

        return jnp.mean((jax.lax.scan(layer, x, p)[0] - y) ** 2)

    accumulated = jax.jit(
        lambda p, s, mb: qto.accumulate_gradients(loss, p, s, mb, key=key)
    )
    full_batch = jax.jit(
        lambda p, s, b: qt.grad(lambda p: loss(qto.mark(p, s, key=key, iters=0), b))(p)
    )
    for _ in range(2):  # refresh, keep
        microbatches = tuple(
            jnp.asarray(rng.standard_normal((K, B, 8)), jnp.float32) for _ in range(2)
        )
        _, grads = accumulated(params, state, microbatches)
        expected = full_batch(params, state, _full(microbatches))
        for name in params:
            assert grads[name].batch_ndim == 1
            assert_close(grads[name], expected[name], factor=5)
        updates, state = tx.update(grads, state)
        params = qto.apply_updates(params, updates)


def _count(jaxpr, name):
    """The equations of primitive `name` in `jaxpr` and the jaxprs inside it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _count(inner, name)
    return count


@pytest.mark.parametrize("iters", [0, 1])
def test_every_pass_is_a_trip_of_one_loop_around_one_copy_of_the_loss(iters):
    # Plain control flow, one compiled pass: one `while_loop` over (trip,
    # microbatch) whose body holds the only copy of the loss; a step that keeps the
    # projectors makes one trip, a refresh `3 + 2 * iters` (sketch, power
    # iterations, basis, then the step's own).
    params = stacked_params((3,), 24, 40)
    tx = qto.projected(optax.scale_by_adam(), rank=3, learning_rate=1e-2)
    microbatches = random_array(5, (2, 4, 24))
    calls = []

    def loss(p, batch):
        jax.debug.callback(lambda: calls.append(1))
        return jnp.mean(scanned(batch, p) ** 2)

    def step(p, s, mb):
        return qto.accumulate_gradients(
            loss, p, s, mb, key=jax.random.key(0), iters=iters
        )

    state = tx.init(params)
    jaxpr = jax.make_jaxpr(step)(params, state, microbatches)
    loops = [e for e in jaxpr.eqns if e.primitive.name == "while"]
    assert len(loops) == 1
    assert _count(jaxpr.jaxpr, "debug_callback") == 1
    assert _count(loops[0].params["body_jaxpr"].jaxpr, "debug_callback") == 1
    for refresh, trips in ((True, 3 + 2 * iters), (False, 1)):
        calls.clear()
        jax.block_until_ready(
            step(params, state._replace(refresh=jnp.asarray(refresh)), microbatches)
        )
        assert len(calls) == 2 * trips


def _one_layer(h, w):
    return h + jnp.tanh(h @ w["up"]) @ w["up"].T


_SCANS = {
    "reverse": lambda p, x: jax.lax.scan(
        lambda h, w: (_one_layer(h, w), None), x, p, reverse=True
    )[0],
    "unrolled": lambda p, x: jax.lax.scan(
        lambda h, w: (_one_layer(h, w), None), x, p, unroll=2
    )[0],
    "weight used twice per layer": lambda p, x: jax.lax.scan(
        lambda h, w: (_one_layer(_one_layer(h, w), w), None), x, p
    )[0],
    # A `jax.jit` or `jax.checkpoint` around the scan, as a model may hold one.
    "inside a jit": jax.jit(
        lambda p, x: jax.lax.scan(lambda h, w: (_one_layer(h, w), None), x, p)[0]
    ),
    "inside a checkpoint": jax.checkpoint(
        lambda p, x: jax.lax.scan(lambda h, w: (_one_layer(h, w), None), x, p)[0]
    ),
    "inside an outer scan": lambda p, x: jax.lax.scan(
        lambda c, _: (
            jax.lax.scan(lambda h, w: (_one_layer(h, w), None), c, p)[0],
            None,
        ),
        x,
        None,
        length=2,
    )[0],
}


@pytest.mark.parametrize("form", sorted(_SCANS))
def test_the_layer_by_layer_projection_holds_for_other_forms_of_scan(
    form, scans_projected
):
    # Each form gives the full-batch projection. All but the last take the
    # layer-by-layer path: a scan over the stack nested in an outer scan that closes
    # over it keeps each layer's factors until the scans end.
    rng = np.random.default_rng(6)
    params = {"up": jnp.asarray(rng.standard_normal((3, 6, 9)), jnp.float32) * 0.3}
    tx = qto.projected(optax.scale_by_adam(), rank=RANK, learning_rate=1e-2)
    state = tx.init(params)

    def loss(p, x):
        return jnp.mean(_SCANS[form](p, x) ** 2)

    microbatches = jnp.asarray(rng.standard_normal((K, B, 6)), jnp.float32)
    nested = form == "inside an outer scan"
    with qt.fallback("error"), warnings.catch_warnings():
        # The nested form keeps the factors, and says so (tested below).
        if nested:
            warnings.simplefilter("ignore", qto.LayerByLayerWarning)
        _, grads = qto.accumulate_gradients(loss, params, state, microbatches)
    assert bool(scans_projected) == (not nested)
    # The reference projects after the scans, whatever their form.
    expected = qt.grad(
        lambda p: loss(qto.mark(p, state, by_layer=False), _full(microbatches))
    )(params)
    assert_close(grads["up"], expected["up"], factor=5)


# Scans over a stack that cannot project it layer by layer, as a model may hold them.
_UNSEEN = {
    "inside an outer scan": _SCANS["inside an outer scan"],
    "transposed before the scan": lambda p, x: jax.lax.scan(
        lambda h, w: (_one_layer(h, {"up": w.T}), None),
        x,
        jnp.swapaxes(p["up"], -1, -2),
    )[0],
}


def _trace_accumulation(model, by_layer=True):
    """The `LayerByLayerWarning`s of tracing `accumulate_gradients` on `model`."""
    rng = np.random.default_rng(6)
    params = {"up": jnp.asarray(rng.standard_normal((3, 6, 9)), jnp.float32) * 0.3}
    state = qto.projected(optax.scale_by_adam(), rank=RANK).init(params)
    microbatches = jnp.asarray(rng.standard_normal((K, B, 6)), jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(
            lambda p, s, mb: qto.accumulate_gradients(
                lambda p, x: jnp.mean(model(p, x) ** 2), p, s, mb, by_layer=by_layer
            ),
            params,
            state,
            microbatches,
        )
    return [w for w in caught if issubclass(w.category, qto.LayerByLayerWarning)]


@pytest.mark.parametrize("form", sorted(_UNSEEN))
def test_a_stack_that_no_scan_projects_warns_naming_by_layer_false(
    form, scans_projected
):
    found = _trace_accumulation(_UNSEEN[form])
    assert not scans_projected
    assert found, "no LayerByLayerWarning"
    message = str(found[0].message)
    assert re.search(r"shape \(3, (6, 9|9, 6)\)", message), message
    assert "by_layer=False" in message
    assert not _trace_accumulation(_UNSEEN[form], by_layer=False)


def test_a_stack_cast_before_the_scan_is_projected_layer_by_layer(scans_projected):
    # As a mixed-precision policy casts float32 parameters for the forward pass.
    rng = np.random.default_rng(7)
    params = {"up": jnp.asarray(rng.standard_normal((3, 6, 9)), jnp.float32) * 0.3}
    state = qto.projected(optax.scale_by_adam(), rank=RANK).init(params)

    def loss(p, x):
        w, h = p["up"].astype(jnp.bfloat16), x.astype(jnp.bfloat16)
        out = jax.lax.scan(lambda h, w: (_one_layer(h, {"up": w}), None), h, w)[0]
        return jnp.mean(out.astype(jnp.float32) ** 2)

    microbatches = jnp.asarray(rng.standard_normal((K, B, 6)), jnp.float32)
    with qt.fallback("error"):
        _, grads = qto.accumulate_gradients(loss, params, state, microbatches)
    assert scans_projected
    expected = qt.grad(lambda p: loss(qto.mark(p, state), _full(microbatches)))(params)
    assert grads["up"].left.dtype == jnp.float32
    assert_close(grads["up"], expected["up"], jnp.bfloat16)


def test_a_stack_that_a_scan_projects_does_not_warn(scans_projected):
    assert not _trace_accumulation(_SCANS["reverse"])
    assert scans_projected


def test_by_layer_must_be_a_bool():
    params = {"up": jnp.zeros((2, 6, 9))}
    state = qto.projected(optax.scale_by_adam(), rank=RANK).init(params)
    with pytest.raises(TypeError, match="by_layer"):
        qto.accumulate_gradients(
            lambda p, x: jnp.sum(x), params, state, jnp.ones((K, 1)), by_layer=1
        )


def test_a_stack_scanned_twice_raises_naming_by_layer_false_which_gives_the_result():
    # The layer-by-layer projection writes the running sum inside the one scan over
    # the stack; a model that runs the stack twice (weights shared across two
    # passes) must say so, and `by_layer=False` gives the full-batch projection.
    rng = np.random.default_rng(5)
    params = {"up": jnp.asarray(rng.standard_normal((2, 6, 9)), jnp.float32) * 0.3}
    tx = qto.projected(optax.scale_by_adam(), rank=RANK, learning_rate=1e-2)
    state = tx.init(params)

    def loss(p, x):
        def layer(h, w):
            return h + jnp.tanh(h @ w["up"]) @ w["up"].T, None

        twice = jax.lax.scan(layer, jax.lax.scan(layer, x, p)[0], p)[0]
        return jnp.mean(twice**2)

    microbatches = jnp.asarray(rng.standard_normal((K, B, 6)), jnp.float32)
    with pytest.raises(ValueError, match="by_layer=False"):
        qto.accumulate_gradients(loss, params, state, microbatches)
    _, grads = qto.accumulate_gradients(
        loss, params, state, microbatches, by_layer=False
    )
    expected = qt.grad(
        lambda p: loss(qto.mark(p, state, by_layer=False), _full(microbatches))
    )(params)
    assert_close(grads["up"], expected["up"], factor=5)


# ---------------------------------------------------------------------------------------
# Weights stored with more dims than their matrix (`dims=`)


def test_viewed_leaves_accumulate_to_the_full_batch_projected_gradient():
    params = attention_params()
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, learning_rate=1e-2, refresh_every=2, dims=DIMS
    )
    state = tx.init(params)
    key = jax.random.key(2)
    accumulated = jax.jit(
        lambda p, s, mb: qto.accumulate_gradients(attention_loss, p, s, mb, key=key)
    )
    full_batch = jax.jit(
        lambda p, s, b: qt.value_and_grad(
            lambda p: attention_loss(qto.mark(p, s, key=key, iters=0), b)
        )(p)
    )
    for t in range(2):  # refresh, keep
        microbatches = random_array(10 + t, (2, 2, 4, D))
        with qt.fallback("error"):
            loss, grads = accumulated(params, state, microbatches)
            expected_loss, expected = full_batch(params, state, _full(microbatches))
        assert_close(loss, expected_loss)
        for name, dims in DIMS.items():
            g, e = grads[name], expected[name]
            assert isinstance(g, qt.LowRank) and g.batch_ndim == 1
            assert g.shape == matrix_view(params[name], dims).shape
            assert g.projector_side == e.projector_side
            assert_close(g, e, factor=5)
        updates, state = tx.update(grads, state)
        params = qto.apply_updates(params, updates)


def test_viewed_leaves_accumulate_with_no_weight_shaped_buffer():
    params = attention_params(layers=3, d=24, heads=4, head_dim=5)
    state = qto.projected(optax.scale_by_adam(), rank=RANK, dims=DIMS).init(params)
    microbatches = random_array(3, (2, 2, 3, 24))
    accumulated = jax.jit(
        lambda p, s, mb: qto.accumulate_gradients(attention_loss, p, s, mb)
    )

    # One pass over the microbatches taking the gradient of the inputs alone: it
    # reads the weights in the backward pass (transposed, per layer) as every pass
    # does, but forms no weight gradient.
    def inputs_only(p, mb):
        return jax.lax.map(jax.grad(lambda b: attention_loss(p, b)), mb)

    passes = 4  # a refresh (3 passes: sketches, then products with the basis's
    # first `rank` columns and with the rest), then the step's own pass
    shapes = [
        f"f32[{layers}{s}]"
        for layers in ("3,", "")
        for s in ("24,4,5", "4,5,24", "24,20", "20,24")
    ]
    with qt.fallback("error"):
        ours = [
            len(weight_buffers(accumulated, (params, state, microbatches), s))
            for s in shapes
        ]
    reads = [
        len(weight_buffers(jax.jit(inputs_only), (params, microbatches), s))
        for s in shapes
    ]
    # A leafwise dense accumulator holds stacked `(3, 24, 4, 5)` gradients, which
    # no pass reads (8 such buffers for each weight, measured): those must be 0.
    assert all(o <= passes * r for o, r in zip(ours, reads)), (ours, reads)
    assert ours[:4] == [0, 0, 0, 0]


def test_weights_viewed_with_dims_accumulate_to_the_projection_of_their_matrix():
    # (d, heads, head_dim) einsum weights with `dims=`: each microbatch marks the
    # (d, heads * head_dim) matrix, and the gradient is a LowRank of that matrix,
    # with no densification.
    model = heads.HeadsLM(jax.random.key(0))
    tx = qto.projected(
        optax.scale_by_adam(),
        rank=RANK,
        learning_rate=1e-2,
        refresh_every=2,
        project=heads.project,
        dims=heads.dims,
    )
    state = tx.init(model)
    step_loss = jax.jit(
        lambda m, s, mb, key: qto.accumulate_gradients(heads.loss, m, s, mb, key=key)
    )
    rng = np.random.default_rng(5)
    for step in range(2):  # refresh, keep
        microbatches = jnp.asarray(rng.integers(0, heads.VOCAB, (2, 3, 7)))
        with qt.fallback("error"):
            loss, grads = step_loss(model, state, microbatches, jax.random.key(step))
        full = microbatches.reshape(6, 7)
        expected_loss, dense = jax.value_and_grad(heads.loss)(model, full)
        assert_close(loss, expected_loss)
        projectors = heads.weights(state.projector)
        for g, d, p in zip(heads.weights(grads), heads.weights(dense), projectors):
            matrix = d.reshape(d.shape[0], -1)
            assert isinstance(g, qt.LowRank) and g.shape == matrix.shape
            q = g.left if g.projector_side == "left" else g.right
            assert_close(q.T @ q, jnp.eye(RANK))
            if g.projector_side == "left":
                assert_close(g, q @ (q.T @ matrix))
            else:
                assert_close(g, (matrix @ q) @ q.T)
            if not bool(state.refresh):
                assert_close(q, p)
        updates, state = tx.update(grads, state)
        new = qto.apply_updates(model, updates)
        assert [w.shape for w in heads.weights(new)] == [
            w.shape for w in heads.weights(model)
        ]
        model = new


def test_stacked_per_head_weights_in_a_scan_accumulate_to_their_matrix_projection(
    scans_projected,
):
    # (layers, d, heads, head_dim) with dims=(1, 1), sliced by a scan over a
    # checkpointed body: one LowRank of the (layers, d, heads * head_dim) stack,
    # projected layer by layer in the scan's backward pass.
    params = heads.stacked_per_head(jax.random.key(0))
    tx = qto.projected(
        optax.scale_by_adam(), rank=RANK, learning_rate=1e-2, dims=lambda w: (1, 1)
    )
    state = tx.init(params)
    xs = jax.random.normal(jax.random.key(1), (2, 3, 5, heads.DIM))
    with qt.fallback("error"):
        _, grads = jax.jit(
            lambda p, s: qto.accumulate_gradients(
                heads.scanned_loss, p, s, xs, key=jax.random.key(2)
            )
        )(params, state)
    assert scans_projected
    mean_loss = lambda p: jnp.mean(jax.vmap(lambda b: heads.scanned_loss(p, b))(xs))  # noqa: E731
    dense = jax.grad(mean_loss)(params)
    for name, g in grads.items():
        matrices = dense[name].reshape(g.shape)
        assert isinstance(g, qt.LowRank) and g.batch_ndim == 1
        assert g.shape == (heads.LAYERS, heads.DIM, heads.HEADS * heads.HEAD_DIM)
        q = g.left
        assert_close(g, q @ (jnp.swapaxes(q, -1, -2) @ matrices))
    updates, _ = tx.update(grads, state)
    new = qto.apply_updates(params, updates)
    assert jax.tree.map(jnp.shape, new) == jax.tree.map(jnp.shape, params)
