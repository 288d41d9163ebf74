"""Which compiler a test's memory or HLO claim holds on: this suite compiles for
XLA:CPU, whose passes change from one JAX release to the next."""

import jax
import pytest


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


# XLA:CPU in JAX 0.10 converts a bfloat16 stack that a loop reads slice by slice to
# float32 whole, before the loop: a 16-layer stack's `apply_updates` held 393,348
# bytes of temporaries against 123,012 for 4 layers on 0.10.2, and the layerwise
# 8-bit update three float32 copies of the stacked gradient. From JAX 0.11 (checked
# on 0.11.2, 0.12.0.1 and 0.12.1) each slice is converted inside the loop.
converts_slices_in_loops = pytest.mark.skipif(
    _release(jax.__version__) < (0, 11),
    reason=(
        "XLA:CPU before JAX 0.11 converts a bfloat16 stack read in a loop to float32 "
        "whole, outside the loop; the one-slice-at-a-time memory holds from JAX 0.11"
    ),
)
