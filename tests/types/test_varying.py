"""Compressed values built inside `jax.shard_map` from arrays that differ per device:
their types vary over the mesh axis as their fields do, so that JAX's own functions
(which trace with a value's type, then run with its fields) and control flow take
them beside replicated operands, as they take the dense arrays they stand for.

Each case is the dense computation on each device's shard: materialise, then run the
same function.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import quax_tangents as qt
from tests.helpers import assert_close
from tests.helpers.collective import skip_without_devices
from tests.helpers.values import TYPE_NAMES
from tests.types import test_lax_harness as lax_harness


DEVICES = 4
AXIS = "d"
ROWS = 8  # per device


def _rows(g):
    # Every other row of the shard, as the gradient of an embedding table.
    return qt.SparseRows.build(jnp.arange(0, ROWS, 2), g[::2], ROWS)


COMPRESS = {
    "top_k": lambda g: qt.top_k(g, 10),
    "quantize": qt.quantize,
    "sign_norm": qt.sign_norm,
    "low_rank": lambda g: qt.low_rank(g, 3),
    "rows": _rows,
}

# Each takes the compressed value and a replicated weight.
FUNCTIONS = (
    lambda c, w: c * 2.0,
    lambda c, w: c / 4.0,
    lambda c, w: -c,
    lambda c, w: c + c,
    lambda c, w: c + jnp.ones(c.shape, c.dtype),
    lambda c, w: jnp.ones(c.shape, c.dtype) - c,
    lambda c, w: c * jnp.arange(c.shape[-1], dtype=c.dtype),
    lambda c, w: c @ w,
    lambda c, w: jnp.where(jnp.ones(c.shape, bool), c, 0.0),
    lambda c, w: jnp.sum(c, axis=0),
    lambda c, w: jnp.sum(c) * jnp.ones((2,)),
    lambda c, w: c.T,
    lambda c, w: jax.lax.fori_loop(0, 2, lambda i, c: c * 2.0, c),
    lambda c, w: jax.lax.cond(True, lambda c: c * 0.5, lambda c: c, c),
    lambda c, w: jax.lax.scan(lambda c, _: (c * 1.5, None), c, None, length=2)[0],
)


def _all(c, w):
    return [qt.materialise(f(c, w)) for f in FUNCTIONS]


@skip_without_devices(DEVICES)
@pytest.mark.parametrize("kind", sorted(COMPRESS))
def test_values_that_differ_per_device_go_through_jax_functions(kind):
    mesh = jax.make_mesh(
        (DEVICES,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4]
    )
    rng = np.random.default_rng(0)
    g = rng.standard_normal((DEVICES * ROWS, 16)).astype(np.float32)
    w = rng.standard_normal((16, 5)).astype(np.float32)
    compress = COMPRESS[kind]

    def per_device(g, w):
        results = quax.quaxify(_all)(compress(g), w)
        return [r[None] for r in results]  # stacked over the devices

    run = jax.shard_map(per_device, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    with qt.fallback("silent"):
        got = jax.jit(run)(
            jax.device_put(g, NamedSharding(mesh, P("d"))), jnp.asarray(w)
        )
        for device in range(DEVICES):
            shard = jnp.asarray(g[device * ROWS : (device + 1) * ROWS])
            dense = qt.materialise(compress(shard))
            expected = [f(dense, jnp.asarray(w)) for f in FUNCTIONS]
            for x, y in zip(got, expected, strict=True):
                assert_close(np.asarray(x)[device], y)


# ---------------------------------------------------------------------------------
# JAX's `lax` operations (the list of `test_lax_harness.py`: a representative subset,
# every one under `HYPOTHESIS_PROFILE=thorough`) on values that differ per device:
# applied to compressed values, with compressed tangents and with a compressed
# cotangent seed, each against the dense computation on each device's shard.

# JAX's own `jax.jvp` of these fails under `check_vma` with primals that differ per
# device, on dense arrays ("Primitive polynomial requires varying manual axes to
# match", JAX 0.12): skipped where that is still so.
_MAY_FAIL_IN_JAX = {"erf", "erfc"}


def _jax_fails(op, mesh, inputs) -> bool:
    def dense_jvp(*shards):
        primals = tuple(qt.device_varying(list(shards), AXIS))
        return jax.jvp(op.fn, primals, shards)[1][None]

    run = jax.shard_map(
        dense_jvp, mesh=mesh, in_specs=tuple(P(AXIS) for _ in inputs), out_specs=P(AXIS)
    )
    try:
        jax.eval_shape(run, *inputs)
    except ValueError as error:
        return "requires varying manual axes to match" in str(error)
    return False


def _varying_compressed(type_name, x):
    """A `type_name` value of `x`'s shape (dims before the last two are batch dims)
    compressed from `x`."""
    size = math.prod(x.shape[max(x.ndim - 2, 0) :])
    compress = {
        "LowRank": lambda v: qt.low_rank(v, min(2, *v.shape[-2:])),
        "Sparse": lambda v: qt.top_k(v, min(3, size)),
        "Quantized": qt.quantize,
        "SignNorm": qt.sign_norm,
    }[type_name]
    for _ in range(x.ndim - 2):
        compress = jax.vmap(compress)
    return compress(x)


def _seed_pattern(shape):
    return jnp.asarray(np.random.default_rng(3).uniform(0.1, 0.9, shape), jnp.float32)


def _outputs(op, type_name, shards, constants):
    """`(got, expected)`: lists of dense arrays computed from one device's shards
    (which differ per device) and `constants` (the same on every device)."""
    compressed = [_varying_compressed(type_name, s) for s in shards]
    dense = [qt.materialise(c) for c in compressed]
    rest = list(constants[1:])
    got = [quax.quaxify(op.fn)(compressed[0], *rest)]
    expected = [op.fn(dense[0], *rest)]
    if rest:  # beside a compressed value that every device shares
        shared = _varying_compressed(type_name, rest[0])
        got.append(quax.quaxify(op.fn)(compressed[0], shared))
        expected.append(op.fn(dense[0], qt.materialise(shared)))
    primals = tuple(qt.device_varying(list(constants), AXIS))
    got.append(qt.jvp(op.fn, primals, tuple(compressed))[1])
    expected.append(jax.jvp(op.fn, primals, tuple(dense))[1])
    out = jax.eval_shape(op.fn, *primals)
    if out.ndim >= 2:
        seed_values = jnp.mean(shards[0]) * _seed_pattern(out.shape)
        seed = _varying_compressed(type_name, seed_values)
        got.extend(qt.vjp(op.fn, *primals)[1](seed))
        expected.extend(jax.vjp(op.fn, *primals)[1](qt.materialise(seed)))
    return [qt.materialise(x) for x in got], expected


def _harness_cases():
    for op in lax_harness.OPS:
        for type_name in TYPE_NAMES:
            if type_name == "LowRank" and min(map(len, op.shapes)) < 2:
                continue  # no LowRank below two dims
            case = f"{lax_harness._op_id(op)}-{type_name}"
            yield pytest.param(op, type_name, id=case)


@skip_without_devices(DEVICES)
@pytest.mark.parametrize("op, type_name", list(_harness_cases()))
def test_lax_ops_on_values_that_differ_per_device(op, type_name):
    mesh = jax.make_mesh(
        (DEVICES,), (AXIS,), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4]
    )
    rng = np.random.default_rng(0)
    sharded = [
        rng.uniform(0.1, 0.9, (DEVICES * s[0], *s[1:])).astype(np.float32)
        for s in op.shapes
    ]
    constants = [rng.uniform(0.1, 0.9, s).astype(np.float32) for s in op.shapes]

    def per_device(*shards):
        got, expected = _outputs(op, type_name, shards, constants)
        return [x[None] for x in got], [x[None] for x in expected]

    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=tuple(P(AXIS) for _ in sharded),
        out_specs=P(AXIS),
    )
    inputs = [jax.device_put(x, NamedSharding(mesh, P(AXIS))) for x in sharded]
    if op.name in _MAY_FAIL_IN_JAX and _jax_fails(op, mesh, inputs):
        pytest.skip(f"JAX's own jvp of {op.name} fails here, dense, under check_vma")
    with qt.fallback("silent"):
        got, expected = jax.jit(run, compiler_options=lax_harness._FAST_COMPILE)(
            *inputs
        )
    for x, y in zip(got, expected, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        # A nonlinearity applied to a compressed value's zeros (`log`, `div`) gives
        # infinities and NaNs, which must be the dense computation's.
        x, y = np.asarray(x), np.asarray(y)
        finite = np.isfinite(y)
        np.testing.assert_array_equal(
            np.where(finite, 0.0, x), np.where(finite, 0.0, y)
        )
        assert_close(np.where(finite, x, 0.0), np.where(finite, y, 0.0), factor=8.0)
