"""Random `Sparse` values and the property-test cases of every Sparse rule."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

import quax_tangents as qt
from quax_tangents._core._lax import add_any_p
from tests.helpers import float_dtypes, seeds
from tests.helpers.cases import Case, bind_convert, bind_reshape, bind_transpose, case


def random_array(seed, shape, dtype=jnp.float32):
    """A standard normal array built on the host (no per-shape compilation)."""
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jnp.asarray(data.astype(jnp.dtype(dtype)))


def dense_sparse(x):
    """`x` materialised in float64 with NumPy: an independent reference."""
    batch = x.indices.shape[:-1]
    rows = math.prod(batch)
    out = np.zeros((rows, math.prod(x.event_shape)))
    indices = np.asarray(x.indices).reshape(rows, -1)
    values = np.asarray(x.values, np.float64).reshape(rows, -1)
    np.add.at(out, (np.arange(rows)[:, None], indices), values)
    return out.reshape(batch + x.event_shape)


def numpy_dot_general(lhs, rhs, dimension_numbers):
    """`lax.dot_general` in NumPy (float64), via `einsum`."""
    (lc, rc), (lb, rb) = dimension_numbers
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    lhs_labels = [next(letters) for _ in range(lhs.ndim)]
    rhs_labels = [next(letters) for _ in range(rhs.ndim)]
    for a, b in zip(lc + lb, rc + rb, strict=True):
        rhs_labels[b] = lhs_labels[a]
    out = [lhs_labels[a] for a in lb]
    out += [lhs_labels[a] for a in range(lhs.ndim) if a not in lc + lb]
    out += [rhs_labels[b] for b in range(rhs.ndim) if b not in rc + rb]
    spec = f"{''.join(lhs_labels)},{''.join(rhs_labels)}->{''.join(out)}"
    return np.einsum(spec, lhs, rhs)


@st.composite
def sparse_values(draw, shape=None, dtype=None, k=None, batch_dims=None):
    """A `Sparse` of `shape` (or a drawn one, sides 1..5) with `batch_dims` leading
    batch dims (drawn 0..1 if `None`), `k` entries per batch element (drawn in
    1..min(6, event size) if `None`) at random, possibly repeated, indices and standard
    normal values."""
    if shape is None:
        nb = draw(st.integers(0, 1)) if batch_dims is None else batch_dims
        n_event = draw(st.integers(0 if nb else 1, 3))
        shape = tuple(draw(st.integers(1, 5)) for _ in range(nb + n_event))
    else:
        shape = tuple(shape)
        nb = 0 if batch_dims is None else batch_dims
    dtype = draw(float_dtypes()) if dtype is None else dtype
    size = math.prod(shape[nb:])
    k = draw(st.integers(1, min(6, size))) if k is None else k
    return random_sparse(draw(seeds()), shape, k, dtype, batch_dims=nb)


def random_sparse(seed, shape, k, dtype=jnp.float32, batch_dims=0):
    """A `Sparse` with `k` uniformly random (possibly repeated) indices per batch
    element and standard normal values, reproducible from `seed`."""
    batch, event = tuple(shape[:batch_dims]), tuple(shape[batch_dims:])
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, math.prod(event), batch + (k,))
    values = random_array(seed + 1, batch + (k,), dtype)
    return qt.Sparse(indices, values, shape)


def _sparse_case(fn, out_type=qt.Sparse, **kwargs):
    return lambda x: Case(fn, (x,), x.dtype, out_type, **kwargs)


@case("neg", "Sparse")
def _neg():
    return sparse_values().map(_sparse_case(jax.lax.neg))


@case("copy", "Sparse")
def _copy():
    return sparse_values().map(_sparse_case(jnp.copy))


@case("convert_element_type", "Sparse")
def _convert():
    @st.composite
    def draw_case(draw):
        x = draw(sparse_values())
        target = draw(float_dtypes())
        fn = bind_convert(target)
        # Duplicates are rounded one by one before they add up: allow the coarser
        # dtype, twice.
        coarse = max((x.dtype, target), key=lambda d: jnp.finfo(d).eps)
        return Case(fn, (x,), coarse, qt.Sparse, factor=2.0)

    return draw_case()


@st.composite
def _scaled(draw, sparse_first):
    x = draw(sparse_values())
    kind = draw(st.sampled_from(["scalar", "full", "broadcast"]))
    if kind == "scalar":
        y_shape = ()
    elif kind == "full":
        y_shape = x.shape
    else:
        y_shape = tuple(d if draw(st.booleans()) else 1 for d in x.shape)
    y = random_array(draw(seeds()), y_shape, x.dtype)
    args = (x, y) if sparse_first else (y, x)
    return Case(jax.lax.mul, args, x.dtype, qt.Sparse, factor=2.0)


@case("mul", "Sparse", "dense")
def _mul_right():
    return _scaled(True)


@case("mul", "dense", "Sparse")
def _mul_left():
    return _scaled(False)


@st.composite
def _pair(draw, fn):
    """Two Sparse of one aval, with the same or different batch layouts."""
    dtype = draw(float_dtypes())
    x = draw(sparse_values(dtype=dtype))
    nb = draw(st.integers(0, x.ndim))
    y = draw(sparse_values(x.shape, dtype, batch_dims=nb))
    return Case(fn, (x, y), dtype, qt.Sparse, factor=2.0)


@case("add_any", "Sparse", "Sparse")
def _add_any():
    return _pair(add_any_p.bind)


@case("add", "Sparse", "Sparse")
def _add():
    return _pair(jax.lax.add)


@case("sub", "Sparse", "Sparse")
def _sub():
    return _pair(jax.lax.sub)


@st.composite
def _with_dense(draw, fn, sparse_first):
    x = draw(sparse_values())
    y = random_array(draw(seeds()), x.shape, x.dtype)
    args = (x, y) if sparse_first else (y, x)
    # Dense by design: the output is an array.
    return Case(fn, args, x.dtype, jax.Array, factor=2.0)


@case("add_any", "Sparse", "dense")
def _add_any_right():
    return _with_dense(add_any_p.bind, True)


@case("add_any", "dense", "Sparse")
def _add_any_left():
    return _with_dense(add_any_p.bind, False)


@case("add", "Sparse", "dense")
def _add_right():
    return _with_dense(jax.lax.add, True)


@case("add", "dense", "Sparse")
def _add_left():
    return _with_dense(jax.lax.add, False)


@st.composite
def dot_general_operands(draw, sparse_is_lhs, dtype=None):
    """A Sparse, a dense operand, and `dot_general` dimension numbers with drawn
    batch, contracting and free dims in drawn orders, where the exact sparse result
    is smaller than the dense one (so the rule keeps it sparse).

    Returns `(args, dimension_numbers, preferred_element_type)`, `args` in call
    order."""
    dtype = draw(float_dtypes()) if dtype is None else dtype
    itemsize = jnp.dtype(dtype).itemsize
    n_batch, n_contract = draw(st.integers(0, 1)), draw(st.integers(0, 2))
    n_s_free, n_d_free = draw(st.integers(1, 2)), draw(st.integers(0, 2))
    side = st.integers(1, 4)
    sizes = {("b", i): draw(side) for i in range(n_batch)}
    sizes |= {("c", i): draw(side) for i in range(n_contract)}
    sizes |= {("s", i): draw(side) for i in range(n_s_free)}
    sizes |= {("d", i): draw(side) for i in range(n_d_free)}
    # Output entries the sparse operand spans: batch times its own free dims. The
    # exact result keeps nnz * (dense free size) entries; it beats dense when
    # nnz * (4 + itemsize) <= spanned * itemsize.
    spanned = math.prod(sizes[t] for t in sizes if t[0] in "bs")
    need = -(-(4 + itemsize) // itemsize)
    if spanned < need:
        sizes[("s", 0)] *= need
        spanned *= need
    k_max = spanned * itemsize // (4 + itemsize)
    common = [("b", i) for i in range(n_batch)] + [("c", i) for i in range(n_contract)]
    s_dims = draw(st.permutations(common + [("s", i) for i in range(n_s_free)]))
    d_dims = draw(st.permutations(common + [("d", i) for i in range(n_d_free)]))
    s_shape = tuple(sizes[t] for t in s_dims)
    # Optionally store the sparse operand with its first dim as a Sparse batch dim
    # (k entries per row): nnz is then rows * k.
    nb = draw(st.integers(0, 1)) if s_shape and s_shape[0] <= k_max else 0
    rows = math.prod(s_shape[:nb])
    k = draw(st.integers(1, min(k_max // rows, math.prod(s_shape[nb:]), 4)))
    x = draw(sparse_values(s_shape, dtype, k=k, batch_dims=nb))
    d = random_array(draw(seeds()), tuple(sizes[t] for t in d_dims), dtype)
    s_c = tuple(s_dims.index(("c", i)) for i in range(n_contract))
    d_c = tuple(d_dims.index(("c", i)) for i in range(n_contract))
    s_b = tuple(s_dims.index(("b", i)) for i in range(n_batch))
    d_b = tuple(d_dims.index(("b", i)) for i in range(n_batch))
    preferred = None
    if itemsize < 4 and draw(st.booleans()):
        preferred = jnp.float32
    if sparse_is_lhs:
        return (x, d), ((s_c, d_c), (s_b, d_b)), preferred
    return (d, x), ((d_c, s_c), (d_b, s_b)), preferred


@st.composite
def _dot_case(draw, sparse_is_lhs):
    args, numbers, preferred = draw(dot_general_operands(sparse_is_lhs))

    def fn(a, b):
        return jax.lax.dot_general(a, b, numbers, preferred_element_type=preferred)

    # Products are rounded before they add up: measure the error against the sum
    # of the magnitudes of the terms.
    magnitudes = [
        np.abs(dense_sparse(a) if isinstance(a, qt.Sparse) else np.asarray(a, float))
        for a in args
    ]
    scale = max(float(np.max(numpy_dot_general(*magnitudes, numbers))), 1.0)
    dtype = args[0].dtype
    return Case(fn, args, dtype, qt.Sparse, factor=2.0, scale=scale)


@case("dot_general", "Sparse", "dense")
def _dot_right():
    return _dot_case(True)


@case("dot_general", "dense", "Sparse")
def _dot_left():
    return _dot_case(False)


@case("transpose", "Sparse")
def _transpose():
    @st.composite
    def draw_case(draw):
        x = draw(sparse_values())
        perm = tuple(draw(st.permutations(range(x.ndim))))
        return Case(bind_transpose(perm), (x,), x.dtype, qt.Sparse)

    return draw_case()


def _factorisations(size, max_dims=3):
    """Every shape of at most `max_dims` dims with product `size`."""
    shapes = [()] if size == 1 else []
    for first in range(1, size + 1):
        if size % first == 0 and max_dims > 0:
            shapes += [
                (first,) + rest for rest in _factorisations(size // first, max_dims - 1)
            ]
    return shapes


@case("reshape", "Sparse")
def _reshape():
    @st.composite
    def draw_case(draw):
        x = draw(sparse_values())
        nb = x.indices.ndim - 1
        if draw(st.booleans()):  # keep the batch dims
            event = draw(st.sampled_from(_factorisations(math.prod(x.event_shape))))
            new_shape = x.shape[:nb] + event
        else:
            new_shape = draw(st.sampled_from(_factorisations(x.size)))
        return Case(bind_reshape(new_shape), (x,), x.dtype, qt.Sparse)

    return draw_case()


@case("reduce_sum", "Sparse")
def _reduce_sum():
    @st.composite
    def draw_case(draw):
        x = draw(sparse_values())
        axes = tuple(a for a in range(x.ndim) if draw(st.booleans()))
        scale = float(max(1, np.sum(np.abs(np.asarray(x.values, np.float32)))))
        return Case(
            lambda a: jnp.sum(a, axis=axes), (x,), x.dtype, qt.Sparse, scale=scale
        )

    return draw_case()
