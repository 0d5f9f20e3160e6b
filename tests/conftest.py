from __future__ import annotations

import pytest
from backends import Variant, selected_variants

# The session-level guards (required modules, forbidden skips, at least one pass) and the
# selection of a backend's own tests where it runs alone (ATTNFLOW_BACKEND_TESTS_ONLY).
from session_checks import (  # noqa: F401
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_sessionfinish,
)


def pytest_report_header() -> list[str]:
    return ["attnflow backends: " + ", ".join(v.id for v in selected_variants())]


@pytest.fixture(scope="session", params=selected_variants(), ids=lambda v: v.id)
def backend(request: pytest.FixtureRequest) -> Variant:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session", params=["float32", "float64"])
def dtype_name(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]
