"""The lab's test session: everything its tests need is installed, so a skip fails it.

``ATTNFLOW_LAB_FORBID_SKIPS=1`` (the lab's nox sessions set it) turns any skipped test
into a failed session, so that a missing install never lets the session go green empty.
"""

from __future__ import annotations

import os

import pytest

_SKIPPED: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _SKIPPED.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("ATTNFLOW_LAB_FORBID_SKIPS") == "1" and _SKIPPED:
        print(f"\n{len(_SKIPPED)} tests skipped where none may: {_SKIPPED[:5]}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
