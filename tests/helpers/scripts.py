"""Running a benchmark or example script as a user does."""

import os
import pathlib
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_script(script: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """Runs `python <script> <args>` from the repository root, as the README and
    `nox -s bench` do, with this checkout's package importable; fails the test with
    the script's stderr if it exits non-zero.

    A subprocess, not `runpy`: the scripts set the fallback mode and reset the global
    fallback counters, which must not leak into other tests.
    """
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(script.relative_to(ROOT)), *args],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result
