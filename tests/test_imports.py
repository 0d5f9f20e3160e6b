"""`import attnflow` stays light, and the public surface is what it says it is."""

from __future__ import annotations

import inspect
import subprocess
import sys

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
        parameters = list(inspect.signature(getattr(attnflow, name)).parameters.values())
        kinds = [p.kind for p in parameters]
        assert kinds[:count] == [inspect.Parameter.POSITIONAL_ONLY] * count, name
        assert all(kind is inspect.Parameter.KEYWORD_ONLY for kind in kinds[count:]), name
        assert parameters[-1].name == "xp", name
        assert parameters[-1].default is None, name


def test_adapters_are_installed_as_a_subpackage() -> None:
    assert attnflow.adapters.__name__ == "attnflow.adapters"
    assert attnflow.adapters.__all__ == []
