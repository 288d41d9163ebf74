"""Helpers of the multi-device tests: a mesh over host CPU devices and programs that
run on it.

The collective code registers no quax rules (it works on concrete compressed values
inside `shard_map`), so this module adds no rule cases. Nothing here touches devices
at import: the rule tests import every helper module.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P


AXIS = "d"
DEVICES = 4
DEVICE_FLAG = "--xla_force_host_platform_device_count=8"


def enough_devices(devices: int = DEVICES) -> bool:
    return len(jax.devices()) >= devices


def skip_without_devices(devices: int = DEVICES):
    """Skips a test in a process with fewer than `devices` devices. `tests/conftest.py`
    asks XLA for 8 host CPU devices unless `XLA_FLAGS` already names a count."""
    return pytest.mark.skipif(
        not enough_devices(devices),
        reason=f"needs {devices} devices: run with XLA_FLAGS={DEVICE_FLAG}",
    )


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def subprocess_env() -> dict[str, str]:
    """This environment with 8 host CPU devices, for a fresh Python process."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {DEVICE_FLAG}".strip()
    return env


def run_python(
    args: list[str], *, cwd=None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Runs `python *args` with 8 host CPU devices; fails with its output if it
    fails."""
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
        cwd=cwd,
    )
    assert result.returncode == 0, (result.stdout[-6000:], result.stderr[-6000:])
    return result


def mesh(devices: int = DEVICES) -> jax.sharding.Mesh:
    return jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])


def on_mesh(fn, in_specs, out_specs, *, check_vma: bool = True, devices: int = DEVICES):
    """`fn` run on every device of a mesh of `devices`, jitted."""
    return jax.jit(
        jax.shard_map(
            fn,
            mesh=mesh(devices),
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=check_vma,
        )
    )


def put(x, spec: P, devices: int = DEVICES) -> jax.Array:
    """`x` placed on a mesh of `devices` as `spec` says."""
    return jax.device_put(np.asarray(x), NamedSharding(mesh(devices), spec))


def split(x, devices: int = DEVICES) -> jax.Array:
    """`x` split along its first axis, one block per device."""
    return put(x, P(AXIS), devices)


def quadratic(
    seed: int = 0, m: int = 16, n: int = 8, rows: int = 32, devices: int = DEVICES
):
    """A least-squares problem split over the devices, and its solution.

    Device `i` holds `A_i` `(rows, m)` and `B_i` `(rows, n)`; the objective is the
    mean over devices of `|A_i W - B_i|^2 / (2 rows)`. The devices' data differ (the
    gradients are heterogeneous), so a device's own gradient is not zero at the
    optimum.
    """
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((devices, rows, m)).astype(np.float32)
    w = rng.standard_normal((m, n)).astype(np.float32)
    b = (a @ w + 0.5 * rng.standard_normal((devices, rows, n))).astype(np.float32)
    solution = np.linalg.lstsq(a.reshape(-1, m), b.reshape(-1, n), rcond=None)[0]
    return a, b, solution


def quadratic_grad(w, a, b):
    """This device's gradient of `|a w - b|^2 / (2 rows)`."""
    return a.T @ (a @ w - b) / a.shape[0]


def run_replicated(tx, grad, a, b, shape, steps: int):
    """`steps` updates of `tx` from zeros of `shape` on this device's `grad(w, a, b)`,
    applied as `w + updates`, in one `lax.scan`."""
    w = jax.numpy.zeros(shape)
    state = tx.init(w)

    def step(carry, _):
        w, state = carry
        updates, state = tx.update(grad(w, a, b), state, w)
        return (w + updates, state), None

    (w, _), _ = jax.lax.scan(step, (w, state), length=steps)
    return w
