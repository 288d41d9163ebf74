"""The benchmarks run end to end in their quick mode, their scripts cannot shadow an
importable module, and a quick run leaves the committed results alone.

Every quick run is a smoke run of a whole script in its own process, marked `slow`:
`-m "not slow"` leaves them out, `.ci/run` runs them as a part of their own."""

import ast
import importlib.metadata
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.scripts import run_script


ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"


def _run_quick(script: str, out: pathlib.Path, *args: str) -> str:
    """The results a script's quick run writes, which name the command that made
    them."""
    run_script(BENCHMARKS / script, "--quick", "--out", str(out), *args)
    text = out.read_text()
    assert f"{script} --quick --out" in text, text
    return text


def test_script_names_cannot_shadow_a_module():
    # Running `python benchmarks/x.py` (or `examples/x.py`) puts that folder first on
    # `sys.path`, so a file named like a module shadows it for every import, JAX's
    # included. Checked by name, with `bench_` as the convention that keeps
    # benchmarks clear of modules added to the standard library later (as
    # `compression` was, in Python 3.14).
    installed = set(importlib.metadata.packages_distributions())
    stems = {p.stem for p in BENCHMARKS.glob("*.py")}
    stems |= {p.stem for p in (ROOT / "examples").glob("*.py")}
    clashes = stems & (set(sys.stdlib_module_names) | installed)
    assert not clashes, clashes
    for script in BENCHMARKS.glob("*.py"):
        assert script.name.startswith(("bench_", "_")), script.name
        # With nothing to shadow, no script needs to edit `sys.path` either.
        uses = [
            node.lineno
            for node in ast.walk(ast.parse(script.read_text()))
            if isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ]
        assert not uses, f"{script.name} uses sys.path on lines {uses}"


@pytest.mark.slow
def test_jvp_benchmark_quick_leaves_committed_results_alone():
    # As a user or `nox -s bench -- bench_jvp --quick` runs it: no `--out`.
    committed = RESULTS / "bench_jvp.md"
    before = committed.read_bytes()
    quick = RESULTS / "quick" / "bench_jvp.md"
    quick.unlink(missing_ok=True)
    result = run_script(BENCHMARKS / "bench_jvp.py", "--quick")
    assert committed.read_bytes() == before
    assert f"wrote {quick}" in result.stdout
    text = quick.read_text()

    assert "python benchmarks/bench_jvp.py --quick\n" in text
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


def _verdict_rows(text: str) -> list[tuple[float, float, str]]:
    """(value, limit, verdict) of each row of the JVP benchmark's targets table."""
    return [
        (float(value), float(limit), verdict)
        for value, limit, verdict in re.findall(
            r"^\| [^|]+ \| \d+, r=\d+ \| ([0-9.]+) \| <= ([0-9.]+) \| (met|MISSED) \|$",
            text,
            re.M,
        )
    ]


def test_committed_jvp_verdicts_follow_their_values():
    rows = _verdict_rows((RESULTS / "bench_jvp.md").read_text())
    assert len(rows) == 16
    for value, limit, verdict in rows:
        assert verdict == ("met" if value <= limit else "MISSED"), (value, limit)


# About 45 s of CPU time (8 host devices), a minute on two cores.
@pytest.mark.slow
def test_collective_benchmark_quick(tmp_path):
    text = _run_quick("bench_collective.py", tmp_path / "collective.md")
    assert "| powersgd-r4 |" in text
    assert (
        "| bytes per matrix per round = r (m + n) itemsize | every all-reduce operand "
        "as predicted (tables below) | met |"
    ) in text
    assert (tmp_path / "collective.png").stat().st_size > 0
    # The two-phase rows and the device-count sweep (bytes, from compiled programs).
    assert "| int8-two-phase |" in text and "| sign-ef-two-phase |" in text
    assert "| method | 2 devices | 4 devices | 8 devices |" in text


@pytest.mark.slow
def test_collective_benchmark_step_times_only_quick(tmp_path):
    # Only the two-phase step-time rows, once each (the ratios are not checked).
    out = tmp_path / "step_times.md"
    run_script(
        BENCHMARKS / "bench_collective.py",
        "--step-times-only",
        "--quick",
        "--runs",
        "1",
        "--out",
        str(out),
    )
    text = out.read_text()
    assert "bench_collective.py --step-times-only --quick --runs 1 --out" in text
    for name in ("int8-two-phase", "sign-ef-two-phase"):
        assert re.search(
            rf"^\| {name}: step wall time <= 1.5 x dense \| [0-9.]+x \| [0-9.]+x \| "
            r"[0-9.]+ - [0-9.]+ \| (met|MISSED) \|$",
            text,
            re.M,
        ), text
    assert "| powersgd" not in text  # nothing else was trained


@pytest.mark.slow
def test_compression_benchmark_quick(tmp_path):
    # The script exits non-zero when a storage target is missed or a documented
    # error bound does not hold, which `run_script` turns into a failure.
    text = _run_quick("bench_compression.py", tmp_path / "compression.md")
    # Storage is a function of shapes alone: every target row, and every bound.
    targets = re.findall(
        r"^\| [^|]+ \| [^|]+ \| >= [0-9.]+x \| [0-9.]+x \| (\S+) \|$", text, re.M
    )
    assert targets == ["met"] * 4, targets
    assert "| holds:" in text and "VIOLATED" not in text


@pytest.mark.slow
def test_schedule_benchmark_quick(tmp_path):
    # The script exits non-zero when the default receives more bytes than a schedule
    # it could have chosen, more than dense, or other than predicted.
    text = _run_quick("bench_schedule.py", tmp_path / "schedule.md")
    rows = re.findall(r"^\| [^|]+ \| [248] \|.*\| (\S+) \|$", text, re.M)
    assert rows == ["ok"] * 15, rows


@pytest.mark.slow
def test_encoders_benchmark_quick(tmp_path):
    # The script exits non-zero when a baseline's output differs from the library's
    # (bit for bit, encoded and decoded), which `run_script` turns into a failure.
    # Timings are not checked: the machine is shared and the sizes are tiny.
    text = _run_quick("bench_encoders.py", tmp_path / "encoders.md")
    rows = re.findall(
        r"^\| ([^|]+): (encode|decode) \| 64 x 64 \| [0-9.]+ \| [0-9.]+ \| "
        r"[0-9.]+x \| [0-9.]+ - [0-9.]+ \| \(smoke run\) \|$",
        text,
        re.M,
    )
    names = {name for name, _ in rows}
    assert len(rows) == 10 and len(names) == 5, rows
    for name in ("sign_norm", "quantize 8-bit", "quantize 4-bit", "top_k"):
        assert any(n.startswith(name) for n in names), (name, names)
    assert "## What the overflow safety costs" in text


@pytest.mark.slow
@pytest.mark.parametrize("path", ["accumulate", "mark"])
def test_by_layer_benchmark_quick(tmp_path, path):
    text = _run_quick("bench_by_layer.py", tmp_path / "by_layer.md", "--path", path)
    assert {"accumulate": "accumulate_gradients", "mark": "qto.mark"}[path] in text
    for layout in ("matrices", "per-head", "jit around the scan"):
        assert f"| {layout} |" in text
    # Inside an outer scan, `by_layer` changes nothing: the same program either way.
    assert re.search(
        r"\| inside an outer scan \| ([0-9.]+) MiB \| \1 MiB \| 1\.00 \|", text
    )


@pytest.mark.slow
def test_eigh_benchmark_quick(tmp_path):
    text = _run_quick("bench_eigh.py", tmp_path / "eigh.md")
    rows = re.findall(r"^\| (\d+) \| [0-9.]+ \| [0-9.]+ \|$", text, re.M)
    assert rows == ["132", "257"], text


@pytest.mark.slow
def test_eigh_benchmark_run_quick(tmp_path):
    # Both functions run on both kinds of matrix; on a CPU both are LAPACK's, exact
    # to float32 rounding.
    text = _run_quick("bench_eigh.py", tmp_path / "eigh.md", "--run")
    rows = re.findall(
        r"^\| (\d+) \| ([a-z ]+) \| `(\S+)` \| [0-9.]+ \| ([0-9.e+-]+) \| ([0-9.e+-]+) \|$",
        text,
        re.M,
    )
    assert len(rows) == 8, text
    assert {(w, kind, name) for w, kind, name, *_ in rows} == {
        (w, kind, name)
        for w in ("132", "257")
        for kind in ("general", "near the identity")
        for name in ("jnp.linalg.eigh", "symmetric_eigh")
    }, text
    for *_, residual, orthogonality in rows:
        assert float(residual) < 1e-5 and float(orthogonality) < 1e-5, text


@pytest.mark.slow
def test_row_blocks_benchmark_quick(tmp_path):
    text = _run_quick("bench_row_blocks.py", tmp_path / "row_blocks.md")
    rows = re.findall(
        r"^\| \(600, 20\) \| ([^|]+) \| [0-9.]+ \| [0-9.]+ \|$", text, re.M
    )
    assert rows == ["default", "HIGHEST", "HIGHEST, blocks of 256"], text


@pytest.mark.slow
def test_projector_rank_benchmark_quick(tmp_path):
    # Every column of the sketches' bases is kept, and they miss what QR misses.
    text = _run_quick("bench_projector_rank.py", tmp_path / "rank.md")
    rows = re.findall(
        r"^\| \(\d+, \d+\) \| \d+ \| \S+ \| (\d+) of (\d+) \| ([0-9.e+-]+) \| ([0-9.e+-]+) \|$",
        text,
        re.M,
    )
    assert len(rows) == 2, text
    for kept, width, missed, missed_by_qr in rows:
        assert kept == width, text
        assert float(missed) <= 1.01 * float(missed_by_qr) + 1e-6, text


@pytest.mark.slow
def test_precision_benchmark_quick(tmp_path):
    # Both precisions per case; on CPU they agree, and each projector passes the
    # check's tolerance.
    text = _run_quick("bench_precision.py", tmp_path / "precision.md")
    number = r"([0-9.e+-]+)"
    rows = re.findall(
        rf"^\| \(\d+, \d+\) \| \d+ \| (HIGHEST \(shipped\)|DEFAULT) \| {number} \| "
        rf"\d+ \| {number} \| [0-9.]+ \| [0-9.]+ \| {number} \| {number} \|$",
        text,
        re.M,
    )
    assert [r[0] for r in rows] == ["HIGHEST (shipped)", "DEFAULT"], text
    for _, q, projector, check, tolerance in rows:
        assert float(check) <= float(tolerance), text
        assert float(q) < 1e-4 and float(projector) < 1e-4, text


@pytest.mark.slow
def test_marks_data_parallel_benchmark_quick(tmp_path):
    # 8 host devices: the marks without `axis_name` sum the stacks' dense
    # gradients (counted); with `axis_name` the projected factors only, and with
    # or without it the embedding's rows read, not its table.
    text = _run_quick("bench_marks_data_parallel.py", tmp_path / "marks.md")
    rows = re.findall(r"^\| `(.+)` \| ([0-9.]+) \| [0-9.]+ \| (\d+) \|$", text, re.M)
    received = {name: (float(mib), int(count)) for name, mib, count in rows}
    dense = received["jax.value_and_grad"]
    with_axis = received['qto.mark(params, state, axis_name="data")']
    assert len(received) == 3 and dense[1] == 0, text
    assert with_axis[1] == 0 and with_axis[0] < dense[0] / 4, text
    assert received["qto.mark(params, state)"][1] > 0, text


@pytest.mark.slow
def test_data_parallel_benchmark_quick(tmp_path):
    # 60M on 8 host devices: every arm compiles, and `qto.galore` inside
    # `shard_map` receives fewer bytes per step than either Adam, and fewer than
    # itself under `jit`, whose partitioner all-reduces in every microbatch.
    text = _run_quick("bench_data_parallel.py", tmp_path / "dp.md")
    rows = re.findall(
        r"^\| 60M \| `([\w ,_-]+)` \| [0-9.]+ \| [0-9.]+ \| ([0-9.]+) \|", text, re.M
    )
    received = {arm: float(value) for arm, value in rows}
    assert list(received) == [
        "adam, jit",
        "adam, shard_map",
        "galore, jit",
        "galore, shard_map",
    ], text
    galore = received["galore, shard_map"]
    assert galore < min(received["adam, jit"], received["adam, shard_map"]), text
    assert galore < received["galore, jit"], text


@pytest.mark.slow
def test_loop_layouts_benchmark_quick(tmp_path):
    # On the CPU, small shapes: every arm compiles, and its whole-stack copies are
    # counted (XLA:CPU copies some; the TPU figures are the results files').
    text = _run_quick("bench_loop_layouts.py", tmp_path / "loops.md")
    rows = re.findall(r"^\| ([\w +,_-]+) \| ([0-9.]+) \| (\d+) \|$", text, re.M)
    assert [row[0] for row in rows] == [
        "no loop",
        "while_loop",
        "scan + cond",
        "while_loop, carried row-major",
    ], text
    # The loops hold a running sum of the gradient that the arm of no loop lacks.
    assert all(float(row[1]) >= float(rows[0][1]) for row in rows), text


@pytest.mark.slow
def test_compile_benchmark_quick(tmp_path):
    # On the CPU: each arm's step is lowered and compiled under the profiler, and
    # the compiler's own events give its phases and the kernels it generated.
    # With `--pieces`, each step's gradients, update and apply compiled alone too.
    text = _run_quick("bench_compile.py", tmp_path / "compile.md", "--pieces")
    rows = re.findall(
        r"^\| `([\w-]+)`( \(\w+\))? \| ([0-9.]+) \| ([0-9.]+) \| [0-9.]+ \| "
        r"([0-9.]+) \| n/a \| (\d+) \|",
        text,
        re.M,
    )
    pieces = ["", " (gradients)", " (update)", " (apply)"]
    assert [row[0] + row[1] for row in rows] == [
        arm + piece for arm in ("adam", "projected-8bit") for piece in pieces
    ], text
    for _, piece, lower, compile_s, passes, kernels in rows:
        # A piece as small as the apply lowers in under 0.05 s, printed as 0.0.
        assert float(lower) > 0 or piece, text
        assert float(compile_s) > 0 and int(kernels) > 0, text
        assert float(passes) <= float(compile_s), text
    # The projected step's passes take most of a second: the events were found.
    assert float(rows[4][4]) > 0, text
    # Each piece is a part of its step's program: fewer kernels.
    for step in (rows[0], rows[4]):
        pieces_of_step = [row for row in rows if row[0] == step[0] and row[1]]
        assert all(int(row[5]) < int(step[5]) for row in pieces_of_step), text


@pytest.mark.slow
def test_transformer_benchmark_quick(tmp_path):
    text = _run_quick("bench_transformer.py", tmp_path / "transformer.md")
    verdicts = re.findall(
        r"^\| [^|]+ \| (projected[^|]*) \| [^|]+ \| (\w+) \|$", text, re.M
    )
    # Three targets per projected arm; no step time in quick mode.
    assert len(verdicts) == 6 and all(v == "met" for _, v in verdicts), verdicts


@pytest.mark.slow
def test_scale_benchmark_quick(tmp_path):
    # Compiles (never runs) the 60M Llama's step with BF16 Adam and with projected
    # gradients and 8-bit state; the figures are XLA's, so only their presence and
    # the order of the two optimiser states (bytes from shapes) are checked. (At
    # 60M the totals are within 1% of each other: the embedding and head dominate.)
    text = _run_quick("bench_scale.py", tmp_path / "scale.md")
    assert "not a GPU's measured peak" in text
    rows = re.findall(
        r"^\| 60M \| \d+M \| ([a-z0-9-]+) \|(?: [0-9.]+ \|){4} \*\*([0-9.]+)\*\* "
        r"\| [0-9.]+ \| [0-9.]+ \| ([0-9.]+) \|",
        text,
        re.M,
    )
    states = {arm: float(state) for arm, total, state in rows}
    assert set(states) == {"adam", "projected-8bit"}, rows
    assert states["projected-8bit"] < states["adam"]
    assert (tmp_path / "scale.png").stat().st_size > 0


@pytest.mark.slow
def test_scale_benchmark_targets_table(tmp_path):
    # `--target cpu` for one arm of the 60M model at one microbatch: the side-by-side
    # file names its command and has the arm's row with its ratio to Adam.
    out = tmp_path / "targets.md"
    run_script(
        BENCHMARKS / "bench_scale.py",
        *("--target", "cpu", "--models", "60M", "--arms", "adam", "marks-8bit"),
        *("--accumulation", "1", "--out", str(out)),
    )
    text = out.read_text()
    assert "bench_scale.py --target cpu --models 60M" in text
    rows = re.findall(
        r"^\| 60M \| 1 \| 1 \| `([a-z0-9-]+)` \| ([0-9.]+) \| ([0-9.]+) \|", text, re.M
    )
    assert [arm for arm, _, _ in rows] == ["adam", "marks-8bit"], text
    assert float(rows[0][2]) == 1.0 and float(rows[1][2]) > 0
    # The run's own versions, recorded with its rows.
    jax_version = importlib.metadata.version("jax")
    assert f"- versions: jax {jax_version}, jaxlib " in text, text
    saved = json.loads(out.with_suffix(".json").read_text())
    assert all(f"jax {jax_version}," in run["versions"] for run in saved["runs"])


def _report_module():
    """`benchmarks/_report.py`, imported from its file (it imports no JAX)."""
    spec = importlib.util.spec_from_file_location("_report", BENCHMARKS / "_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_sharing_a_results_file_each_name_their_versions():
    versions_lines = _report_module().versions_lines
    old = {"command": "python a.py --old"}  # saved before runs recorded versions
    new = [
        {"command": "python a.py --x", "versions": "jax 2"},
        {"command": "python a.py --y", "versions": "jax 2"},
        {"command": "python a.py --x", "versions": "jax 2"},
    ]
    assert versions_lines(new) == ["- versions: jax 2"]
    assert versions_lines(
        [old, *new, {"command": "python b.py", "versions": "jax 1"}]
    ) == [
        "- versions: jax 1, for `python b.py`",
        "- versions: jax 2, for `python a.py --x`; `python a.py --y`",
        "- versions: not recorded, for `python a.py --old`",
    ]


def test_scale_benchmark_refuses_compiler_layouts_off_a_tpu_chip(tmp_path):
    # The compiler's layouts are a TPU figure: XLA:CPU has one layout per shape.
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "bench_scale.py"),
            *("--target", "cpu", "--models", "60M", "--arms", "adam"),
            *("--layouts", "auto", "--out", str(tmp_path / "t.md")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "for one TPU chip" in result.stderr
    assert not (tmp_path / "t.md").exists()


@pytest.mark.slow
def test_oversample_benchmark_quick(tmp_path):
    text = _run_quick("bench_oversample.py", tmp_path / "oversample.md")
    rows = [line for line in text.splitlines() if line.startswith("| 64 x 128 |")]
    assert len(rows) == 4  # two spectra, 0 and 1 power iterations
    for row in rows:
        best, *found = (float(c) for c in row.split("|")[5:8])
        # No projector keeps more than the truncated SVD's; a range finder keeps a
        # fair part of it (a random rank-4 subspace would keep 4/64 of the energy).
        assert all(0.25 * best < f <= best + 1e-4 for f in found), row


@pytest.mark.slow
def test_device_benchmark_quick(tmp_path):
    # On the CPU: each arm's step compiles and runs in a process of its own, the
    # compile time and the memory estimate are recorded, and the loss is finite.
    # `--eigh jnp` reaches the child processes, and the results say so (on a CPU
    # both choices lower to LAPACK's).
    out = tmp_path / "device.md"
    text = _run_quick("bench_device.py", out, "--eigh", "jnp")
    rows = [line for line in text.splitlines() if line.startswith("| 60M |")]
    assert len(rows) == 2, text
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert float(cells[3]) > 0 and float(cells[5]) > 0, row
        assert np.isfinite(float(cells[-1])), row
    assert "With `--eigh jnp`" in text, text
    raw = json.loads(out.with_suffix(".json").read_text())
    assert [r["eigh"] for r in raw["rows"]] == ["jnp", "jnp"], raw
