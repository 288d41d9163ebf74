"""`forward_grad`: unbiasedness, the variance of each kind of direction, compression
of the estimate, and input checks.

The statistical tests draw many single-direction estimates under one `jax.vmap` over
keys (one compilation, milliseconds to run) and compare them with `jax.grad`. Each
tolerance is a number of standard errors computed from the samples themselves; the
seeds are fixed, so the tests are deterministic.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
import quax
from jaxtyping import Array, Float

import quax_tangents as qt
from quax_tangents import Differentiable, differentiable
from tests.helpers import assert_close, random_array


# Standard errors allowed. A mean of many samples is close to normal; |Z| > 5 has
# probability 6e-7 per comparison, so the few hundred comparisons here would all pass
# for almost every seed if the estimator is right.
Z_BOUND = 5.0
SAMPLES = 100_000


def key(seed: int):
    # The "rbg" generator: XLA compiles its random bits several times faster than
    # threefry's on CPU, and the statistics tested do not depend on the generator.
    return jax.random.key(seed, impl="rbg")


def _dense(tree):
    """Materialises compressed leaves, batched ones included (`Value.materialise`
    handles leading dims)."""
    return jtu.tree_map(
        lambda x: x.materialise() if isinstance(x, quax.Value) else x,
        tree,
        is_leaf=lambda x: isinstance(x, quax.Value),
    )


# ---------------------------------------------------------------------------------------
# A small nonlinear problem: a 5 x 4 weight and a bias, so D = 24 parameters. Rank-2
# factors (2 x 9 numbers) are still smaller than the weight, so it gets LowRank
# directions at ranks 1 and 2.

X = random_array(0, (8, 5))
Y = random_array(1, (8, 4))
PARAMS = {"w": random_array(2, (5, 4)), "b": random_array(3, (4,))}
D = sum(int(np.prod(p.shape)) for p in PARAMS.values())


def loss(params):
    hidden = jnp.tanh(X @ params["w"] + params["b"])
    return jnp.sum(hidden * Y) + 0.5 * jnp.sum(hidden**2)


@functools.cache
def _exact_gradient():
    # Jitted: eagerly, each primitive of the backward pass would compile on its own.
    grads = jax.jit(jax.grad(loss))(PARAMS)
    return {name: np.asarray(g, np.float64) for name, g in grads.items()}


def _squared_norms(grads):
    return {name: float(jnp.sum(g**2)) for name, g in grads.items()}


def _kappa(kind: str, shape: tuple[int, ...], rank: int) -> float:
    """`E[(g_l . v_l)^2 ||v_l||^2] / ||g_l||^2` for one leaf's direction `v_l`."""
    d = int(np.prod(shape))
    if kind == "gaussian" or len(shape) < 2:
        return d + 2.0  # fourth moments of a standard normal vector
    if kind == "sparse":
        return float(d)  # ||v||^2 = d exactly
    m, n = shape
    # Sum over the pairings of the 4th moment of sum_i a_i b_i^T / sqrt(r):
    # ((m+2)(n+2) + (r-1)(mn+2)) / r; the Gaussian's d + 2 as r grows.
    return ((m + 2) * (n + 2) + (rank - 1) * (m * n + 2)) / rank


def expected_squared_error(kind: str, rank: int, grads) -> float:
    """`E||g - grad f||^2` of one direction, for independent directions per leaf:
    `sum_l kappa_l |g_l|^2 + sum_l (D - d_l) |g_l|^2 - |grad f|^2`. For Gaussian
    directions this is the textbook `(D + 1) |grad f|^2`."""
    norms = _squared_norms(grads)
    sizes = {name: int(np.prod(PARAMS[name].shape)) for name in PARAMS}
    total = sum(sizes.values())
    return sum(
        _kappa(kind, PARAMS[name].shape, rank) * norms[name]
        + (total - sizes[name]) * norms[name]
        for name in PARAMS
    ) - sum(norms.values())


def _strategy(kind: str, rank: int):
    """The strategy of a case: `kind` as the variance formula names it."""
    if kind == "gaussian":
        return qt.GaussianDirections()
    if kind == "low_rank":
        return qt.LowRankDirections(rank=rank)
    return qt.SparseDirections(k=5)


def _samples(directions):
    """`SAMPLES` single-direction estimates, dense, stacked along axis 0."""
    estimate = jax.jit(
        jax.vmap(lambda k: qt.forward_grad(loss, PARAMS, k, directions=directions))
    )
    with qt.fallback("silent"):  # tanh densifies the tangent; that is not tested here
        stacked = estimate(jax.random.split(key(0), SAMPLES))
    return {name: np.asarray(x, np.float64) for name, x in _dense(stacked).items()}


CASES = [
    pytest.param("gaussian", 1, id="gaussian"),
    pytest.param("low_rank", 1, id="low_rank-r1"),
    pytest.param("low_rank", 2, id="low_rank-r2"),
    pytest.param("sparse", 1, id="sparse-k5"),
]


@pytest.mark.parametrize("directions, rank", CASES)
def test_unbiased_with_predicted_variance(directions, rank):
    samples = _samples(_strategy(directions, rank))
    grads = _exact_gradient()

    # Unbiased: each entry's sample mean is within Z_BOUND standard errors of the
    # gradient, the standard error being the entry's sample std / sqrt(SAMPLES).
    for name, values in samples.items():
        mean = values.mean(0)
        standard_error = values.std(0, ddof=1) / np.sqrt(SAMPLES)
        z = np.abs(mean - grads[name]) / standard_error
        assert z.max() < Z_BOUND, (name, z.max(), mean, grads[name])

    # The variance: the mean squared error over the samples matches the formula,
    # within Z_BOUND standard errors of that mean.
    errors = sum(
        np.sum((samples[n] - grads[n]) ** 2, axis=tuple(range(1, samples[n].ndim)))
        for n in grads
    )
    expected = expected_squared_error(directions, rank, grads)
    standard_error = errors.std(ddof=1) / np.sqrt(SAMPLES)
    assert abs(errors.mean() - expected) < Z_BOUND * standard_error, (
        errors.mean(),
        expected,
        standard_error,
    )
    # The bound is tight: for Gaussians it tells (D + 1) from D or D + 2, which are
    # 1/(D + 1) apart; the other directions have heavier tails.
    bound = 1 / (D + 1) if directions == "gaussian" else 0.1
    assert Z_BOUND * standard_error < bound * expected


# ---------------------------------------------------------------------------------------
# What the estimate is made of


def test_estimate_is_compressed_and_averaged():
    w = random_array(4, (16, 12))
    b = random_array(5, (12,))
    x = random_array(6, (5, 16))
    c = random_array(7, (12,))

    def linear(params):
        return jnp.sum((x @ params["w"]) @ c) + jnp.sum(params["b"] * c)

    params = {"w": w, "b": b}
    estimate = jax.jit(
        lambda p, k: qt.forward_grad(
            linear,
            p,
            k,
            directions=qt.LowRankDirections(rank=2),
            num_directions=3,
            return_info=True,
        )
    )
    with qt.fallback("error"):
        g, info = estimate(params, key(1))
    # s * v keeps each LowRank; three directions of rank 2 concatenate to rank 6.
    assert isinstance(g["w"], qt.LowRank) and g["w"].rank == 6
    assert not isinstance(g["b"], qt.CompressedArray)
    assert info.directional_derivatives.shape == (3,)
    # Checked in NumPy: eagerly, every JAX operation would compile on its own.
    x, c, w, b = (np.asarray(a, np.float64) for a in (x, c, w, b))
    assert_close(info.value, x.sum(0) @ w @ c + b @ c)
    # g = mean_i s_i v_i with s_i = grad . v_i exactly, so <g, grad> = mean_i s_i^2.
    g_w = np.asarray(g["w"].left) @ np.asarray(g["w"].right).T
    inner = np.sum(g_w * np.outer(x.sum(0), c)) + np.dot(np.asarray(g["b"]), c)
    mean_square = np.mean(np.asarray(info.directional_derivatives, np.float64) ** 2)
    assert_close(info.squared_norm_estimate, mean_square)
    assert_close(inner, mean_square, scale=mean_square + 1.0)
    assert np.isfinite(info.derivative_variance)


def test_sparse_estimate_is_sparse():
    x = random_array(8, (5, 16))

    def fn(w):
        return jnp.sum(jnp.tanh(x @ w))

    w = random_array(9, (16, 12))
    with qt.fallback("silent"):
        g = jax.jit(
            lambda w, k: qt.forward_grad(
                fn, w, k, directions=qt.SparseDirections(k=4), num_directions=2
            )
        )(w, key(2))
    assert isinstance(g, qt.Sparse) and g.k == 8 and g.shape == w.shape


def test_no_fallback_for_a_linear_model():
    # The tangent of X @ W is (X @ A) B^T, still low-rank, and the reductions to the
    # scalar loss go through the factors: nothing densifies.
    x = random_array(10, (32, 16))
    c = random_array(11, (8,))
    w = random_array(12, (16, 8))

    def linear(w):
        return jnp.sum((x @ w) @ c) + jnp.mean(x @ w)

    with qt.fallback("error"):
        g = jax.jit(lambda w, k: qt.forward_grad(linear, w, k, num_directions=2))(
            w, key(3)
        )
    assert isinstance(g, qt.LowRank) and g.rank == 2


def test_which_leaves_get_which_directions():
    params = {
        "matrix": jnp.ones((16, 12)),
        "stack": jnp.ones((3, 8, 6)),
        "row": jnp.ones((1, 12)),  # rank-1 factors would be larger than the row
        "vector": jnp.ones(12),
        "scalar": jnp.ones(()),
    }

    def fn(p):
        return sum(jnp.sum(leaf) for leaf in jtu.tree_leaves(p))

    def kinds(directions):
        with qt.fallback("silent"):
            shapes = jax.eval_shape(  # traces only: no compilation
                lambda k: qt.forward_grad(fn, params, k, directions=directions), KEY
            )
        return {
            name: (type(leaf).__name__, getattr(leaf, "rank", getattr(leaf, "k", None)))
            for name, leaf in shapes.items()
        }

    assert kinds(qt.LowRankDirections(rank=2)) == {
        "matrix": ("LowRank", 2),
        "stack": ("LowRank", 2),
        "row": ("ShapeDtypeStruct", None),
        "vector": ("ShapeDtypeStruct", None),
        "scalar": ("ShapeDtypeStruct", None),
    }
    sparse = kinds(qt.SparseDirections(k=0.25))
    assert sparse["matrix"] == ("Sparse", 48) and sparse["stack"] == ("Sparse", 36)
    assert sparse["row"] == ("Sparse", 3) and sparse["vector"][0] == "ShapeDtypeStruct"
    # An int count is capped at the leaf's size.
    assert kinds(qt.SparseDirections(k=100))["row"] == ("Sparse", 12)
    assert set(kinds(qt.GaussianDirections()).values()) == {("ShapeDtypeStruct", None)}


# ---------------------------------------------------------------------------------------
# A @differentiable model: the estimate is its Tangent, which `move` consumes


@differentiable
class Linear(eqx.Module):
    weight: Differentiable[Float[Array, "i o"]]
    bias: Differentiable[Float[Array, " o"]]
    steps: Array  # non-differentiable data


def test_differentiable_model_gets_its_tangent():
    model = Linear(random_array(13, (6, 4)), random_array(14, (4,)), jnp.asarray(0))
    x = random_array(15, (3, 6))

    def fn(model):
        return jnp.sum((x @ model.weight) @ model.bias)

    @jax.jit
    def step(model, k):
        g = qt.forward_grad(fn, model, k)
        return g, qt.move(model, -0.1 * g)

    with qt.fallback("silent"):
        g, moved = step(model, key(4))
    assert isinstance(g, Linear.Tangent) and isinstance(g.weight, qt.LowRank)
    assert_close(moved.weight, model.weight - 0.1 * g.weight.materialise())
    assert_close(moved.bias, model.bias - 0.1 * g.bias)


# ---------------------------------------------------------------------------------------
# Bad input


def _quadratic(w):
    return jnp.sum(w**2)


W = jnp.ones((3, 2))
KEY = key(0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_directions=0), ValueError, "`num_directions` must be at least 1"),
        (dict(directions="dense"), TypeError, "`directions` must be `qt.LowRank"),
        (
            dict(directions=qt.LowRankDirections),
            TypeError,
            r"an instance: `qt.LowRankDirections\(\)`",
        ),
        (
            dict(directions=qt.GaussianDirections(), rank=2),
            ValueError,
            "`rank` sets `LowRankDirections`'s `rank`",
        ),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        qt.forward_grad(_quadratic, W, KEY, **kwargs)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: qt.LowRankDirections(rank=0), ValueError, "`rank` must be at least 1"),
        (lambda: qt.LowRankDirections(rank=1.5), TypeError, "`rank` must be a Python"),
        (lambda: qt.SparseDirections(k=0.0), ValueError, r"in \(0, 1\]"),
        (lambda: qt.SparseDirections(k=0), ValueError, "`k` must be at least 1"),
    ],
)
def test_bad_directions(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_key_must_be_a_prng_key():
    with pytest.raises(TypeError, match="`key` must be a PRNG key.*got 0"):
        qt.forward_grad(_quadratic, W, 0)


def test_integer_params_are_refused():
    params = {"w": W, "n": jnp.arange(3)}
    with pytest.raises(TypeError, match=r"leaf \['n'\] has dtype int32"):
        qt.forward_grad(lambda p: jnp.sum(p["w"]) * p["n"][0], params, KEY)


def test_compressed_params_are_refused():
    with pytest.raises(TypeError, match="parameters must be dense arrays"):
        qt.forward_grad(_quadratic, qt.LowRank(jnp.ones((3, 1)), jnp.ones((2, 1))), KEY)


def test_non_scalar_output_is_refused():
    with pytest.raises(TypeError, match="real scalar output"):
        jax.jit(lambda w, k: qt.forward_grad(lambda w: w * 2, w, k))(W, KEY)


def test_directions_pass_through_jit_as_arguments():
    # The strategies' sizes are static fields: passed as an argument of a jitted
    # function they are part of its treedef, not traced.
    @jax.jit
    def estimate(directions, w, k):
        return qt.forward_grad(_quadratic, w, k, directions=directions)

    sparse = qt.SparseDirections(k=2)
    assert (
        jax.tree.leaves(sparse) == [] and jax.tree.leaves(qt.LowRankDirections()) == []
    )
    with qt.fallback("silent"):
        assert estimate(sparse, jnp.ones((4, 3)), KEY).k == 2
        assert estimate(qt.LowRankDirections(rank=1), jnp.ones((4, 3)), KEY).rank == 1
