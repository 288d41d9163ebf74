"""Old public names still work for one release: each use warns, names its
replacement, and gives what the replacement gives."""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
import quax

import quax_tangents as qt


DEPRECATED = "is deprecated and will be removed in the next release of quax_tangents"


def _warns(new):
    return pytest.warns(
        DeprecationWarning, match=re.escape(f"{DEPRECATED}; use `{new}`")
    )


@pytest.mark.parametrize(
    "name", ["Collective", "collectives", "received_bytes", "schedule_bytes"]
)
def test_diagnostics_moved_to_the_hlo_namespace(name):
    with _warns(f"qt.hlo.{name}"):
        old = getattr(qt, name)
    assert old is getattr(qt.hlo, name)
    assert name not in qt.__all__ and name in qt.hlo.__all__
    assert name not in dir(qt)


def test_the_warning_points_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qt.collectives  # noqa: B018
    assert [w.filename for w in caught] == [__file__]


def test_apply_tangent_updates_is_apply_updates():
    pytest.importorskip("optax", reason="needs the `optax` extra")
    with _warns("quax_tangents.optax.apply_updates"):
        old = qt.apply_tangent_updates
    assert old is qt.move
    assert "apply_tangent_updates" not in qt.__all__


def test_optax_compress_is_compress_updates():
    qto = pytest.importorskip("quax_tangents.optax", reason="needs the `optax` extra")
    with _warns("qto.compress_updates"):
        old = qto.compress
    assert old is qto.compress_updates
    assert "compress" not in qto.__all__
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        qto.no_such_name  # noqa: B018


def _init_structure(tx):
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
    return jax.tree.structure(jax.eval_shape(tx.init, params))


@pytest.mark.parametrize(
    "old, new, method",
    [
        ({"two_phase": True}, "method=qt.TwoPhase()", qt.TwoPhase()),
        ({"two_phase": False}, "method=qt.GatherSum()", qt.GatherSum()),
        ({"schedule": "two_phase"}, "method=qt.TwoPhase()", qt.TwoPhase()),
        ({"schedule": "gather"}, "method=qt.GatherSum()", qt.GatherSum()),
        ({"schedule": "auto"}, "method=qt.Cheapest()", qt.Cheapest()),
    ],
)
def test_schedule_and_two_phase_are_method(old, new, method):
    qto = pytest.importorskip("quax_tangents.optax", reason="needs the `optax` extra")
    with _warns(f"compress_updates({new})"):
        deprecated = qto.compress_updates(qt.sign_norm, axis_name="data", **old)
    current = qto.compress_updates(qt.sign_norm, axis_name="data", method=method)
    assert _init_structure(deprecated) == _init_structure(current)


def test_schedule_and_method_that_disagree_are_refused():
    qto = pytest.importorskip("quax_tangents.optax", reason="needs the `optax` extra")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="only"):
        qto.compress_updates(
            qt.sign_norm, axis_name="data", method=qt.GatherSum(), two_phase=True
        )
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="only"):
        qto.compress_updates(
            qt.sign_norm, axis_name="data", schedule="gather", two_phase=True
        )
    with pytest.raises(ValueError, match="`schedule` must be"):
        qto.compress_updates(qt.sign_norm, axis_name="data", schedule="ring")


def test_a_filter_written_per_leaf_still_selects_leaf_by_leaf():
    qto = pytest.importorskip("quax_tangents.optax", reason="needs the `optax` extra")
    params = {"w": jnp.zeros((64, 32)), "v": jnp.zeros((32, 64))}
    per_leaf = qto.compress_updates(
        qt.sign_norm, filter=lambda leaf: leaf.shape == (64, 32)
    )
    with _warns("filter=lambda updates: jax.tree.map(lambda leaf: ..., updates)"):
        state = per_leaf.init(params)
    whole = qto.compress_updates(
        qt.sign_norm,
        filter=lambda u: jax.tree.map(lambda leaf: leaf.shape == (64, 32), u),
    )
    expected = whole.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(expected)
    assert state.error["v"] is None and state.error["w"] is not None


@pytest.mark.parametrize("old, new", [("ef", "ErrorFeedback"), ("ef21", "EF21")])
def test_error_feedback_names_are_strategies(old, new):
    qto = pytest.importorskip("quax_tangents.optax", reason="needs the `optax` extra")
    strategy = getattr(qto, new)()
    with _warns(f"compress_updates(error_feedback=qto.{new}())"):
        deprecated = qto.compress_updates(qt.sign_norm, error_feedback=old)
    current = qto.compress_updates(qt.sign_norm, error_feedback=strategy)
    assert _init_structure(deprecated) == _init_structure(current)
    # The same numbers, step after step.
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
    grads = {"w": jnp.linspace(-1.0, 1.0, 64 * 32).reshape(64, 32), "b": jnp.ones(32)}
    results = []
    for tx in (deprecated, current):
        state = tx.init(params)
        for _ in range(2):
            updates, state = tx.update(grads, state)
        results.append((updates, state))
    assert jax.tree.all(jax.tree.map(jnp.array_equal, *results))


@pytest.mark.parametrize(
    "old, new",
    [
        ({"directions": "low_rank"}, qt.LowRankDirections(rank=1)),
        ({"directions": "gaussian"}, qt.GaussianDirections()),
        ({"directions": "sparse", "k": 3}, qt.SparseDirections(k=3)),
        ({"rank": 2}, qt.LowRankDirections(rank=2)),
    ],
)
def test_forward_grad_directions_are_strategies(old, new):
    params = {"w": jnp.linspace(0.0, 1.0, 24).reshape(4, 6), "b": jnp.ones(6)}

    def fn(p):
        return jnp.sum(p["w"] @ jnp.arange(6.0)) + jnp.sum(p["b"])

    with _warns(f"forward_grad(directions=qt.{new!r})"):
        deprecated = qt.forward_grad(fn, params, jax.random.key(0), **old)
    current = qt.forward_grad(fn, params, jax.random.key(0), directions=new)
    assert type(deprecated["w"]) is type(current["w"])
    same = jax.tree.map(
        jnp.array_equal, qt.materialise(deprecated), qt.materialise(current)
    )
    assert jax.tree.all(same)


@pytest.mark.parametrize(
    "old, new", [("densify", "Densify"), ("recompress", "Recompress")]
)
def test_rank_budget_names_are_strategies(old, new):
    a = qt.low_rank(jnp.linspace(-1.0, 1.0, 48).reshape(8, 6), 3)
    b = qt.low_rank(jnp.cos(jnp.arange(48.0)).reshape(8, 6), 3)
    results = []
    for action in (old, getattr(qt, new)()):
        qt.reset_fallback_counts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with qt.rank_budget(action), qt.fallback("silent"):
                out = quax.quaxify(jax.lax.add)(a, b)
        deprecations = [w for w in caught if w.category is DeprecationWarning]
        if isinstance(action, str):
            assert [w.filename for w in deprecations] == [__file__]
            assert f"use `rank_budget(qt.{new}())`" in str(deprecations[0].message)
        else:
            assert deprecations == []
        counts = (qt.fallback_counts(), qt.rank_budget_counts())
        results.append((type(out), qt.materialise(out), counts))
    (old_type, old_out, old_counts), (new_type, new_out, new_counts) = results
    assert old_type is new_type and old_counts == new_counts
    assert jnp.array_equal(old_out, new_out)
    # Rank 6 of an 8x6 matrix is over the budget: the action decides.
    assert (new_type is qt.LowRank) == (new == "Recompress")
