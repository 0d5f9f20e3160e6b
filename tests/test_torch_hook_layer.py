"""The torch adapter watches a model through one hook layer and finds its attention one way.

Read from the sources, not imported, so that every session checks it whichever frameworks
it has: only ``adapters/_torch_hooks.py`` registers hooks, patches functions or
``forward`` methods, and walks a model's modules to tell attention from the rest.
"""

from __future__ import annotations

import ast
from pathlib import Path

import attnflow.adapters

ADAPTERS = Path(attnflow.adapters.__file__).parent
HOOK_LAYER = "_torch_hooks.py"
#: Registering a hook on a module or a tensor, in any of torch's spellings.
HOOK_METHODS = frozenset(
    {
        "register_forward_hook",
        "register_forward_pre_hook",
        "register_full_backward_hook",
        "register_full_backward_pre_hook",
        "register_backward_hook",
        "register_hook",
        "register_module_forward_hook",
        "register_module_forward_pre_hook",
    }
)
#: What tells attention modules apart while walking a model's modules.
ATTENTION_MARKS = frozenset({"__name__", "MultiheadAttention"})


def _torch_sources() -> dict[str, ast.Module]:
    paths = sorted([*ADAPTERS.glob("_torch_*.py"), ADAPTERS / "torch.py"])
    assert any(path.name == HOOK_LAYER for path in paths), paths
    return {path.name: ast.parse(path.read_text(encoding="utf-8")) for path in paths}


def _hooks_and_patches(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            function = node.func
            if isinstance(function, ast.Attribute) and function.attr in HOOK_METHODS:
                found.append(f"line {node.lineno}: .{function.attr}(...)")
            elif isinstance(function, ast.Name) and function.id in {"setattr", "delattr"}:
                found.append(f"line {node.lineno}: {function.id}(...)")
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.extend(
                f"line {node.lineno}: .forward = ..."
                for target in targets
                if isinstance(target, ast.Attribute) and target.attr == "forward"
            )
    return found


def _walks_modules(node: ast.AST) -> bool:
    """Whether a loop or comprehension iterates ``x.modules()`` or ``x.named_modules()``."""
    iterables: list[ast.expr] = []
    if isinstance(node, ast.For):
        iterables = [node.iter]
    elif isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
        iterables = [generator.iter for generator in node.generators]
    return any(
        isinstance(it, ast.Call)
        and isinstance(it.func, ast.Attribute)
        and it.func.attr in {"modules", "named_modules"}
        for it in iterables
    )


def _attention_finders(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not _walks_modules(node):
            continue
        for inner in ast.walk(node):
            mark = (
                inner.attr
                if isinstance(inner, ast.Attribute)
                else inner.id
                if isinstance(inner, ast.Name)
                else None
            )
            if mark in ATTENTION_MARKS:
                line = getattr(node, "lineno", "?")
                found.append(f"line {line}: a walk of the modules reading {mark}")
                break
    return found


def test_only_the_hook_layer_hooks_or_patches_a_model() -> None:
    sources = _torch_sources()
    assert _hooks_and_patches(sources[HOOK_LAYER])  # the check sees the layer's own
    old = "h = model.register_forward_pre_hook(f)\nblock.forward = g\nsetattr(F, 'x', y)"
    assert len(_hooks_and_patches(ast.parse(old))) == 3
    elsewhere = {
        name: found
        for name, tree in sources.items()
        if name != HOOK_LAYER and (found := _hooks_and_patches(tree))
    }
    assert not elsewhere, (
        f"hooks or patches outside {HOOK_LAYER}: {elsewhere}; install them through "
        "_torch_hooks.Hooks (before, after, on_gradient, patch, on_weights)"
    )


def test_only_the_hook_layer_finds_the_attention() -> None:
    sources = _torch_sources()
    old = (  # the finders this test replaced: by class name, by type, by attribute
        "a = [m for m in model.modules() if type(m).__name__ in SUPPORTED]\n"
        "for m in model.modules():\n    if isinstance(m, nn.MultiheadAttention): pass\n"
        "for name, m in model.named_modules():\n"
        "    if type(getattr(m, 'self_attn', None)).__name__ in names: pass\n"
    )
    assert len(_attention_finders(ast.parse(old))) == 3
    elsewhere = {
        name: found
        for name, tree in sources.items()
        if name != HOOK_LAYER and (found := _attention_finders(tree))
    }
    assert not elsewhere, (
        f"a second way of finding the attention outside {HOOK_LAYER}: {elsewhere}; use "
        "_torch_hooks.attention_sites (the blocks) or attention_modules"
    )
