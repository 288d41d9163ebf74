"""Products at the highest precision of a tall float32 matrix, lowered on a TPU as a
loop over blocks of its rows.

A TPU runs a float32 product at `jax.lax.Precision.HIGHEST` as six bfloat16 passes,
and its compiler takes a time that grows with the rows of the operand. Compiled
ahead of time for one v5e chip on 2 CPU cores (JAX 0.12.0.1,
`benchmarks/bench_row_blocks.py --target tpu-v5e`), `a^T a` of a `(5461, 516)`
float32 `a` took 11.8 s at `HIGHEST` and 1.5 s at the default precision; summed
over blocks of 256 rows in a loop, 1.3 s (512 rows: 2.4 s; 1024: 5.5 s). `a @ b` for
a `(516, 516)` `b`: 3.6 s, and 1.6 s in blocks. At 2048 rows the Gram matrix took
2.3 s against 1.1 s in blocks, and the product 1.1 s against 1.5. The range finder
takes several such products per shape of projected matrix in each refresh, and they
were most of the refresh's compile on a TPU (`benchmarks/bench_compile.py --target
tpu-v5e`, *refresh codegen s*: 52.2 thread-seconds before the blocks, 13.0 after).
The loop computes the same products, summed in float32 block by block.

Other backends keep the one product (a CPU's float32 product is float32 at every
precision; a GPU's `HIGHEST` is a float32 GEMM); the choice is made when the program
is lowered (`jax.lax.platform_dependent`), as `_eigh`'s is.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


# Rows per block: the smallest of the sizes measured above compiles fastest, and a
# block of 256 rows still fills the TPU's matrix unit.
ROWS = 256


def _in_blocks(a: Float[Array, "m k"], rows: int) -> Float[Array, "blocks rows k"]:
    """`a`'s rows in blocks of `rows`, the last one completed with zero rows."""
    count = -(-a.shape[0] // rows)
    padded = jnp.pad(a, ((0, count * rows - a.shape[0]), (0, 0)))
    return padded.reshape(count, rows, a.shape[1])


def gram_in_row_blocks(
    a: Float[Array, "m k"], precision: Any, rows: int = ROWS
) -> Float[Array, "k k"]:
    """`a^T a`, summed over blocks of `rows` rows of `a` in a loop."""
    blocks = _in_blocks(a, rows)

    def add(i: Any, total: Array) -> Array:
        block = jax.lax.dynamic_index_in_dim(blocks, i, keepdims=False)
        return total + jnp.matmul(block.T, block, precision=precision)

    start = jnp.zeros((a.shape[1], a.shape[1]), a.dtype)
    return jax.lax.fori_loop(0, blocks.shape[0], add, start)


def matmul_in_row_blocks(
    a: Float[Array, "m k"], b: Float[Array, "k n"], precision: Any, rows: int = ROWS
) -> Float[Array, "m n"]:
    """`a @ b`, one block of `rows` rows of `a` at a time in a loop."""
    products = jax.lax.map(
        lambda block: jnp.matmul(block, b, precision=precision), _in_blocks(a, rows)
    )
    return products.reshape(-1, b.shape[1])[: a.shape[0]]


def _tall_float32(a: Array) -> bool:
    return a.ndim == 2 and a.dtype == jnp.float32 and a.shape[0] > 2 * ROWS


def _on_a_tpu(plain: Callable, blocked: Callable, *operands: Array) -> Array:
    return jax.lax.platform_dependent(*operands, tpu=blocked, default=plain)


def exact_gram(a: Float[Array, "m k"], precision: Any) -> Float[Array, "k k"]:
    """`a^T a` at `precision`; on a TPU, for a float32 `a` of more than `2 * ROWS`
    rows and a precision given, summed over blocks of its rows."""
    plain = lambda a: jnp.matmul(a.T, a, precision=precision)  # noqa: E731
    if precision is None or not _tall_float32(a):
        return plain(a)
    blocked = lambda a: gram_in_row_blocks(a, precision)  # noqa: E731
    return _on_a_tpu(plain, blocked, a)


def exact_matmul(
    a: Float[Array, "m k"], b: Float[Array, "k n"], precision: Any
) -> Float[Array, "m n"]:
    """`a @ b` at `precision`; on a TPU, for float32 matrices, `a` of more than
    `2 * ROWS` rows and a precision given, one block of `a`'s rows at a time."""
    plain = lambda a, b: jnp.matmul(a, b, precision=precision)  # noqa: E731
    if (
        precision is None
        or not _tall_float32(a)
        or b.dtype != jnp.float32
        or b.ndim != 2
    ):
        return plain(a, b)
    blocked = lambda a, b: matmul_in_row_blocks(a, b, precision)  # noqa: E731
    return _on_a_tpu(plain, blocked, a, b)
