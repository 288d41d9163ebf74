"""The first seed thread: a primal whose tangent is stored as sign bits and a norm."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import quax_tangents as qt
from tests.helpers import assert_close, random_array


def _load_example():
    path = pathlib.Path(__file__).parents[1] / "examples" / "lossy_tangent.py"
    spec = importlib.util.spec_from_file_location("lossy_tangent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _load_example()


def _reference(directions):
    """The example's recursion in NumPy: t <- sign(t + d) * |t + d|_2 / sqrt(n)."""
    tangent = np.zeros(directions.shape[1:])
    for d in np.asarray(directions, np.float64):
        total = tangent + d
        signs = np.where(total >= 0, 1.0, -1.0)
        tangent = signs * np.linalg.norm(total) / np.sqrt(total.size)
    return tangent


def test_the_tangent_is_a_primal_holding_sign_and_norm():
    updates = random_array(0, (3, *EXAMPLE.SHAPE))
    directions = random_array(1, (3, *EXAMPLE.SHAPE))
    with qt.fallback("error"):
        primal, tangent = qt.jvp(
            EXAMPLE.accumulate, (jnp.zeros(()), updates), (None, directions)
        )
    assert isinstance(primal, EXAMPLE.Primal) and isinstance(tangent, EXAMPLE.Primal)
    assert isinstance(tangent.x, qt.SignNorm)
    assert tangent.x.compression_ratio >= 30
    assert_close(primal.x, jnp.sum(updates, axis=0), scale=3.0)
    assert_close(tangent.x.materialise(), _reference(directions), scale=1.0)


def test_plain_jax_computes_the_same_numbers_densely():
    updates = random_array(2, (2, *EXAMPLE.SHAPE))
    directions = random_array(3, (2, *EXAMPLE.SHAPE))
    _, tangent = jax.jvp(
        lambda u: EXAMPLE.accumulate(jnp.zeros(()), u), (updates,), (directions,)
    )
    assert isinstance(tangent.x, jax.Array)
    assert_close(tangent.x, _reference(directions), scale=1.0)


def test_the_example_runs(capsys):
    EXAMPLE.main()
    out = capsys.readouterr().out
    assert "tangent:  Primal(x=SignNorm)" in out
