"""The README's commands match CI, and the API reference covers every public name.
(tests/test_docs.py runs the README's Python snippet with the docs pages.)"""

import pathlib
import re


ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_test_command_is_what_ci_runs():
    commands = re.findall(r"```bash\n(.*?)```", README, flags=re.S)[0]
    test_line = [line for line in commands.splitlines() if "pytest" in line][0]
    pytest_command = test_line.split("&&")[-1].strip()
    assert pytest_command in (ROOT / ".ci" / "run").read_text()


def test_api_reference_covers_every_public_name():
    import types

    import quax_tangents as qt

    api = (ROOT / "docs" / "api.md").read_text()
    public = [
        name
        for name, value in vars(qt).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    ]
    missing = [name for name in public if f"::: quax_tangents.{name}" not in api]
    assert not missing, f"docs/api.md lacks: {missing}"
