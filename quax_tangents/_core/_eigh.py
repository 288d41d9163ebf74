"""`symmetric_eigh`: `jnp.linalg.eigh` with a TPU lowering that compiles quickly.

The range finder's orthonormalisation and its truncation take eigendecompositions of
`w x w` Gram matrices, `w` the rank plus a little oversampling (132 to 1028 for the
GaLore ranks). On a TPU, `jnp.linalg.eigh` is a native Jacobi kernel up to 256 rows
and a QDWH divide and conquer above, whose program is large: compiled ahead of time
for one TPU v5e chip on 2 CPU cores, one `eigh` takes 0.3 s at 256 rows, 5.0 s at
257, 24.7 s at 516 and 120 s at 1028, against 0.3, 1.5, 3.2 and 8.5 s for this
function (`benchmarks/bench_eigh.py --target tpu-v5e`). A 1B training step with a
refresh holds several of them: it compiled in 735 s against BF16 Adam's 94 s with
`jnp.linalg.eigh` (on a busier machine), and in 60 s against 13 s with this function
(`benchmarks/bench_scale.py --target tpu-v5e --models 1B`).

Above 256 rows, the TPU lowering here is a block Jacobi method whose sub-problems
are the native kernel's size: the matrix is cut into blocks of 128 rows; each round
pairs the blocks (a round-robin tournament, so that `k - 1` rounds meet every pair
once), diagonalises every `256 x 256` pair with the native `eigh`, batched, and
rotates the whole matrix by the result. Sweeps of rounds repeat until the
off-diagonal part is below rounding. Its program is one loop body, whatever the
size. Other backends keep `jnp.linalg.eigh` (LAPACK, cuSOLVER), which compile
quickly; the choice is made when the program is lowered
(`jax.lax.platform_dependent`), so a program compiled ahead of time for a TPU on a
CPU-only machine gets the TPU lowering.

It costs run time and accuracy. Run on a TPU v5e chip, one float32
eigendecomposition of 516 rows takes 38.2 ms here against 10.3 ms for
`jnp.linalg.eigh` (residual 6.7e-5 against 3.9e-6), and the 1B step's refresh
7.67 s against 4.25 s (three eigendecompositions per matrix), for 43.7 against
76.9 s of compile on the chip's host
(`benchmarks/bench_eigh.py --run`, `benchmarks/bench_device.py --eigh`; docs/llm.md).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


# The largest matrix that a TPU's `eigh` diagonalises with its native kernel.
NATIVE_ROWS = 256
_HIGHEST = jax.lax.Precision.HIGHEST


def symmetric_eigh(
    a: Float[Array, "*batch w w"],
) -> tuple[Float[Array, "*batch w"], Float[Array, "*batch w w"]]:
    """The eigenvalues (ascending) and eigenvectors (as columns) of symmetric `a`, as
    `jnp.linalg.eigh` gives them; on a TPU above `NATIVE_ROWS` rows, by
    `block_jacobi_eigh`."""
    if a.shape[-1] <= NATIVE_ROWS:
        return tuple(jnp.linalg.eigh(a))
    return jax.lax.platform_dependent(a, tpu=block_jacobi_eigh, default=_lapack_eigh)


def _lapack_eigh(a: Array) -> tuple[Array, Array]:
    return tuple(jnp.linalg.eigh(a))


def _round_robin(blocks: int) -> np.ndarray:
    """`(blocks - 1, blocks)`: per round, an order of the blocks whose consecutive
    pairs `(2j, 2j + 1)` meet; over the rounds, every pair meets once (the circle
    method: block 0 stays, the others rotate)."""
    others = list(range(1, blocks))
    rounds = []
    for _ in range(blocks - 1):
        players = [0, *others]
        rounds.append(
            [p for i in range(blocks // 2) for p in (players[i], players[-1 - i])]
        )
        others = others[-1:] + others[:-1]
    return np.asarray(rounds, np.int32)


def _rotate_pairs(a4: Array, v3: Array, order: Array) -> tuple[Array, Array]:
    """One round: the blocks of `a4` `(k, b, k, b)` taken in `order`, every pair's
    `2b x 2b` diagonal block diagonalised, and `a4` and the eigenvectors so far
    `v3` `(size, k, b)` rotated by the result."""
    k, b = a4.shape[:2]
    pairs = k // 2
    inverse = jnp.argsort(order)
    ap = jnp.take(jnp.take(a4, order, axis=0), order, axis=2)
    ap = ap.reshape(pairs, 2 * b, pairs, 2 * b)
    diagonal = ap[jnp.arange(pairs), :, jnp.arange(pairs), :]
    _, rotation = jnp.linalg.eigh(diagonal)
    rotation = _keep_halves(rotation)
    ap = jnp.einsum("iab,iajc->ibjc", rotation, ap, precision=_HIGHEST)
    ap = jnp.einsum("ibjc,jcd->ibjd", ap, rotation, precision=_HIGHEST)
    a4 = ap.reshape(k, b, k, b)
    a4 = jnp.take(jnp.take(a4, inverse, axis=0), inverse, axis=2)
    vp = jnp.take(v3, order, axis=1).reshape(v3.shape[0], pairs, 2 * b)
    vp = jnp.einsum("xjc,jcd->xjd", vp, rotation, precision=_HIGHEST)
    v3 = jnp.take(vp.reshape(v3.shape[0], k, b), inverse, axis=1)
    return a4, v3


def _keep_halves(rotation: Array) -> Array:
    """The columns of each pair's rotation `(pairs, 2b, 2b)` reordered so that the
    `b` eigenvectors with the most weight on the first block's rows come first.
    `eigh` orders them by eigenvalue, which would move coordinates between the two
    blocks; the tournament then stops pairing the blocks that hold the remaining
    off-diagonal mass, and the sweeps stall."""
    b = rotation.shape[-1] // 2
    weight = jnp.sum(jnp.square(rotation[:, :b, :]), axis=1)
    ranked = jnp.argsort(-weight, axis=-1)
    columns = jnp.concatenate(
        [jnp.sort(ranked[:, :b], axis=-1), jnp.sort(ranked[:, b:], axis=-1)], axis=-1
    )
    return jnp.take_along_axis(rotation, columns[:, None, :], axis=-1)


def _off_diagonal(a: Array) -> Array:
    """The squared norm of `a`'s off-diagonal entries (summed as such: the whole's
    minus the diagonal's would cancel to noise near convergence)."""
    off = jnp.where(jnp.eye(a.shape[-1], dtype=bool), 0, a)
    return jnp.sum(jnp.square(off))


@functools.partial(jax.jit, static_argnames=("block", "max_sweeps"))
def block_jacobi_eigh(
    a: Float[Array, "*batch w w"], block: int = NATIVE_ROWS // 2, max_sweeps: int = 10
) -> tuple[Float[Array, "*batch w"], Float[Array, "*batch w w"]]:
    """The eigenvalues (ascending) and eigenvectors of symmetric `a` by block Jacobi
    sweeps (see the module's docstring), in `a`'s dtype.

    **Arguments:**

    - `a`: a floating `(*batch, w, w)` array, read as symmetric (the mean of `a` and
        its transpose).
    - `block`: rows per block; pairs of blocks are diagonalised with
        `jnp.linalg.eigh`, so `2 * block` should be at most `NATIVE_ROWS`.
    - `max_sweeps`: sweeps at most; the rest are skipped once the off-diagonal
        part's squared norm is below `w eps^2` of the whole's (quadratic
        convergence takes 4 to 6 sweeps in float32).

    **Returns:**

    `(eigenvalues, eigenvectors)` as `jnp.linalg.eigh` returns them.
    """
    if a.ndim > 2:
        return jax.vmap(
            functools.partial(block_jacobi_eigh, block=block, max_sweeps=max_sweeps)
        )(a)
    w = a.shape[-1]
    dtype = a.dtype
    blocks = max(2, -(-w // block))
    blocks += blocks % 2
    size = blocks * block
    pad = size - w
    a = (a + a.T) / 2
    # Scaled by a power of two (exactly) to a largest magnitude near 1, so that the
    # squares the sweeps are stopped by neither underflow nor overflow.
    largest = jnp.max(jnp.abs(a))
    scale = jnp.exp2(jnp.round(jnp.log2(jnp.where(largest > 0, largest, 1))))
    a = a / scale
    # The padding's eigenvalues, `-2 bound`, lie below every eigenvalue of `a` (the
    # largest row sum bounds the spectrum) by a gap of `a`'s own scale, so that they
    # sort first and are dropped, and the pairs' `eigh` keeps `a`'s relative
    # precision (a padding of another scale would set its rounding).
    bound = jnp.max(jnp.sum(jnp.abs(a), axis=-1))
    low = -jnp.minimum(2 * bound + jnp.finfo(dtype).tiny, jnp.finfo(dtype).max)
    padded = jnp.zeros((size, size), dtype).at[:w, :w].set(a)
    tail = jnp.arange(w, size)
    padded = padded.at[tail, tail].set(low)
    rounds = jnp.asarray(_round_robin(blocks))
    tolerance = size * jnp.square(jnp.finfo(dtype).eps) * jnp.sum(jnp.square(a))

    def one_round(r: Array, state: tuple[Array, Array]) -> tuple[Array, Array]:
        a4, v3 = state
        return _rotate_pairs(a4, v3, rounds[r])

    def sweep(_: Array, state: tuple) -> tuple:
        # A fixed count of sweeps, each skipped once the rest has converged: a loop
        # with a trip count, whose collectives (when a partitioner spreads the
        # matrix over devices) `quax_tangents.hlo` can count.
        unfinished = _off_diagonal(state[0].reshape(size, size)) > tolerance
        return jax.lax.cond(
            unfinished,
            lambda s: jax.lax.fori_loop(0, blocks - 1, one_round, s),
            lambda s: s,
            state,
        )

    init = (
        padded.reshape(blocks, block, blocks, block),
        jnp.eye(size, dtype=dtype).reshape(size, blocks, block),
    )
    a4, v3 = jax.lax.fori_loop(0, max_sweeps, sweep, init)
    values = jnp.diagonal(a4.reshape(size, size))
    order = jnp.argsort(values)[pad:]
    vectors = v3.reshape(size, size)[:w][:, order]
    return values[order] * scale, vectors
