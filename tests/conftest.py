from __future__ import annotations

import os
from pathlib import Path

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
    # A session that installs everything some tests need must not go green by skipping
    # them: nox sets ATTNFLOW_FORBID_SKIPS to those tests' paths (comma-separated path
    # prefixes, or "1" for all), and a skip there fails the run.
    forbidden = [p for p in os.environ.get("ATTNFLOW_FORBID_SKIPS", "").split(",") if p]
    if not forbidden:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = [] if reporter is None else reporter.stats.get("skipped", [])
    root = session.config.rootpath

    def where(report: pytest.TestReport) -> str:
        path = Path(str(report.longrepr[0]))
        path = path if path.is_absolute() else root / path
        return (
            path.resolve().relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
        )

    offending = [
        report
        for report in skipped
        if forbidden == ["1"] or where(report).startswith(tuple(forbidden))
    ]
    if offending and exitstatus == pytest.ExitCode.OK:
        reasons = sorted({f"{r.longrepr[0]}: {r.longrepr[-1]}" for r in offending})[:5]
        print(f"\nATTNFLOW_FORBID_SKIPS: {len(offending)} skipped ({'; '.join(reasons)})")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
