"""The forward-gradient example and the memory benchmark run end to end in their
quick modes, and the memory benchmark's verdicts follow from its compiled figures."""

import pathlib
import re
import runpy

import pytest

from tests.helpers.scripts import run_script


ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE_RESULTS = ROOT / "examples" / "results"


def _needs_examples_extra():
    for module in ("sklearn", "matplotlib", "tqdm"):
        pytest.importorskip(module, reason="the examples need the `examples` extra")


def test_forward_gradient_example_quick(tmp_path):
    _needs_examples_extra()
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


def test_forward_gradient_quick_run_leaves_committed_results_alone():
    # The way a user runs it, with no `--out`: the smoke run must not replace the
    # committed results of the full run.
    _needs_examples_extra()
    committed = [EXAMPLE_RESULTS / f"forward_gradient.{ext}" for ext in ("md", "png")]
    before = [path.read_bytes() for path in committed]
    quick = EXAMPLE_RESULTS / "quick" / "forward_gradient.md"
    quick.unlink(missing_ok=True)
    run_script(ROOT / "examples" / "forward_gradient.py", "--quick")
    assert [path.read_bytes() for path in committed] == before
    assert "python examples/forward_gradient.py --quick\n" in quick.read_text()


# ---------------------------------------------------------------------------------
# The memory benchmark's report


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _rows_after(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first table after `heading`."""
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


def check_memory_report(text: str) -> None:
    """What must hold in any run of the memory benchmark, whatever its sizes: each
    verdict is the target applied to the temp bytes in the tables, and a rank-1
    direction holds less temp than a dense one (the dense direction is weight-sized).
    Bytes come from the compiled programs, so nothing here depends on timing."""
    target = float(re.search(r"temp bytes at most (\d+)% of backprop's", text)[1])
    verdicts = _rows_after(text, "## Verdict")
    assert len(verdicts) == 4, verdicts
    for model, donated, _, _, ratio, verdict in verdicts:
        table = {
            (row[0], row[1]): row
            for row in _rows_after(text, f"## {model.capitalize()} MLP")
        }
        low_rank, dense = (
            table["forward, low-rank", donated],
            table["forward, dense", donated],
        )
        # Column 3 is "temp ÷ backprop's", printed to three decimals like the ratio.
        assert ratio == low_rank[3], (model, donated)
        assert verdict == ("met" if float(ratio) <= target / 100 else "missed")
        assert float(low_rank[3]) < float(dense[3]), (model, donated)


def test_committed_memory_verdicts_follow_from_its_tables():
    check_memory_report(
        (ROOT / "benchmarks" / "results" / "bench_memory.md").read_text()
    )


def test_memory_benchmark_quick(tmp_path):
    out = tmp_path / "memory.md"
    run_script(ROOT / "benchmarks" / "bench_memory.py", "--quick", "--out", str(out))
    text = out.read_text()
    assert "bench_memory.py --quick --out" in text
    check_memory_report(text)
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
