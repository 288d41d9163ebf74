"""The package namespace: `__all__`, and the lazily imported `optax` submodule."""

import pathlib
import subprocess
import sys
import types

import pytest

import quax_tangents as qt


REPO = pathlib.Path(__file__).resolve().parents[1]


def test_all_lists_every_public_name():
    public = {
        name
        for name, value in vars(qt).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert sorted(qt.__all__) == sorted(public)
    assert len(set(qt.__all__)) == len(qt.__all__)
    for name in qt.__all__:
        assert getattr(qt, name) is not None


def test_star_import_needs_no_optional_extra():
    namespace = {}
    exec("from quax_tangents import *", namespace)
    assert set(qt.__all__) <= set(namespace)


def test_optax_is_an_attribute_of_the_package():
    pytest.importorskip("optax", reason="needs the `optax` extra")
    import quax_tangents.optax as qto

    assert qt.optax is qto
    assert "optax" in dir(qt)


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        qt.no_such_name  # noqa: B018


def _run(code):
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        check=False,
    )


def test_optax_without_the_extra_names_it():
    # `None` in `sys.modules` makes `import optax` fail as if it were not installed.
    result = _run(
        "import sys; sys.modules['optax'] = None\n"
        "import quax_tangents as qt\n"
        "try:\n"
        "    qt.optax\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ImportError ")
    assert 'pip install "quax-tangents[optax]"' in result.stdout


def test_importing_starts_no_backend():
    # A multi-process program calls `jax.distributed.initialize` after its imports and
    # before JAX's backend starts; importing the package must not start it.
    result = _run(
        "import quax_tangents, quax_tangents.optax\n"
        "from jax._src import xla_bridge\n"
        "print(sorted(xla_bridge._backends))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
