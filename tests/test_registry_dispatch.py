"""The adapters follow the method registry: no method name is decided by a literal.

Every entry point branches on the spec's properties (``spec.gradients``,
``spec.value_aware``, ``spec.target_conditioned``...) of :data:`attnflow._methods.METHODS`,
so adding a method touches the registry and the function that computes it. This scans the
adapters' source with :mod:`ast` for a comparison (``==``, ``!=``, ``in``, ``not in``) of a
method (a name containing "method", or an attribute ``.method``/``.name``) with a method
name written as a literal, or a tuple, list or set of them.
"""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from attnflow._methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
SCANNED = sorted([*(ROOT / "adapters").glob("*.py"), *(ROOT / "attnflow").glob("_cli_*.py")])


def _is_method(node: ast.expr) -> bool:
    """A name containing "method", or an attribute ``.method``/``.name``/``..._method``."""
    if isinstance(node, ast.Name):
        return "method" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return node.attr in ("method", "name") or "method" in node.attr.lower()
    return False


def _method_literals(node: ast.expr) -> list[str]:
    """The method names written as literals in `node`: a str, or a tuple/list/set of str."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in METHODS else []
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        if len(values) == len(node.elts) and all(isinstance(v, str) for v in values):
            return [v for v in values if v in METHODS]
    return []


def literal_dispatch(source: str, filename: str = "<source>") -> list[str]:
    """Return ``line: code`` of every comparison of a method with literal method names."""
    tree = ast.parse(source, filename)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        if not all(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops):
            continue
        operands = [node.left, *node.comparators]
        if any(_is_method(o) for o in operands) and any(_method_literals(o) for o in operands):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_what_it_looks_for() -> None:
    # Its own oracle: each form it must catch, and what it must let pass.
    caught = [
        'method == "gradient_rollout"',
        'self.method != "norm"',
        'spec.name in ("norm", "globenc", "alti")',
        '"gradient_rollout" not in methods',
        'settings.method == "rollout"',
        'method in ["raw", "flow"]',
    ]
    for code in caught:
        assert literal_dispatch(code), code
    passed = [
        "spec.gradients",
        'engine == "sdpa"',  # not a method
        'method == "attention"',  # not a method name
        "method == LEADING",  # a constant, not a literal
        'name == "norm"',  # a loop variable: not named as a method
    ]
    for code in passed:
        assert not literal_dispatch(code), code


@pytest.mark.parametrize(
    "path",
    [pytest.param(path, id=path.relative_to(ROOT).as_posix()) for path in SCANNED],
)
def test_no_method_name_is_decided_by_a_literal(path: Path) -> None:
    found = literal_dispatch(path.read_text(encoding="utf-8"), str(path))
    assert not found, (
        f"{path.relative_to(ROOT)} compares a method with literal names; branch on the "
        "spec's properties (attnflow._methods.MethodSpec) instead:\n" + "\n".join(found)
    )


def test_the_adapters_method_type_lists_the_registry() -> None:
    # `Method` is for type checkers only; the code reads the registry.
    from attnflow.adapters import _common

    assert typing.get_args(_common.Method) == tuple(METHODS)
    assert tuple(_common.METHODS) == tuple(METHODS)
