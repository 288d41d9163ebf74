"""Helpers of the two-phase and reduce-scatter tests: a mesh of 8 host CPU devices.

Nothing here touches devices at import: the rule tests import every helper module.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


AXIS = "d"
DEVICES = 8


def enough_devices() -> bool:
    return len(jax.devices()) >= DEVICES


def mesh(devices: int = DEVICES) -> jax.sharding.Mesh:
    return jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])


def on_mesh(fn, in_specs, out_specs, devices: int = DEVICES):
    """`fn` run on every device of a mesh of `devices`, jitted."""
    return jax.jit(
        jax.shard_map(fn, mesh=mesh(devices), in_specs=in_specs, out_specs=out_specs)
    )


def split(x, devices: int = DEVICES) -> jax.Array:
    """`x` split along its first axis, one block per device."""
    return jax.device_put(np.asarray(x), NamedSharding(mesh(devices), P(AXIS)))


def least_squares(seed: int = 0, m: int = 32, n: int = 16, rows: int = 24):
    """A least-squares problem split over the devices, and its solution: device `i`
    holds `A_i` `(rows, m)` and `B_i` `(rows, n)`; the objective is the mean over
    devices of `|A_i W - B_i|^2 / (2 rows)`, with heterogeneous data."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((DEVICES, rows, m)).astype(np.float32)
    w = rng.standard_normal((m, n)).astype(np.float32)
    b = (a @ w + 0.5 * rng.standard_normal((DEVICES, rows, n))).astype(np.float32)
    solution = np.linalg.lstsq(a.reshape(-1, m), b.reshape(-1, n), rcond=None)[0]
    return a, b, solution


def least_squares_grad(w, a, b):
    """This device's gradient of `|a w - b|^2 / (2 rows)`."""
    return a.T @ (a @ w - b) / a.shape[0]
