from __future__ import annotations

import os

import pytest
from backends import Variant, selected_variants
from hypothesis import HealthCheck, settings

# The session-level guards (required modules, forbidden skips, at least one pass).
from session_checks import pytest_configure, pytest_sessionfinish  # noqa: F401

# `ci`: deterministic and reproducible (derandomized, no example database); `dev`: quick
# local runs; `thorough`: many examples, for a change to the maths.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("ATTNFLOW_HYPOTHESIS_PROFILE", "ci"))


def pytest_report_header() -> list[str]:
    return [
        "attnflow backends: " + ", ".join(v.id for v in selected_variants()),
        f"hypothesis profile: {settings.get_current_profile_name()}",
    ]


@pytest.fixture(scope="session", params=selected_variants(), ids=lambda v: v.id)
def backend(request: pytest.FixtureRequest) -> Variant:
    return request.param  # type: ignore[no-any-return]
