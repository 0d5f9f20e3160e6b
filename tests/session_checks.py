"""Checks that keep a test session from going green without testing anything.

Shared by ``tests/conftest.py`` and ``property_tests/conftest.py``; each check is switched
on by an environment variable that ``noxfile.py`` sets:

- ``ATTNFLOW_REQUIRE_MODULES``: comma-separated modules the session installed (a framework
  and its model libraries). If one cannot be imported the run stops before collecting
  anything, so a failed install cannot turn module-level ``importorskip`` calls into a
  green session of skips.
- ``ATTNFLOW_FORBID_SKIPS``: comma-separated path prefixes (or "1" for all) where a skip
  fails the run: the session installs everything those tests need.
- ``ATTNFLOW_REQUIRE_PASSES``: "1" fails a run in which no test passed (all skipped, or
  all deselected).
- ``ATTNFLOW_BACKEND_TESTS_ONLY``: "1" keeps only the tests of the session's backends: those
  that take the ``backend`` fixture, and those marked ``with_backend(library, ...)`` for one
  of the session's libraries (a Dask-cluster test, say). It is set where one backend runs
  alone (TensorFlow, the local per-backend cells): the backend-free tests run once, in
  the default ``tests`` session, not again in every backend's session.
- ``ATTNFLOW_JIT_DTYPES``: comma-separated dtypes (``float32``) to which the ``jax.jit``
  cells of the matrix are kept; the others are deselected. Tracing does not depend on the
  dtype (no path of the core branches on it), and every dtype still runs eagerly on JAX,
  so the default ``tests`` session compiles each program once, not once per dtype: XLA's
  compilations are most of that session's time. Unset: every cell.
- ``ATTNFLOW_BACKEND_FREE_ONLY``: "1" keeps only the tests that take no ``backend`` fixture
  and carry no ``with_backend`` marker. ``tests`` runs them in a pytest process of their
  own, without the multithreaded frameworks loaded: several of them fork (a browser, worker
  processes), which JAX, once imported, warns against.

Under pytest-xdist (nox runs the long sessions with ``-n auto``) the selection runs in
every worker, which all collect the same tests, and the guards on skips and passes run in
the controlling process, which receives every worker's reports.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

__all__ = ["pytest_collection_modifyitems", "pytest_configure", "pytest_sessionfinish"]


def _listed(variable: str) -> list[str]:
    return [part.strip() for part in os.environ.get(variable, "").split(",") if part.strip()]


def pytest_configure(config: pytest.Config) -> None:
    missing = []
    for name in _listed("ATTNFLOW_REQUIRE_MODULES"):
        try:
            importlib.import_module(name)
        except ImportError as error:
            missing.append(f"{name} ({error})")
    if missing:
        msg = (
            f"ATTNFLOW_REQUIRE_MODULES: this session requires {', '.join(missing)}, which "
            "cannot be imported; its tests would all be skipped. Fix the install."
        )
        raise pytest.UsageError(msg)


# The longest scopes of the parallel runs, measured (CI logs, 2 workers), started first:
# pytest-xdist's loadscope hands scopes out in collection order, and one of these
# collected last keeps a worker busy for a minute after the other has finished.
HEAVY_FIRST = (
    "tests/adapters/test_doc_examples.py::TestLLMsPage",
    "tests/llm/test_convert.py",
    "tests/adapters/test_doc_examples.py::TestPages",
    "tests/adapters/test_doc_examples.py::TestReadme",
    "tests/test_rollout_backend_properties.py",
    "tests/test_causal_cache.py",
    "tests/test_gradient_rollout.py",
    "tests/test_rollout.py",
    "tests/test_variants.py",
    "tests/test_causal.py",
    "tests/test_encoder_decoder.py",
)


def _rank(item: pytest.Item) -> int:
    """Where `item`'s scope comes in HEAVY_FIRST (after every listed one if it is not)."""
    node = item.nodeid
    for rank, prefix in enumerate(HEAVY_FIRST):
        if node.startswith(prefix + "::") or node == prefix:
            return rank
    return len(HEAVY_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The same order in every worker (a stable sort of the same collection), heavy first.
    items.sort(key=_rank)
    _keep_jit_dtypes(config, items)
    backend_only = os.environ.get("ATTNFLOW_BACKEND_TESTS_ONLY") == "1"
    free_only = os.environ.get("ATTNFLOW_BACKEND_FREE_ONLY") == "1"
    if backend_only and free_only:
        msg = "ATTNFLOW_BACKEND_TESTS_ONLY and ATTNFLOW_BACKEND_FREE_ONLY together select nothing."
        raise pytest.UsageError(msg)
    if not (backend_only or free_only):
        return
    from backends import selected_variants

    libraries = {variant.library for variant in selected_variants()}
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("with_backend")
        takes_backend = "backend" in getattr(item, "fixturenames", ())
        if free_only:
            ours = not takes_backend and marker is None
        else:
            ours = takes_backend or (marker is not None and bool(libraries & set(marker.args)))
        (kept if ours else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _keep_jit_dtypes(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the ``jax.jit`` cells of dtypes outside ``ATTNFLOW_JIT_DTYPES``."""
    allowed = _listed("ATTNFLOW_JIT_DTYPES")
    if not allowed:
        return
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        variant, dtype = params.get("backend"), params.get("dtype_name")
        jitted = bool(getattr(variant, "jit", False))
        (dropped if jitted and dtype is not None and dtype not in allowed else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _skipped_where(report: pytest.TestReport, root: Path) -> str:
    path = Path(str(report.longrepr[0]))  # type: ignore[index]
    path = path if path.is_absolute() else root / path
    return path.resolve().relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus != pytest.ExitCode.OK:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = {} if reporter is None else reporter.stats
    forbidden = _listed("ATTNFLOW_FORBID_SKIPS")
    if forbidden:
        root = session.config.rootpath
        offending = [
            report
            for report in stats.get("skipped", [])
            if forbidden == ["1"] or _skipped_where(report, root).startswith(tuple(forbidden))
        ]
        if offending:
            reasons = sorted({f"{r.longrepr[0]}: {r.longrepr[-1]}" for r in offending})[:5]
            print(f"\nATTNFLOW_FORBID_SKIPS: {len(offending)} skipped ({'; '.join(reasons)})")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            return
    if os.environ.get("ATTNFLOW_REQUIRE_PASSES") == "1":
        passed = len([r for r in stats.get("passed", []) if r.when == "call"])
        if session.testscollected == 0 or passed == 0:
            print(
                f"\nATTNFLOW_REQUIRE_PASSES: {session.testscollected} test(s) collected, "
                f"{passed} passed; a session must run at least one test"
            )
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
