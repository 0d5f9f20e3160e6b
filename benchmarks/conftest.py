"""The benchmark suite's harness: each timed function against a baseline timed in the same run.

A benchmark calls ``compare(function, baseline)``: pytest-benchmark times `function`
(``rounds`` calls after a warm-up), then the same number of calls of `baseline` are timed
here, right after, in the same process. The ratio of the two medians is what a run
reports (``extra_info["ratio"]`` in ``--benchmark-json``, and a table at the end of the
run): on a shared machine absolute times move with the load, a ratio to a baseline timed
alongside moves much less. Each benchmark checks the two results agree first, so a timing
is never of a wrong answer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest

_RESULTS: list[tuple[str, str, float, float]] = []


@pytest.fixture
def compare(benchmark: Any, request: pytest.FixtureRequest) -> Callable[..., tuple[Any, Any]]:
    """Return ``compare(function, baseline, *, label, rounds=5)`` -> both results."""

    def run(
        function: Callable[[], Any],
        baseline: Callable[[], Any],
        *,
        label: str,
        rounds: int = 5,
    ) -> tuple[Any, Any]:
        result = benchmark.pedantic(function, rounds=rounds, iterations=1, warmup_rounds=1)
        expected = baseline()  # its warm-up, and the result the benchmark checks
        seconds = []
        for _ in range(rounds):
            start = time.perf_counter()
            baseline()
            seconds.append(time.perf_counter() - start)
        base = statistics.median(seconds)
        stats = getattr(benchmark, "stats", None)
        if stats is not None:  # None under --benchmark-disable (one call, no timing)
            own = stats.stats.median
            benchmark.extra_info.update(baseline=label, baseline_median_s=base, ratio=own / base)
            _RESULTS.append((request.node.name, label, own, base))
        return result, expected

    return run


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _RESULTS:
        return
    write = terminalreporter.write_line
    write("")
    write("attnflow against its baselines (medians, same run; ratio < 1: attnflow faster)")
    width = max(len(name) for name, *_ in _RESULTS)
    for name, label, own, base in _RESULTS:
        write(
            f"{name:<{width}}  {own * 1e3:10.2f} ms  {base * 1e3:10.2f} ms  "
            f"ratio {own / base:7.3f}  (baseline: {label})"
        )
