"""The transformer example: its quick mode runs the four arms and reports loss and
memory, and its memory accounting (compile only) meets the targets at a size where
weights dominate activations."""

import dataclasses
import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
ARMS = ("adam", "galore", "projected", "projected + sparse rows")

pytest.importorskip("matplotlib", reason="the examples need the `examples` extra")
pytest.importorskip("tqdm", reason="the examples need the `examples` extra")
# The module's fixture trains the example's four arms in its quick mode: about 50 s of
# CPU time, a minute on two cores.
pytestmark = pytest.mark.slow


def _example():
    spec = importlib.util.spec_from_file_location(
        "transformer_example", ROOT / "examples" / "transformer.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("transformer")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TQDM_DISABLE="1")
    run = subprocess.run(
        [sys.executable, "examples/transformer.py", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert (out / "transformer.png").stat().st_size > 0
    return (out / "transformer.md").read_text(), run.stdout


def _table(text: str, header: str) -> dict[str, list[str]]:
    lines = text[text.index(header) :].splitlines()
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_quick_mode_reports_loss_and_memory_of_every_arm(quick):
    text, stdout = quick
    assert text in stdout and "transformer.png" in stdout
    assert "python examples/transformer.py --quick --out" in text
    losses = _table(text, "| arm | final training loss")
    assert tuple(losses) == ARMS
    for cells in losses.values():
        assert len(cells) == 3  # no step-time ratio in quick mode: it is noise
        loss, val = _number(cells[0]), _number(cells[1])
        # 24 steps from ln(96) = 4.56: every arm learns something.
        assert math.isfinite(val) and loss < 4.5
    memory = _table(text, "| arm | temp bytes")
    assert tuple(memory) == ARMS
    for cells in memory.values():
        temp, argument, output, total = (_number(c) for c in cells[:4])
        assert total == temp + argument + output
    for word in ("missed", "Targets", "step time"):
        assert word not in text


def test_quick_mode_state_and_gradient_bytes(quick):
    memory = _table(quick[0], "| arm | temp bytes")
    state = {arm: _number(cells[4]) for arm, cells in memory.items()}
    grads = {arm: _number(cells[5]) for arm, cells in memory.items()}
    assert grads["adam"] == grads["galore"]
    assert grads["projected"] < grads["adam"] / 2
    assert state["galore"] < state["adam"] / 2
    assert state["projected"] < state["adam"] / 2


def test_galore_layer_views_equal_galore_on_each_layer():
    import jax
    import jax.numpy as jnp
    import optax

    example = _example()
    config = dataclasses.replace(example.QUICK, d_model=16, heads=2, rank=4)
    params, _ = example.init(config, 20, 0)
    weights = example.projected_weights(params, config.rank)
    make = lambda dims: optax.contrib.galore(  # noqa: E731
        1e-2, rank=4, weight_dimension_numbers=dims
    )
    tx = example.layer_views(make, params, weights)
    grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    w = lambda p: p.blocks.mlp_in.weight  # noqa: E731
    for layer in range(config.layers):
        alone = optax.contrib.galore(1e-2, rank=4)
        g = {"w": w(grads)[layer]}
        expected, _ = jax.jit(alone.update)(g, alone.init({"w": w(params)[layer]}), g)
        assert jnp.allclose(w(updates)[layer], expected["w"], atol=1e-6)


def test_memory_targets_where_weights_dominate():
    example = _example()
    # Compile only; weights of 2 x 12 x 128^2 floats against 16 tokens.
    config = dataclasses.replace(
        example.MEMORY, d_model=128, heads=2, layers=2, seq=8, batch=2, rank=8
    )
    result = example.measure_memory(config)
    adam, galore, projected = (result.arms[a] for a in ARMS[:3])
    assert projected.grads < adam.grads / 4
    assert projected.total <= adam.total - adam.grads
    assert projected.total < galore.total
    steady = result.steady_temp["projected"]
    assert 0 <= projected.temp - steady <= result.refresh_working_set
    text = example.memory_report(result)
    assert "missed" not in text and text.count(": met.") == 3
