"""The test suite's own guards can fail: a session cannot go green by testing nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from backends import Variant

_TESTS = Path(__file__).parent


_GUARDS = "from session_checks import pytest_configure, pytest_sessionfinish  # noqa: F401\n"


def _run_pytest(
    folder: Path, *args: str, conftest: str = _GUARDS, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run pytest on `folder` (a conftest using tests/session_checks.py) with `env` set.

    Without the installed plugins (hypothesis, pytest-benchmark, ...): the guards need
    none of them, and loading them was three quarters of each run's start-up. xdist is
    loaded where a run asks for workers.
    """
    (folder / "conftest.py").write_text(conftest)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ATTNFLOW_")}
    plugins = ["-p", "xdist.plugin"] if "-n" in args else []
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *plugins,
            *args,
            str(folder),
        ],
        env={**clean, "PYTHONPATH": str(_TESTS), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **env},
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def adapter_skipped(tmp_path: Path) -> Path:
    # A session whose framework failed to install: the adapter module skips as a whole
    # (module-level importorskip) while the session's other tests pass.
    (tmp_path / "test_adapter.py").write_text(
        "import pytest\n"
        "pytest.importorskip('attnflow_no_such_framework')\n"
        "def test_model():\n    pass\n"
    )
    (tmp_path / "test_other.py").write_text("def test_other():\n    pass\n")
    return tmp_path


def test_a_session_of_skips_is_green_without_the_guards(adapter_skipped: Path) -> None:
    assert _run_pytest(adapter_skipped).returncode == 0


def test_a_missing_required_module_fails_the_session(adapter_skipped: Path) -> None:
    run = _run_pytest(adapter_skipped, ATTNFLOW_REQUIRE_MODULES="attnflow_no_such_framework")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "attnflow_no_such_framework" in run.stdout + run.stderr


def test_a_forbidden_skip_fails_the_session(adapter_skipped: Path) -> None:
    run = _run_pytest(adapter_skipped, ATTNFLOW_FORBID_SKIPS="test_adapter.py")
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout + run.stderr


def test_a_session_where_nothing_passed_fails(tmp_path: Path) -> None:
    # Every test collected, every test skipped: pytest itself exits 0.
    (tmp_path / "test_all_skip.py").write_text(
        "import pytest\ndef test_model():\n    pytest.importorskip('attnflow_no_such_framework')\n"
    )
    assert _run_pytest(tmp_path).returncode == 0
    run = _run_pytest(tmp_path, ATTNFLOW_REQUIRE_PASSES="1")
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout + run.stderr
    assert "ATTNFLOW_REQUIRE_PASSES" in run.stdout


def test_the_guards_hold_across_xdist_workers(adapter_skipped: Path) -> None:
    # nox runs the long sessions under pytest-xdist (-n auto): the skips and passes of the
    # workers must reach the guards, which run in the controlling process.
    run = _run_pytest(adapter_skipped, "-n", "2", ATTNFLOW_FORBID_SKIPS="test_adapter.py")
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout + run.stderr
    assert "ATTNFLOW_FORBID_SKIPS: 1 skipped" in run.stdout, run.stdout
    assert "bringing up nodes" in run.stdout, run.stdout  # it ran under xdist


def test_a_session_with_a_pass_stays_green(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    run = _run_pytest(tmp_path, ATTNFLOW_REQUIRE_PASSES="1", ATTNFLOW_REQUIRE_MODULES="numpy")
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.fixture
def mixed_tests(tmp_path: Path) -> Path:
    # Backend tests, backend-free tests, and backend-free tests marked for one backend.
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    with_backend(*libraries): runs with these backends\n"
    )
    (tmp_path / "test_mixed.py").write_text(
        "import pytest\n"
        "def test_free():\n    pass\n"
        "def test_on(backend):\n    pass\n"
        "@pytest.mark.with_backend('numpy')\ndef test_numpy_marked():\n    pass\n"
        "@pytest.mark.with_backend('torch', 'dask')\ndef test_others_marked():\n    pass\n"
    )
    return tmp_path


_MATRIX_CONFTEST = (
    "import pytest\n"
    "from backends import selected_variants\n"
    "from session_checks import (  # noqa: F401\n"
    "    pytest_collection_modifyitems, pytest_configure, pytest_sessionfinish,\n"
    ")\n"
    "@pytest.fixture(params=selected_variants(), ids=lambda v: v.id)\n"
    "def backend(request):\n    return request.param\n"
)


def _ran(run: subprocess.CompletedProcess[str]) -> set[str]:
    return {line.split("::")[-1] for line in run.stdout.splitlines() if "::" in line}


def test_where_a_backend_runs_alone_only_its_tests_run(mixed_tests: Path) -> None:
    run = _run_pytest(
        mixed_tests,
        "--collect-only",
        conftest=_MATRIX_CONFTEST,
        ATTNFLOW_TEST_BACKENDS="numpy",
        ATTNFLOW_BACKEND_TESTS_ONLY="1",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert _ran(run) == {"test_on[numpy]", "test_numpy_marked"}, run.stdout
    assert "2 deselected" in run.stdout, run.stdout


def test_without_the_switch_every_test_runs(mixed_tests: Path) -> None:
    run = _run_pytest(
        mixed_tests, "--collect-only", conftest=_MATRIX_CONFTEST, ATTNFLOW_TEST_BACKENDS="numpy"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    expected = {"test_free", "test_on[numpy]", "test_numpy_marked", "test_others_marked"}
    assert _ran(run) == expected, run.stdout


def test_a_backend_session_left_with_nothing_fails(tmp_path: Path) -> None:
    # Every test deselected (none takes `backend`): the session must not go green empty.
    (tmp_path / "test_free.py").write_text("def test_free():\n    pass\n")
    run = _run_pytest(
        tmp_path,
        conftest=_MATRIX_CONFTEST,
        ATTNFLOW_TEST_BACKENDS="numpy",
        ATTNFLOW_BACKEND_TESTS_ONLY="1",
        ATTNFLOW_REQUIRE_PASSES="1",
    )
    assert run.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, run.stdout + run.stderr
    assert "1 deselected" in run.stdout, run.stdout


def test_array_api_strict_check_refuses_a_numpy_result() -> None:
    # The library check of the array_api_strict cell must be able to fail.
    xp = pytest.importorskip("array_api_strict")
    variant = Variant(
        "array_api_strict", "array_api_strict", xp.Device("CPU_DEVICE"), modules={"xp": xp}
    )
    good = xp.asarray(np.zeros(2))
    variant.check(good, dtype_name="float64", shape=(2,))
    with pytest.raises(AssertionError):
        variant.check(np.zeros(2), dtype_name="float64", shape=(2,))
