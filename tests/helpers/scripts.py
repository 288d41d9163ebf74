"""Running a benchmark or example script, or a snippet of Python, as a user does."""

import os
import pathlib
import subprocess
import sys

from tests.helpers.collective import DEVICE_FLAG


ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_in_checkout(*args: str) -> subprocess.CompletedProcess:
    """Runs `python <args>` from the repository root with this checkout's package
    importable; fails the test with the process's stderr if it exits non-zero.

    A subprocess, not `runpy`: the scripts set the fallback mode and reset the global
    fallback counters, and some set `XLA_FLAGS` at import; none of it must leak into
    other tests.
    """
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": path, "XLA_FLAGS": _flags_of_a_user()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _flags_of_a_user() -> str:
    """This process's `XLA_FLAGS` without the host device count the test suite asks
    for: a script sets the count it needs, as it does when a user runs it."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if f != DEVICE_FLAG)


def run_script(script: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """Runs `python <script> <args>` as the README and `nox -s bench` do (see
    `run_in_checkout`)."""
    return run_in_checkout(str(script.relative_to(ROOT)), *args)
