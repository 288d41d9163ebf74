"""Every registered rule agrees with the dense computation.

The test enumerates the rule registry: a rule registered without a case in
`tests/helpers` fails here. Each case also checks that quax dispatched to the rule
under test (a dense result can equal the generic fallback's, so agreement alone does
not show that the rule ran).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import quax
from hypothesis import given, settings, strategies as st

import quax_tangents as qt
from quax_tangents._core import _validate
from quax_tangents._core._registry import RULES, dispatch_log
from tests.helpers import assert_close
from tests.helpers.cases import load_all_cases
from tests.helpers.values import TYPE_NAMES, compressed


CASES = load_all_cases()


@contextlib.contextmanager
def _count_value_checks():
    """The names passed to `_validate.check_finite` (a host sync on concrete values)
    inside the block."""
    calls = []
    original = _validate.check_finite

    def spy(name, x):
        calls.append(name)
        return original(name, x)

    _validate.check_finite = spy
    try:
        yield calls
    finally:
        _validate.check_finite = original


def _quaxified(fn):
    # Always enter the trace: construction rules fire on dense operands only.
    return quax.quaxify(fn, filter_spec=lambda _: True)


def _run_case(fn, args):
    """The quaxified result, and the dense reference, in one compiled program."""
    out = _quaxified(fn)(*args)
    return out, qt.materialise(out), fn(*qt.materialise(args))


# One compilation per example instead of one per primitive and shape.
_run_case_jit = jax.jit(_run_case, static_argnums=0)


def _rule_id(entry) -> str:
    return f"{entry.primitive.name}({', '.join(entry.operands)})"


@pytest.mark.parametrize("entry", RULES, ids=_rule_id)
def test_rule_matches_dense(entry):
    strategy_factory = CASES.get(entry.key)
    if strategy_factory is None:
        pytest.fail(
            f"Rule {_rule_id(entry)} ({entry.fn.__module__}.{entry.fn.__name__}) has "
            "no property-test case: add one with `@case` in tests/helpers."
        )
    # Rules that keep values compressed must not densify anywhere; rules that return
    # dense by design record that, so they run silently.
    mode = "silent" if entry.dense_output else "error"

    @settings(deadline=None)
    @given(st.data())
    def check(data):
        example = data.draw(strategy_factory())
        with qt.fallback(mode):
            # Traced once more (no compilation) to see which rules quax dispatched to;
            # the jitted run below may reuse a cached trace.
            with dispatch_log() as dispatched, _count_value_checks() as checks:
                jax.eval_shape(_quaxified(example.fn), *example.args)
            out, dense_out, expected = _run_case_jit(example.fn, example.args)
        assert any(e is entry for e in dispatched), (
            f"{_rule_id(entry)} was not dispatched; got "
            f"{[_rule_id(e) for e in dispatched]}"
        )
        # `compress`'s rule calls the user's compressor, whose public constructors
        # check their values as they should; the types' own rules do not.
        from_user_code = entry.fn.__module__ == "quax_tangents._types._primitives"
        if (
            entry.fn.__module__.startswith("quax_tangents._types")
            and not from_user_code
        ):
            # Rule outputs are built unchecked: a value check would sync eagerly.
            assert checks == [], f"{_rule_id(entry)} ran value checks on {checks}"
        if example.out_type is not None:
            assert isinstance(out, example.out_type), type(out)
        assert jax.tree.structure(dense_out) == jax.tree.structure(expected)
        for got, want in zip(
            jax.tree.leaves(dense_out), jax.tree.leaves(expected), strict=True
        ):
            assert got.dtype == want.dtype, (got.dtype, want.dtype)
            assert_close(
                got, want, example.dtype, scale=example.scale, factor=example.factor
            )

    check()


def test_every_case_has_a_rule():
    registered = {entry.key for entry in RULES}
    orphans = sorted(set(CASES) - registered)
    assert not orphans, f"Cases without a registered rule: {orphans}"


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_eager_rules_keep_non_finite_results(type_name):
    """Dense semantics: `x * inf` is non-finite, not an error, and eager rules run no
    value checks (each would be a device-to-host sync)."""
    x = compressed(type_name, (3, 4))
    with _count_value_checks() as checks, qt.fallback("error"):
        out = quax.quaxify(lambda a: a * jnp.inf)(x)
        negated = quax.quaxify(lambda a: -(a * jnp.nan))(x)
    assert checks == []
    assert type(out) is type(x) and type(negated) is type(x)
    with np.errstate(invalid="ignore"):
        dense = np.asarray(x.materialise()) * np.inf
    got = np.asarray(out.materialise())
    if type_name == "Sparse":
        # Entries it does not store are zeros that no product touches (see
        # docs/sharp-bits.md); the stored ones follow dense semantics.
        assert not np.any(np.isfinite(np.asarray(out.values)))
        assert np.all(np.isnan(np.asarray(negated.values)))
    else:
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(dense))
        assert np.all(np.isnan(np.asarray(negated.materialise())))


def test_public_constructor_still_checks_values():
    with pytest.raises(ValueError, match="NaN or Inf"):
        qt.LowRank(jnp.full((3, 2), jnp.inf), jnp.ones((4, 2)))


def test_family_registers_every_primitive_and_order():
    keys = {entry.key for entry in RULES}
    for primitive in ("add_any", "add"):
        assert (primitive, ("LowRank", "dense")) in keys
        assert (primitive, ("dense", "LowRank")) in keys
    assert ("sub", ("LowRank", "LowRank")) in keys
    swapped = [e for e in RULES if e.swapped]
    assert swapped and all(
        any(o.fn is e.fn and o.operands == e.operands[::-1] for o in RULES)
        for e in swapped
    )
