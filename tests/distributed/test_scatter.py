"""The two-phase all-reduce and the compressed reduce-scatter on 8 host devices: the
bytes each device receives (from the compiled HLO), the results against the same
sums computed centrally, and error feedback around them in `qto.compress_updates`.

The multi-device tests use the 8 host CPU devices that `tests/conftest.py` asks XLA
for.
"""

import functools as ft
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import quax_tangents as qt
import quax_tangents.optax as qto
from quax_tangents._distributed._hlo import Collective
from quax_tangents._distributed._scatter import chunk_elems
from tests.helpers import assert_close
from tests.helpers.collective import (
    relative_error,
    run_replicated,
    skip_without_devices,
)
from tests.helpers.scatter import (
    AXIS,
    DEVICES,
    least_squares,
    least_squares_grad,
    on_mesh,
    split,
)
from tests.helpers.scripts import run_script


ROOT = pathlib.Path(__file__).resolve().parents[2]

needs_devices = skip_without_devices(DEVICES)


# ---------------------------------------------------------------------------------
# The byte accounting


def test_received_bytes_follows_each_collective_kind():
    def one(kind):
        return Collective(kind, "c", ("f32[64]",), 256)

    n = 8
    assert qt.hlo.received_bytes(one("all-gather"), n) == 7 * 256
    assert qt.hlo.received_bytes(one("all-to-all"), n) == 7 / 8 * 256
    assert qt.hlo.received_bytes(one("reduce-scatter"), n) == 7 / 8 * 256
    assert qt.hlo.received_bytes(one("all-reduce"), n) == 2 * 7 / 8 * 256
    assert qt.hlo.received_bytes(one("collective-permute"), n) == 256
    assert qt.hlo.received_bytes(one("all-reduce"), 1) == 0.0
    with pytest.raises(ValueError, match="devices"):
        qt.hlo.received_bytes(one("all-reduce"), 0)


def test_chunks_align_with_blocks_and_cover_the_array():
    assert chunk_elems(1000, 8, 1) == 125
    assert chunk_elems(1000, 8, 16) == 128
    # Fewer elements than a block per device: no padding to whole blocks.
    assert chunk_elems(640, 8, 256) == 80
    for size, n, multiple in [(1000, 8, 16), (7, 4, 1), (4096, 8, 256), (3, 8, 4)]:
        chunk = chunk_elems(size, n, multiple)
        assert n * chunk >= size > (n - 1) * chunk - n * multiple
        assert chunk % multiple == 0 or chunk < multiple


# ---------------------------------------------------------------------------------
# Two-phase all-reduce

_SHAPE = (256, 384)
_COMPRESSORS = {
    "int8": ft.partial(qt.quantize, bits=8),
    "sign": qt.sign_norm,
}


@ft.cache
def _received(name: str, method=None) -> tuple[float, set[str]]:
    """Bytes one device receives per all-reduce of a `_SHAPE` float32 matrix on 8
    devices (dense `psum` for `"dense"`, else `method` on `name`'s compressed value)
    and the collective kinds, read from the compiled program."""
    compressor = _COMPRESSORS.get(name)

    def body(x):
        if compressor is None:
            return qt.all_reduce(x[0], AXIS)
        return qt.materialise(qt.all_reduce(compressor(x[0]), AXIS, method))

    xs = split(np.ones((DEVICES, *_SHAPE), np.float32))
    found = qt.hlo.collectives(on_mesh(body, P(AXIS), P()), xs)
    return sum(qt.hlo.received_bytes(c, DEVICES) for c in found), {
        c.kind for c in found
    }


@needs_devices
@pytest.mark.parametrize("name, fewer", [("int8", 1.8), ("sign", 14.0)])
def test_two_phase_receives_about_two_compressed_values(name, fewer):
    dense_bytes = np.prod(_SHAPE) * 4
    dense, kinds = _received("dense")
    assert kinds == {"all-reduce"}
    assert dense == 2 * (DEVICES - 1) / DEVICES * dense_bytes
    ratio = _COMPRESSORS[name](jnp.ones(_SHAPE)).compression_ratio
    two_phase, kinds = _received(name, qt.TwoPhase())
    assert kinds == {"all-to-all", "all-gather"}
    assert two_phase <= 2.2 * dense_bytes / ratio
    assert dense / two_phase >= fewer, (dense, two_phase)


@needs_devices
def test_gather_sum_receives_every_other_devices_value():
    ratio = _COMPRESSORS["int8"](jnp.ones(_SHAPE)).compression_ratio
    gathered, kinds = _received("int8", qt.GatherSum())
    assert kinds == {"all-gather"}
    assert gathered >= (DEVICES - 1) * np.prod(_SHAPE) * 4 / ratio
    assert gathered > _received("dense")[0]


_INT8 = ft.partial(qt.quantize, bits=8, block_size=16)
_CHUNKED = {
    "sign": ft.partial(qt.sign_norm, block_size=8),
    "top-k": lambda x: qt.top_k(x, 0.25),
}


def _low_rank(x):
    return qt.LowRank(x[:, :2], x[:2].T)


@ft.cache
def _two_phase_sums(seed: int = 1) -> tuple[np.ndarray, dict]:
    """Per-device inputs and, in one program, their two-phase sums: int8 (sum and
    mean), sign, top-k, and a LowRank (which has no chunks)."""
    xs = np.random.default_rng(seed).standard_normal((DEVICES, 24, 40), np.float32)

    def body(x):
        x = x[0]

        def two_phase(value, mean=False):
            return qt.materialise(qt.all_reduce(value, AXIS, qt.TwoPhase(), mean=mean))

        out = {name: two_phase(c(x)) for name, c in _CHUNKED.items()}
        out["int8"] = two_phase(_INT8(x))
        out["int8-mean"] = two_phase(_INT8(x), mean=True)
        out["low-rank"] = two_phase(_low_rank(x))
        return out

    sums = on_mesh(body, P(AXIS), P())(split(xs))
    return xs, {name: np.asarray(v) for name, v in sums.items()}


@needs_devices
def test_two_phase_int8_is_within_half_a_block_scale_of_the_exact_sum():
    xs, sums = _two_phase_sums()
    exact = sum(np.asarray(_INT8(x).materialise()) for x in xs)
    # The chunks are whole blocks, so the sum's blocks are re-quantised as they are.
    blocks = exact.reshape(-1, 16)
    bound = np.abs(blocks).max(-1, keepdims=True) / 254
    error = np.abs(sums["int8"].reshape(-1, 16) - blocks)
    assert np.all(error <= bound * (1 + 1e-5) + 1e-6), (error - bound).max()
    mean_error = np.abs(sums["int8-mean"].reshape(-1, 16) - blocks / DEVICES)
    assert np.all(mean_error <= bound / DEVICES * (1 + 1e-5) + 1e-6)
    assert error.max() > 0  # the second compression is lossy


@needs_devices
@pytest.mark.parametrize("name", list(_CHUNKED))
def test_two_phase_is_the_compressed_chunks_of_the_exact_sum(name):
    """Both phases computed centrally: each device's value decoded and compressed
    chunk by chunk, the chunks summed, and each chunk of the sum compressed."""
    xs, sums = _two_phase_sums()
    compressor = _CHUNKED[name]
    codec = compressor(jnp.asarray(xs[0])).chunk_compressor()
    size = xs[0].size
    chunk = chunk_elems(size, DEVICES, codec.multiple)

    def chunkwise(flat):
        padded = np.pad(flat, (0, DEVICES * chunk - size)).reshape(-1, chunk)
        parts = [np.asarray(codec.compress(c).materialise()) for c in padded]
        return np.concatenate(parts)[:size]

    decoded = [np.asarray(compressor(x).materialise()).reshape(-1) for x in xs]
    expected = chunkwise(sum(chunkwise(d) for d in decoded))
    assert relative_error(sums[name], expected.reshape(xs[0].shape)) < 1e-5


@needs_devices
def test_two_phase_sums_a_type_without_chunks_exactly():
    xs, sums = _two_phase_sums()
    exact = sum(np.asarray(_low_rank(x).materialise()) for x in xs)
    assert_close(sums["low-rank"], exact)


# ---------------------------------------------------------------------------------
# Reduce-scatter


def _inputs(seed=0, shape=(24, 40)):
    return np.random.default_rng(seed).standard_normal((DEVICES, *shape), np.float32)


def _reduce_scatter(compressor, xs, dimension=0):
    def body(x):
        return qt.reduce_scatter(x[0], compressor, AXIS, scatter_dimension=dimension)

    out_spec = P(*([None] * dimension), AXIS)
    step = on_mesh(body, P(AXIS), out_spec)
    return np.asarray(step(split(xs))), qt.hlo.collectives(step, split(xs))


@needs_devices
def test_reduce_scatter_without_compressor_is_psum_scatter():
    xs = _inputs(seed=3, shape=(16, 24))
    out, found = _reduce_scatter(None, xs, dimension=1)
    assert_close(out, xs.sum(0))
    assert {c.kind for c in found} == {"reduce-scatter"}


@needs_devices
def test_int8_reduce_scatter_sums_the_compressed_chunks_with_fewer_bytes():
    xs = _inputs(seed=4, shape=(64, 512))
    compressor = ft.partial(qt.quantize, bits=8)
    out, found = _reduce_scatter(compressor, xs)
    chunks = xs.reshape(DEVICES, DEVICES, 8, 512)
    expected = sum(
        np.concatenate([np.asarray(compressor(c).materialise()) for c in chunks[i]])
        for i in range(DEVICES)
    )
    assert_close(out, expected)
    assert {c.kind for c in found} == {"all-to-all"}
    _, dense = _reduce_scatter(None, xs)
    received = sum(qt.hlo.received_bytes(c, DEVICES) for c in found)
    dense_received = sum(qt.hlo.received_bytes(c, DEVICES) for c in dense)
    assert dense_received / received >= 3.5


@needs_devices
def test_reduce_scatter_rejects_an_indivisible_dimension():
    with pytest.raises(ValueError, match="multiple of the 8 devices"):
        _reduce_scatter(qt.sign_norm, _inputs(shape=(12, 4)))


# ---------------------------------------------------------------------------------
# Error feedback around them, on least squares


def _two_phase_sgd(compressor, **options):
    tx = qto.compress_updates(
        compressor, axis_name=AXIS, method=qt.TwoPhase(), **options
    )
    return optax.chain(tx, optax.sgd(0.1))


def _run_replicated(tx, a, b, shape, steps):
    return run_replicated(tx, least_squares_grad, a, b, shape, steps)


def _run_sharded(tx, a, b, shape, steps):
    """The weight sharded along its rows: each step all-gathers it, takes this
    device's gradient of the whole weight and updates this device's rows."""
    w = qt.device_varying(jnp.zeros((shape[0] // DEVICES, *shape[1:])), AXIS)
    state = tx.init(w)

    def step(carry, _):
        w, state = carry
        whole = lax.all_gather(w, AXIS, tiled=True)
        updates, state = tx.update(least_squares_grad(whole, a, b), state, w)
        return (w + updates, state), None

    (w, _), _ = lax.scan(step, (w, state), length=steps)
    return w


@needs_devices
def test_error_feedback_converges_with_two_phase_and_sharded_int8_errors():
    a, b, solution = least_squares()
    steps = 400
    int8 = ft.partial(qt.quantize, bits=8, block_size=32)
    sign = ft.partial(qt.sign_norm, block_size=64)
    runs = {
        "two-phase-int8": (_run_replicated, _two_phase_sgd(int8)),
        "two-phase-sign": (_run_replicated, _two_phase_sgd(sign)),
        "two-phase-sign-no-feedback": (
            _run_replicated,
            _two_phase_sgd(sign, error_feedback=None),
        ),
        "sharded-int8": (
            _run_sharded,
            optax.chain(
                qto.compress_updates(int8, axis_name=AXIS, sharded=True), optax.sgd(0.1)
            ),
        ),
        "sharded-sign-int8-error": (
            _run_sharded,
            optax.chain(
                qto.compress_updates(
                    sign, axis_name=AXIS, sharded=True, error_dtype="int8"
                ),
                optax.sgd(0.1),
            ),
        ),
    }

    def body(a, b):
        return {
            name: run(tx, a[0], b[0], solution.shape, steps)
            for name, (run, tx) in runs.items()
        }

    out_specs = {
        name: P(AXIS) if run is _run_sharded else P() for name, (run, _) in runs.items()
    }
    found = on_mesh(body, (P(AXIS), P(AXIS)), out_specs)(split(a), split(b))
    errors = {name: relative_error(w, solution) for name, w in found.items()}
    tolerances = {
        "two-phase-int8": 1e-4,
        "two-phase-sign": 2e-2,
        "sharded-int8": 1e-4,
        "sharded-sign-int8-error": 2e-2,
    }
    failed = {n: e for n, e in tolerances.items() if not errors[n] < e}
    assert not failed, errors
    # Without feedback the sign of the mean stalls far from the solution.
    assert errors["two-phase-sign-no-feedback"] > 5 * errors["two-phase-sign"], errors


# ---------------------------------------------------------------------------------
# States


def _state_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_int8_error_state_is_a_quarter_of_float32():
    params = {"w": jnp.zeros((256, 512)), "b": jnp.zeros(512)}
    plain = qto.compress_updates(qt.sign_norm).init(params)
    small = qto.compress_updates(qt.sign_norm, error_dtype="int8").init(params)
    assert isinstance(small.error["w"], qt.Quantized) and small.error["b"] is None
    assert _state_bytes(small.error) <= 0.3 * _state_bytes(plain.error)


def test_int8_error_feedback_converges_on_one_device():
    a, b, solution = least_squares(m=32, n=16)
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    tx = optax.chain(
        qto.compress_updates(
            ft.partial(qt.sign_norm, block_size=64), error_dtype="int8"
        ),
        optax.sgd(0.1),
    )
    w = jax.jit(_run_replicated, static_argnums=(0, 3, 4))(
        tx, a, b, solution.shape, 400
    )
    assert relative_error(w, solution) < 2e-2


@pytest.mark.parametrize(
    "options, match",
    [
        ({"method": qt.TwoPhase()}, "axis_name"),
        ({"sharded": True}, "axis_name"),
        ({"method": qt.TwoPhase(), "sharded": True, "axis_name": AXIS}, "one of"),
        (
            {"method": qt.TwoPhase(), "axis_name": AXIS, "error_feedback": qto.EF21()},
            "EF21",
        ),
        ({"error_dtype": "int8", "error_feedback": None}, "error_dtype"),
        ({"error_dtype": "int4"}, "error_dtype"),
        ({"sharded": lambda x: True, "axis_name": AXIS}, "callable"),
    ],
)
def test_compress_rejects_conflicting_options(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        qto.compress_updates(qt.sign_norm, **options)


def test_partition_specs_shard_the_states_that_mirror_sharded_params():
    params = {"w": jnp.zeros((4, 8)), "b": jnp.zeros(8)}
    param_specs = {"w": P(AXIS), "b": P()}
    tx = optax.chain(
        qto.compress_updates(qt.sign_norm, axis_name=AXIS, method=qt.TwoPhase()),
        optax.adam(1e-3),
    )
    specs = qto.partition_specs(jax.eval_shape(tx.init, params), AXIS, param_specs)
    compress_specs, (adam_specs, _) = specs
    assert compress_specs.error["w"] == P(AXIS)
    assert compress_specs.server_error["w"] == P(AXIS)
    assert adam_specs.mu == param_specs and adam_specs.nu == param_specs
    assert adam_specs.count == P()


# ---------------------------------------------------------------------------------
# The example


def test_sharded_example_quick():
    # As a user runs it, with no `--out`: like the other examples, the smoke run
    # writes to the git-ignored examples/results/quick/, never over the committed
    # results of the full run.
    pytest.importorskip("sklearn", reason="the examples need the `examples` extra")
    results = ROOT / "examples" / "results"
    committed = [results / f"sharded.{ext}" for ext in ("md", "png")]
    before = [path.read_bytes() for path in committed]
    out = results / "quick" / "sharded.md"
    out.unlink(missing_ok=True)
    result = run_script(
        ROOT / "examples" / "sharded.py", "--quick", "--methods", "int8-ef"
    )
    assert [path.read_bytes() for path in committed] == before
    assert f"wrote {out} and {out.with_suffix('.png')}" in result.stdout
    text = out.read_text()
    assert out.with_suffix(".png").stat().st_size > 0
    rows = {
        line.split("|")[1].strip(): line
        for line in text.splitlines()
        if line.startswith("| ") and "%" in line
    }
    assert {"dense", "int8-ef"} <= set(rows), text
    assert "examples/sharded.py --quick --methods int8-ef" in text
    # Bytes come from the compiled program, so they hold even in a quick run.
    fewer = float(rows["int8-ef"].split("|")[8].strip().rstrip("x"))
    assert fewer >= 3.5, rows["int8-ef"]
