"""Every Python code block of the documentation (`docs/**/*.md` and README.md) runs as
shown and prints what the page shows.

Conventions (stated for writers in `docs/index.md`; implemented in
`tests/helpers/docs.py`):

- the ```` ```python ```` blocks of a page run in page order, in one namespace per
  page, from the repository root;
- a ```` ```text ```` block right after a Python block (only blank lines between) is
  that block's printed output, compared line by line, trailing whitespace ignored;
- `<!-- skip -->` on the line before a fence marks a block that cannot run as shown
  (the page says why);
- a page whose code sets `XLA_FLAGS` (simulated host devices) runs in a fresh Python
  process, since JAX reads the flags only when it starts.
"""

import difflib
import pathlib
import textwrap

import jax.numpy as jnp
import pytest

import quax_tangents as qt
from tests.helpers.docs import ROOT, normalise, read_blocks, run_page


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES_WITH_CODE = [page for page in PAGES if read_blocks(page)]
# Pages whose blocks compile whole training steps: 10-20 s each on two cores.
SLOW_PAGES = {"docs/llm.md", "docs/training.md"}


def _name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def _cotangents_page_values(namespace: dict) -> None:
    """What `docs/cotangents.md` computes beyond what it prints, and that nothing on
    it densifies."""
    assert qt.fallback_counts() == {}
    assert isinstance(namespace["g_embedding"], qt.SparseRows)
    assert namespace["g_embedding"].k == 4
    assert isinstance(namespace["g_w"], qt.LowRank)
    assert namespace["projector"].matrix.shape == (32, 4)
    g_blocks = namespace["g_blocks"]
    assert g_blocks["w"].left.shape == (3, 16, 4)
    assert g_blocks["v"].projector_side == "right"
    assert g_blocks["v"].right.shape == (3, 16, 4)
    assert namespace["g_chunked"]["w"].left.shape == (3, 16, 4)
    assert namespace["g_bf16"].dtype == jnp.float32
    assert namespace["g_sum"].rank == 4


# Checks of the values a page leaves behind, by page (pages run in this process).
PAGE_VALUES = {"docs/cotangents.md": _cotangents_page_values}


def _page_param(page: pathlib.Path):
    marks = [pytest.mark.slow] if _name(page) in SLOW_PAGES else []
    return pytest.param(page, marks=marks, id=_name(page))


@pytest.mark.parametrize("page", [_page_param(page) for page in PAGES_WITH_CODE])
def test_page_runs_and_prints_what_it_shows(page):
    blocks = [block for block in read_blocks(page) if not block.skip]
    outcomes = run_page(page, PAGE_VALUES.get(_name(page)))
    problems = []
    for block, outcome in zip(blocks, outcomes):
        where = f"{_name(page)}:{block.line}"
        if outcome.error is not None:
            problems.append(f"{where} raised:\n{outcome.error}")
        elif block.expected is not None:
            expected, printed = normalise(block.expected), normalise(outcome.printed)
            if expected != printed:
                diff = difflib.unified_diff(
                    expected.splitlines(),
                    printed.splitlines(),
                    "shown on the page",
                    "printed",
                    lineterm="",
                )
                problems.append(f"{where} printed something else:\n" + "\n".join(diff))
    assert not problems, "\n\n".join(problems)
    assert len(outcomes) == len(blocks)


def test_the_docs_have_code_to_run():
    # Guards against a parser change that silently finds nothing.
    assert len(PAGES_WITH_CODE) >= 10
    assert SLOW_PAGES <= {_name(page) for page in PAGES_WITH_CODE}, SLOW_PAGES
    assert sum(len(read_blocks(page)) for page in PAGES_WITH_CODE) >= 50


def test_block_conventions(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        textwrap.dedent(
            """\
            # A page

            ```python
            x = 1
            print(x + 1)
            ```

            ```text
            2
            ```

            Prose, then a text block that is not output:

            ```text
            a formula
            ```

            <!-- skip -->

            ```python
            raise RuntimeError("not run")
            ```

            - In a list:

                ```python
                print(x)
                ```
            """
        )
    )
    blocks = read_blocks(page)
    assert [(b.line, b.expected, b.skip) for b in blocks] == [
        (3, "2", False),
        (20, None, True),
        (26, None, False),
    ]
    assert blocks[2].code.strip() == "print(x)"
