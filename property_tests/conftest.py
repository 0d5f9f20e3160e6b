from __future__ import annotations

from backends import selected_variants
from hypothesis import settings
from hypothesis_profiles import PROFILE_NAME

# The session-level guards (required modules, forbidden skips, at least one pass).
from session_checks import pytest_configure, pytest_sessionfinish  # noqa: F401

settings.load_profile(PROFILE_NAME)  # tests/hypothesis_profiles.py: ci, dev, thorough


def pytest_report_header() -> list[str]:
    return [
        "attnflow backends: " + ", ".join(v.id for v in selected_variants()),
        f"hypothesis profile: {settings.get_current_profile_name()}",
    ]
