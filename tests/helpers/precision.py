"""Which products of a lowered program ask for the highest matmul precision (a TPU
runs a float32 product at the default precision as one bfloat16 pass)."""

import jax


def dots_below_highest(fn, *args) -> list[str]:
    """The `dot_general` lines of `jax.jit(fn)` lowered on `args` that do not ask for
    HIGHEST; fails if the program has no product at all, where the check would pass
    vacuously."""
    text = jax.jit(fn).lower(*args).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots, "no product lowered: the check would pass vacuously"
    return [line for line in dots if "precision = [HIGHEST, HIGHEST]" not in line]
