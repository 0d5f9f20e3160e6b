"""The documentation's Markdown pages: no broken tables, no code inside maths, no missing files.

The docs session builds the site with warnings as errors, but Sphinx accepts a table row
without a table (it renders as a paragraph of pipes), backticks inside ``$...$`` (MathJax
typesets them as backticks) and an include or image of a file that was never written
(MyST warns only for some). These checks read the sources, so they run in every session.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)

pytestmark = pytest.mark.skipif(not DOCS.is_dir(), reason="the docs are not in this checkout")


def _prose(text: str) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, numbered from 1."""
    kept, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            kept.append((number, line))
    return kept


def _blocks(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Runs of consecutive lines that start with a pipe (Markdown tables, or broken ones)."""
    blocks: list[list[tuple[int, str]]] = []
    previous = None
    for number, line in lines:
        if not line.startswith("|"):
            continue
        if previous is not None and number == previous + 1:
            blocks[-1].append((number, line))
        else:
            blocks.append([(number, line)])
        previous = number
    return blocks


def _cells(line: str) -> int:
    return len(re.sub(r"\\\|", "", line).strip().strip("|").split("|"))


def test_the_pages_are_found() -> None:
    assert len(PAGES) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_table_is_a_table(page: Path) -> None:
    for block in _blocks(_prose(page.read_text(encoding="utf-8"))):
        first = block[0][0]
        assert len(block) >= 3, f"{page.name}:{first}: a table row without a table"
        separator = block[1][1]
        assert re.fullmatch(r"\|?(\s*:?-{3,}:?\s*\|)+\s*:?-*:?\s*\|?", separator.strip()), (
            f"{page.name}:{first}: no header separator under the first row"
        )
        width = _cells(block[0][1])
        for number, line in block:
            assert _cells(line) == width, f"{page.name}:{number}: {_cells(line)} cells, not {width}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_no_code_inside_maths(page: Path) -> None:
    text = "\n".join(line for _, line in _prose(page.read_text(encoding="utf-8")))
    spans = re.findall(r"\$\$.*?\$\$", text, flags=re.DOTALL)  # display maths
    text = re.sub(r"\$\$.*?\$\$", "", text, flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code may hold dollars
    spans += re.findall(r"\$[^$\n]+\$", text)
    for span in spans:
        assert "`" not in span, f"{page.name}: backticks inside maths: {span[:80]!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_included_file_and_figure_exists(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    targets = re.findall(r"```\{(?:include|image|figure)\}\s+(\S+)", text)
    targets += re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    for target in targets:
        if "://" in target:
            continue
        assert (page.parent / target).is_file(), f"{page.name}: {target} does not exist"


# Pages are for users: one concise page per subject (dated logs live in lab/reports), and no
# reference a reader cannot open (the project's issue numbers). Included files (_data/) are
# read as part of their page.
OWN_PAGES = [p for p in PAGES if "_data" not in p.parts]
PAGE_LIMIT = 40_000  # bytes


@pytest.mark.parametrize("page", OWN_PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_page_is_at_most_40_kb(page: Path) -> None:
    size = len(page.read_bytes())
    assert size <= PAGE_LIMIT, f"{page.name}: {size:,} bytes; split it or move history to lab/"


ISSUE = re.compile(r"\b[Ii]ssues? \d|\([Ii]ssue \d")


def test_the_issue_check_finds_issue_numbers() -> None:
    assert ISSUE.search("as measured for issue 23.")
    assert ISSUE.search("(issue 24, third round)")
    assert not ISSUE.search("vit-explain issue #6, an issue of another project")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_no_page_cites_an_issue_number(page: Path) -> None:
    found = [
        f"{page.name}:{number}"
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if ISSUE.search(line)
    ]
    assert found == [], f"issue numbers in {found}"
