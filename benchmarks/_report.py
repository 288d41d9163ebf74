"""What every benchmark's results file records: where it goes, the command that
produced it, and the machine it ran on.

Benchmark scripts are named `bench_<what>.py`, so that none can shadow a module of
the standard library or of an installed package when its folder is on `sys.path`
(as it is when the script runs); helpers like this one start with `_`.
"""

import importlib.metadata
import os
import pathlib
import platform
import shlex
import sys
from typing import Any


ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# Quick runs write here, which git ignores, so a smoke run never replaces the
# committed results of a full run.
QUICK_RESULTS = RESULTS / "quick"


def default_out(script: str, quick: bool) -> pathlib.Path:
    """`results/<script's stem>.md`, or `results/quick/<stem>.md` for a quick run."""
    folder = QUICK_RESULTS if quick else RESULTS
    return folder / f"{pathlib.Path(script).stem}.md"


def command() -> str:
    """The command line of this run, with the script's path relative to the
    repository root when it is inside it (the results files quote it as run from
    the root)."""
    script = pathlib.Path(sys.argv[0]).resolve()
    if script.is_relative_to(ROOT):
        script = script.relative_to(ROOT)
    return shlex.join(["python", str(script), *sys.argv[1:]])


def produced_by(title: str) -> list[str]:
    """A results file's title and the command that produced it."""
    return [f"# {title}", "", "Produced by:", "", "```", command(), "```", ""]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or what `platform` knows."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions(*packages: str) -> str:
    """`name version` for each installed package, then Python's version."""
    listed = ", ".join(
        f"{name} {importlib.metadata.version(name)}" for name in packages
    )
    return f"{listed}, python {platform.python_version()}"


def versions_lines(runs: list[dict]) -> list[str]:
    """The versions lines of a results file that several runs share, each run a
    dict with its `command` and the `versions` it recorded: one line when they
    agree, else one per set of versions naming its commands ("not recorded" for a
    run saved before runs recorded them)."""
    found: dict[str, set[str]] = {}
    for run in runs:
        found.setdefault(run.get("versions", "not recorded"), set()).add(run["command"])
    if len(found) == 1:
        return [f"- versions: {next(iter(found))}"]
    return [
        f"- versions: {found_versions}, for "
        + "; ".join(f"`{c}`" for c in sorted(commands))
        for found_versions, commands in sorted(found.items())
    ]


def machine_line() -> str:
    return f"- nproc: {len(os.sched_getaffinity(0))}; CPU: {cpu_model()}"


def load_line(load_at_start: tuple[float, ...]) -> str:
    """The load average when the run started and now: how noisy its timings are."""
    return (
        "- load average (1, 5, 15 min) at start / end: "
        + ", ".join(f"{x:.2f}" for x in load_at_start)
        + " / "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    )


def environment(
    packages: tuple[str, ...],
    backend: str,
    load_at_start: tuple[float, ...] | None = None,
) -> list[str]:
    """The versions, backend and machine lines, and the load line when
    `load_at_start` is given (for a run whose timings it qualifies)."""
    lines = [
        "- versions: " + versions(*packages),
        f"- backend: {backend}",
        machine_line(),
    ]
    if load_at_start is not None:
        lines.append(load_line(load_at_start))
    return lines


def add_out_argument(parser: Any, script: str) -> None:
    """The `--out` option every benchmark takes, with its default in the help."""
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        help="where to write the markdown results (default: "
        f"{default_out(script, False)}, or {default_out(script, True)} with "
        "--quick)",
    )


def write_results(
    lines: list[str], out: Any, script: str, quick: bool, variant: str
) -> pathlib.Path:
    """Writes a results file's lines to `out`, or by default to
    `results/<script's stem>-<variant>.md` (`results/quick/...` for a quick run)."""
    if out is None:
        default = default_out(script, quick)
        out = default.with_name(f"{default.stem}-{variant}.md")
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return out
