"""Each compressed type through jit, vmap, scan, while_loop, cond, checkpoint,
custom_jvp and custom_vjp, and the joins and carry checks of `_control.py`."""

import functools

import jax
import jax.numpy as jnp
import pytest
import quax

import quax_tangents as qt
from quax_tangents._types._primitives import compress_p
from tests.helpers import assert_close, random_array


DENSE = random_array(0, (6, 8))
STACK = random_array(1, (3, 6, 8))
COMPRESSORS = {
    "LowRank": lambda a: qt.low_rank(a, 2),
    "Sparse": lambda a: qt.top_k(a, 5),
    "Quantized": lambda a: qt.quantize(a, 8, 4),
    "SignNorm": lambda a: qt.sign_norm(a, 4),
}


def _scale(t):
    return 2.0 * t


def _flip(t):
    return -t


@jax.custom_jvp
def _custom(x):
    return 2.0 * x


@_custom.defjvp
def _custom_jvp(primals, tangents):
    return _custom(primals[0]), _scale(tangents[0])


@jax.custom_vjp
def _custom_rev(x):
    return 2.0 * x


_custom_rev.defvjp(lambda x: (2.0 * x, None), lambda _, ct: (_scale(ct),))


def _scan(t):
    return jax.lax.scan(lambda c, _: (_flip(c), _scale(c)), t, None, length=3)


def _while(t):
    def body(state):
        i, c = state
        return i + 1, _flip(c)

    return jax.lax.while_loop(lambda s: s[0] < 3, body, (0, t))[1]


def _cond(t):
    return jax.lax.cond(True, _scale, _flip, t)


TRANSFORMS = {
    "jit-outside": lambda f, t: jax.jit(quax.quaxify(f))(t),
    "jit-inside": lambda f, t: quax.quaxify(jax.jit(f))(t),
    "checkpoint": lambda f, t: quax.quaxify(jax.checkpoint(f))(t),
    "cond": lambda f, t: quax.quaxify(_cond)(t),
    "scan": lambda f, t: quax.quaxify(_scan)(t),
    "while": lambda f, t: quax.quaxify(_while)(t),
    "custom_jvp": lambda f, t: qt.jvp(_custom, (DENSE,), (t,))[1],
    "custom_vjp": lambda f, t: qt.vjp(_custom_rev, DENSE)[1](t)[0],
}
REFERENCE = {
    "cond": _cond,
    "scan": _scan,
    "while": _while,
    "custom_jvp": _scale,
    "custom_vjp": _scale,
}


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_transform_keeps_each_type(name, transform):
    t = COMPRESSORS[name](DENSE)
    with qt.fallback("error"):
        out = TRANSFORMS[transform](_scale, t)
    expected = REFERENCE.get(transform, _scale)(t.materialise())
    for got, want in zip(
        jax.tree.leaves(out, is_leaf=qt.CompressedArray.__instancecheck__),
        jax.tree.leaves(expected),
    ):
        assert isinstance(got, type(t)), (transform, type(got))
        assert_close(got.materialise(), want)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_vmap_outside_and_inside(name):
    stacked = jax.vmap(COMPRESSORS[name])(STACK)
    with qt.fallback("error"):
        outside = jax.vmap(quax.quaxify(_scale))(stacked)
        inside = quax.quaxify(jax.vmap(_scale))(stacked)
    for out in (outside, inside):
        assert isinstance(out, type(stacked)) and out.shape == (3, 6, 8)
        assert_close(out.materialise(), 2 * stacked.materialise())


# ---------------------------------------------------------------------------------------
# Joins and carries


LR1 = qt.LowRank(random_array(2, (10, 1)), random_array(3, (12, 1)))
LR2 = qt.LowRank(random_array(4, (10, 1)), random_array(5, (12, 1)))


def test_cond_pads_branches_of_different_rank():
    def f(p, a, b):
        return jax.lax.cond(p, lambda a, b: a, lambda a, b: a + b, a, b)

    for p in (True, False):
        with qt.fallback("error"):
            out = quax.quaxify(f)(p, LR1, LR2)
        assert isinstance(out, qt.LowRank) and out.rank == 2
        assert_close(out.materialise(), f(p, LR1.materialise(), LR2.materialise()))


def test_cond_densifies_branches_of_different_types_and_counts_it():
    sparse = qt.top_k(random_array(6, (10, 12)), 4)

    def f(p, a, b):
        return jax.lax.cond(p, lambda a, b: a, lambda a, b: b, a, b)

    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(f)(False, LR1, sparse)
    assert_close(out, sparse.materialise())
    assert qt.fallback_counts() == {("cond", "LowRank"): 1, ("cond", "Sparse"): 1}
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="`cond`"):
        quax.quaxify(f)(False, LR1, sparse)


def _growing(t, step):
    # Each iteration adds `step`: the carry's rank would grow by one per iteration.
    return jax.lax.scan(lambda c, _: (c + step, None), t, None, length=3)[0]


def _growing_while(t, step):
    def body(state):
        i, c = state
        return i + 1, c + step

    return jax.lax.while_loop(lambda s: s[0] < 3, body, (0, t))[1]


@pytest.mark.parametrize(
    "loop, name", [(_growing, "scan"), (_growing_while, "while_loop")]
)
def test_growing_carry_names_the_carry(loop, name):
    with pytest.raises(TypeError, match=rf"`lax.{name}` carry \d+ .* rank 1 .* rank 2"):
        quax.quaxify(loop)(LR2, LR1)


@pytest.mark.parametrize("loop", [_growing, _growing_while])
def test_growing_carry_is_truncated_under_recompress(loop):
    qt.reset_fallback_counts()
    with qt.rank_budget(qt.Recompress()), qt.fallback("error"):
        out = quax.quaxify(loop)(LR2, LR1)
    assert isinstance(out, qt.LowRank) and out.rank == 1
    # Every step adds the same rank-1 term to a rank-1 carry, so the best rank-1
    # approximation of each step's sum is what the dense loop would not keep; check
    # against the same truncation done densely.
    expected = LR2.materialise()
    for _ in range(3):
        u, s, vt = jnp.linalg.svd(expected + LR1.materialise())
        expected = (u[:, :1] * s[:1]) @ vt[:1]
    assert_close(out.materialise(), expected, factor=50)
    assert sum(qt.rank_budget_counts().values()) >= 1


def test_carry_that_turns_dense_starts_dense():
    def loop(t):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c), None), t, None, length=2)[0]

    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(loop)(LR1)
    assert_close(out, loop(LR1.materialise()))
    assert ("scan", "LowRank") in qt.fallback_counts()


def test_dense_carry_becoming_compressed_is_an_error():
    compressor = functools.partial(qt.low_rank, rank=1)

    def loop(c):
        body = lambda c, _: (
            compress_p.bind(c, compressor=compressor, batch_ndim=0),
            None,
        )
        return jax.lax.scan(body, c, None, length=2)[0]

    with pytest.raises(TypeError, match="carry 0 enters the body dense"):
        quax.quaxify(loop, filter_spec=lambda _: True)(jnp.ones((10, 12)))
    # Outside quax the same loop is dense code with the same numbers.
    assert loop(jnp.ones((10, 12))).shape == (10, 12)


def test_jvp_through_a_cond_branch_that_ignores_the_tangent():
    """One branch does not touch the input, so JAX gives it a zero tangent; plain
    quax fails with "all branches output must have the same pytree". Here the join
    densifies that branch's tangent (counted) and the result is exact."""
    x = random_array(7, (4, 10))
    w = random_array(8, (10, 12))

    def f(w, p):
        return jax.lax.cond(p, lambda w: x @ w, lambda w: jnp.ones((4, 12)), w)

    tangent = qt.low_rank(random_array(9, (10, 12)), 1)
    for p in (True, False):
        qt.reset_fallback_counts()
        with qt.fallback("silent"):
            _, out = qt.jvp(f, (w, p), (tangent, None))
        expected = jax.jvp(functools.partial(f, p=p), (w,), (tangent.materialise(),))[1]
        assert_close(qt.materialise(out), expected, scale=10.0)
        assert ("cond", "LowRank") in qt.fallback_counts()


def test_scan_transpose_accumulates_a_shared_weight_cotangent_densely():
    """JAX's scan transpose starts the cotangent carry of a weight used in every
    step as dense zeros, so per-step compressed cotangents are summed into a dense
    array: the result is exact and dense, and the densification is counted."""
    xs = random_array(10, (3, 4, 10))
    w = random_array(11, (10, 12))
    compressor = functools.partial(qt.low_rank, rank=2)

    def loss(w):
        def body(total, x):
            return total + jnp.sum(
                jnp.tanh(x @ qt.compress_cotangent(w, compressor))
            ), None

        return jax.lax.scan(body, 0.0, xs)[0]

    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        grad = qt.grad(loss)(w)
    assert isinstance(grad, jax.Array)
    assert qt.fallback_counts()
    assert_close(grad, jax.grad(loss)(w), scale=float(jnp.abs(grad).max()))


def test_scanning_over_the_rows_of_a_matrix_densifies_it():
    w = random_array(12, (3, 4))
    tangent = qt.LowRank(random_array(13, (3, 1)), random_array(14, (4, 1)))

    def f(w):
        return jax.lax.scan(lambda c, row: (c + jnp.sum(row**2), 2 * row), 0.0, w)

    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        _, out = qt.jvp(f, (w,), (tangent,))
    expected = jax.jvp(f, (w,), (tangent.materialise(),))[1]
    for got, want in zip(
        jax.tree.leaves(qt.materialise(out)), jax.tree.leaves(expected)
    ):
        assert_close(got, want, scale=10.0)
    assert ("scan", "LowRank") in qt.fallback_counts()


def test_a_densification_inside_a_jitted_function_counts_on_every_trace():
    # A jitted function given a compressed value (as `jnp.take` is, inside a
    # loss): every trace runs the rules again, so each counts the densification
    # and `fallback("error")` raises on a later trace as on the first.
    @jax.jit
    def inner(x):
        return jnp.sin(x)

    value = qt.LowRank(random_array(15, (6, 2)), random_array(16, (5, 2)))
    for _ in range(2):
        qt.reset_fallback_counts()
        with qt.fallback("silent"):
            out = jax.jit(quax.quaxify(inner))(value)
        assert qt.fallback_counts() == {("sin", "LowRank"): 1}
        assert_close(out, jnp.sin(value.materialise()))
        with qt.fallback("error"), pytest.raises(qt.DensificationError):
            jax.jit(quax.quaxify(lambda x: inner(x)))(value)


def test_scanning_over_stacked_values_keeps_them():
    stacked = jax.vmap(lambda a: qt.low_rank(a, 1))(STACK)
    with qt.fallback("error"):
        _, ys = quax.quaxify(
            lambda xs: jax.lax.scan(lambda c, x: (c, 2.0 * x), 0.0, xs)
        )(stacked)
    assert isinstance(ys, qt.LowRank)
    assert_close(ys.materialise(), 2 * stacked.materialise())


def test_construction_primitives_under_vmap():
    xs = random_array(15, (3, 6, 8))
    assert_close(jax.vmap(qt.materialise)(xs), xs)
    compressed = jax.vmap(lambda a: qt.compress(a, lambda b: qt.sign_norm(b)))(xs)
    assert_close(compressed, jax.vmap(lambda a: qt.sign_norm(a).materialise())(xs))
