"""The benchmarks run end to end in their quick mode."""

import pathlib
import re
import subprocess
import sys


BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _run_quick(script: str, out: pathlib.Path) -> str:
    # A subprocess, as `nox -s bench` runs it: the benchmark sets the fallback mode
    # and resets the global fallback counters, which must not leak into other tests.
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out.read_text()


def test_jvp_benchmark_quick(tmp_path):
    text = _run_quick("jvp.py", tmp_path / "jvp.md")
    assert "jvp.py --quick --out" in text
    for name in ("dense", "lowrank-r1", "lowrank-r4", "lowrank-r16", "hand-r16"):
        assert f"| {name} |" in text
    # Deterministic facts of the compiled programs (timings are not checked: the
    # machine is shared). The tanh densifies the LowRank tangent, and the tangent
    # FLOPs match the analytic count of the factored math.
    assert "('mul', 'LowRank'): 1" in text
    assert "('add_any', 'LowRank'): 3" in text
    flops_rows = re.findall(r"\| tangent FLOPs vs analytic \(x off\) \|[^\n]*", text)
    assert len(flops_rows) == 3 and all(row.endswith("| met |") for row in flops_rows)
    assert "DIFFERENT matmuls" not in text


def test_collective_benchmark_quick(tmp_path):
    text = _run_quick("collective.py", tmp_path / "collective.md")
    assert "collective.py --quick --out" in text and "| powersgd-r4 |" in text
    assert (
        "| bytes per matrix per round = r (m + n) itemsize | every all-reduce operand "
        "as predicted (tables below) | met |"
    ) in text
