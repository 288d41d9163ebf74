"""What the block-wise types (`Quantized`, `SignNorm`) share in tests: shape menus, the
batched compressor, drawers of order-keeping permutations and reshapes, case builders,
and the property-test cases of the rules registered once for `BlockedArray`."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from tests.helpers import float_dtypes, random_array, seeds
from tests.helpers.cases import (
    Case,
    bind_convert,
    bind_reshape,
    bind_transpose,
    case,
)


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


def constructor_arguments(name, **changes):
    """Valid keyword arguments for the constructor of type `name` (`"Quantized"` or
    `"SignNorm"`): a float32 value of shape (2, 5) in 3 blocks of 4; `changes` replace
    some of them."""
    if name == "Quantized":
        own = dict(
            codes=jnp.zeros((3, 4), jnp.int8),
            scales=jnp.ones((3,), jnp.float32),
            bits=8,
        )
    else:
        own = dict(bits=jnp.zeros((3, 1), jnp.uint8), norms=jnp.ones((3,), jnp.float32))
    return {
        **own,
        "event_shape": (2, 5),
        "block_size": 4,
        "dtype": jnp.float32,
        **changes,
    }


def draw_input(draw, event_shape=None, dtype=None, batch_shape=None):
    """`(x, n_batch)`: a writable NumPy array of standard normal data, of shape
    `batch_shape + event_shape` and `dtype` (each drawn unless given), and the number
    of batch dims, for `batched_compressor`."""
    event_shape = draw(event_shapes()) if event_shape is None else tuple(event_shape)
    batch_shape = draw(batch_shapes()) if batch_shape is None else tuple(batch_shape)
    dtype = draw(float_dtypes()) if dtype is None else dtype
    x = np.array(random_array(draw(seeds()), batch_shape + event_shape, dtype))
    return x, len(batch_shape)


def blocked_values():
    """A `Quantized` or a `SignNorm`."""
    # Imported here: those modules import this one.
    from tests.helpers.quantized import quantized_values
    from tests.helpers.signnorm import signnorm_values

    return st.one_of(quantized_values(), signnorm_values())


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


def _n_batch(x):
    return len(x.shape) - len(x.event_shape)


def _unary_case(values, fn):
    """`fn(x)` for `x` drawn from `values`; the result must keep `x`'s type."""
    return values.map(lambda x: Case(fn, (x,), x.dtype, type(x)))


def _scale_case(values, value_first):
    """`lax.mul` of a value by a 0-d scalar or by an all-ones-shape array."""

    @st.composite
    def draw_case(draw):
        x = draw(values)
        shape = draw(st.sampled_from([(), (1,) * x.ndim]))
        sign = draw(st.sampled_from([1, -1, 0]))
        y = np.asarray(random_array(draw(seeds()), shape, x.dtype))
        y = y * np.asarray(sign, x.dtype)
        args = (x, y) if value_first else (y, x)
        # Scaling the stored scales/norms rounds once; the dense product rounds twice.
        return Case(jax.lax.mul, args, x.dtype, type(x), factor=2.0)

    return draw_case()


def register_own_cases(label, values):
    """Registers the cases of the rules each block-wise type registers itself: `neg`
    and the products with a scalar on either side, for values drawn by `values()`
    and operand label `label`."""
    case("neg", label)(lambda: _unary_case(values(), jax.lax.neg))
    case("mul", label, "dense")(lambda: _scale_case(values(), value_first=True))
    case("mul", "dense", label)(lambda: _scale_case(values(), value_first=False))


@case("copy", "BlockedArray")
def _copy():
    return _unary_case(blocked_values(), jnp.copy)


@case("convert_element_type", "BlockedArray")
def _convert():
    @st.composite
    def draw_case(draw):
        x = draw(blocked_values())
        target = draw(float_dtypes())
        fn = bind_convert(target)
        # The value is decoded straight into `target`; dense rounds to x.dtype first.
        coarse = max((x.dtype, target), key=lambda d: jnp.finfo(d).eps)
        return Case(fn, (x,), coarse, type(x))

    return draw_case()


@case("transpose", "BlockedArray")
def _transpose():
    @st.composite
    def draw_case(draw):
        x = draw(blocked_values())
        perm = order_keeping_permutation(draw, x.shape, _n_batch(x))
        return Case(bind_transpose(perm), (x,), x.dtype, type(x))

    return draw_case()


@case("reshape", "BlockedArray")
def _reshape():
    @st.composite
    def draw_case(draw):
        x = draw(blocked_values())
        n_batch = _n_batch(x)
        if draw(st.booleans()):
            # `lax.reshape` with `dimensions`: an order-keeping transpose, then reshape.
            perm = order_keeping_permutation(draw, x.shape, n_batch)
            batch = tuple(x.shape[p] for p in perm[:n_batch])
        else:
            perm, batch = None, x.shape[:n_batch]
        new_shape = batch + event_reshapes(draw, math.prod(x.event_shape))
        return Case(bind_reshape(new_shape, perm), (x,), x.dtype, type(x))

    return draw_case()
