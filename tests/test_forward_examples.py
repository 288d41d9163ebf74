"""The forward-gradient example and the memory benchmark run end to end in their
quick modes."""

import pathlib
import re
import runpy
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_forward_gradient_example_quick(tmp_path):
    pytest.importorskip("sklearn", reason="the examples need the `examples` extra")
    pytest.importorskip("matplotlib", reason="the examples need the `examples` extra")
    pytest.importorskip("tqdm", reason="the examples need the `examples` extra")
    example = runpy.run_path(str(ROOT / "examples" / "forward_gradient.py"))
    histories = example["main"](tmp_path, quick=True)

    assert (tmp_path / "forward_gradient.png").stat().st_size > 0
    table = (tmp_path / "forward_gradient.md").read_text()
    for name in ("backprop", "forward, dense", "forward, low-rank"):
        assert f"| {name} |" in table
    by_name = {h.method.name: h for h in histories}
    # The low-rank estimate stores rank-1 factors for each weight, not the weights.
    assert by_name["forward, low-rank"].floats < by_name["forward, dense"].floats / 10
    assert by_name["forward, dense"].floats == by_name["backprop"].floats
    for h in histories:
        assert len(h.test_accuracy) == len(h.steps) > 1
        assert all(0.0 <= a <= 1.0 for a in h.test_accuracy)
    # A few SGD steps of backprop already beat chance (10 classes) clearly.
    assert by_name["backprop"].test_accuracy[-1] > 0.3


def test_memory_benchmark_quick(tmp_path):
    # A subprocess, as `nox -s bench` runs it: the benchmark resets the global
    # fallback counters, which must not leak into other tests.
    out = tmp_path / "memory.md"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--quick"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    text = out.read_text()
    assert "memory.py --quick --out" in text
    verdicts = re.findall(
        r"^\| (unrolled|scanned) \| (no|yes) \|.*\| (met|missed) \|$", text, re.M
    )
    assert len(verdicts) == 4, text
    for step in ("loss only", "backprop", "forward, dense", "forward, low-rank"):
        assert f"| {step} | no |" in text
    # Only the activation-sized tangents densify in the low-rank step: never a
    # weight-sized value (a dot_general or reduce_sum of a LowRank weight direction).
    low_rank_rows = [
        line for line in text.splitlines() if "| forward, low-rank |" in line
    ]
    assert len(low_rank_rows) == 4
    for row in low_rank_rows:
        densified = row.rsplit("|", 2)[-2]
        assert set(re.findall(r"(\w+) x\d+", densified)) <= {"add", "add_any", "mul"}, (
            row
        )
