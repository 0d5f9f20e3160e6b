from __future__ import annotations

import os

import pytest
from backends import Variant, selected_variants


def pytest_report_header() -> list[str]:
    return ["attnflow backends: " + ", ".join(v.id for v in selected_variants())]


@pytest.fixture(scope="session", params=selected_variants(), ids=lambda v: v.id)
def backend(request: pytest.FixtureRequest) -> Variant:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session", params=["float32", "float64"])
def dtype_name(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A session that installs everything its tests need must not go green by skipping:
    # nox sets ATTNFLOW_FORBID_SKIPS there, and any skip fails the run.
    if not os.environ.get("ATTNFLOW_FORBID_SKIPS"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = [] if reporter is None else reporter.stats.get("skipped", [])
    if skipped and exitstatus == pytest.ExitCode.OK:
        reasons = sorted({str(report.longrepr[-1]) for report in skipped})[:5]
        print(f"\nATTNFLOW_FORBID_SKIPS: {len(skipped)} skipped ({'; '.join(reasons)})")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
