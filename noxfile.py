"""Developer tasks: `nox -s tests`, `nox -s lint`, `nox -s docs`, `nox -s bench`."""

import pathlib
import shutil

import nox
from packaging.requirements import Requirement


ROOT = pathlib.Path(__file__).parent
BENCHMARKS = ROOT / "benchmarks"
ON_AN_ACCELERATOR = {"bench_device"}
RESULTS = BENCHMARKS / "results"

nox.options.default_venv_backend = "uv" if shutil.which("uv") else "venv"
nox.options.sessions = ["tests", "lint"]


def _ruff_requirement() -> str:
    """The ruff requirement of the `dev` extra, so lint uses the same ruff as dev."""
    project = nox.project.load_toml(ROOT / "pyproject.toml")["project"]
    dev = project["optional-dependencies"]["dev"]
    return next(req for req in dev if Requirement(req).name == "ruff")


@nox.session
def tests(session: nox.Session) -> None:
    """Runs the test suite; extra arguments replace the default `-q -n 2`."""
    session.install(".[dev,optax,examples]")
    session.run("python", "-m", "pytest", *(session.posargs or ["-q", "-n", "2"]))


@nox.session
def lint(session: nox.Session) -> None:
    """Checks lint rules and formatting with ruff, and types with basedpyright (its
    settings are in pyproject.toml)."""
    session.install(_ruff_requirement(), ".[optax]", "basedpyright>=1.30")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("basedpyright")


@nox.session
def docs(session: nox.Session) -> None:
    """Builds the documentation into site/, failing on any warning."""
    session.install(".[docs]")
    # Quiets mkdocs-material's banner about MkDocs 2.0; it is not a build warning.
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("mkdocs", "build", "--strict", *session.posargs)


def _results_of(results: pathlib.Path, stem: str) -> dict:
    """`<stem>.md`, or `<stem>-<target>.md` for a script that names its target, with
    the time each was written."""
    return {p: p.stat().st_mtime_ns for p in results.glob(f"{stem}*.md")}


@nox.session
def bench(session: nox.Session) -> None:
    """Runs the benchmark scripts, `benchmarks/bench_*.py`.

    Each writes `benchmarks/results/<name>.md`, or with `--quick`
    `benchmarks/results/quick/<name>.md`, which git ignores.

    Arguments name the scripts to run (default: all); from the first argument that
    starts with `-` on, the arguments go to every script, e.g.
    `nox -s bench -- bench_jvp --quick --out /tmp/jvp.md`. The session fails if a
    script did not write its results file. Files starting with `_` are helpers.
    """
    session.install(".[optax,examples]")
    args = session.posargs
    first_flag = next((i for i, a in enumerate(args) if a.startswith("-")), len(args))
    names = {pathlib.Path(a).stem for a in args[:first_flag]}
    flags = args[first_flag:]
    scripts = sorted(BENCHMARKS.glob("bench_*.py"))
    unknown = names - {p.stem for p in scripts}
    if unknown:
        session.error(f"No such benchmark: {', '.join(sorted(unknown))}")
    # A script that runs a step for real on an attached accelerator runs when named.
    scripts = [
        p
        for p in scripts
        if p.stem in names or (not names and p.stem not in ON_AN_ACCELERATOR)
    ]
    if not scripts:
        session.error("No benchmark scripts in benchmarks/.")
    results = RESULTS / "quick" if "--quick" in flags else RESULTS
    for script in scripts:
        before = _results_of(results, script.stem)
        session.run("python", str(script.relative_to(ROOT)), *flags)
        written = any(
            before.get(p) != t for p, t in _results_of(results, script.stem).items()
        )
        result = results / f"{script.stem}.md"
        if not written and not any(f.startswith("--out") for f in flags):
            session.error(f"{script.name} did not write {result.relative_to(ROOT)}")
