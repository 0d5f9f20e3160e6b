"""The solver's self arcs set apart (issue 21 item 6), against igraph and the layout's own rules.

Where every middle token's strongest arc is its own (attention with a residual of 0.5 or
more), the compiled solver keeps the self arcs out of the per-token arc lists, token-major,
and tries each token's own arc first. Everything that reads edge ids must agree: the
first blocking flows (list and dense layers), the breadth-first layerings, the backward
arcs, the bottom-up bound and the resets. Every max-flow must equal igraph's on the whole
graph to 1e-12, where the layout is taken and where it is not (a self arc weaker than
another arc of its token); on causal attention, where the search order is unchanged, the
values equal the listed layout's to the last bit.
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
from oracle import oracle_flow

import attnflow
import attnflow._maxflow as engine
from attnflow._maxflow import SOLVED, FlowTask, solve_flow_task_with_status

EXACT = 1e-12


def _attention(rng: np.random.Generator, layers: int, n: int, causal: bool) -> np.ndarray:
    """Fused attention ``(L, n, n)`` with a BOS sink, causal or not."""
    logits = rng.normal(scale=2.0, size=(layers, n, n))
    logits[..., 0] += 2.0
    if causal:
        logits = np.where(np.triu(np.ones((n, n), dtype=bool), k=1), -np.inf, logits)
    return _softmax(logits)


def test_scan_says_whether_every_self_arc_is_the_strongest() -> None:
    # The compiled scan's answer equals the NumPy reference: true with a residual of 0.5
    # (ties included, and rows without arcs), false where one middle row has a stronger
    # arc than its own, or a zero self arc beside others; the first and the last matrix
    # (sink and source edges, never listed) do not count.
    rng = np.random.default_rng(0)
    mixed = _mixed(_attention(rng, 5, 12, causal=True), 0.5)
    cases = {"residual 0.5": (mixed, True)}
    tie = mixed.copy()
    tie[2, 6, 3] = tie[2, 6, 6]
    cases["a tie"] = (tie, True)
    padded = mixed.copy()
    padded[1:, 4] = 0.0
    cases["rows without arcs"] = (padded, True)
    weaker = mixed.copy()
    weaker[3, 9, 2] = np.nextafter(weaker[3, 9, 9], 2.0)
    cases["one stronger arc"] = (weaker, False)
    zero = mixed.copy()
    zero[2, 5, 5] = 0.0
    cases["a zero self arc"] = (zero, False)
    ends = _mixed(_attention(rng, 5, 12, causal=True), 0.5)
    ends[0, 3, 1] = ends[-1, 3, 1] = 2.0
    cases["first and last matrices"] = (ends, True)
    cases["residual 0.2"] = (_mixed(_attention(rng, 5, 12, causal=True), 0.2), False)
    for name, (graph, expected) in cases.items():
        assert engine._scan_layers(graph)[3] is expected, name
        assert engine._scan_layers(np.asfortranarray(graph))[3] is expected, name  # NumPy
        assert engine._self_strongest(graph[1:-1]) is expected, name


def test_self_arcs_apart_hold_every_entry_once() -> None:
    # Each row's listed arcs are its non-zero entries but the diagonal, strongest first by
    # powers of two (heads descending within one), and the diagonal is the self arc
    # `self_base + j L + i`; the backward lists hold every arc into a token, self arcs
    # included, in the order of their tails; the last heads count the self arcs.
    middle = _mixed(_attention(np.random.default_rng(1), 4, 16, causal=False), 0.6)
    middle[1, 5] = 0.0  # a row without arcs (its self arc has capacity 0)
    arcs = engine._arcs(middle, self_arcs=True)
    capacities = arcs.capacities(middle)
    n_mats, n = middle.shape[:2]
    assert arcs.self_base == arcs.start[-1, -1]
    assert arcs.head.shape[0] == arcs.self_base + n_mats * n
    for i in range(n_mats):
        for j in range(n):
            part = slice(arcs.start[i, j], arcs.start[i, j + 1])
            heads, capacity = arcs.head[part].astype(int), capacities[part]
            expected = [k for k in np.flatnonzero(middle[i, j] > 0) if k != j]
            assert sorted(heads) == expected
            np.testing.assert_array_equal(capacity, middle[i, j, heads])
            exponents = np.frexp(capacity)[1]
            assert np.all(np.diff(exponents) <= 0)
            for e in np.unique(exponents):
                assert np.all(np.diff(heads[exponents == e]) < 0)
            own = arcs.self_base + j * n_mats + i
            assert arcs.head[own] == j
            assert capacities[own] == middle[i, j, j]
    top = engine._last_heads(arcs, 3)
    expected_top = [
        [np.flatnonzero(row > 0).max() if np.any(row > 0) else -1 for row in matrix]
        for matrix in middle[:3]
    ]
    assert top.tolist() == expected_top
    listed = engine._arcs(middle)
    reach = engine._reach(np.concatenate([middle[:1], middle, middle[:1]]))
    with_self = engine._backward_arcs(arcs, reach, 0, n - 1)
    without = engine._backward_arcs(listed, reach, 0, n - 1)
    for i in range(n_mats):
        for k in range(n):
            entries = with_self[1][with_self[0][i, k] : with_self[0][i, k + 1]]
            tails = with_self[2][with_self[0][i, k] : with_self[0][i, k + 1]].astype(int)
            ids = engine._arc_ids(arcs, i, entries, tails)
            assert np.all(arcs.head[ids] == k)
            np.testing.assert_array_equal(capacities[ids], middle[i, tails, k])
            reference_tails = without[2][without[0][i, k] : without[0][i, k + 1]]
            own = [k] if middle[i, k, k] == 0 else []  # a zero self arc is listed apart
            assert sorted(tails) == sorted(list(reference_tails) + own)
            assert np.all(np.diff(tails) > 0)  # by tail, as without the layout


@pytest.mark.parametrize("residual", [0.5, 0.8])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dense_layers", [1, 12])
@pytest.mark.parametrize("complete", [False, True])
@pytest.mark.parametrize("copied", [True, False])
def test_self_arcs_apart_equal_igraph(
    residual: float,
    causal: bool,
    dense_layers: int,
    complete: bool,
    copied: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every path of the solver on the layout: certified first blocking flows (dense and
    # listed layers), and with a negative tolerance every pair run to completion (later
    # layerings, backward arcs, the bottom-up bound, resets between pairs), with the arcs'
    # copy of their capacities (small graphs) and without it (read from the matrices).
    monkeypatch.setattr(engine, "DENSE_LAYERS", dense_layers)
    monkeypatch.setattr(engine, "ARC_CAPACITIES_BYTES", 2**30 if copied else 0)
    if complete:
        monkeypatch.setattr(engine, "TARGET_TOLERANCE", -1.0)
    mixed = _mixed(_attention(np.random.default_rng(2), 7, 24, causal), residual)
    arcs = engine._prepared(mixed).arcs
    assert arcs.self_base >= 0
    assert (arcs.capacity is not None) is copied
    if arcs.capacity is not None:
        np.testing.assert_array_equal(arcs.capacity, arcs.capacities(mixed[1:-1]))
    rows = np.array([23, 17, 9, 0])
    values, status, reference = kernel_and_igraph(mixed, rows, monkeypatch)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    if complete:
        assert np.all(status[reference > 0] == SOLVED)


@pytest.mark.parametrize("residual", [0.0, 0.3])
@pytest.mark.parametrize("copied", [True, False])
def test_graphs_whose_self_arcs_are_not_strongest_keep_the_lists(
    residual: float, copied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where one token's self arc is weaker than another of its arcs, every arc stays in
    # the lists (the layout of before), and the max-flows equal igraph's.
    monkeypatch.setattr(engine, "ARC_CAPACITIES_BYTES", 2**30 if copied else 0)
    monkeypatch.setattr(engine, "TARGET_TOLERANCE", -1.0)  # backward arcs too
    mixed = _mixed(_attention(np.random.default_rng(3), 6, 20, causal=True), residual)
    weaker = _mixed(_attention(np.random.default_rng(4), 6, 20, causal=True), 0.5)
    weaker[2, 11, 4] = 0.9  # one stronger arc than token 11's own
    for graph in (mixed, weaker):
        arcs = engine._prepared(graph).arcs
        assert arcs.self_base == -1
        assert arcs.head.shape[0] == np.count_nonzero(graph[1:-1] > 0)
        values, _, reference = kernel_and_igraph(graph, np.array([19, 11]), monkeypatch)
        np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)


def test_causal_values_equal_the_listed_layout_to_the_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    # On causal attention a token's own arc led its list (the strongest, the largest head
    # of its class): the search is the same step for step, and so are the values.
    mixed = _mixed(_attention(np.random.default_rng(5), 8, 40, causal=True), 0.5)
    rows = np.array([39, 30, 21])
    task = FlowTask((), mixed, rows, np.arange(3), np.arange(40))
    apart, _ = solve_flow_task_with_status(task)
    assert engine._prepared(mixed).arcs.self_base >= 0
    listed = mixed.copy()  # another array: prepared anew
    scan = engine._scan_layers
    monkeypatch.setattr(engine, "_scan_layers", lambda m: (*scan(m)[:3], False))
    values, _ = solve_flow_task_with_status(FlowTask((), listed, rows, np.arange(3), np.arange(40)))
    assert engine._prepared(listed).arcs.self_base == -1
    np.testing.assert_array_equal(apart, values)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_public_flow_on_causal_attention_equals_the_paper_oracle(dtype: type) -> None:
    # attnflow.flow with its defaults (residual 0.5: the layout is taken) against the
    # networkx oracle of the paper, float32 and float64 input.
    attention = _attention(np.random.default_rng(6), 5, 9, causal=True)[:, None].astype(dtype)
    result = attnflow.flow(attention, rows=[-1, 4], n_jobs=1)
    expected = oracle_flow(attention.astype(np.float64), rows=[-1, 4])
    np.testing.assert_allclose(result, expected, atol=1e-6 if dtype == np.float32 else EXACT)


@settings(parent=PROFILE, max_examples=40)
@given(
    seed=st.integers(0, 2**32 - 1),
    layers=st.integers(3, 6),
    n=st.integers(2, 9),
    residual=st.sampled_from([0.0, 0.2, 0.45, 0.5, 0.7, 1.0]),
    causal=st.booleans(),
    zero_row=st.booleans(),
    complete=st.booleans(),
    copied=st.booleans(),
)
def test_any_small_graph_equals_igraph(
    seed: int,
    layers: int,
    n: int,
    residual: float,
    causal: bool,
    zero_row: bool,
    complete: bool,
    copied: bool,
) -> None:
    # Any small graph, with the layout or without (taken exactly when every middle token's
    # self arc is its strongest), certified or run to completion, with the arcs' copy of
    # their capacities or without: igraph's max-flows.
    mixed = _mixed(_attention(np.random.default_rng(seed), layers, n, causal), residual)
    if zero_row:
        mixed[1:, n // 2] = 0.0  # a token with no arc down from layer 2 on
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "ARC_CAPACITIES_BYTES", 2**30 if copied else 0)
        if complete:
            patch.setattr(engine, "TARGET_TOLERANCE", -1.0)
        apart = engine._prepared(mixed).arcs.self_base >= 0
        assert apart is engine._self_strongest(mixed[1:-1])
        values, _, reference = kernel_and_igraph(mixed, np.arange(n), patch)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)


def test_too_many_tokens_for_the_solver_fail_before_any_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tokens are 16-bit in the solver's arcs: a longer sequence is refused, naming the
    # limit and the length, before anything is built.
    monkeypatch.setattr(engine, "MAX_TOKENS", 11)
    mixed = _mixed(_attention(np.random.default_rng(7), 4, 12, causal=True), 0.5)
    scans: list[int] = []
    monkeypatch.setattr(engine, "_scan_layers", lambda m: scans.append(1))
    with pytest.raises(ValueError, match=r"at most 11 tokens a sequence, got 12"):
        engine._Prepared(mixed)
    assert not scans


@pytest.mark.parametrize("copied", [True, False])
def test_a_second_residual_buffer_is_written_from_the_matrices(
    copied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # While one buffer is out (another thread's), a solve takes a new one, written from the
    # matrices (`fill_residuals`): its arcs at their capacities (the dense layers' when
    # backward arcs need them), and its max-flows igraph's, certified or run to completion.
    monkeypatch.setattr(engine, "ARC_CAPACITIES_BYTES", 2**30 if copied else 0)
    mixed = _mixed(_attention(np.random.default_rng(8), 7, 30, causal=True), 0.5)
    graph = engine._prepared(mixed)
    held = graph.take_buffer(mixed)
    second = graph.take_buffer(mixed)
    arcs = graph.arcs.head.shape[0]
    capacity = graph.arcs.capacities(mixed[1:-1])
    listed = slice(graph.lower_end, graph.arcs.self_base)
    np.testing.assert_array_equal(second.array[listed], capacity[listed])
    np.testing.assert_array_equal(graph.complete(second)[:arcs], capacity)
    graph.give_back(second)
    for tolerance in (engine.TARGET_TOLERANCE, -1.0):
        monkeypatch.setattr(engine, "TARGET_TOLERANCE", tolerance)
        values, _, reference = kernel_and_igraph(mixed, np.array([29, 20]), monkeypatch)
        np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    graph.give_back(held)
