"""Running the Python code blocks of a documentation page, as a reader would.

The conventions (also stated in `docs/index.md`):

- Every ```` ```python ```` block of a page runs, in page order, in one namespace per
  page, from the repository root.
- A ```` ```text ```` block that follows a Python block, with nothing but blank lines
  between them, is the output that block prints; it is compared with what the block
  printed (trailing whitespace ignored). A Python block with no such block may print
  anything.
- `<!-- skip -->` on the line before a fence (blank lines allowed) means the block
  cannot run as shown (for example `jax.distributed.initialize`); the page says why.
- A page whose code sets `XLA_FLAGS` (to simulate several host devices) runs in a
  fresh Python process, since JAX reads the flags once, when it starts.

Run as a script, `python -m tests.helpers.docs PAGE OUT` runs PAGE's blocks and
writes what each printed to the JSON file OUT.
"""

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import textwrap
import traceback
import warnings
from collections.abc import Callable


ROOT = pathlib.Path(__file__).resolve().parents[2]
SKIP = "<!-- skip -->"
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One Python code block: where it starts, its code, and the output it shows."""

    line: int  # 1-based line of the opening fence
    code: str
    expected: str | None  # the following ```text block, if any
    skip: bool


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What running one block gave: its printed output, or the error it raised."""

    line: int
    printed: str
    error: str | None


def _fenced_blocks(text: str) -> list[tuple[int, int, str, str]]:
    """Every fenced block as (opening line index, closing line index, language,
    dedented content)."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, language = match.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = "\n".join(line[len(indent) :] for line in lines[i + 1 : end])
        blocks.append((i, end, language, textwrap.dedent(body)))
        i = end + 1
    return blocks


def _previous_nonblank(lines: list[str], index: int) -> str:
    for line in reversed(lines[:index]):
        if line.strip():
            return line.strip()
    return ""


def read_blocks(path: pathlib.Path) -> list[Block]:
    """The Python blocks of a Markdown page, in page order."""
    text = path.read_text()
    lines = text.splitlines()
    fenced = _fenced_blocks(text)
    blocks = []
    for n, (start, end, language, code) in enumerate(fenced):
        if language != "python":
            continue
        expected = None
        if n + 1 < len(fenced):
            next_start, _, next_language, next_code = fenced[n + 1]
            between = lines[end + 1 : next_start]
            if next_language == "text" and not any(line.strip() for line in between):
                expected = next_code
        skip = _previous_nonblank(lines, start) == SKIP
        blocks.append(Block(start + 1, code, expected, skip))
    return blocks


def needs_fresh_process(blocks: list[Block]) -> bool:
    """Whether the page sets `XLA_FLAGS`, which JAX reads only when it starts."""
    return any("XLA_FLAGS" in block.code for block in blocks if not block.skip)


def run_blocks(
    blocks: list[Block], filename: str, check: Callable[[dict], None] | None = None
) -> list[Outcome]:
    """Runs the blocks that are not skipped in one namespace, from the repository
    root; stops at the first block that raises. `check(namespace)`, if given, runs
    after the last block when none raised, before the fallback counters are reset."""
    import quax_tangents as qt

    namespace: dict = {"__name__": "__main__"}
    outcomes = []
    cwd = os.getcwd()
    os.chdir(ROOT)
    # The fallback counters and warn-once memory are global: a page starts afresh, and
    # leaves nothing behind for the tests that follow it.
    qt.reset_fallback_counts()
    try:
        with warnings.catch_warnings():
            # A reader sees warnings on stderr; they are not part of the output.
            warnings.simplefilter("ignore")
            for block in blocks:
                if block.skip:
                    continue
                printed = io.StringIO()
                error = None
                try:
                    code = compile(block.code, f"{filename}:{block.line}", "exec")
                    with contextlib.redirect_stdout(printed):
                        exec(code, namespace)
                except Exception:
                    error = traceback.format_exc(limit=-8)
                outcomes.append(Outcome(block.line, printed.getvalue(), error))
                if error is not None:
                    break
        if check is not None and all(o.error is None for o in outcomes):
            check(namespace)
    finally:
        os.chdir(cwd)
        qt.reset_fallback_counts()
    return outcomes


def run_page(
    path: pathlib.Path, check: Callable[[dict], None] | None = None
) -> list[Outcome]:
    """Runs a page's blocks, in a fresh process when it sets `XLA_FLAGS`; `check`
    as in `run_blocks`, for pages that run in this process only."""
    blocks = read_blocks(path)
    filename = str(path.relative_to(ROOT))
    if not needs_fresh_process(blocks):
        return run_blocks(blocks, filename, check)
    assert check is None, f"{filename} runs in a fresh process: nothing to check"
    pythonpath = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with tempfile.TemporaryDirectory() as folder:
        out = pathlib.Path(folder) / "outcomes.json"
        result = subprocess.run(
            [sys.executable, "-m", "tests.helpers.docs", str(path), str(out)],
            cwd=ROOT,
            env=env | {"PYTHONPATH": pythonpath},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        return [Outcome(**o) for o in json.loads(out.read_text())]


def normalise(output: str) -> str:
    """Output lines with trailing whitespace and trailing blank lines removed."""
    return "\n".join(line.rstrip() for line in output.strip("\n").splitlines())


if __name__ == "__main__":
    page, result_file = map(pathlib.Path, sys.argv[1:3])
    outcomes = run_blocks(read_blocks(page), str(page.resolve().relative_to(ROOT)))
    result_file.write_text(json.dumps([dataclasses.asdict(o) for o in outcomes]))
