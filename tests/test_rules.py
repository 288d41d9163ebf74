"""Every registered rule agrees with the dense computation.

The test enumerates the rule registry: a rule registered without a case in
`tests/helpers` fails here.
"""

import jax
import pytest
import quax
from hypothesis import given, settings, strategies as st

import quax_tangents as qt
from quax_tangents._registry import RULES
from tests.helpers import assert_close
from tests.helpers.cases import load_all_cases


CASES = load_all_cases()


def _run_case(fn, args):
    """The quaxified result, and the dense reference, in one compiled program."""
    # Always enter the trace: construction rules fire on dense operands only.
    out = quax.quaxify(fn, filter_spec=lambda _: True)(*args)
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
            out, dense_out, expected = _run_case_jit(example.fn, example.args)
        if example.out_type is not None:
            assert isinstance(out, example.out_type), type(out)
        for got, want in zip(jax.tree.leaves(dense_out), jax.tree.leaves(expected)):
            assert got.dtype == want.dtype, (got.dtype, want.dtype)
            assert_close(
                got, want, example.dtype, scale=example.scale, factor=example.factor
            )

    check()


def test_every_case_has_a_rule():
    registered = {entry.key for entry in RULES}
    orphans = sorted(set(CASES) - registered)
    assert not orphans, f"Cases without a registered rule: {orphans}"
