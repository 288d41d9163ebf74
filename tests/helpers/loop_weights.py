"""The weights that `accumulate_gradients`' loop carries in row-major order: a case
with one weight whose last two dims fill a TPU's tiles and one whose do not, and
the layout constraints a lowered program holds."""

import re

import jax.numpy as jnp


def layout_constraints(lowered: str) -> list[str]:
    """The operand types of the `LayoutConstraint` custom calls of a lowered
    program (StableHLO text: the same on every backend)."""
    return re.findall(r"@LayoutConstraint\(.*\(tensor<([^>]*)>\) ->", lowered)


def tiled_case(rng, microbatches: int, batch: int):
    """`(params, (x, y), loss)`: a `(128, 128)` weight (tiled), a `(128, 100)` one
    (not) and a vector, with `microbatches` microbatches of `batch` rows."""
    params = {
        "tiled": jnp.asarray(rng.standard_normal((128, 128)), jnp.float32) * 0.1,
        "ragged": jnp.asarray(rng.standard_normal((128, 100)), jnp.float32) * 0.1,
        "bias": jnp.zeros(100),
    }
    x = jnp.asarray(rng.standard_normal((microbatches, batch, 128)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((microbatches, batch, 100)), jnp.float32)

    def loss(p, batch):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ p["tiled"]) @ p["ragged"] + p["bias"] - y) ** 2)

    return params, (x, y), loss


def project_matrices(params: dict) -> dict:
    return {"tiled": True, "ragged": True, "bias": False}
