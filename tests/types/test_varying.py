"""Compressed values built inside `jax.shard_map` from arrays that differ per device:
their types vary over the mesh axis as their fields do, so that JAX's own functions
(which trace with a value's type, then run with its fields) and control flow take
them beside replicated operands, as they take the dense arrays they stand for.

Each case is the dense computation on each device's shard: materialise, then run the
same function.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import quax_tangents as qt
from tests.helpers import assert_close
from tests.helpers.collective import skip_without_devices


DEVICES = 4
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
