import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import quax
from hypothesis import given, strategies as st

import quax_tangents as qt
from quax_tangents._core._fallback import is_vector_shape
from quax_tangents._core._lax import add_any_p
from tests.helpers import assert_close, float_dtypes, random_array, seeds
from tests.helpers.lowrank import lowrank_values
from tests.helpers.values import compressed


# ---------------------------------------------------------------------------------------
# Construction and validation


def test_aval_and_storage():
    x = qt.LowRank(jnp.zeros((3, 5, 2)), jnp.zeros((3, 7, 2)))
    assert x.shape == (3, 5, 7) and x.dtype == jnp.float32 and x.rank == 2
    assert x.nbytes == 3 * 2 * (5 + 7) * 4
    assert x.dense_nbytes == 3 * 5 * 7 * 4
    assert x.compression_ratio == pytest.approx(35 / 24)


def test_rank_4_on_2048_squared_stores_256x_fewer_bytes():
    x = qt.LowRank(jnp.zeros((2048, 4)), jnp.zeros((2048, 4)))
    assert x.compression_ratio >= 250


@pytest.mark.parametrize(
    "left, right, match",
    [
        (jnp.zeros((4, 2)), jnp.zeros((5, 3)), "same rank"),
        (jnp.zeros((2, 4, 2)), jnp.zeros((3, 5, 2)), "same leading dims"),
        (jnp.zeros((4,)), jnp.zeros((5, 2)), "`left` must have at least 2"),
        (jnp.zeros((4, 2)), jnp.zeros((5, 2), jnp.bfloat16), "Mixed dtypes"),
        (
            jnp.zeros((4, 2), jnp.int32),
            jnp.zeros((5, 2), jnp.int32),
            "`left` has dtype",
        ),
        (jnp.full((4, 2), jnp.nan), jnp.zeros((5, 2)), "`left` contains NaN"),
        (jnp.zeros((4, 2)), jnp.full((5, 2), jnp.inf), "`right` contains NaN or Inf"),
    ],
)
def test_bad_factors(left, right, match):
    with pytest.raises((ValueError, TypeError), match=match):
        qt.LowRank(left, right)


@pytest.mark.parametrize(
    "rank, error, match",
    [
        (5, ValueError, "`rank`=5 is larger than 4"),
        (0, ValueError, "`rank` must be"),
        (1.5, TypeError, "`rank` must be a Python int"),
    ],
)
def test_low_rank_bad_rank(rank, error, match):
    with pytest.raises(error, match=match):
        qt.low_rank(jnp.ones((4, 6)), rank)


def test_low_rank_bad_input():
    with pytest.raises(TypeError, match="`x` has dtype int32"):
        qt.low_rank(jnp.ones((4, 6), jnp.int32), 1)
    with pytest.raises(ValueError, match="`x` contains NaN"):
        qt.low_rank(jnp.full((4, 6), jnp.nan), 1)
    with pytest.raises(ValueError, match="`x` must have at least 2 dimensions"):
        qt.low_rank(jnp.ones(4), 1)


# ---------------------------------------------------------------------------------------
# The compressor


@st.composite
def _exactly_low_rank(draw):
    # A few sizes only: each new shape compiles the compressor again.
    m, n = draw(st.sampled_from([2, 5, 12])), draw(st.sampled_from([3, 7, 12]))
    true_rank = draw(st.integers(1, min(m, n)))
    rank = draw(st.integers(true_rank, min(m, n)))
    seed = draw(seeds())
    a, b = random_array(seed, (m, true_rank)), random_array(seed + 1, (true_rank, n))
    return a @ b, rank, seed


@given(_exactly_low_rank())
def test_low_rank_is_exact_at_or_above_the_true_rank(case):
    x, rank, seed = case
    approx = qt.low_rank(x, rank, key=jax.random.key(seed))
    assert approx.rank == rank
    assert_close(approx.materialise(), x, factor=10)


@given(
    st.sampled_from([4, 9, 24]),
    st.sampled_from([5, 16, 24]),
    st.sampled_from([0.5, 0.8, 0.95, 1.0]),
    seeds(),
)
def test_low_rank_is_near_optimal(m, n, decay, seed):
    """Stated bound: Frobenius error within 1.1x of the truncated SVD's (iters=1)."""
    rng = np.random.default_rng(seed)
    k = min(m, n)
    u = np.linalg.qr(rng.standard_normal((m, k)))[0]
    v = np.linalg.qr(rng.standard_normal((n, k)))[0]
    spectrum = decay ** np.arange(k) * rng.uniform(0.5, 1.5, k)
    x = (u * spectrum) @ v.T
    rank = int(rng.integers(1, k))
    optimal = np.sqrt(np.sum(np.sort(spectrum)[::-1][rank:] ** 2))
    approx = qt.low_rank(jnp.asarray(x, jnp.float32), rank, key=jax.random.key(seed))
    error = np.linalg.norm(np.asarray(approx.materialise(), np.float64) - x)
    assert error <= 1.1 * optimal + 1e-5


def test_low_rank_batch_jit_vmap_and_half_precision():
    x = random_array(0, (3, 8, 2)) @ random_array(1, (3, 2, 6))
    batched = qt.low_rank(x, 2)
    assert batched.left.shape == (3, 8, 2) and batched.right.shape == (3, 6, 2)
    assert_close(batched.materialise(), x, factor=10)
    jitted = jax.jit(qt.low_rank, static_argnums=1)(x, 2)
    assert_close(jitted.materialise(), x, factor=10)
    mapped = jax.vmap(lambda a: qt.low_rank(a, 2))(x)
    assert_close(mapped.materialise(), x, factor=10)
    half = qt.low_rank(x.astype(jnp.bfloat16), 2)
    assert half.dtype == jnp.bfloat16
    assert_close(half.materialise(), x, jnp.bfloat16, factor=4)


def test_low_rank_is_deterministic_given_a_key():
    x = random_array(0, (9, 7))
    a = qt.low_rank(x, 2, key=jax.random.key(3))
    b = qt.low_rank(x, 2, key=jax.random.key(3))
    assert np.array_equal(np.asarray(a.left), np.asarray(b.left))


# ---------------------------------------------------------------------------------------
# The "done when" case, and transforms


@pytest.mark.parametrize("weight_on_right", [True, False])
@pytest.mark.parametrize("use_jit", [False, True])
def test_jvp_of_a_matmul_stays_low_rank_without_fallback(weight_on_right, use_jit):
    x = random_array(0, (8, 5))
    w = random_array(1, (5, 6)) if weight_on_right else random_array(1, (8, 8))
    tangent = qt.low_rank(random_array(2, w.shape), 2)
    f = (lambda w: x @ w) if weight_on_right else (lambda w: w @ x)

    def jvp(w, t):
        return quax.quaxify(jax.jvp)(f, (w,), (t,))

    jvp = jax.jit(jvp) if use_jit else jvp
    with qt.fallback("error"):
        primal, out = jvp(w, tangent)
    assert isinstance(out, qt.LowRank)
    expected = jax.jvp(f, (w,), (tangent.materialise(),))[1]
    assert_close(out.materialise(), expected, factor=5)


def test_vmap_over_stacked_low_rank_tangents():
    x = random_array(0, (4, 5))
    stacked = qt.LowRank(random_array(1, (3, 5, 2)), random_array(2, (3, 6, 2)))

    def product(t):
        return quax.quaxify(lambda t: x @ t)(t)

    with qt.fallback("error"):
        out = jax.vmap(product)(stacked)
    assert isinstance(out, qt.LowRank) and out.shape == (3, 4, 6)
    assert_close(out.materialise(), x @ stacked.materialise(), factor=5)


@given(lowrank_values(batch_dims=0, dtype=jnp.float32))
def test_vmap_inside_a_quaxified_function(x):
    """vmap inside quaxify adds a free dim to the dense operand."""
    ys = random_array(0, (3, 2, x.shape[0]))
    with qt.fallback("error"):
        out = quax.quaxify(jax.vmap(lambda y, w: y @ w, in_axes=(0, None)))(ys, x)
    assert isinstance(out, qt.LowRank)
    assert_close(out.materialise(), ys @ x.materialise(), scale=float(x.shape[0]))


# ---------------------------------------------------------------------------------------
# Densification paths: counted, subject to the mode


def test_mul_by_a_full_matrix_densifies_and_is_counted():
    x = qt.LowRank(random_array(0, (4, 1)), random_array(1, (5, 1)))
    y = random_array(2, (4, 5))
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(jax.lax.mul)(x, y)
    assert not isinstance(out, qt.LowRank)
    assert_close(out, x.materialise() * y)
    assert qt.fallback_counts() == {("mul", "LowRank"): 1}
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="`mul`"):
        quax.quaxify(jax.lax.mul)(x, y)


def test_warn_mode_warns_once_per_primitive_and_type():
    x = qt.LowRank(random_array(0, (4, 1)), random_array(1, (5, 1)))
    qt.reset_fallback_counts()
    with pytest.warns(qt.DensificationWarning, match="`tanh` turns a LowRank"):
        quax.quaxify(jnp.tanh)(x)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quax.quaxify(jnp.tanh)(x)
    assert qt.fallback_counts()[("tanh", "LowRank")] == 2


def test_a_densification_warning_points_at_the_users_line():
    # Not at the rule, quax's dispatch or JAX's tracing that it went through.
    x = qt.LowRank(random_array(0, (4, 1)), random_array(1, (5, 1)))
    qt.reset_fallback_counts()
    with pytest.warns(qt.DensificationWarning, match="`sin`") as caught:
        jax.jit(quax.quaxify(jnp.sin))(x)
    assert [w.filename for w in caught] == [__file__]


def test_adding_an_update_into_its_weight_densely_names_apply_updates():
    # The usual way to get there: `optax.apply_updates` of a low-rank update.
    params = {"w": random_array(0, (4, 5))}
    update = {"w": qt.LowRank(random_array(1, (4, 2)), random_array(2, (5, 2)))}
    qt.reset_fallback_counts()
    with pytest.warns(qt.DensificationWarning, match=r"optax\.apply_updates\(params"):
        out = optax.apply_updates(params, update)
    assert_close(out["w"], params["w"] + update["w"].materialise())
    with qt.fallback("error"), pytest.raises(qt.DensificationError, match="opt.apply"):
        optax.apply_updates(params, update)


def _over_budget_pair():
    # 4x4 with rank 1 + 1: 2 * (4 + 4) = 16 >= 16, over the default budget.
    a = qt.LowRank(random_array(0, (4, 1)), random_array(1, (4, 1)))
    b = qt.LowRank(random_array(2, (4, 1)), random_array(3, (4, 1)))
    return a, b


def test_rank_budget_densifies_by_default():
    a, b = _over_budget_pair()
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(add_any_p.bind)(a, b)
    assert not isinstance(out, qt.LowRank)
    assert_close(out, a.materialise() + b.materialise())
    assert qt.fallback_counts() == {("add_any", "LowRank"): 1}


def test_rank_budget_recompresses_to_the_best_approximation():
    a, b = _over_budget_pair()
    qt.reset_fallback_counts()
    with qt.rank_budget(qt.Recompress()), qt.fallback("error"):
        out = quax.quaxify(add_any_p.bind)(a, b)
    assert isinstance(out, qt.LowRank) and out.rank == 1  # (16 - 1) // 8
    dense = np.asarray(a.materialise() + b.materialise(), np.float64)
    u, s, vt = np.linalg.svd(dense)
    best = (u[:, :1] * s[:1]) @ vt[:1]
    assert_close(out.materialise(), best, factor=5)
    assert qt.rank_budget_counts() == {("add_any", "recompress"): 1}


def test_max_rank_caps_concatenation():
    a = qt.LowRank(random_array(0, (20, 2)), random_array(1, (20, 2)))
    # The same values in other arrays: `a + a` itself would share its factors.
    copy = qt.LowRank(a.left + 0, a.right + 0)
    with qt.rank_budget(qt.Recompress(), max_rank=3), qt.fallback("error"):
        out = quax.quaxify(jax.lax.add)(a, copy)
    # Concatenated rank 4 is cut to 3; a + a has true rank 2, so nothing is lost.
    assert out.rank == 3
    assert_close(out.materialise(), 2 * a.materialise(), factor=5)
    b = qt.LowRank(random_array(2, (20, 2)), random_array(3, (20, 2)))
    with qt.rank_budget(qt.Recompress(), max_rank=3), qt.fallback("error"):
        out = quax.quaxify(jax.lax.add)(a, b)
    assert out.rank == 3


def test_budget_settings_are_validated():
    with pytest.raises(ValueError, match="`action`.*Recompress"):
        with qt.rank_budget("drop"):
            pass

    class Mine(qt.BudgetAction):
        pass

    # Only the two actions there are: another would silently act as `Densify`.
    with pytest.raises(ValueError, match="`action`.*got .*Mine"):
        with qt.rank_budget(Mine()):
            pass
    with pytest.raises(TypeError, match=r"an instance: `quax_tangents.Recompress\(\)`"):
        with qt.rank_budget(qt.Recompress):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="`max_rank`"):
        with qt.rank_budget(max_rank=0):
            pass
    with pytest.raises(ValueError, match="`mode`"):
        with qt.fallback("loud"):
            pass


def test_unsupported_structural_ops_densify_exactly():
    x = qt.LowRank(random_array(0, (2, 3, 1)), random_array(1, (2, 4, 1)))
    dense = x.materialise()
    checks = [
        (lambda a: jnp.transpose(a, (1, 0, 2)), "transpose"),
        (lambda a: jnp.reshape(a, (6, 4)), "reshape"),
        (lambda a: a.astype(jnp.int32), "convert_element_type"),
        (
            lambda a: jax.lax.dot_general(
                a, jnp.ones((2, 3, 4)), (((1, 2), (1, 2)), ((0,), (0,)))
            ),
            "dot_general",
        ),
    ]
    for fn, name in checks:
        qt.reset_fallback_counts()
        with qt.fallback("silent"):
            out = quax.quaxify(fn)(x)
        np.testing.assert_allclose(
            np.asarray(out), np.asarray(fn(dense)), rtol=1e-5, atol=1e-5
        )
        assert qt.fallback_counts() == {(name, "LowRank"): 1}, name


def test_matvec_gives_a_dense_vector_without_counting():
    x = qt.LowRank(random_array(0, (5, 2)), random_array(1, (4, 2)))
    v = random_array(2, (4,))
    qt.reset_fallback_counts()
    with qt.fallback("error"):
        out = quax.quaxify(jnp.matmul)(x, v)
    assert_close(out, x.materialise() @ v)
    assert qt.fallback_counts() == {}


def test_mixed_with_other_compressed_types_densifies_both():
    x = qt.LowRank(random_array(0, (6, 1)), random_array(1, (5, 1)))
    y = qt.top_k(random_array(2, (6, 5)), 3)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(jax.lax.add)(x, y)
    assert_close(out, x.materialise() + y.materialise())
    assert qt.fallback_counts() == {("add", "LowRank"): 1, ("add", "Sparse"): 1}


def test_adding_mismatched_dtypes_is_an_error():
    a = qt.LowRank(random_array(0, (3, 1)), random_array(1, (4, 1)))
    b = qt.LowRank(
        random_array(2, (3, 1), jnp.bfloat16), random_array(3, (4, 1), jnp.bfloat16)
    )
    with pytest.raises(TypeError, match="dtypes must match"):
        quax.quaxify(add_any_p.bind)(a, b)


@pytest.mark.parametrize(
    "shapes", [((8, 9), (8, 1)), ((8, 9), (1, 9)), ((2, 8, 9), (2, 1, 9))]
)
@pytest.mark.parametrize("op", [jnp.add, jnp.subtract])
def test_broadcasting_sums_stay_low_rank(op, shapes):
    """`lax.add` broadcasts size-1 dims; the rule broadcasts the factors (exact).
    The shapes keep rank 4 within the budget."""
    primals = tuple(random_array(i, s) for i, s in enumerate(shapes))
    tangents = tuple(compressed("LowRank", s, 10 + i) for i, s in enumerate(shapes))
    with qt.fallback("error"):
        _, out = qt.jvp(op, primals, tangents)
    expected = jax.jvp(op, primals, qt.materialise(tangents))[1]
    assert isinstance(out, qt.LowRank)
    assert_close(out, expected)


def test_reduce_sum_over_no_axes_is_the_identity():
    x = random_array(0, (3, 4, 5))
    t = compressed("LowRank", (3, 4, 5))
    with qt.fallback("error"):
        _, out = qt.jvp(lambda a: jax.lax.reduce_sum(a, ()), (x,), (t,))
    assert out is not None and out.shape == (3, 4, 5)
    assert isinstance(out, qt.LowRank)
    assert_close(out, t.materialise())


@pytest.mark.parametrize("shape", [(3, 1), (1, 4)])
def test_broadcast_in_dim_of_a_unit_dim_keeps_the_factors(shape):
    x = compressed("LowRank", shape)
    fn = lambda a: jax.lax.broadcast_in_dim(a, (3, 4), (0, 1))  # noqa: E731
    with qt.fallback("error"):
        out = quax.quaxify(fn)(x)
    assert isinstance(out, qt.LowRank)
    assert_close(out, fn(x.materialise()))


def test_a_vector_result_is_not_counted_and_a_matrix_is():
    """The densification policy: a dense result with at most one dim other than 1 is
    not counted; a dense matrix is."""
    with qt.fallback("silent"):
        qt.reset_fallback_counts()
        x = compressed("LowRank", (3, 4))
        row = quax.quaxify(lambda a: jnp.sum(a, axis=1, keepdims=True))(x)
        assert row.shape == (3, 1) and qt.fallback_counts() == {}
        batched = compressed("LowRank", (2, 3, 4))
        matrix = quax.quaxify(lambda a: jnp.sum(a, axis=1))(batched)
        assert matrix.shape == (2, 4)
        assert qt.fallback_counts() == {("reduce_sum", "LowRank"): 1}


# ---------------------------------------------------------------------------------------
# Broadcasting sums: size-1 dims of either operand


@st.composite
def _broadcasting_sums(draw):
    """`op(a, b)` where each operand has, per dim, the full size or 1 (as `lax.add`
    broadcasts), at least one is LowRank, and both share a dtype."""
    dtype = draw(float_dtypes())
    batch = draw(st.sampled_from([(), (2,)]))
    full = (*batch, draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    kinds = draw(
        st.sampled_from(
            [("LowRank", "LowRank"), ("LowRank", "dense"), ("dense", "LowRank")]
        )
    )
    operands = []
    for kind in kinds:
        shape = tuple(draw(st.sampled_from([d, 1])) for d in full)
        if kind == "LowRank":
            rank = draw(st.integers(1, 2))
            # Untagged: a sum of two projections is refused, or kept at the rank
            # of their one projector (the `test_projections_onto_*` tests).
            operands.append(
                draw(lowrank_values(shape, dtype, rank, projector_side=None))
            )
        else:
            operands.append(random_array(draw(seeds()), shape, dtype))
    op = draw(st.sampled_from([jax.lax.add, jax.lax.sub]))
    return op, tuple(operands), dtype


def _stays_within_budget(a: qt.LowRank, b: qt.LowRank, shape) -> bool:
    m, n = shape[-2:]
    return (a.rank + b.rank) * (m + n) < m * n


@given(_broadcasting_sums())
def test_broadcasting_sums_match_dense_and_count_every_dense_matrix(case):
    """Against the dense computation: a LowRank result where the broadcast factors
    give one within the rank budget; otherwise a dense result, counted unless it is a
    vector (the policy of `_fallback.record_dense_result`). A LowRank minus a dense
    array has no rule of its own: the default rule counts it whatever its shape."""
    op, (a, b), dtype = case
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(op)(a, b)
    expected = op(qt.materialise(a), qt.materialise(b))
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert_close(out, expected, dtype, factor=4.0)
    both = isinstance(a, qt.LowRank) and isinstance(b, qt.LowRank)
    if both and _stays_within_budget(a, b, expected.shape):
        assert isinstance(out, qt.LowRank)
        assert qt.fallback_counts() == {}
        return
    assert not isinstance(out, qt.CompressedArray)
    by_default_rule = not both and op is jax.lax.sub
    counted = by_default_rule or not is_vector_shape(expected.shape)
    name = op.__name__
    assert qt.fallback_counts() == ({(name, "LowRank"): 1} if counted else {})


@pytest.mark.parametrize(
    "shapes", [((3, 1), (3, 4)), ((3, 4), (1, 4)), ((3, 1), (1, 4))]
)
def test_broadcasting_add_of_a_unit_dim_lowrank_is_counted(shapes):
    """A LowRank with a unit dim against a full (3, 4) operand: a dense (3, 4)
    result, computed from the broadcast factors and counted."""
    a, b = (compressed("LowRank", s, 3 * i) for i, s in enumerate(shapes))
    if shapes[1] == (3, 4):
        b = random_array(9, (3, 4))
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = quax.quaxify(jax.lax.add)(a, b)
    assert_close(out, qt.materialise(a) + qt.materialise(b))
    assert qt.fallback_counts() == {("add", "LowRank"): 1}


def test_broadcasting_add_keeps_factors_where_a_lowrank_result_exists():
    a = qt.LowRank(random_array(0, (30, 1)), random_array(1, (1, 1)))
    b = qt.LowRank(random_array(2, (1, 1)), random_array(3, (40, 1)))
    with qt.fallback("error"):
        out = quax.quaxify(jax.lax.add)(a, b)
    assert isinstance(out, qt.LowRank) and out.shape == (30, 40) and out.rank == 2
    assert_close(out, a.materialise() + b.materialise())


@pytest.mark.parametrize("op", [jax.lax.add, jax.lax.sub])
@pytest.mark.parametrize("unit_shape", [(3, 1), (1, 4)])
@pytest.mark.parametrize("tangent_first", [True, False])
def test_one_sided_broadcasting_jvp_is_counted_unless_broadcast_first(
    op, unit_shape, tangent_first
):
    """JAX's JVP of `x + y` (or `-`), `x` of shape (3, 1) or (1, 4) and the only
    one differentiated, squeezes the tangent to a vector and broadcasts that vector
    outside any rule: the squeeze is counted, and raises under "error". Broadcasting
    `x` first keeps the factors (`broadcast_in_dim`), as docs/types/lowrank.md
    advises."""
    x, y = random_array(0, unit_shape), random_array(1, (3, 4))
    t = qt.LowRank(
        random_array(2, (unit_shape[0], 2)), random_array(3, (unit_shape[1], 2))
    )
    fn = op if tangent_first else (lambda u, v: op(v, u))
    expected = jax.jvp(fn, (x, y), (t.materialise(), jnp.zeros_like(y)))[1]
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        _, implicit = qt.jvp(fn, (x, y), (t, None))
    assert not isinstance(implicit, qt.CompressedArray)
    assert qt.fallback_counts() == {("reshape", "LowRank"): 1}
    assert_close(implicit, expected)
    with (
        qt.fallback("error"),
        pytest.raises(qt.DensificationError, match="broadcast_to"),
    ):
        qt.jvp(fn, (x, y), (t, None))
    with qt.fallback("error"):
        _, explicit = qt.jvp(
            lambda u, v: fn(jnp.broadcast_to(u, v.shape), v), (x, y), (t, None)
        )
    assert isinstance(explicit, qt.LowRank)
    assert_close(explicit, expected)


# projector_side and sums that share a factor


def _shared(x, side, fresh_seed):
    """A LowRank of `x`'s shape that holds `x`'s `side` factor object itself."""
    other = random_array(fresh_seed, (x.right if side == "left" else x.left).shape)
    other = other.astype(x.dtype)
    if side == "left":
        return qt.LowRank(x.left, other, projector_side=x.projector_side)
    return qt.LowRank(other, x.right, projector_side=x.projector_side)


@given(
    lowrank_values(projector_side=None),
    st.sampled_from(["left", "right"]),
    st.sampled_from(["add", "add_any", "sub"]),
    seeds(),
)
def test_a_sum_sharing_a_factor_keeps_the_rank(x, side, op, seed):
    x = qt.LowRank(x.left, x.right, projector_side=side)
    y = _shared(x, side, seed)
    fn = {"add": jax.lax.add, "add_any": add_any_p.bind, "sub": jax.lax.sub}[op]
    with qt.fallback("error"):
        out = quax.quaxify(fn)(x, y)
    assert isinstance(out, qt.LowRank) and out.rank == x.rank
    assert out.projector_side == side
    shared = out.left if side == "left" else out.right
    assert shared is (x.left if side == "left" else x.right)
    assert_close(out, fn(x.materialise(), y.materialise()), x.dtype, factor=2.0)


@given(lowrank_values(projector_side=None), seeds())
def test_a_sum_sharing_the_untagged_factor_drops_the_tag(x, seed):
    # `left` is shared but `right` is the projector: the sum of the rights is not.
    x = qt.LowRank(x.left, x.right, projector_side="right")
    y = _shared(x, "left", seed)
    out = quax.quaxify(jax.lax.add)(x, y)
    assert out.rank == x.rank and out.projector_side is None
    assert_close(out, x.materialise() + y.materialise(), x.dtype, factor=2.0)


def _tagged(seed, side, projector=None):
    left, right = random_array(seed, (8, 2)), random_array(seed + 1, (9, 2))
    if projector is not None:
        left, right = (projector, right) if side == "left" else (left, projector)
    return qt.LowRank(left, right, projector_side=side)


@pytest.mark.parametrize("side", ["left", "right"])
def test_projections_onto_equal_projectors_in_different_arrays_keep_the_rank(side):
    """A loop carry and a new gradient hold one projector in two arrays: the sum is
    `LowRank(P, A + B)`, eagerly and under `jit`."""
    x = _tagged(0, side)
    projector = jnp.array(x.left if side == "left" else x.right)  # a copy
    y = _tagged(5, side, projector)
    expected = x.materialise() + y.materialise()
    for run in (quax.quaxify(jax.lax.add), jax.jit(quax.quaxify(jax.lax.add))):
        with qt.fallback("error"):
            out = run(x, y)
        assert out.rank == 2 and out.projector_side == side
        assert_close(out, expected)


def test_a_scan_accumulating_projected_gradients_keeps_rank_and_tag():
    """Levanter-style accumulation: the carry starts as `0 * g`, and each step adds a
    gradient projected onto the same projector (passed in, so a different array)."""
    projector = jnp.asarray(np.linalg.qr(random_array(0, (8, 2)))[0])
    grads = random_array(1, (3, 9, 2))

    def accumulate(projector, grads):
        def body(total, right):
            g = qt.LowRank(projector, right, projector_side="left")
            return total + g, None

        start = qt.LowRank(projector, grads[0] * 0, projector_side="left")
        return jax.lax.scan(body, start, grads)[0]

    out = jax.jit(quax.quaxify(accumulate))(projector, grads)
    assert out.rank == 2 and out.projector_side == "left"
    assert_close(out, projector @ jnp.sum(grads, axis=0).T)


def test_projections_onto_different_projectors_are_refused_naming_the_fix():
    x, y = _tagged(0, "left"), _tagged(5, "left")
    with pytest.raises(ValueError, match="accumulate_gradients"):
        quax.quaxify(jax.lax.add)(x, y)
    with pytest.raises(Exception, match="accumulate_gradients"):
        jax.block_until_ready(jax.jit(quax.quaxify(jax.lax.add))(x, y))
    # Untagged, the exact sum at twice the rank.
    out = quax.quaxify(jax.lax.add)(
        x.with_projector_side(None), y.with_projector_side(None)
    )
    assert out.rank == 4 and out.projector_side is None
    assert_close(out, x.materialise() + y.materialise())


@given(lowrank_values(projector_side="left"), st.floats(-3, 3))
def test_rules_that_keep_a_projection_keep_the_tag(x, scale):
    projector = x.left
    for fn in (jax.lax.neg, lambda a: a * scale, lambda a: scale * a):
        out = quax.quaxify(fn)(x)
        assert out.projector_side == "left" and out.left is projector
        assert_close(out, fn(x.materialise()), x.dtype, factor=2.0)
    cast = quax.quaxify(lambda a: a.astype(jnp.float16))(x)
    assert cast.projector_side == "left"
    flipped = quax.quaxify(lambda a: jnp.swapaxes(a, -1, -2))(x)
    assert flipped.projector_side == "right" and flipped.right is projector


def test_rules_that_change_the_factors_drop_the_tag():
    x = qt.LowRank(jnp.ones((2, 6, 1)), jnp.ones((2, 7, 1)), projector_side="left")
    summed = quax.quaxify(lambda a: jnp.sum(a, axis=0))(x)
    assert summed.projector_side is None
    row = quax.quaxify(lambda a: a * jnp.arange(7.0))(x)
    assert row.projector_side is None
    assert x.pad_rank(3).projector_side is None
    with pytest.raises(ValueError, match="`projector_side` must be None"):
        qt.LowRank(jnp.ones((3, 1)), jnp.ones((4, 1)), projector_side="up")


def test_cond_and_scan_carry_join_values_of_different_tags():
    def branches(flag, x, y):
        return jax.lax.cond(flag, lambda: x, lambda: y)

    x = qt.LowRank(jnp.ones((6, 1)), jnp.ones((7, 1)), projector_side="left")
    untagged = qt.LowRank(x.left, 2 * x.right)
    for flag in (True, False):
        out = quax.quaxify(branches)(jnp.asarray(flag), x, untagged)
        assert out.projector_side is None and out.rank == 1
        assert_close(out, (x if flag else untagged).materialise())

    def loop(x):
        # The body drops the tag (a sum with a different factor, truncated back).
        def body(c, _):
            return c * 0.5, None

        return jax.lax.scan(body, x, None, length=3)[0]

    out = quax.quaxify(loop)(x)
    assert out.projector_side == "left"
    assert_close(out, x.materialise() * 0.125)

    def untagging_loop(x):
        # Scaling the columns drops the tag: the carry enters the loop untagged.
        def body(c, _):
            return c * jnp.arange(7.0), None

        return jax.lax.scan(body, x, None, length=2)[0]

    qt.reset_fallback_counts()
    with qt.fallback("error"):
        out = quax.quaxify(untagging_loop)(x)
    assert out.projector_side is None and out.rank == 1
    assert_close(out, x.materialise() * jnp.arange(7.0) ** 2)
