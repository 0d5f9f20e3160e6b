"""Push-relabel for strongly local attention (issue 24), against igraph and Dinic.

On graphs up to ``PUSH_RELABEL_ENTRIES`` middle capacities whose flow does not cross the
sequence (strongly local attention, where most first blocking flows miss their bound), the
pairs are solved by push-relabel on dense residuals (``solve_push_relabel``): its max-flows must equal igraph's on the whole graph
and Dinic's with backward arcs (the path of larger graphs) to 1e-12, with the same
statuses, and each pair's value must not depend on the other pairs of its call.
"""

from __future__ import annotations

import numpy as np
import pytest
from flow_engines import residual_mix as _mixed
from flow_engines import softmax as _softmax
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import PROFILE

import attnflow
import attnflow._maxflow as engine
from attnflow._maxflow import CERTIFIED, SOLVED, FlowTask, solve_flow_task_with_status

EXACT = 1e-12


def _banded(rng: np.random.Generator, layers: int, n: int, slope: float = 0.7) -> np.ndarray:
    """Fused local-window attention ``(L, n, n)``: logits ``N(0, 2²) - slope |i - j|``."""
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    return _softmax(rng.normal(scale=2.0, size=(layers, n, n)) - slope * distance)


def _solve(mixed: np.ndarray, rows: np.ndarray, sinks: np.ndarray) -> tuple[np.ndarray, ...]:
    task = FlowTask((), mixed, rows, np.arange(rows.shape[0]), sinks)
    return solve_flow_task_with_status(task)


def _igraph(mixed: np.ndarray, rows: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "ENGINE", "igraph")
        return _solve(mixed, rows, sinks)[0]


def _kernel(
    mixed: np.ndarray,
    rows: np.ndarray,
    sinks: np.ndarray,
    upper: np.ndarray,
    tolerance: float = engine.TARGET_TOLERANCE,
    global_every: int = 6,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Values, statuses and counters of ``solve_push_relabel`` called directly."""
    assert engine._kernel is not None
    graph = engine._prepared(mixed)
    values = np.zeros(upper.shape)
    status = np.zeros(upper.shape, dtype=np.int8)
    counters = np.zeros(4, dtype=np.int64)
    arcs = graph.arcs
    engine._kernel[5](
        mixed, graph.middle_t(mixed), graph.sink_columns, rows.astype(np.int64),
        sinks.astype(np.int64), np.ascontiguousarray(upper), arcs.start, arcs.head,
        arcs.bucket_end, graph.sorted_heads, *graph.reach, tolerance, values,
        status, arcs.self_base, arcs.capacity, counters, global_every,
    )  # fmt: skip
    return values, status, counters


def test_strongly_local_pairs_go_to_push_relabel_and_equal_igraph_and_dinic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Local windows: most pairs miss their bound, and every pair goes to push-relabel,
    # without first blocking flows. Values equal igraph's on the whole graph, and Dinic's
    # with backward arcs, with the same statuses.
    mixed = _mixed(_banded(np.random.default_rng(3), 8, 48))
    rows, sinks = np.array([0, 20]), np.arange(48)
    called: list[int] = []
    push_relabel = engine._push_relabel

    def recording(*args: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        called.append(args[3].size)
        return push_relabel(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "DEFERRAL_CHUNK", 4)
    with monkeypatch.context() as patch:
        patch.setattr(engine, "_push_relabel", recording)
        values, status = _solve(mixed, rows, sinks)
    assert sum(called) >= 24
    assert np.count_nonzero(status == SOLVED) >= 24
    np.testing.assert_allclose(values, _igraph(mixed, rows, sinks), atol=EXACT, rtol=0)
    with monkeypatch.context() as patch:
        patch.setattr(engine, "PUSH_RELABEL_ENTRIES", 0)
        dinic, dinic_status = _solve(mixed.copy(), rows, sinks)
    np.testing.assert_allclose(values, dinic, atol=1e-14, rtol=0)
    np.testing.assert_array_equal(status, dinic_status)
    # Every pair goes to push-relabel, those first blocking flows settle too: they report
    # Dinic's bound to the bit.
    assert sum(called) == sinks.size
    certified = status == CERTIFIED
    assert certified.any()
    np.testing.assert_array_equal(values[certified], dinic[certified])


def test_push_relabel_only_on_small_local_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    # The dense residuals cost (T-2) n² per pair: larger graphs keep Dinic's phases, and
    # so do graphs whose flow crosses the sequence (the few pairs left there take a phase
    # or two of Dinic's, cheaper than a push-relabel solve).
    mixed = _mixed(_banded(np.random.default_rng(4), 6, 20))
    assert engine._prepared(mixed).push_relabel
    crossing = _mixed(_banded(np.random.default_rng(4), 6, 20, slope=0.0))
    assert not engine._prepared(crossing).push_relabel
    monkeypatch.setattr(engine, "PUSH_RELABEL_ENTRIES", 4 * 20 * 20 - 1)
    other = mixed.copy()
    assert not engine._prepared(other).push_relabel
    monkeypatch.setattr(engine, "_push_relabel", None)  # never called
    values, _ = _solve(other, np.array([0]), np.arange(20))
    np.testing.assert_allclose(values, _igraph(other, np.array([0]), np.arange(20)), atol=EXACT)


@settings(PROFILE, max_examples=60)
@given(
    seed=st.integers(0, 2**31 - 1),
    layers=st.integers(3, 6),
    n=st.integers(1, 12),
    kind=st.sampled_from(["banded", "causal", "sparse", "dense", "above one"]),
    global_every=st.sampled_from([0, 1, 6]),
)
def test_push_relabel_to_completion_equals_igraph(
    seed: int, layers: int, n: int, kind: str, global_every: int
) -> None:
    # Unreachable targets (a negative tolerance): every pair is solved to completion,
    # on local, causal (zero arcs), sparse (zero rows: tokens that reach nothing) and
    # dense graphs, and capacities whose rows sum above one; with global relabellings
    # after every step, every node count of relabels, or the default.
    rng = np.random.default_rng(seed)
    mixed = _mixed(_banded(rng, layers, n, 0.0 if kind == "dense" else 0.7))
    if kind == "causal":
        mixed = np.ascontiguousarray(np.tril(mixed))
    if kind == "sparse":
        mixed = np.ascontiguousarray(mixed * (rng.random(mixed.shape) < 0.4))
    if kind == "above one":
        mixed = np.ascontiguousarray(mixed * 1.7)
    rows, sinks = np.arange(n), np.arange(n)
    upper = engine._upper_bounds(mixed, rows, sinks) + 1.0
    values, status, counters = _kernel(mixed, rows, sinks, upper, -1.0, global_every)
    reference = _igraph(mixed, rows, sinks)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    assert np.all(status == SOLVED)
    assert counters[0] >= np.count_nonzero(reference > 0)  # a push at least per pair with flow
    if global_every == 0 and counters[1] > 0:
        assert counters[2] > 0  # a global relabelling after each step that relabelled


def test_global_relabellings_leave_the_max_flows() -> None:
    # On a graph where the default count of relabels is reached, and with a global
    # relabelling after every step: the same max-flows as igraph's.
    mixed = _mixed(_banded(np.random.default_rng(3), 10, 30, 1.0))
    rows, sinks = np.array([11, 20]), np.arange(30)  # rows whose solves reach the default
    upper = engine._upper_bounds(mixed, rows, sinks) + 1.0
    reference = _igraph(mixed, rows, sinks)
    for every, some in ((6, sinks), (0, sinks[::7])):
        values, _, counters = _kernel(mixed, rows, some, upper[:, some], -1.0, every)
        np.testing.assert_allclose(values, reference[:, some], atol=EXACT, rtol=0)
        assert counters[2] > 0


def test_bound_reported_where_the_max_flow_reaches_it() -> None:
    # A pair whose max-flow reaches its bound within the tolerance reports the bound (the
    # search stops there); one that misses it, its bound tightened by the bottom-up tree
    # bound where that is lower, else the max-flow: the statuses and values of Dinic's.
    mixed = _mixed(_banded(np.random.default_rng(5), 5, 16))
    rows, sinks = np.array([0, 7]), np.arange(16)
    reference = _igraph(mixed, rows, sinks)
    exact_bound = reference.copy()
    values, status, _ = _kernel(mixed, rows, sinks, exact_bound)
    np.testing.assert_array_equal(values, exact_bound)
    assert np.all(status[reference > 0] == CERTIFIED)
    loose = engine._upper_bounds(mixed, rows, sinks) + 0.5
    values, status, _ = _kernel(mixed, rows, sinks, loose)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "PUSH_RELABEL_ENTRIES", 0)
        patch.setattr(engine, "_upper_bounds", lambda *a: loose)
        dinic, dinic_status = _solve(mixed.copy(), rows, sinks)
    np.testing.assert_array_equal(status, dinic_status)
    np.testing.assert_allclose(values, dinic, atol=1e-14, rtol=0)


def test_each_pair_is_its_own_solve() -> None:
    # A pair's value does not depend on the pairs solved before it in the same call (the
    # residuals, labels and the count between global relabellings start afresh).
    mixed = _mixed(_banded(np.random.default_rng(6), 6, 24))
    rows, sinks = np.array([0, 11, 23]), np.arange(24)
    upper = engine._upper_bounds(mixed, rows, sinks) + 1.0
    together, _, _ = _kernel(mixed, rows, sinks, upper)
    for i in range(3):
        for j in (0, 9, 23):
            alone, _, _ = _kernel(mixed, rows[i : i + 1], sinks[j : j + 1], upper[i : i + 1, [j]])
            assert alone[0, 0] == together[i, j]


def test_bad_shapes_are_refused_before_any_work() -> None:
    mixed = _mixed(_banded(np.random.default_rng(7), 4, 6))
    graph = engine._prepared(mixed)
    assert engine._kernel is not None
    arcs = graph.arcs
    values = np.zeros((1, 6))
    status = np.zeros((1, 6), dtype=np.int8)
    with pytest.raises(ValueError, match="middle_t"):
        engine._kernel[5](
            mixed, mixed[1:].copy(), graph.sink_columns, np.zeros(1, np.int64),
            np.arange(6, dtype=np.int64), np.ones((1, 6)), arcs.start, arcs.head,
            arcs.bucket_end, graph.sorted_heads, *graph.reach, 1e-13, values, status,
        )  # fmt: skip


def test_threads_equal_serial_where_push_relabel_solves() -> None:
    # Tasks split over threads (sinks split: chunks, deferrals and the switch to solving
    # later sinks directly fall differently) give the values of one worker to the bit.
    rng = np.random.default_rng(8)
    distance = np.abs(np.arange(40)[:, None] - np.arange(40)[None, :])
    weights = _softmax(rng.normal(scale=2.0, size=(6, 2, 40, 40)) - 0.7 * distance)
    serial = attnflow.flow(weights, rows=[0, 17], normalize_result=False, n_jobs=1)
    threaded = attnflow.flow(weights, rows=[0, 17], normalize_result=False, n_jobs=2)
    np.testing.assert_array_equal(threaded, serial)
    mixed = _mixed(weights.mean(axis=1))
    assert engine._prepared(mixed).push_relabel
    rows, sinks = np.array([0, 17]), np.arange(40)
    np.testing.assert_allclose(serial, _igraph(mixed, rows, sinks), atol=EXACT, rtol=0)
