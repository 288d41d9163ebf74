"""A small scanned model with stacked weights, as large JAX codebases write them, and a
reader of the weight-shaped buffers of a compiled step."""

import re

import jax
import jax.numpy as jnp

from tests.helpers import random_array


def orthonormal(seed, shape):
    """Orthonormal columns in the last two dims of `shape` (one matrix per slice)."""
    return jnp.linalg.qr(random_array(seed, shape))[0]


def stacked_params(batch, m, n):
    """Blocks `{"w": (*batch, m, n), "v": (*batch, n, m)}`: `w` is projected on its
    left side (m <= n), `v` on its right."""
    return {
        "w": random_array(0, (*batch, m, n)) / 4,
        "v": random_array(1, (*batch, n, m)) / 4,
    }


def block(h, p):
    """One residual block: `h + tanh(h @ w) @ v`."""
    return h + jnp.tanh(h @ p["w"]) @ p["v"]


def scanned(h, params, *, remat=False, mark_slice=None):
    """`block` applied over every leading dim of `params` with nested `lax.scan`s (one
    per batch dim), the body under `jax.checkpoint` if `remat`. `mark_slice(p)`, if
    given, marks each slice inside the innermost body."""
    depth = params["w"].ndim - 2

    def body(h, p):
        if p["w"].ndim > 2:
            return scanned(h, p, remat=remat, mark_slice=mark_slice), None
        if mark_slice is not None:
            p = mark_slice(p)
        return block(h, p), None

    del depth
    body = jax.checkpoint(body) if remat else body
    h, _ = jax.lax.scan(body, h, params)
    return h


def project(g, projector, side):
    """`P P^T G` (side "left") or `G Q Q^T` (side "right"), slice by slice."""
    t = lambda a: jnp.swapaxes(a, -1, -2)  # noqa: E731
    if side == "left":
        return projector @ (t(projector) @ g)
    return (g @ projector) @ t(projector)


_READS = ("parameter", "get-tuple-element", "bitcast", "dynamic-slice", "copy")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = (\S+) ([a-z-]+)\(")


def weight_buffers(jitted, args, shape):
    """Instructions of the compiled program (XLA:CPU's, this suite's backend) whose
    result has HLO shape `shape`
    (e.g. `"f32[3,24,40]"`), other than reads of a parameter: the parameter itself,
    tuple plumbing, bitcasts, copies and the dynamic slice (or the fusion XLA names
    after it) that reads one layer's weight in a loop body, which the forward pass
    needs either way."""
    found = []
    for line in jitted.lower(*args).compile().as_text().splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, result, opcode = match.groups()
        if result.split("{")[0] != shape:
            continue
        is_read = opcode in _READS or (
            opcode == "fusion" and name.startswith("dynamic-slice")
        )
        if not is_read:
            found.append(line.strip())
    return found
