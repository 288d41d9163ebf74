"""The default collectives choose the schedule that receives the fewest bytes: the
byte counts per schedule from shapes, the choice at each device count, and, on 2, 4
and 8 host devices, the bytes read from the compiled HLO.

The multi-device tests use the 8 host CPU devices that `tests/conftest.py` asks XLA
for; meshes of 2 and 4 devices use the first devices of the 8.
"""

import functools as ft

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import quax_tangents as qt
import quax_tangents.optax as qto
from quax_tangents._distributed._schedule import cheapest_schedule
from tests.helpers import assert_close
from tests.helpers.collective import (
    AXIS,
    on_mesh,
    skip_without_devices,
    split,
)


needs_devices = skip_without_devices(8)


_SHAPE = (64, 128)
COMPRESSORS = {
    "int8": ft.partial(qt.quantize, bits=8),
    "sign": qt.sign_norm,
    "top-k": lambda x: qt.top_k(x, 0.01),
}


def _value(name, shape=_SHAPE):
    return COMPRESSORS[name](jnp.ones(shape))


# ---------------------------------------------------------------------------------
# Bytes per schedule, from shapes


def test_schedule_bytes_follow_each_collective():
    x = qt.quantize(jnp.ones(_SHAPE), bits=8)
    dense = np.prod(_SHAPE) * 4
    for n in (2, 4, 8):
        costs = qt.hlo.schedule_bytes(x, n)
        assert costs["gather"] == (n - 1) * x.nbytes
        assert costs["dense"] == 2 * (n - 1) / n * dense
        # Chunks of whole 256-element blocks: 2 (n - 1) chunks of 1/n of the value.
        assert costs["two_phase"] == 2 * (n - 1) * x.nbytes / n
    assert qt.hlo.schedule_bytes(x, 1) == {
        "gather": 0.0,
        "dense": 0.0,
        "two_phase": 0.0,
    }
    # No chunks for LowRank, nor for batched values.
    assert set(qt.hlo.schedule_bytes(qt.low_rank(jnp.ones(_SHAPE), 2), 4)) == {
        "gather",
        "dense",
    }
    with pytest.raises(ValueError, match="`devices`"):
        qt.hlo.schedule_bytes(x, 0)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_the_choice_at_each_device_count(name):
    x = _value(name)
    assert cheapest_schedule(x, 1) == "gather"
    assert cheapest_schedule(x, 2) == "gather"  # a tie with two-phase: exact wins
    for n in (3, 4, 8, 64):
        assert cheapest_schedule(x, n) == "two_phase"
    for n in (2, 3, 4, 8, 64):
        costs = qt.hlo.schedule_bytes(x, n)
        assert costs[cheapest_schedule(x, n)] == min(costs.values())
        assert costs[cheapest_schedule(x, n)] <= costs["dense"]


def test_the_dense_all_reduce_when_no_compressed_schedule_is_cheaper():
    # Over half the entries kept: index and value cost more than the dense entry.
    dense_topk = qt.top_k(jnp.ones(_SHAPE), 0.6)
    for n in (2, 4, 8):
        assert cheapest_schedule(dense_topk, n) == "dense"
    # A LowRank gathers `(n - 1) r (m + n)` elements: cheaper until many devices.
    low_rank = qt.low_rank(jnp.ones(_SHAPE), 4)
    assert cheapest_schedule(low_rank, 8) == "gather"
    assert cheapest_schedule(low_rank, 64) == "dense"


class _Halves(qt.CompressedArray):
    """A type of the protocol without its own `all_reduce` (nor chunks): half of
    each row stored."""

    half: jax.Array

    def aval(self):
        rows, cols = self.half.shape
        return jax.core.ShapedArray((rows, 2 * cols), self.half.dtype)

    def materialise(self):
        return jnp.concatenate([self.half, self.half], axis=1)


def test_a_type_without_its_own_all_reduce_is_never_gathered():
    # Its `all_reduce` materialises (counted) and runs `lax.psum`: receiving
    # `(n - 1)` compressed values is not what it would do.
    x = _Halves(jnp.ones((4, 2)))
    assert qt.hlo.schedule_bytes(x, 2)["gather"] < qt.hlo.schedule_bytes(x, 2)["dense"]
    for n in (2, 8):
        assert cheapest_schedule(x, n) == "dense"


def test_compress_method_arguments():
    sign = qt.sign_norm
    for method in [None, qt.Cheapest(), qt.GatherSum(), qt.TwoPhase()]:
        qto.compress_updates(sign, axis_name=AXIS, method=method)
    with pytest.raises(TypeError, match=r"an instance: `TwoPhase\(\)`"):
        qto.compress_updates(sign, axis_name=AXIS, method=qt.TwoPhase)
    with pytest.raises(TypeError, match="`method` must be"):
        qto.compress_updates(sign, axis_name=AXIS, method="two_phase")
    with pytest.raises(TypeError, match="qto.powersgd"):
        qto.compress_updates(sign, axis_name=AXIS, method=qt.PowerSum(2))
    with pytest.raises(ValueError, match="needs an `axis_name`"):
        qto.compress_updates(sign, method=qt.TwoPhase())


# ---------------------------------------------------------------------------------
# On 2, 4 and 8 devices, from the compiled HLO


def _received(body, n) -> tuple[float, set[str]]:
    xs = split(np.ones((n, *_SHAPE), np.float32), n)
    found = qt.hlo.collectives(on_mesh(body, P(AXIS), P(), devices=n), xs)
    return sum(qt.hlo.received_bytes(c, n) for c in found), {c.kind for c in found}


def _dense_received(n):
    return 2 * (n - 1) / n * np.prod(_SHAPE) * 4


@needs_devices
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("name", COMPRESSORS)
def test_the_default_all_reduce_never_receives_more_than_dense(name, n):
    compressor = COMPRESSORS[name]

    def body(x):
        return qt.materialise(qt.all_reduce(compressor(x[0]), AXIS))

    received, kinds = _received(body, n)
    dense, _ = _received(lambda x: qt.all_reduce(x[0], AXIS), n)
    assert dense == _dense_received(n)
    assert received <= dense, (received, dense)
    # What the compiled program receives is what the choice was made on.
    choice = cheapest_schedule(_value(name), n)
    expected = {"gather": {"all-gather"}, "two_phase": {"all-to-all", "all-gather"}}
    assert kinds == expected[choice]
    assert received == pytest.approx(qt.hlo.schedule_bytes(_value(name), n)[choice])


@needs_devices
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("name", COMPRESSORS)
def test_the_default_compress_never_receives_more_than_dense(name, n):
    tx = qto.compress_updates(COMPRESSORS[name], axis_name=AXIS)

    def body(g):
        state = tx.init(g[0])
        updates, _ = tx.update(g[0], state)
        return updates

    received, _ = _received(body, n)
    # The dense updates of uncompressed leaves would add their own all-reduce.
    assert received <= _dense_received(n), (received, _dense_received(n))


@needs_devices
@pytest.mark.parametrize("n", [2, 8])
def test_the_dense_fallback_is_the_exact_sum_and_counted(n):
    xs = np.random.default_rng(0).standard_normal((n, *_SHAPE)).astype(np.float32)
    compressor = ft.partial(qt.top_k, k=0.6)

    def body(x, method):
        return qt.materialise(qt.all_reduce(compressor(x[0]), AXIS, method))

    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        fallback = on_mesh(ft.partial(body, method=None), P(AXIS), P(), devices=n)
        total = fallback(split(xs, n))
    assert qt.fallback_counts() == {("all_reduce", "Sparse"): 1}
    gathered = on_mesh(ft.partial(body, method=qt.GatherSum()), P(AXIS), P(), devices=n)
    assert_close(total, gathered(split(xs, n)))
    with qt.fallback("silent"):
        _, kinds = _received(ft.partial(body, method=None), n)
    assert kinds == {"all-reduce"}
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="GatherSum"):
        # A new function, traced again under the error mode.
        on_mesh(ft.partial(body, method=None), P(AXIS), P(), devices=n)(split(xs, n))


@needs_devices
def test_auto_compress_on_two_and_eight_devices_converges():
    # On 2 devices the gather (exact), on 8 the two-phase schedule with its server
    # error: both fit least squares as well as the explicit schedules do.
    rng = np.random.default_rng(1)
    for n in (2, 8):
        a = rng.standard_normal((n, 24, 16)).astype(np.float32)
        b = rng.standard_normal((n, 24, 8)).astype(np.float32)
        solution = np.linalg.lstsq(a.reshape(-1, 16), b.reshape(-1, 8), rcond=None)[0]
        int8 = ft.partial(qt.quantize, bits=8)
        tx = optax.chain(qto.compress_updates(int8, axis_name=AXIS), optax.sgd(0.05))

        def run(a, b, tx=tx):
            w = jnp.zeros((16, 8))
            state = tx.init(w)

            def step(carry, _):
                w, state = carry
                grad = a[0].T @ (a[0] @ w - b[0]) / a.shape[1]
                updates, state = tx.update(grad, state, w)
                return (optax.apply_updates(w, updates), state), None

            (w, _), _ = jax.lax.scan(step, (w, state), length=400)
            return w

        w = on_mesh(run, (P(AXIS), P(AXIS)), P(), devices=n)(split(a, n), split(b, n))
        error = np.linalg.norm(w - solution) / np.linalg.norm(solution)
        assert error < 0.05, (n, error)
