"""attnflow and attnflow.integrations import no toolkit: only the submodules do."""

from __future__ import annotations

import subprocess
import sys


def test_package_imports_no_toolkit() -> None:
    code = (
        "import sys, attnflow, attnflow.integrations; "
        "print(sorted(m for m in ('torch', 'inseq', 'captum', 'quantus', 'transformers') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
