"""The examples run end to end and print what their documentation promises."""

import pathlib
import re
import runpy
import sys

import pytest


EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

pytest.importorskip("sklearn", reason="the examples need the `examples` extra")


def test_quickstart(monkeypatch, capsys):
    # Few SGD steps: the facts checked do not depend on how trained the MLP is.
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--steps", "3"])
    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    rows = {
        tuple(line.split()[:2])
        for line in out.splitlines()
        if line.split()[:1] in (["LowRank"], ["Sparse"], ["Quantized"], ["SignNorm"])
    }
    expected = {
        ("LowRank", "rank=1"),
        ("LowRank", "rank=4"),
        ("LowRank", "rank=16"),
        ("Sparse", "k=1%"),
        ("Sparse", "k=10%"),
        ("Quantized", "bits=8"),
        ("Quantized", "bits=4"),
        ("SignNorm", "per-tensor"),
        ("SignNorm", "block=256"),
    }
    assert expected <= rows, out
    # The tangent stays low-rank up to the first nonlinearity and is dense after it,
    # with the densification counted.
    assert "JVP up to the first tanh: tangent is LowRank (rank 4" in out
    assert "JVP through the whole MLP: tangent is dense Array" in out
    assert "('mul', 'LowRank')" in out
    # Both JVPs agree with `jax.jvp` on the materialised tangent.
    errors = re.findall(r"rel\. error vs jax\.jvp ([0-9.e+-]+)", out)
    assert len(errors) == 2 and all(float(e) < 1e-5 for e in errors), out
    assert "gradient of w1 is LowRank (rank 4), 3072 bytes instead of 32768" in out
