"""The `CompressedArray` protocol: each method's default is correct for any subclass
(it densifies, counted), and the library's types override it where a compressed form
exists. Also Python's operators on compressed values."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

import quax_tangents as qt
from tests.helpers import assert_close
from tests.helpers.sparse import random_sparse


class Doubled(qt.CompressedArray):
    """A type the library did not foresee: only `aval` and `materialise`."""

    half: Array

    def aval(self):
        return jax.core.ShapedArray(self.half.shape, self.half.dtype)

    def materialise(self):
        return 2 * self.half


def _key(i):
    return jax.random.key(i)


def _lowrank(shape=(6, 5), rank=2, seed=0):
    return qt.low_rank(jax.random.normal(_key(seed), shape), rank)


def _examples():
    x = jax.random.normal(_key(1), (6, 5))
    return {
        "LowRank": _lowrank(),
        "Sparse": random_sparse(2, (6, 5), 4),
        "Quantized": qt.quantize(x, bits=8, block_size=8),
        "SignNorm": qt.sign_norm(x, block_size=8),
        "SparseRows": qt.SparseRows(jnp.array([1, 4, 1]), jnp.ones((3, 5)), 6),
        "Doubled": Doubled(x),
    }


EXAMPLES = _examples()


def _counted(fn, *args):
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = fn(*args)
    return out, sum(qt.fallback_counts().values())


# ---------------------------------------------------------------------------------------
# cond: join_branches


def _branches_differ(x):
    # The second branch doubles the size of a Sparse (concatenated entries).
    return jax.lax.cond(x.sum() > 0, lambda y: y, lambda y: y + y, x)


def test_cond_with_sparse_of_different_k_stays_sparse():
    x = jnp.ones((6, 5))
    t = random_sparse(3, (6, 5), 4)
    with qt.fallback("error"):
        _, out = qt.jvp(_branches_differ, (x,), (t,))
        _, out_neg = qt.jvp(_branches_differ, (-x,), (t,))
    assert isinstance(out, qt.Sparse) and isinstance(out_neg, qt.Sparse)
    assert out.k == out_neg.k == 2 * t.k
    assert_close(out, qt.materialise(t))
    assert_close(out_neg, 2 * qt.materialise(t))


def test_cond_with_lowrank_of_different_rank_stays_lowrank():
    x = jnp.ones((6, 5))
    t = _lowrank(rank=1)

    def branches(x):
        # `y + y` keeps rank 1 (it shares a factor); a sum over a broadcast dim
        # concatenates the copies' factors.
        def doubled(y):
            return jnp.sum(jnp.broadcast_to(y, (2, *y.shape)), axis=0)

        return jax.lax.cond(x.sum() > 0, lambda y: y, doubled, x)

    with qt.fallback("error"):
        _, out = qt.jvp(branches, (-x,), (t,))
    assert isinstance(out, qt.LowRank) and out.rank == 2
    assert_close(out, 2 * qt.materialise(t))


def test_cond_with_an_unforeseen_type_densifies_counted():
    x = jnp.ones((6, 5))
    t = EXAMPLES["Doubled"]
    for sign in (1.0, -1.0):
        (_, out), count = _counted(qt.jvp, _branches_differ, (sign * x,), (t,))
        assert count > 0
        assert_close(out, qt.materialise(t) * (1 if sign > 0 else 2))


# ---------------------------------------------------------------------------------------
# loops: fit_carry


def _doubling_scan(x):
    carry, _ = jax.lax.scan(lambda c, _: (c + c, None), x, length=3)
    return carry


def test_loop_carry_of_an_unforeseen_type_densifies_counted():
    x = jnp.ones((6, 5))
    t = EXAMPLES["Doubled"]
    (_, out), count = _counted(qt.jvp, _doubling_scan, (x,), (t,))
    assert count > 0
    assert_close(out, 8 * qt.materialise(t))


def test_sparse_carry_that_shrinks_is_padded_back():
    x = jnp.ones((6, 5))
    t = random_sparse(4, (6, 5), 4)

    def body(c, _):
        # A carry of k entries in, k out: unchanged kind.
        return 0.5 * c, None

    with qt.fallback("error"):
        _, out = qt.jvp(lambda y: jax.lax.scan(body, y, length=2)[0], (x,), (t,))
    assert isinstance(out, qt.Sparse) and out.k == t.k
    assert_close(out, 0.25 * qt.materialise(t))


def test_sparse_fit_carry_pads_and_refuses_growth():
    small, large = random_sparse(5, (6, 5), 2), random_sparse(6, (6, 5), 4)
    fitted = small.fit_carry(large)
    assert isinstance(fitted, qt.Sparse) and fitted.k == 4
    assert_close(fitted, qt.materialise(small))
    assert large.fit_carry(small) is None


# ---------------------------------------------------------------------------------------
# all_reduce, on a one-device mesh (the multi-device behaviour is in
# tests/distributed/test_collective.py)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_all_reduce_of_every_type(name):
    value = EXAMPLES[name]
    mesh = jax.make_mesh((1,), ("d",))

    @ft.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P())
    def reduce(v):
        return qt.all_reduce(v, "d", mean=True)

    reduced, count = _counted(reduce, value)
    assert_close(reduced, qt.materialise(value))
    # Only a type without a compressed all-reduce densifies.
    assert (count > 0) == (name == "Doubled")


# ---------------------------------------------------------------------------------------
# inner


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_inner_with_dense_and_with_itself(name):
    value = EXAMPLES[name]
    dense = qt.materialise(value)
    other = jax.random.normal(_key(7), dense.shape, dense.dtype)
    with qt.fallback("silent"):
        got_dense = value.inner(other)
        got_self = value.inner(value)
    assert_close(got_dense, jnp.vdot(dense, other), scale=float(jnp.abs(dense).sum()))
    assert_close(got_self, jnp.vdot(dense, dense), scale=float((dense**2).sum()))


def test_lowrank_inner_never_forms_the_product():
    a, b = _lowrank(seed=1), _lowrank(seed=2)
    jaxpr = jax.make_jaxpr(lambda a, b: a.inner(b))(a, b)
    shapes = {tuple(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars}
    assert (6, 5) not in shapes


def test_inner_rejects_a_shape_mismatch():
    with pytest.raises(ValueError, match="one shape"):
        EXAMPLES["Doubled"].inner(jnp.ones((2, 2)))


# ---------------------------------------------------------------------------------------
# Python operators


_OPERATORS = {
    "t + t": lambda t, x: t + t,
    "2 * t": lambda t, x: 2 * t,
    "t * 2": lambda t, x: t * 2,
    "t / 2": lambda t, x: t / 2,
    "-t": lambda t, x: -t,
    "t - t": lambda t, x: t - t,
    "x @ t": lambda t, x: x @ t,
    "t @ x.T": lambda t, x: t @ x.T,
    "t.T": lambda t, x: t.T,
    "t[0]": lambda t, x: t[0],
    "t[1:3]": lambda t, x: t[1:3],
    "t + x": lambda t, x: t + x,
    "np x @ t": lambda t, x: np.asarray(x) @ t,
}


@pytest.mark.parametrize("op", sorted(_OPERATORS))
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_operators_compute_the_dense_value(name, op):
    value = EXAMPLES[name]
    dense = qt.materialise(value)
    fn = _OPERATORS[op]
    rows = dense.shape[-1] if op == "t @ x.T" else dense.shape[0]
    x = jax.random.normal(_key(9), (4, rows)) if "@" in op else dense
    with qt.fallback("silent"):
        got = fn(value, x)
    assert_close(got, fn(dense, x), scale=float(jnp.abs(fn(dense, x)).max()) + 1)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_jit_of_an_operator(name):
    value = EXAMPLES[name]
    with qt.fallback("silent"):
        got = jax.jit(lambda c: c * 2)(value)
    assert_close(got, 2 * qt.materialise(value))


def test_operators_keep_compression_where_the_rules_do():
    t = _lowrank(shape=(32, 32))
    with qt.fallback("error"):
        assert isinstance(t + t, qt.LowRank)
        assert isinstance(2 * t, qt.LowRank)
        assert isinstance(t.T, qt.LowRank)
        assert isinstance(jnp.ones((3, 32)) @ t, qt.LowRank)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_numpy_conversion_raises_instead_of_an_object_array(name):
    with pytest.raises(TypeError, match="materialise"):
        np.asarray(EXAMPLES[name])
