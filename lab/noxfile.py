#!/usr/bin/env python3
"""The lab's sessions (``cd lab && nox``), outside attnflow's default matrix.

``lab`` installs attnflow from this repository (``..``), the lab, PyTorch (CPU),
transformers and the shipped MiniLM, then runs every lab test and example;
``lab-fast`` runs the tests that train nothing (the data generators, the reports, the
check that the lab imports no private attnflow name) on NumPy only, with the lab
installed without its dependencies' extras. A skipped test fails both sessions: what
they need is installed.
"""

# /// script
# dependencies = ["nox>=2025.2"]
# ///

from __future__ import annotations

import nox

nox.needs_version = ">=2025.2"
nox.options.default_venv_backend = "virtualenv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lab"]

TORCH = "torch==2.13.0"  # the CPU build; an unpinned torch pulls GBs of CUDA packages
TESTS = ["pytest>=8.3", "hypothesis>=6.100", "scipy>=1.11", "tqdm>=4.66"]
ENV = {
    "PYTHONSAFEPATH": "1",
    "PYTHONHASHSEED": "0",
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "ATTNFLOW_LAB_FORBID_SKIPS": "1",
}
# No training run, no model: the generators, their checks, the reports' text.
FAST = [
    "tests/test_public_imports.py",
    "tests/test_agreement.py",
    "tests/test_agreement_linzen.py",
    "tests/test_sentiment.py",
]


@nox.session
def lab(session: nox.Session) -> None:
    """Every lab test and example, with PyTorch, transformers and the shipped MiniLM."""
    session.install("--no-compile", TORCH, *TESTS, "..[torch,plot,progress]", ".[sentiment]")
    session.run("pytest", *session.posargs, env=ENV)
    session.run("pytest", "--doctest-modules", "--pyargs", "attnflow_lab", env=ENV)


@nox.session(name="lab-fast")
def lab_fast(session: nox.Session) -> None:
    """The lab's tests that train nothing: NumPy only (no PyTorch installed)."""
    session.install("--no-compile", *TESTS, "..")
    session.install("--no-compile", "--no-deps", ".")  # its torch extra is not needed here
    session.run("pytest", *FAST, *session.posargs, env=ENV)
