"""The lab uses attnflow as a user does: no private module or name of attnflow is imported.

Every ``import attnflow...`` and ``from attnflow... import name`` in the lab's package,
protocols, scripts and tests is read from the source (AST, function-level imports
included); a module path or a name with a leading underscore is a private one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    path
    for folder in ("attnflow_lab", "protocols", "scripts", "tests")
    for path in (LAB / folder).rglob("*.py")
)


def private_imports(source: str) -> list[str]:
    """Return each import of a private attnflow module or name in `source`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            names = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] != "attnflow":
                continue
            if any(part.startswith("_") for part in parts) or any(
                name.startswith("_") for name in names
            ):
                found.append((node.lineno, f"line {node.lineno}: {module} {names or ''}".strip()))
    return [text for _, text in sorted(found)]


def test_the_check_finds_private_imports() -> None:
    source = (
        "import attnflow\nfrom attnflow.evaluate import faithfulness\n"
        "def f():\n    from attnflow._atomic import write_atomically\n"
        "from attnflow.evaluate import _markdown\nimport attnflow.adapters._torch_llm\n"
        "from attnflow_lab._atomic import write_atomically\n"
    )
    assert private_imports(source) == [
        "line 4: attnflow._atomic ['write_atomically']",
        "line 5: attnflow.evaluate ['_markdown']",
        "line 6: attnflow.adapters._torch_llm",
    ]


def test_sources_are_found() -> None:
    assert len(SOURCES) > 20
    assert LAB / "attnflow_lab" / "value_aware.py" in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(LAB)))
def test_the_lab_imports_no_private_attnflow_name(path: Path) -> None:
    assert private_imports(path.read_text(encoding="utf-8")) == []
