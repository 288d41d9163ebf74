"""Random `LowRank` values and the property-test cases of every LowRank rule."""

import jax
import jax.numpy as jnp
from hypothesis import assume, strategies as st

import quax_tangents as qt
from quax_tangents._core._lax import add_any_p
from tests.helpers import float_dtypes, random_array, seeds
from tests.helpers.cases import Case, bind_convert, bind_reshape, bind_transpose, case


@st.composite
def lowrank_values(
    draw, shape=None, dtype=None, rank=None, batch_dims=None, projector_side=False
):
    """A LowRank of `shape` (or a drawn (*batch, m, n)) with standard normal factors
    and a drawn `projector_side` (a tag: rules must carry it or drop it; the factor
    it names is not made orthonormal, which no rule relies on)."""
    if shape is None:
        nb = draw(st.integers(0, 1)) if batch_dims is None else batch_dims
        shape = tuple(draw(st.integers(1, 3)) for _ in range(nb)) + (
            draw(st.integers(1, 6)),
            draw(st.integers(1, 6)),
        )
    dtype = draw(float_dtypes()) if dtype is None else dtype
    rank = draw(st.integers(1, 3)) if rank is None else rank
    *lead, m, n = shape
    seed = draw(seeds())
    left = random_array(seed, (*lead, m, rank), dtype)
    right = random_array(seed + 1, (*lead, n, rank), dtype)
    if projector_side is False:
        projector_side = draw(st.sampled_from([None, "left", "right"]))
    return qt.LowRank(left, right, projector_side=projector_side)


def _within_budget_shape(draw, rank):
    """(m, n) where two concatenated rank-`rank` LowRanks stay within budget."""
    m, n = draw(st.integers(4, 7)), draw(st.integers(4, 7))
    assume(2 * rank * (m + n) < m * n)
    return m, n


@case("neg", "LowRank")
def _neg():
    return lowrank_values().map(lambda x: Case(jax.lax.neg, (x,), x.dtype, qt.LowRank))


@case("copy", "LowRank")
def _copy():
    return lowrank_values().map(lambda x: Case(jnp.copy, (x,), x.dtype, qt.LowRank))


@case("convert_element_type", "LowRank")
def _convert():
    @st.composite
    def draw_case(draw):
        x = draw(lowrank_values())
        target = draw(float_dtypes())
        fn = bind_convert(target)
        # Rounding the factors is not rounding the product: allow the coarser dtype.
        coarse = max((x.dtype, target), key=lambda d: jnp.finfo(d).eps)
        return Case(fn, (x,), coarse, qt.LowRank, factor=2.0)

    return draw_case()


@st.composite
def _scaled(draw, lowrank_first, divide=False):
    x = draw(lowrank_values())
    *lead, m, n = x.shape
    kind = draw(st.sampled_from(["scalar", "row", "column", "corner"]))
    y_shape = {
        "scalar": (),
        "row": (*lead, 1, n),
        "column": (*lead, m, 1),
        "corner": (*lead, 1, 1),
    }[kind]
    y = random_array(draw(seeds()), y_shape, x.dtype)
    if divide:
        # Away from zero, so that the quotient's rounding stays at the dtype's scale.
        y = (jnp.sign(y) + (y == 0)) * (1 + jnp.abs(y))
        return Case(jax.lax.div, (x, y), x.dtype, qt.LowRank, factor=2.0)
    if lowrank_first:
        return Case(jax.lax.mul, (x, y), x.dtype, qt.LowRank, factor=2.0)
    return Case(jax.lax.mul, (y, x), x.dtype, qt.LowRank, factor=2.0)


@case("mul", "LowRank", "dense")
def _mul_right():
    return _scaled(True)


@case("mul", "dense", "LowRank")
def _mul_left():
    return _scaled(False)


@case("div", "LowRank", "dense")
def _div():
    return _scaled(True, divide=True)


@st.composite
def _pair(draw, fn):
    rank = draw(st.integers(1, 2))
    m, n = _within_budget_shape(draw, rank)
    dtype = draw(float_dtypes())
    batch = draw(st.sampled_from([(), (2,)]))
    x = draw(lowrank_values(batch + (m, n), dtype, rank))
    y = draw(lowrank_values(batch + (m, n), dtype, rank))
    side = x.projector_side
    if side is not None and y.projector_side == side:
        # Two projections on one side share their projector's values (in another
        # array, as a loop carry holds it): their sum keeps the rank. Different
        # projectors are refused (`tests/types/test_lowrank.py`).
        if side == "left":
            y = qt.LowRank(jnp.array(x.left), y.right, projector_side=side)
        else:
            y = qt.LowRank(y.left, jnp.array(x.right), projector_side=side)
    return Case(fn, (x, y), dtype, qt.LowRank, factor=2.0)


@case("add_any", "LowRank", "LowRank")
def _add_any():
    return _pair(add_any_p.bind)


@case("add", "LowRank", "LowRank")
def _add():
    return _pair(jax.lax.add)


@case("sub", "LowRank", "LowRank")
def _sub():
    return _pair(jax.lax.sub)


@case("transpose", "LowRank")
def _transpose():
    @st.composite
    def draw_case(draw):
        x = draw(lowrank_values(batch_dims=draw(st.integers(0, 2))))
        nb = x.ndim - 2
        batch_perm = tuple(draw(st.permutations(range(nb))))
        matrix_perm = draw(st.sampled_from([(nb, nb + 1), (nb + 1, nb)]))
        perm = batch_perm + matrix_perm
        return Case(bind_transpose(perm), (x,), x.dtype, qt.LowRank)

    return draw_case()


@case("reshape", "LowRank")
def _reshape():
    @st.composite
    def draw_case(draw):
        x = draw(lowrank_values(batch_dims=draw(st.integers(0, 2))))
        lead = x.shape[:-2]
        size = 1
        for d in lead:
            size *= d
        new_lead = draw(st.sampled_from([(size,), (1, size), (size, 1), ()]))
        assume(size == 1 or new_lead != ())
        new_shape = new_lead + x.shape[-2:]
        return Case(bind_reshape(new_shape), (x,), x.dtype, qt.LowRank)

    return draw_case()


@case("broadcast_in_dim", "LowRank")
def _broadcast():
    @st.composite
    def draw_case(draw):
        x = draw(lowrank_values())
        new_lead = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
        shape = new_lead + x.shape
        return Case(lambda a: jnp.broadcast_to(a, shape), (x,), x.dtype, qt.LowRank)

    return draw_case()


@case("reduce_sum", "LowRank")
def _reduce_sum():
    @st.composite
    def draw_case(draw):
        x = draw(lowrank_values(batch_dims=draw(st.integers(0, 2)), rank=1))
        nb = x.ndim - 2
        batch_axes = tuple(a for a in range(nb) if draw(st.booleans()))
        matrix_axes = draw(st.sampled_from([(), (nb,), (nb + 1,), (nb, nb + 1)]))
        axes = batch_axes + matrix_axes
        assume(axes)
        keep_matrix = not matrix_axes
        if keep_matrix:
            m, n = x.shape[-2:]
            summed = 1
            for a in batch_axes:
                summed *= x.shape[a]
            assume(summed * x.rank * (m + n) < m * n)
        # Without a batch dim left, a sum over a matrix dim is a vector: dense, allowed.
        remaining = x.ndim - len(axes)
        assume(keep_matrix or remaining <= 1)
        out_type = qt.LowRank if keep_matrix else jax.Array
        scale = float(x.shape[-1] * x.shape[-2])
        return Case(
            lambda a: jnp.sum(a, axis=axes), (x,), x.dtype, out_type, scale=scale
        )

    return draw_case()


@st.composite
def _dot_case(draw, lowrank_is_lhs):
    """A `dot_general` that keeps a LowRank: x contracts one matrix dim, batch dims are
    x's leading dims, and the dense operand brings free dims."""
    dtype = draw(float_dtypes())
    nb = draw(st.integers(0, 1))
    x = draw(lowrank_values(dtype=dtype, batch_dims=nb))
    batch, (m, n) = x.shape[:-2], x.shape[-2:]
    contract_n = draw(st.booleans())
    k = n if contract_n else m
    x_c = nb + 1 if contract_n else nb
    # Dense free dims: exactly one on the right of a LowRank lhs (to stay LowRank);
    # one or two on the left of a LowRank rhs (extra ones become leading dims).
    n_free = 1 if lowrank_is_lhs else draw(st.integers(1, 2))
    free = tuple(draw(st.integers(1, 4)) for _ in range(n_free))
    # Put the dense operand's dims in a drawn order.
    dims = (
        [("b", i) for i in range(nb)] + [("c", 0)] + [("f", i) for i in range(n_free)]
    )
    dims = draw(st.permutations(dims))
    sizes = {("c", 0): k} | {("b", i): batch[i] for i in range(nb)}
    sizes |= {("f", i): free[i] for i in range(n_free)}
    d = random_array(draw(seeds()), tuple(sizes[t] for t in dims), dtype)
    d_c = (dims.index(("c", 0)),)
    d_b = tuple(dims.index(("b", i)) for i in range(nb))
    x_b = tuple(range(nb))
    if lowrank_is_lhs:
        numbers = (((x_c,), d_c), (x_b, d_b))
        fn = lambda a, b: jax.lax.dot_general(a, b, numbers)  # noqa: E731
        args = (x, d)
    else:
        numbers = ((d_c, (x_c,)), (d_b, x_b))
        fn = lambda a, b: jax.lax.dot_general(a, b, numbers)  # noqa: E731
        args = (d, x)
    return Case(fn, args, dtype, qt.LowRank, factor=2.0, scale=float(k))


@case("dot_general", "LowRank", "dense")
def _dot_right():
    return _dot_case(True)


@case("dot_general", "dense", "LowRank")
def _dot_left():
    return _dot_case(False)


@st.composite
def _with_dense(draw, fn, lowrank_first):
    x = draw(lowrank_values())
    y = random_array(draw(seeds()), x.shape, x.dtype)
    args = (x, y) if lowrank_first else (y, x)
    return Case(fn, args, x.dtype, jax.Array, factor=2.0)


@case("add_any", "LowRank", "dense")
def _add_any_dense_right():
    return _with_dense(add_any_p.bind, True)


@case("add_any", "dense", "LowRank")
def _add_any_dense_left():
    return _with_dense(add_any_p.bind, False)


@case("add", "LowRank", "dense")
def _add_dense_right():
    return _with_dense(jax.lax.add, True)


@case("add", "dense", "LowRank")
def _add_dense_left():
    return _with_dense(jax.lax.add, False)
