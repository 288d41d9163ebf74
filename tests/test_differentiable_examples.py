"""The `@differentiable` examples run end to end, in a quick mode, and print what their
documentation promises."""

import pathlib
import re
import runpy
import sys

import pytest


EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run_example(name, args, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


def number(pattern, out):
    match = re.search(pattern, out, re.MULTILINE)
    assert match, (pattern, out)
    return float(match.group(1))


def test_batch_norm(monkeypatch, capsys):
    out = run_example("batch_norm.py", ["--steps", "40"], monkeypatch, capsys)
    # The running statistics are data: no place in the Tangents.
    assert "MLP.Tangent fields: ['w1', 'b1', 'norm', 'w2', 'b2']" in out
    assert "BatchNorm.Tangent fields: ['scale', 'offset']" in out
    # Two jitted scans over the model as carry: still an MLP, traced once, and the
    # step counter (data) counted every step.
    assert "model type after two jitted scans: MLP" in out
    assert "traces of the step function: 1" in out
    assert "steps counted by the model: 40" in out
    first = number(r"training loss: first \d+ steps ([0-9.]+)", out)
    last = number(r"training loss: first \d+ steps [0-9.]+, last \d+ ([0-9.]+)", out)
    assert last < first / 2, out
    # The running mean tracks the pre-activations' mean, which sits far from zero.
    gap = number(r"max gap ([0-9.]+)", out)
    spread = number(r"the means themselves reach ([0-9.]+)", out)
    assert gap < spread / 5, out
    assert number(r"[0-9.]+ before, ([0-9.]+) after", out) > 0.8, out


def test_training_loop(monkeypatch, capsys):
    pytest.importorskip("optax", reason="the example needs the `optax` extra")
    out = run_example("training_loop.py", ["--steps", "20"], monkeypatch, capsys)
    assert (
        "gradient type: MLPTangent; first weight: LowRank rank 4, 1280 bytes "
        "instead of 4096; after scaling: LowRank" in out
    )
    initial = number(r"initial loss: ([0-9.]+)", out)
    for name in ("sgd", "sgd, rank-4 first-layer gradient", "adam \\(optax\\)"):
        final = number(rf"^{name}: loss ([0-9.]+) after 20 steps", out)
        assert final < initial / 5, (name, out)
    assert out.count("traced 1 time(s)") == 2, out
    assert "model type MLP" in out
