"""`import attnflow` stays light, and the public surface is what it says it is."""

from __future__ import annotations

import ast
import functools
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attnflow
import attnflow.adapters

HEAVY = (
    "torch",
    "jax",
    "jaxlib",
    "flax",
    "tensorflow",
    "keras",
    "transformers",
    "timm",
    "matplotlib",
    "dask",
    "distributed",
    "igraph",
    "tqdm",
    "array_api_strict",
)


def test_import_and_numpy_rollout_import_no_framework() -> None:
    code = (
        "import sys, numpy as np, attnflow\n"
        "w = np.full((2, 3, 4, 5, 5), 0.2)\n"
        "attnflow.rollout(w, rows=0, layers='all'); attnflow.raw(w)\n"
        f"heavy = {HEAVY!r}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out


def test_public_api_is_sorted_and_documented() -> None:
    assert attnflow.__all__ == sorted(attnflow.__all__)
    public = {
        name
        for name, value in vars(attnflow).items()
        if not name.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
    }
    assert public == set(attnflow.__all__) - {"__version__"}
    for name in public:
        doc = inspect.getdoc(getattr(attnflow, name)) or ""
        sections = (
            ("Parameters", "Examples")
            if inspect.isclass(getattr(attnflow, name))
            else ("Parameters", "Returns", "References", "Examples")
        )
        for section in sections:
            assert section in doc, (name, section)


def test_signatures_follow_the_conventions() -> None:
    for name in ("rollout", "raw", "flow", "flow_cost", "fuse_heads", "add_residual"):
        parameters = list(inspect.signature(getattr(attnflow, name)).parameters.values())
        assert parameters[0].kind is inspect.Parameter.POSITIONAL_ONLY
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters[1:])
        assert parameters[-1].name == "xp"
        assert parameters[-1].default is None
    # The evaluation takes a model and its arrays positionally, options by keyword.
    arrays = {"blank_out": 2, "rank_correlation": 2, "comprehensiveness": 3}
    arrays |= {"sufficiency": 3, "deletion": 3, "insertion": 3}
    for name, count in arrays.items():
        parameters = list(inspect.signature(getattr(attnflow.evaluate, name)).parameters.values())
        kinds = [p.kind for p in parameters]
        assert kinds[:count] == [inspect.Parameter.POSITIONAL_ONLY] * count, name
        assert all(kind is inspect.Parameter.KEYWORD_ONLY for kind in kinds[count:]), name
        assert parameters[-1].name == "xp", name
        assert parameters[-1].default is None, name


def test_the_evaluation_names_moved_to_attnflow_evaluate_with_a_warning() -> None:
    # Before 0.1 the evaluation's names were at the top level too; they keep working there
    # for one release, warning, and are the very objects of attnflow.evaluate.
    import attnflow.evaluate

    moved = ["FaithfulnessReport", "ModelFunctions", "PerturbationCurve", "blank_out"]
    moved += ["comprehensiveness", "deletion", "faithfulness", "insertion"]
    moved += ["rank_correlation", "sufficiency"]
    for name in moved:
        assert name not in attnflow.__all__
        assert name in attnflow.evaluate.__all__
        with pytest.warns(DeprecationWarning, match=f"`attnflow.{name}` is renamed"):
            assert getattr(attnflow, name) is getattr(attnflow.evaluate, name)
    with pytest.raises(AttributeError, match="no attribute 'faithfulnes'"):
        attnflow.faithfulnes  # noqa: B018
    assert len(attnflow.__all__) <= 16  # the README's table, not the whole house


def test_the_readme_table_names_every_public_name() -> None:
    # A user learns the library from the README's table (issue 25.5): every name of
    # attnflow.__all__ is in it, as `attnflow.NAME` or beside its function as `NAME`.
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    table = readme.split("## What is in the box", 1)[1].split("\n\n", 2)[1]
    assert table.startswith("| |")
    public = [name for name in attnflow.__all__ if name != "__version__"]
    missing = [n for n in public if f"`{n}`" not in table and f"`attnflow.{n}`" not in table]
    assert not missing, f"README's table does not name {missing}"


def test_the_lab_is_not_in_the_package() -> None:
    # The paper's reproduction and the studies are the lab's own distribution
    # (lab/, attnflow_lab): neither attnflow._experiments nor attnflow.experiments exists.
    import importlib.util

    assert importlib.util.find_spec("attnflow._experiments") is None
    assert importlib.util.find_spec("attnflow.experiments") is None


def test_adapters_are_installed_as_a_subpackage() -> None:
    assert attnflow.adapters.__name__ == "attnflow.adapters"
    assert attnflow.adapters.__all__ == []


def _isort_key(name: str) -> tuple[int, list[int | str]]:
    """Ruff's RUF022 order: CONSTANTS, then CamelCase, then the rest, each naturally sorted."""
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[:1].isupper() else 2
    return kind, [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _bound_names(statements: list[ast.stmt]) -> set[str]:
    """The names a module's top level binds at run time (``if TYPE_CHECKING:`` excluded)."""
    names: set[str] = set()
    for node in statements:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                names |= _bound_names(node.body) | _bound_names(node.orelse)
        elif isinstance(node, ast.Try):
            names |= _bound_names(node.body + node.orelse + node.finalbody)
            names |= {n for h in node.handlers for n in _bound_names(h.body)}
        elif isinstance(node, ast.With):
            names |= _bound_names(node.body)
    return names


def _source_modules() -> list[Path]:
    """Every Python module of attnflow, its adapters, evaluation and integrations."""
    roots = [Path(attnflow.__file__).parent, Path(attnflow.adapters.__file__).parent]
    return sorted(path for root in roots for path in root.rglob("*.py"))


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The parsed source of `path`, parsed once for every test here (they only read it)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def test_every_module_has_a_sorted_all_of_names_it_defines() -> None:
    # Read from the source, not imported: the framework adapters and integrations are
    # checked in every session, whichever frameworks it has installed.
    modules = _source_modules()
    folders = {path.parent.name for path in modules}
    assert {"attnflow", "adapters", "evaluate", "integrations"} <= folders, folders
    for path in modules:
        tree = _tree(path)
        declared = [
            node
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            and "__all__" in {t.id for t in ast.walk(node) if isinstance(t, ast.Name)}
        ]
        assert len(declared) == 1, f"{path}: no single __all__"
        assert declared[0].value is not None, path
        names = ast.literal_eval(declared[0].value)
        assert isinstance(names, list | tuple), path
        assert list(names) == sorted(names, key=_isort_key), f"{path}: __all__ is not sorted"
        assert len(set(names)) == len(names), f"{path}: __all__ repeats a name"
        missing = set(names) - _bound_names(tree.body)
        assert not missing, f"{path}: __all__ names {sorted(missing)}, which it does not define"


def test_no_docstring_holds_a_control_character() -> None:
    # A backslash in a docstring that is not raw is an escape: `\alpha` becomes a bell and
    # `lpha`, `\f` a form feed, and Sphinx shows neither.
    control = {chr(c) for c in range(32)} - {"\n"}
    for path in _source_modules():
        tree = _tree(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                text = ast.get_docstring(node, clean=False) or ""
                found = sorted(control & set(text))
                name = getattr(node, "name", "the module")
                assert not found, f'{path}: the docstring of {name} holds {found} (use r""")'


def test_the_public_all_of_each_public_module_exists_at_run_time() -> None:
    import attnflow.data
    import attnflow.diagnosis
    import attnflow.evaluate
    import attnflow.explanation
    import attnflow.html
    import attnflow.plot

    public = (
        attnflow.data,
        attnflow.diagnosis,
        attnflow.evaluate,
        attnflow.explanation,
        attnflow.html,
        attnflow.plot,
    )
    for module in (attnflow, *public):
        assert list(module.__all__) == sorted(module.__all__, key=_isort_key), module
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, (module.__name__, missing)


def _module_name(path: Path) -> str:
    """``attnflow.x.y`` for a source file (the adapters install as attnflow.adapters)."""
    package = Path(attnflow.__file__).parent
    adapters = Path(attnflow.adapters.__file__).parent
    root, prefix = (
        (adapters, "attnflow.adapters")
        if path.is_relative_to(adapters)
        else (
            package,
            "attnflow",
        )
    )
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([prefix, *parts])


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The attnflow modules `path` imports, at module level or inside functions (not under
    ``if TYPE_CHECKING:``, which never runs).

    A function-level import is still an edge of the layering: it runs on the first call, and
    a cycle or an upward import through it is as real as one at the top of the file.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []  # ast.walk reads the children after this visit
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if node.module:  # `from . import _x` imports _x, not the package's body
                found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in known and module != name}


def test_module_imports_are_acyclic_and_the_core_never_imports_upwards() -> None:
    import graphlib

    modules = {_module_name(path): path for path in _source_modules()}
    known = set(modules)
    graph = {name: _imports(path, name, known) for name, path in modules.items()}
    assert graph["attnflow._flow"] >= {"attnflow._prepare"}  # the reader sees imports
    order = list(graphlib.TopologicalSorter(graph).static_order())  # CycleError on a cycle
    assert set(order) == known
    # The core (private modules of attnflow other than the command line) imports only
    # the core: never the evaluation, display, integrations, adapters or CLI.
    command_line = {"attnflow._demo", "attnflow.__main__"}
    core = {
        name
        for name in known
        if name.startswith("attnflow._")
        and not name.startswith("attnflow._cli")
        and name not in command_line
    }
    upward = {name: sorted(graph[name] - core) for name in core if graph[name] - core}
    assert not upward, upward
