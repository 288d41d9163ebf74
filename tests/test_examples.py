"""The examples run end to end and print what their documentation promises, and the
`examples` extra installs everything they import."""

import ast
import importlib.metadata
import json
import pathlib
import re
import runpy
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.scripts import run_in_checkout


ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

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


def _top_level_imports(path: pathlib.Path) -> set[str]:
    """The first component of every module a file imports at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("folder", ["examples", "benchmarks"])
def test_examples_extra_provides_every_import(folder):
    # The README installs `.[examples]` and runs the examples; the benchmarks need the
    # same extra (docs/getting-started.md). Every third-party import must come from a
    # distribution that the core dependencies or that extra name directly.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = (
        project["dependencies"] + project["optional-dependencies"]["examples"]
    )
    provided = {canonicalize_name(Requirement(r).name) for r in requirements}
    provided.add(canonicalize_name(project["name"]))
    distributions = importlib.metadata.packages_distributions()
    scripts = sorted((ROOT / folder).glob("*.py"))
    local = {path.stem for path in scripts}
    missing = {}
    for path in scripts:
        for module in _top_level_imports(path) - local - set(sys.stdlib_module_names):
            # The project itself may be installed editable, which the mapping misses.
            names = {canonicalize_name(d) for d in distributions.get(module, [])}
            names.add(canonicalize_name(module))
            if not names & provided:
                missing[f"{path.name}: {module}"] = sorted(names) or "not installed"
    assert not missing, missing


_HELP_FACTS = """
import json, sys

sys.path.insert(0, "examples")
import data_parallel, sharded

facts = {}
for module in (data_parallel, sharded):
    parser = module.build_parser()
    facts[module.__name__] = {
        "docstring": module.__doc__,
        "description": parser.description,
        "helps": {
            action.option_strings[-1]: action.help
            for action in parser._actions
            if action.option_strings
        },
        "quick_out": str(module.parse_args(["--quick"]).out),
        "quick": str(module.QUICK_OUT),
    }
print(json.dumps(facts))
"""


def test_multi_device_examples_explain_every_option_and_write_quick_runs_aside():
    # A subprocess: importing them sets XLA_FLAGS for 8 host devices.
    result = run_in_checkout("-c", _HELP_FACTS)
    for name, facts in json.loads(result.stdout.splitlines()[-1]).items():
        # The whole first paragraph of the docstring: a sentence, not half of one.
        first_paragraph = " ".join(facts["docstring"].split("\n\n")[0].split())
        assert facts["description"] == first_paragraph, name
        assert facts["description"].endswith("."), name
        missing = [option for option, text in facts["helps"].items() if not text]
        assert not missing, f"{name}: options without help: {missing}"
        # A smoke run writes to the git-ignored quick folder.
        quick = EXAMPLES / "results" / "quick" / f"{name}.md"
        assert pathlib.Path(facts["quick_out"]) == pathlib.Path(facts["quick"]) == quick
