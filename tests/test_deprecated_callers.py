"""The code users run (benchmarks, scripts, the docs' data scripts) uses no deprecated name.

``max_work`` (edge visits of the old flow engine) is replaced by ``max_seconds``, and warns
for one release; ``attnflow.experiments`` and ``attnflow._experiments`` are gone (the lab,
``lab/``, is a distribution of its own). A benchmark's baseline may run a revision older than ``max_seconds``: it
then picks the keyword the revision has, without passing ``max_work=`` literally.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_BY_USERS = (
    "benchmarks",
    "scripts",
    "docs/_data",
    "lab/attnflow_lab",
    "lab/protocols",
    "lab/scripts",
)
FILES = sorted(path for folder in RUN_BY_USERS for path in (ROOT / folder).rglob("*.py"))
DEPRECATED = {
    "max_work=": re.compile(r"\bmax_work\s*="),
    "attnflow.experiments": re.compile(
        r"\battnflow\.(_?)experiments\b|from attnflow import (_?)experiments"
    ),
}


@pytest.mark.skipif(not FILES, reason="a source checkout (benchmarks/, scripts/)")
@pytest.mark.parametrize("name", list(DEPRECATED))
def test_no_deprecated_name_in_the_code_users_run(name: str) -> None:
    pattern = DEPRECATED[name]
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in FILES
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == [], f"{name} is deprecated; found in {found}"


def test_the_check_finds_what_it_looks_for() -> None:
    assert DEPRECATED["max_work="].search("attnflow.flow(a, n_jobs=1, max_work=None)")
    assert not DEPRECATED["max_work="].search('limit = {"max_work": None}')
    assert DEPRECATED["attnflow.experiments"].search("from attnflow.experiments import x")
    assert DEPRECATED["attnflow.experiments"].search("from attnflow._experiments import x")
    assert not DEPRECATED["attnflow.experiments"].search("from attnflow_lab import x")
