"""Random `Quantized` values and the property-test cases of every Quantized rule."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import quax_tangents as qt
from tests.helpers import float_dtypes, seeds
from tests.helpers.cases import Case, case


# A fixed menu of small shapes keeps JAX's compile caches warm across examples (each
# new shape costs compilations); it still covers 0-d, size-1 dims, partial blocks and
# several batch layouts.
EVENT_SHAPES = [(), (1,), (5,), (3, 4), (1, 6), (4, 1), (2, 1, 3), (3, 1, 1, 2)]
BATCH_SHAPES = [(), (), (2,), (1, 3)]


def event_shapes():
    return st.sampled_from(EVENT_SHAPES)


def batch_shapes():
    return st.sampled_from(BATCH_SHAPES)


def vmapped(fn, n_batch):
    """`fn` vmapped over `n_batch` leading axes."""
    for _ in range(n_batch):
        fn = jax.vmap(fn)
    return fn


@functools.cache
def batched_compressor(compress, n_batch, *settings):
    """`compress(x, *settings)` vmapped over `n_batch` leading axes and jitted, cached
    so that repeated draws reuse compilations."""
    return jax.jit(vmapped(lambda a: compress(a, *settings), n_batch))


def normal_array(seed, shape, dtype):
    """Standard normal data built in numpy (no JAX op, so no compilation per shape)."""
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return np.asarray(data.astype(jnp.dtype(dtype)))


@st.composite
def quantized_values(
    draw, event_shape=None, dtype=None, bits=None, block_size=None, batch_shape=None
):
    """A `Quantized` of standard normal data. Batch dims (drawn unless given) come from
    vmapping `quantize`, as they do in use."""
    event_shape = draw(event_shapes()) if event_shape is None else tuple(event_shape)
    batch_shape = draw(batch_shapes()) if batch_shape is None else tuple(batch_shape)
    dtype = draw(float_dtypes()) if dtype is None else dtype
    bits = draw(st.sampled_from([4, 8])) if bits is None else bits
    if block_size is None:
        block_size = draw(st.sampled_from([2, 4, 256]))
    x = normal_array(draw(seeds()), batch_shape + event_shape, dtype)
    return batched_compressor(qt.quantize, len(batch_shape), bits, block_size)(x)


def order_keeping_permutation(draw, shape, n_batch):
    """A permutation of `shape`'s axes that permutes batch axes among themselves and
    moves only size-1 event axes, so the flat order of the event elements stays."""
    batch_perm = tuple(draw(st.permutations(range(n_batch))))
    event_axes = list(range(n_batch, len(shape)))
    shuffled = list(draw(st.permutations(event_axes)))
    positions = [i for i, a in enumerate(shuffled) if shape[a] != 1]
    for i, a in zip(positions, sorted(shuffled[i] for i in positions), strict=True):
        shuffled[i] = a
    return batch_perm + tuple(shuffled)


def event_reshapes(draw, size):
    """A new event shape of `size` elements: flat, padded with 1s, or two factors."""
    divisors = [d for d in range(1, size + 1) if size % d == 0] or [1]
    d = draw(st.sampled_from(divisors))
    return draw(
        st.sampled_from(
            [(size,), (1, size), (size, 1), (d, size // d), (d, 1, size // d)]
        )
    )


def _unary(values, fn, out_type):
    return values.map(lambda x: Case(fn, (x,), x.dtype, out_type))


def scale_case(values, out_type, value_first):
    """`lax.mul` of a value by a 0-d scalar or by an all-ones-shape array."""

    @st.composite
    def draw_case(draw):
        x = draw(values)
        shape = draw(st.sampled_from([(), (1,) * x.ndim]))
        sign = draw(st.sampled_from([1, -1, 0]))
        y = normal_array(draw(seeds()), shape, x.dtype) * np.asarray(sign, x.dtype)
        args = (x, y) if value_first else (y, x)
        # Scaling the stored scales/norms rounds once; the dense product rounds twice.
        return Case(jax.lax.mul, args, x.dtype, out_type, factor=2.0)

    return draw_case()


def convert_case(values, out_type):
    @st.composite
    def draw_case(draw):
        x = draw(values)
        target = draw(float_dtypes())
        fn = lambda a: jax.lax.convert_element_type(a, target)  # noqa: E731
        # The value is decoded straight into `target`; dense rounds to x.dtype first.
        coarse = max((x.dtype, target), key=lambda d: jnp.finfo(d).eps)
        return Case(fn, (x,), coarse, out_type)

    return draw_case()


def transpose_case(values, out_type):
    @st.composite
    def draw_case(draw):
        x = draw(values)
        n_batch = len(x.shape) - len(x.event_shape)
        perm = order_keeping_permutation(draw, x.shape, n_batch)
        return Case(lambda a: jax.lax.transpose(a, perm), (x,), x.dtype, out_type)

    return draw_case()


def reshape_case(values, out_type):
    @st.composite
    def draw_case(draw):
        x = draw(values)
        n_batch = len(x.shape) - len(x.event_shape)
        if draw(st.booleans()):
            # `lax.reshape` with `dimensions`: an order-keeping transpose, then reshape.
            perm = order_keeping_permutation(draw, x.shape, n_batch)
            batch = tuple(x.shape[p] for p in perm[:n_batch])
        else:
            perm, batch = None, x.shape[:n_batch]
        new_shape = batch + event_reshapes(draw, math.prod(x.event_shape))
        fn = lambda a: jax.lax.reshape(a, new_shape, perm)  # noqa: E731
        return Case(fn, (x,), x.dtype, out_type)

    return draw_case()


@case("neg", "Quantized")
def _neg():
    return _unary(quantized_values(), jax.lax.neg, qt.Quantized)


@case("copy", "Quantized")
def _copy():
    return _unary(quantized_values(), jnp.copy, qt.Quantized)


@case("mul", "Quantized", "dense")
def _mul_right():
    return scale_case(quantized_values(), qt.Quantized, value_first=True)


@case("mul", "dense", "Quantized")
def _mul_left():
    return scale_case(quantized_values(), qt.Quantized, value_first=False)


@case("convert_element_type", "Quantized")
def _convert():
    return convert_case(quantized_values(), qt.Quantized)


@case("transpose", "Quantized")
def _transpose():
    return transpose_case(quantized_values(), qt.Quantized)


@case("reshape", "Quantized")
def _reshape():
    return reshape_case(quantized_values(), qt.Quantized)
