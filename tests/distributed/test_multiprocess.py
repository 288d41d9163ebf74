"""Two real processes form one JAX cluster over 127.0.0.1 (gloo collectives on the
CPU): `examples/data_parallel.py --processes 2 --devices 4` trains to the same
parameters as one process with 8 devices.

The processes run the example's own launcher; every wait is bounded, and a launcher
that overruns is terminated, which stops its workers.
"""

import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest


ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "data_parallel.py"
# PowerSGD, and int8 quantisation (`qto.compress_updates` of `qt.quantize(bits=8)`).
METHODS = "powersgd-r2,int8"


def _run_example(args: list[str], log: pathlib.Path, timeout: float) -> None:
    """Runs the example to completion within `timeout` seconds, or stops it (by its
    PID) and fails. Output goes to a file, so that workers that inherit it cannot
    keep a pipe open."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, str(EXAMPLE), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
            pytest.fail(
                f"{args} ran longer than {timeout} s:\n{log.read_text()[-4000:]}"
            )
    assert code == 0, log.read_text()[-6000:]


def _train(tmp_path: pathlib.Path, name: str, cluster: list[str]) -> dict:
    params = tmp_path / f"{name}.npz"
    common = ["--quick", "--steps", "4", "--no-progress", "--methods", METHODS]
    outputs = ["--out", str(tmp_path / f"{name}.md"), "--save-params", str(params)]
    _run_example(common + outputs + cluster, tmp_path / f"{name}.log", timeout=400)
    with np.load(params) as saved:
        return dict(saved)


@pytest.mark.slow
def test_two_processes_train_as_one_process(tmp_path):
    pytest.importorskip("sklearn", reason="the examples need the `examples` extra")
    one = _train(tmp_path, "one", ["--devices", "8"])
    two = _train(
        tmp_path,
        "two",
        ["--processes", "2", "--devices", "4", "--timeout", "300"],
    )
    assert {k.split("/")[0] for k in one} == set(METHODS.split(","))
    assert one.keys() == two.keys()
    for key in one:
        # Equal up to float32 rounding: the cluster sums in another order.
        np.testing.assert_allclose(
            two[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key
        )
    # The runs did train: the biases start at zero.
    assert all(np.any(one[k]) for k in one if k.endswith("/b"))
    table = (tmp_path / "two.md").read_text()
    assert "8 host CPU devices in 2 processes" in table
