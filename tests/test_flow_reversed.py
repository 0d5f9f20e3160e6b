"""Sinks solved on the reversed graph (issue 24): against igraph and the graph as it is.

On bidirectional attention whose flow crosses the sequence, with every row asked, the pairs
of the input tokens that take less than a row gives are solved from the sink on the
reversed graph (every arc turned around: the same max-flow). Every value must equal
igraph's on the whole graph and the unreversed solve's to 1e-12, and which pairs are
reversed must not depend on how the sinks were split into tasks.
"""

from __future__ import annotations

import numpy as np
import pytest
from flow_engines import kernel_and_igraph
from flow_engines import residual_mix as _mixed
from flow_engines import softmax as _softmax
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import PROFILE

import attnflow
import attnflow._maxflow as engine
from attnflow._maxflow import FlowTask, solve_flow_task_with_status

EXACT = 1e-12


def _attention(rng: np.random.Generator, layers: int, n: int, kind: str) -> np.ndarray:
    """Fused attention ``(L, n, n)``: bidirectional, local windows or causal."""
    logits = rng.normal(scale=2.0, size=(layers, n, n))
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    if kind == "local":
        logits = logits - 0.7 * distance
    if kind == "causal":
        logits = np.where(np.triu(np.ones((n, n), dtype=bool), k=1), -np.inf, logits)
    return _softmax(logits)


def _solve(mixed: np.ndarray, rows: np.ndarray, sinks: np.ndarray) -> tuple[np.ndarray, ...]:
    task = FlowTask((), mixed, rows, np.arange(rows.shape[0]), sinks)
    return solve_flow_task_with_status(task)


def _global(rng: np.random.Generator, layers: int, n: int) -> np.ndarray:
    """Bidirectional attention whose tokens 0 and n - 1 draw attention ([CLS], [SEP])."""
    logits = rng.normal(size=(layers, n, n))
    logits[..., [0, n - 1]] += 2.5
    return _softmax(logits)


def test_sinks_that_take_little_are_solved_on_the_reversed_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On bidirectional attention whose flow crosses the sequence, every row asked: the
    # sinks that take less than a row gives (all but the two drawing attention) are
    # solved from the sink on the reversed graph. The max-flows equal igraph's and those
    # of the graph as it is to 1e-12; with fewer rows than such sinks, or on local
    # windows or causal attention, nothing is reversed.
    n = 24
    mixed = _mixed(_global(np.random.default_rng(1), 6, n))
    graph = engine._prepared(mixed)
    assert graph.reverse_sinks is not None
    takes = mixed[0].sum(axis=0)
    np.testing.assert_array_equal(graph.reverse_sinks, takes < engine.REVERSE_BELOW)
    assert 2 <= np.count_nonzero(~graph.reverse_sinks) < n - 2
    turned = graph.reversed(mixed)
    np.testing.assert_array_equal(turned[0], mixed[-1].T)
    np.testing.assert_array_equal(turned[-1], mixed[0].T)
    calls: list[np.ndarray] = []
    one_way = engine._solve_one_way

    def recording(
        graph_mixed: np.ndarray, prepared: object, rows: np.ndarray, sinks: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        calls.append(graph_mixed)
        return one_way(graph_mixed, prepared, rows, sinks)  # type: ignore[arg-type]

    rows = np.arange(n)
    with monkeypatch.context() as patch:
        patch.setattr(engine, "_solve_one_way", recording)
        values, status = _solve(mixed, rows, np.arange(n))
        assert any(called is turned for called in calls)
        calls.clear()
        _solve(mixed, rows[:2], np.arange(n))  # fewer rows than sinks to reverse
        assert all(called is mixed for called in calls)
        for kind in ("local", "causal"):
            assert (
                engine._prepared(
                    _mixed(_attention(np.random.default_rng(2), 6, n, kind))
                ).reverse_sinks
                is None
            )
    reference = kernel_and_igraph(mixed, rows, monkeypatch)[2]
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    with monkeypatch.context() as patch:
        patch.setattr(engine, "REVERSED_ENTRIES", 0)
        as_is, as_is_status = _solve(mixed.copy(), rows, np.arange(n))
    np.testing.assert_allclose(values, as_is, atol=EXACT, rtol=0)
    assert np.all(status > 0)
    assert np.all(as_is_status > 0)


def test_reversed_sinks_do_not_depend_on_the_task_split() -> None:
    # Whether a pair is solved on the reversed graph depends on its sink, the graph and
    # the rows asked, never on how the sinks were split: threads equal one worker.
    weights = _global(np.random.default_rng(3), 5, 40)[:, None]
    serial = attnflow.flow(weights, normalize_result=False, n_jobs=1)
    threaded = attnflow.flow(weights, normalize_result=False, n_jobs=2)
    np.testing.assert_array_equal(threaded, serial)


@settings(parent=PROFILE, max_examples=30)
@given(
    seed=st.integers(0, 2**32 - 1),
    layers=st.integers(3, 6),
    n=st.integers(2, 12),
    residual=st.sampled_from([0.0, 0.3, 0.5, 0.8]),
    below=st.sampled_from([0.95, 10.0]),
    padded=st.booleans(),
)
def test_any_small_graph_on_the_reversed_graph_equals_igraph(
    seed: int, layers: int, n: int, residual: float, below: float, padded: bool
) -> None:
    # Any small bidirectional graph (a padded token: no arcs in or out), every row, the
    # sinks reversed as the rule says or all of them: igraph's max-flows, and those of
    # the graph as it is.
    mixed = _mixed(_global(np.random.default_rng(seed), layers, n), residual)
    if padded:
        mixed[:, n // 2, :] = 0.0
        mixed[:, :, n // 2] = 0.0
    rows = np.arange(n)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "REVERSE_BELOW", below)
        values, _ = _solve(mixed, rows, rows)
        reference = kernel_and_igraph(mixed, rows, patch)[2]
        patch.setattr(engine, "REVERSED_ENTRIES", 0)
        as_is, _ = _solve(mixed.copy(), rows, rows)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    np.testing.assert_allclose(values, as_is, atol=EXACT, rtol=0)
