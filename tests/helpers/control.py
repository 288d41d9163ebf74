"""Cases of the construction-primitive rules and the higher-order rules."""

import functools as ft

import jax
import jax.numpy as jnp
from hypothesis import assume, strategies as st

import quax_tangents as qt
from quax_tangents._types._primitives import compress_p, materialise_p, outer_p
from tests.helpers import float_dtypes, random_array, seeds
from tests.helpers.cases import Case, case
from tests.helpers.lowrank import lowrank_values


def _compressors(shape):
    """Compressors applicable to a matrix of `shape` (all exported ones)."""
    m, n = shape
    return st.sampled_from(
        [
            ft.partial(qt.low_rank, rank=min(m, n, 2)),
            ft.partial(qt.top_k, k=max(1, (m * n) // 3)),
            ft.partial(qt.quantize, bits=8, block_size=4),
            ft.partial(qt.sign_norm, block_size=None),
        ]
    )


@st.composite
def _matrix(draw, min_side=1):
    shape = (draw(st.integers(min_side, 6)), draw(st.integers(min_side, 6)))
    return random_array(draw(seeds()), shape, jnp.float32)


@case("compress", "dense")
def _compress():
    @st.composite
    def draw_case(draw):
        a = draw(_matrix())
        compressor = draw(_compressors(a.shape))
        fn = lambda x: compress_p.bind(x, compressor=compressor, batch_ndim=0)  # noqa: E731
        return Case(fn, (a,), out_type=qt.CompressedArray)

    return draw_case()


@st.composite
def _outer_operands(draw):
    rows = draw(st.integers(1, 2))
    m, n = draw(st.integers(4, 7)), draw(st.integers(4, 7))
    assume(rows * (m + n) < m * n)
    dtype = draw(float_dtypes())
    seed = draw(seeds())
    return random_array(seed, (rows, m), dtype), random_array(
        seed + 1, (rows, n), dtype
    )


@case("outer", "dense", "dense")
def _outer():
    def build(operands):
        fn = lambda x, ct: outer_p.bind(x, ct, batch_ndim=0)  # noqa: E731
        return Case(fn, operands, operands[0].dtype, qt.LowRank, factor=2.0)

    return _outer_operands().map(build)


@case("jit", "*dense")
def _jit():
    @st.composite
    def draw_case(draw):
        a = draw(_matrix(min_side=2))
        compressor = ft.partial(qt.low_rank, rank=1)
        body = lambda x: compress_p.bind(2 * x, compressor=compressor, batch_ndim=0)  # noqa: E731
        return Case(jax.jit(body), (a,), out_type=qt.LowRank, factor=4.0)

    return draw_case()


@case("jit", "*ArrayValue|dense")
def _jit_values():
    # A jitted body given a compressed value, inlined under the trace: a product,
    # or a scale and a negation, each keeping the type.
    @st.composite
    def draw_case(draw):
        x = draw(lowrank_values(dtype=jnp.float32, batch_dims=0))
        w = random_array(draw(seeds()), (x.shape[1], draw(st.integers(1, 5))))
        if draw(st.booleans()):
            body = jax.jit(lambda a, b: a @ b)
            return Case(body, (x, w), out_type=qt.LowRank, scale=float(x.shape[1]))
        return Case(jax.jit(lambda a: -(2.0 * a)), (x,), out_type=qt.LowRank)

    return draw_case()


@case("remat2", "*ArrayValue|dense")
def _remat():
    @st.composite
    def draw_case(draw):
        x = draw(lowrank_values(dtype=jnp.float32, batch_dims=0))
        w = random_array(draw(seeds()), (x.shape[1], draw(st.integers(1, 5))))
        fn = jax.checkpoint(lambda a, b: jnp.sin(1.0) * (a @ b))
        return Case(
            fn, (x, w), out_type=qt.LowRank, factor=2.0, scale=float(x.shape[1])
        )

    return draw_case()


@case("cond", "dense", "*ArrayValue|dense")
def _cond():
    @st.composite
    def draw_case(draw):
        x = draw(lowrank_values(dtype=jnp.float32, batch_dims=0, rank=1, shape=(8, 9)))
        y = draw(lowrank_values(dtype=jnp.float32, batch_dims=0, rank=2, shape=(8, 9)))
        take_first = draw(st.booleans())

        def fn(p, a, b):
            # The branches return ranks 1 and 3: the join pads the first.
            return jax.lax.cond(p, lambda a, b: a, lambda a, b: a + b, a, b)

        return Case(fn, (jnp.asarray(take_first), x, y), out_type=qt.LowRank)

    return draw_case()


@case("scan", "*ArrayValue|dense")
def _scan():
    @st.composite
    def draw_case(draw):
        x = draw(lowrank_values(dtype=jnp.float32, batch_dims=0))
        length = draw(st.integers(1, 3))
        scales = random_array(draw(seeds()), (length,))

        def fn(carry, scales):
            def body(c, s):
                return s * c, -c

            return jax.lax.scan(body, carry, scales)

        return Case(fn, (x, scales), out_type=None, factor=2.0)

    return draw_case()


@case("while", "*ArrayValue|dense")
def _while():
    @st.composite
    def draw_case(draw):
        x = draw(lowrank_values(dtype=jnp.float32, batch_dims=0))
        steps = draw(st.integers(0, 3))

        def fn(carry):
            def body(state):
                i, c = state
                return i + 1, 0.5 * c

            return jax.lax.while_loop(lambda s: s[0] < steps, body, (0, carry))[1]

        return Case(fn, (x,), out_type=qt.LowRank)

    return draw_case()


@case("materialise", "ArrayValue")
def _materialise_value():
    from tests.helpers.base import compressed_values

    def build(x):
        fn = lambda a: materialise_p.bind(a, batch_ndim=0)  # noqa: E731
        return Case(fn, (x,), x.dtype, jax.Array)

    return compressed_values().map(build)


@case("materialise", "dense")
def _materialise_dense():
    def build(a):
        fn = lambda x: materialise_p.bind(x, batch_ndim=0)  # noqa: E731
        return Case(fn, (a,), out_type=jax.Array)

    return _matrix().map(build)


@case("compress", "ArrayValue")
def _recompress():
    from tests.helpers.base import compressed_values

    @st.composite
    def draw_case(draw):
        x = draw(compressed_values())
        compressor = ft.partial(qt.sign_norm, block_size=None)
        fn = lambda a: compress_p.bind(a, compressor=compressor, batch_ndim=0)  # noqa: E731
        return Case(fn, (x,), x.dtype, qt.SignNorm)

    return draw_case()
