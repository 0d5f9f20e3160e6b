"""The compiled max-flow solver on the attention patterns of real models, against igraph.

Every path of the engine (the flow stopped at its upper bound, the bound tightened, the
solver run to completion, the closed forms) must equal igraph's max-flow on the whole
reduced graph to 1e-12, and, on small graphs, the independent networkx oracle. The
patterns: the real MiniLM attention shipped with attnflow, the real digits ViT sample,
and synthetic attention sinks, low-rank, local-window and causal (GPT-2-like) attention.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from backends import selected_variants
from flow_engines import kernel_and_igraph
from flow_engines import softmax as _softmax
from oracle import oracle_flow

import attnflow
import attnflow._maxflow as engine
from attnflow._maxflow import CERTIFIED, SOLVED, FlowTask, solve_flow_task_with_status
from attnflow._sample import load_image_sample, load_sample

EXACT = 1e-12


def test_the_compiled_solver_is_built() -> None:
    # Every install builds it (setup.py); without it flow falls back to igraph, exact but
    # slow, and the tests below would not test the solver: fail, never skip.
    assert engine.KERNEL_AVAILABLE, "attnflow._maxflow_kernel is missing from the install"
    assert engine.ENGINE == "kernel"


@pytest.mark.parametrize("engine_name", ["kernel", "igraph"])
def test_solver_and_cost_model_follow_one_path_choice(
    engine_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's statuses say which path solved a task (closed forms report 0 for every
    # pair; a solver marks each pair it certified or solved), and the cost model prices a
    # task at the solver's fixed cost exactly when flow_path names a solver.
    import attnflow._flow as cost_model

    monkeypatch.setattr(engine, "ENGINE", engine_name)
    rng = np.random.default_rng(0)
    for n_layers, expected in [(1, "one_layer"), (2, "two_layers"), (3, engine_name)]:
        assert engine.flow_path(n_layers) == expected
        mixed = _mixed(_softmax(rng.normal(size=(n_layers, 2, 6, 6))))
        task = FlowTask((), mixed, np.arange(2), np.arange(2), np.arange(6))
        _, status = solve_flow_task_with_status(task)
        solver = expected in ("kernel", "igraph")
        assert bool(np.all(status > 0)) is solver
        assert bool(np.all(status == 0)) is not solver
        priced_as_solver = cost_model._solve_seconds(n_layers, 2, 6) >= cost_model.SECONDS_PER_TASK
        assert priced_as_solver is solver


def _mixed(weights: np.ndarray, residual: float = 0.5) -> np.ndarray:
    """``Ã_l = (1 - α) mean_h W_l + α I`` of one sequence ``(L, H, n, n)``."""
    n = weights.shape[-1]
    fused = weights.mean(axis=1)
    fused = fused / fused.sum(axis=-1, keepdims=True)
    return np.ascontiguousarray((1 - residual) * fused + residual * np.eye(n))


def _sinks(rng: np.random.Generator, layers: int, n: int) -> np.ndarray:
    logits = rng.normal(size=(layers, 4, n, n))
    logits[..., 0] += 5.0  # most mass on token 0, as [CLS]/[SEP]/BOS sinks take it
    return _softmax(logits)


def _low_rank(rng: np.random.Generator, layers: int, n: int) -> np.ndarray:
    queries, keys = rng.normal(size=(2, layers, 4, n, 3))
    return _softmax(2.0 * queries @ keys.swapaxes(-1, -2))


def _local(rng: np.random.Generator, layers: int, n: int) -> np.ndarray:
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    return _softmax(rng.normal(size=(layers, 4, n, n)) - 0.7 * distance)


def _causal(rng: np.random.Generator, layers: int, n: int) -> np.ndarray:
    logits = rng.normal(scale=2.0, size=(layers, 4, n, n))
    logits[..., 0] += 3.0  # BOS sink
    future = np.triu(np.ones((n, n), dtype=bool), k=1)
    return _softmax(np.where(future, -np.inf, logits))


PATTERNS: dict[str, Callable[[np.random.Generator, int, int], np.ndarray]] = {
    "sinks": _sinks,
    "low-rank": _low_rank,
    "local-window": _local,
    "causal": _causal,
}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_synthetic_patterns_equal_the_whole_graph_max_flow(
    pattern: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = PATTERNS[pattern](np.random.default_rng(7), 6, 40)
    values, status, reference = kernel_and_igraph(_mixed(weights), np.arange(40), monkeypatch)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    assert np.all(status[reference > 0] > 0)  # nothing carried (causal future): no solve


def test_local_windows_take_the_solver_to_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    # Strongly local attention has bottlenecks the tree bounds miss: the solver's flow
    # falls short of the bound and it runs to completion (backward arcs, later phases).
    weights = _local(np.random.default_rng(3), 8, 48)
    values, status, reference = kernel_and_igraph(_mixed(weights), np.array([0, 20]), monkeypatch)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    assert np.count_nonzero(status == SOLVED) > 0
    assert np.count_nonzero(status == CERTIFIED) > 0


@pytest.mark.parametrize("dead", ["padding", "causal"])
def test_layerings_around_dead_tokens_equal_igraph(
    dead: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A breadth-first layering stops reading the arcs into a layer once every live token
    # of it has a level; tokens that never reach the sink (padding: no arcs; the causal
    # future of the sink) are not waited for. Local windows take most pairs to completion.
    n = 36
    weights = _local(np.random.default_rng(11), 7, n)
    if dead == "padding":
        keep = np.ones(n, dtype=bool)
        keep[[3, 17, 18, 30]] = False
        weights = weights * keep
    else:
        keep = np.ones(n, dtype=bool)
        weights = np.where(np.triu(np.ones((n, n), dtype=bool), k=1), 0.0, weights)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    mixed = _mixed(weights)
    mixed[:, ~keep, :] = 0.0
    mixed[:, :, ~keep] = 0.0
    values, status, reference = kernel_and_igraph(mixed, np.array([0, 20, n - 1]), monkeypatch)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    assert np.count_nonzero(status == SOLVED) > 5
    assert np.all(values[:, ~keep] == 0.0)


def test_strongly_local_sinks_go_straight_to_backward_arcs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Once most pairs of a chunk of sinks needed backward arcs, the later chunks are solved
    # with them from the start (not first without them, then again): the same max-flows.
    # Dinic's path (graphs above PUSH_RELABEL_ENTRIES; push-relabel: test_flow_push_relabel).
    monkeypatch.setattr(engine, "PUSH_RELABEL_ENTRIES", 0)
    mixed = _mixed(_local(np.random.default_rng(5), 8, 48))
    rows = np.array([0, 20])
    values, status, reference = kernel_and_igraph(mixed, rows, monkeypatch)
    passes: list[bool] = []
    solve = engine._kernel_solve

    def recording(*args: object) -> None:
        passes.append(next(a for a in args if isinstance(a, bool)))
        solve(*args)

    with monkeypatch.context() as patch:
        patch.setattr(engine, "DEFERRAL_CHUNK", 4)
        patch.setattr(engine, "_kernel_solve", recording)
        task = FlowTask((), mixed, rows, np.arange(2), np.arange(48))
        chunked, chunked_status = solve_flow_task_with_status(task)
    assert passes.count(True) > 1
    assert passes.count(False) > 1
    np.testing.assert_allclose(chunked, reference, atol=EXACT, rtol=0)
    np.testing.assert_allclose(chunked, values, atol=EXACT, rtol=0)
    assert np.count_nonzero(chunked_status == SOLVED) >= np.count_nonzero(status == SOLVED)


def test_capacities_above_one_equal_igraph(monkeypatch: pytest.MonkeyPatch) -> None:
    # validate=False lets rows of capacities sum above one (unnormalised contributions,
    # scaled attention): the top-down bound must clamp each token at its own out-capacity,
    # not at 1, or the solver stops at a bound below the max-flow.
    rng = np.random.default_rng(5)
    for pattern in ("causal", "sinks"):
        mixed = _mixed(PATTERNS[pattern](rng, 4, 12)) * 1.7
        values, _, reference = kernel_and_igraph(mixed, np.array([0, 11]), monkeypatch)
        np.testing.assert_allclose(values, reference, rtol=0, atol=EXACT)
        assert reference.max() > 1.0  # the case the clamp at 1 got wrong


@pytest.mark.parametrize("push_relabel", [True, False])
def test_solver_run_to_completion_is_the_max_flow(
    push_relabel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A target out of reach forces every pair through every phase of the solver (the
    # bound tightened, then blocking flows on backward arcs until no path is left, or
    # push-relabel on graphs up to PUSH_RELABEL_ENTRIES).
    weights = _sinks(np.random.default_rng(5), 5, 30)
    monkeypatch.setattr(engine, "PUSH_RELABEL_ENTRIES", 2**19 if push_relabel else 0)
    monkeypatch.setattr(engine, "PUSH_RELABEL_REACH", np.inf)  # whatever the attention
    monkeypatch.setattr(engine, "TARGET_TOLERANCE", -1.0)
    values, status, reference = kernel_and_igraph(_mixed(weights), np.arange(30), monkeypatch)
    assert np.all(status == SOLVED)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)


def test_tightened_bound_is_reported_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Top-down bounds made useless (too high): the solver tightens them with the bottom-up
    # bound of each sink, and what it reports is still the max-flow.
    weights = _low_rank(np.random.default_rng(5), 5, 30)
    upper = engine._upper_bounds
    monkeypatch.setattr(engine, "_upper_bounds", lambda *a: upper(*a) + 0.5)
    values, status, reference = kernel_and_igraph(_mixed(weights), np.arange(30), monkeypatch)
    assert np.count_nonzero(status == CERTIFIED) > 0
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)


def _band(rng: np.random.Generator, layers: int, n: int) -> np.ndarray:
    """Banded attention with exact zeros outside a window of 2 tokens each side."""
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    logits = rng.normal(size=(layers, 4, n, n))
    return _softmax(np.where(distance > 2, -np.inf, logits))


def _bottom_up_bound(mixed: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The bottom-up tree bound of every pair, summed over every arc: ``(rows, n)``."""
    deliverable = mixed[0]  # column m: what each token of layer 1 delivers to sink m
    for layer in range(1, mixed.shape[0] - 1):
        deliverable = np.minimum(mixed[layer][:, :, None], deliverable[None]).sum(axis=1)
    return np.minimum(mixed[-1][rows][:, :, None], deliverable[None]).sum(axis=1)


@pytest.mark.parametrize("pattern", ["causal", "sparse-causal", "band"])
def test_bottom_up_bound_reads_only_what_reaches_the_sink(
    pattern: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Top-down bounds made useless (too high): every pair is bounded by the bottom-up tree
    # bound of its sink, which the solver sums over the rows that can reach the sink only,
    # ending a strength class of arcs at its first head that cannot (causal and banded
    # attention; what it leaves out is exactly 0). A pair certified at that bound reports
    # it: the bound summed over every arc; and every value is igraph's max-flow.
    make = {"causal": _causal, "sparse-causal": _sparse_causal, "band": _band}[pattern]
    mixed = _mixed(make(np.random.default_rng(11), 6, 24), 0.5)
    rows = np.array([0, 7, 12, 23])
    upper = engine._upper_bounds
    monkeypatch.setattr(engine, "_upper_bounds", lambda *a: upper(*a) + 0.5)
    values, status, reference = kernel_and_igraph(mixed, rows, monkeypatch)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    certified = status == CERTIFIED
    assert np.count_nonzero(certified & (reference > 0)) > 10
    bound = _bottom_up_bound(mixed, rows)
    np.testing.assert_allclose(values[certified], bound[certified], atol=1e-15, rtol=0)


@pytest.mark.parametrize("pattern", ["causal", "band"])
def test_layerings_skip_heads_that_cannot_reach_the_sink(
    pattern: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every pair solved to completion: each phase's breadth-first search ends a strength
    # class of a token's arcs at the first head that cannot reach the sink (causal and
    # banded attention, heads descending within a class). The levels, and so the flows,
    # are those of a search that reads every arc: igraph's max-flow on the whole graph.
    make = {"causal": _causal, "band": _band}[pattern]
    mixed = _mixed(make(np.random.default_rng(12), 6, 24), 0.3)
    assert engine._sorted_heads(engine._reach(mixed)[1]).all()
    monkeypatch.setattr(engine, "TARGET_TOLERANCE", -1.0)
    values, status, reference = kernel_and_igraph(mixed, np.array([23, 16, 9]), monkeypatch)
    assert np.all(status[reference > 0] == SOLVED)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)


def test_shipped_minilm_sample_every_row_every_layer() -> None:
    # Real pretrained MiniLM attention on three padded sentences: all rows, all layers,
    # against the independent networkx oracle and the igraph engine.
    sample = load_sample()
    weights = np.asarray(sample.attentions, dtype=np.float64)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    got = attnflow.flow(weights, mask=sample.mask, layers="all", normalize_result=False, n_jobs=1)
    expected = oracle_flow(
        weights, mask=sample.mask, layers="all", rows=[0, 4], normalize_result=False
    )
    np.testing.assert_allclose(got[..., [0, 4], :], expected, atol=1e-10, rtol=0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "ENGINE", "igraph")
        whole = attnflow.flow(
            weights, mask=sample.mask, layers="all", normalize_result=False, n_jobs=1
        )
    np.testing.assert_allclose(got, whole, atol=EXACT, rtol=0)


def test_shipped_vit_sample_cls_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    sample = load_image_sample()
    for recorded in np.asarray(sample.attentions, dtype=np.float64)[:3]:
        image = recorded / recorded.sum(axis=-1, keepdims=True)
        values, _, reference = kernel_and_igraph(_mixed(image), np.array([0]), monkeypatch)
        np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)


def test_threads_equal_serial_on_sinks() -> None:
    weights = _sinks(np.random.default_rng(11), 4, 50)
    serial = attnflow.flow(weights, rows=[0, 3, 9], normalize_result=False, n_jobs=1)
    threaded = attnflow.flow(weights, rows=[0, 3, 9], normalize_result=False, n_jobs=2)
    np.testing.assert_array_equal(threaded, serial)


def test_sinks_against_networkx() -> None:
    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.skip("once per matrix run, in the numpy session")
    weights = _sinks(np.random.default_rng(13), 5, 16)
    got = attnflow.flow(weights, rows=[0, 11], normalize_result=False, n_jobs=1)
    expected = oracle_flow(weights, rows=[0, 11], normalize_result=False)
    np.testing.assert_allclose(got, expected, atol=1e-10, rtol=0)


# --------------------------------------------------------------------------- causal graphs
# The engine prunes tokens that cannot reach the sink (reachability intervals), bounds each
# pair by the source arcs into tokens that may reach it, keeps only non-zero arcs, orders
# the backward arcs only for pairs that need them and shares one preparation between the
# tasks of a sequence. Each of these is checked on small random causal attention.


def _sparse_causal(rng: np.random.Generator, layers: int, n: int) -> np.ndarray:
    """Causal attention with exact zeros inside the causal part (sparse, top-k-like)."""
    weights = _causal(rng, layers, n)
    weights[rng.random(weights.shape) < 0.4] = 0.0
    weights[..., 0] += 1e-3  # every row keeps mass
    return weights / weights.sum(axis=-1, keepdims=True)


def _networkx_flows(mixed: np.ndarray, row: int) -> np.ndarray:
    """Max-flows from `row` at the top to every input token: networkx on the full graph."""
    import networkx as nx

    layers, n, _ = mixed.shape
    graph = nx.DiGraph()
    for layer in range(layers):
        for k, m in zip(*np.nonzero(mixed[layer] > 0), strict=True):
            graph.add_edge((layer + 1, int(k)), (layer, int(m)), capacity=mixed[layer, k, m])
    return np.array(
        [
            nx.maximum_flow_value(graph, (layers, row), (0, m)) if (0, m) in graph else 0.0
            for m in range(n)
        ]
    )


@pytest.mark.parametrize("residual", [0.5, 0.0])
@pytest.mark.parametrize("pattern", ["causal", "sparse-causal"])
def test_causal_last_row_equals_networkx(pattern: str, residual: float) -> None:
    # The decoder's case: the last row to every input token, against networkx on the full
    # layered graph (nothing reduced, nothing pruned), and against igraph on every row.
    rng = np.random.default_rng(21)
    make = _causal if pattern == "causal" else _sparse_causal
    for layers, n in [(3, 9), (6, 14)]:
        mixed = _mixed(make(rng, layers, n), residual)
        task = FlowTask((), mixed, np.array([n - 1]), np.array([0]), np.arange(n))
        values, status = solve_flow_task_with_status(task)
        np.testing.assert_allclose(values[0], _networkx_flows(mixed, n - 1), atol=EXACT, rtol=0)
        assert not np.any(status == engine.DEFERRED)


@pytest.mark.parametrize("pattern", ["causal", "sparse-causal"])
def test_causal_every_row_equals_igraph(pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    make = _causal if pattern == "causal" else _sparse_causal
    mixed = _mixed(make(np.random.default_rng(4), 7, 24), 0.3)
    values, _, reference = kernel_and_igraph(mixed, np.arange(24), monkeypatch)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)


@pytest.mark.parametrize("push_relabel", [True, False])
def test_causal_solved_to_completion_with_backward_arcs(
    push_relabel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An unreachable target: every pair is deferred by the first pass and solved again
    # with the backward arc lists (only non-zero arcs, sparse causal), to completion; or
    # by push-relabel (dense residuals, the zero arcs never carry flow).
    monkeypatch.setattr(engine, "PUSH_RELABEL_ENTRIES", 2**19 if push_relabel else 0)
    monkeypatch.setattr(engine, "PUSH_RELABEL_REACH", np.inf)  # whatever the attention
    mixed = _mixed(_sparse_causal(np.random.default_rng(8), 6, 20), 0.2)
    monkeypatch.setattr(engine, "TARGET_TOLERANCE", -1.0)
    values, status, reference = kernel_and_igraph(mixed, np.array([19, 12, 5]), monkeypatch)
    assert np.all(status[reference > 0] == SOLVED)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)


def test_backward_arcs_serve_later_sinks_outside_their_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Backward arcs are listed only into tokens that may reach the deferred sinks: tasks on
    # the same graph, the late sinks first, then earlier ones (the lists widen), all solved
    # to completion and equal to igraph; the lists hold exactly the arcs into those tokens
    # (Dinic's path: graphs above PUSH_RELABEL_ENTRIES).
    monkeypatch.setattr(engine, "PUSH_RELABEL_ENTRIES", 0)
    mixed = _mixed(_sparse_causal(np.random.default_rng(8), 6, 20), 0.2)
    monkeypatch.setattr(engine, "TARGET_TOLERANCE", -1.0)
    rows = np.array([19, 12])
    for sinks in (np.arange(14, 20), np.arange(9, 12), np.arange(0, 4)):
        task = FlowTask((), mixed, rows, np.arange(2), sinks)
        values, status = solve_flow_task_with_status(task)
        with monkeypatch.context() as patch:
            patch.setattr(engine, "ENGINE", "igraph")
            reference, _ = solve_flow_task_with_status(task)
        assert np.all(status[reference > 0] == SOLVED)
        np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
        graph = engine._prepared(mixed)
        low, high = graph._backward_sinks
        assert low <= sinks.min()
        assert sinks.max() <= high
        start, ids, tails = graph.backward(sinks)
        lo, hi = graph.reach
        for i in range(mixed.shape[0] - 2):
            for k in range(20):
                listed = ids[start[i, k] : start[i, k + 1]]
                kept = lo[i, k] <= high and hi[i, k] >= low
                into = np.flatnonzero(mixed[i + 1, :, k] > 0) if kept else []
                assert sorted(tails[start[i, k] : start[i, k + 1]]) == list(into)
                from_tails = tails[start[i, k] : start[i, k + 1]]
                assert np.all(
                    graph.arcs.head[engine._arc_ids(graph.arcs, i, listed, from_tails)] == k
                )


def test_reach_intervals_hold_every_reachable_token() -> None:
    # [lo, hi] of each node holds every input token it reaches, and lo and hi are reached
    # (the interval is the tightest one); a node that reaches nothing has lo > hi.
    rng = np.random.default_rng(2)
    mixed = _mixed(_sparse_causal(rng, 5, 12), 0.0)
    mixed[2, 7] = 0.0  # token 7 of layer 3 has no arc down
    lo, hi = engine._reach(mixed)
    reached = [np.eye(12, dtype=bool)]  # layer 0
    for layer in range(mixed.shape[0] - 1):
        reached.append((mixed[layer] > 0).astype(int) @ reached[-1].astype(int) > 0)
    for layer in range(1, mixed.shape[0]):
        for token in range(12):
            inputs = np.flatnonzero(reached[layer][token])
            if inputs.size == 0:
                assert lo[layer - 1, token] > hi[layer - 1, token]
            else:
                assert (lo[layer - 1, token], hi[layer - 1, token]) == (inputs[0], inputs[-1])
    assert lo[2, 7] > hi[2, 7]


def test_source_cut_is_an_upper_bound_and_tight_on_causal_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every bound is at least the max-flow; on causal attention the cheap bounds (into the
    # sink, out of the source) are the max-flow for most pairs.
    mixed = _mixed(_causal(np.random.default_rng(6), 6, 30), 0.5)
    rows = np.arange(30)
    _, _, reference = kernel_and_igraph(mixed, rows, monkeypatch)
    upper = engine._upper_bounds(mixed, rows, np.arange(30), engine._reach(mixed))
    assert np.all(upper >= reference - 1e-15)
    assert np.mean(np.abs(upper - reference) < 1e-13) > 0.5


def test_one_pass_scan_equals_the_numpy_reach_and_counts() -> None:
    # The compiled scan (reachability and arc counts in one pass) gives what the NumPy
    # reference gives, on causal attention with rows without arcs and on dense attention.
    rng = np.random.default_rng(4)
    causal = _mixed(_sparse_causal(rng, 5, 20), 0.0)
    causal[1, 3] = 0.0
    causal[3, 19] = 0.0
    dense = _mixed(_sinks(rng, 4, 17))
    for mixed in (causal, dense):
        lo, hi, counts = engine._scan(mixed)
        assert counts is not None
        reference = engine._scan(np.asfortranarray(mixed))  # not C-contiguous: NumPy
        assert reference[2] is None
        np.testing.assert_array_equal(lo, reference[0])
        np.testing.assert_array_equal(hi, reference[1])
        np.testing.assert_array_equal(counts, np.count_nonzero(mixed[1:-1] > 0, axis=-1))


@pytest.mark.parametrize("pattern", ["sinks", "causal"])
def test_first_pass_never_reads_the_dense_layers_arc_residuals(
    pattern: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first residual buffer is written with the arcs, all but the residuals of the arcs
    # of the dense layers, which first blocking flows read dense. Poisoned (NaN: an arc
    # read so would look saturated, and the pair would go on to backward arcs), they change
    # nothing where every pair is certified by a first blocking flow (attention sinks) and
    # stay untouched; where pairs need backward arcs (causal), every arc is written at its
    # capacity first, and the max-flows stay exact (Dinic's path: graphs above
    # PUSH_RELABEL_ENTRIES; push-relabel reads the matrices, not this buffer).
    monkeypatch.setattr(engine, "PUSH_RELABEL_ENTRIES", 0)
    rng = np.random.default_rng(6)
    weights = _sinks(rng, 6, 40) if pattern == "sinks" else _causal(rng, 6, 40)
    mixed = _mixed(weights)
    graph = engine._prepared(mixed)
    assert graph.dense_layers >= 1
    assert graph.lower_end > 0
    buffer = graph.take_buffer(mixed)
    assert not buffer.complete
    arcs = graph.arcs.head.shape[0]
    capacity = graph.arcs.capacities(mixed[1:-1])
    np.testing.assert_array_equal(buffer.array[graph.lower_end : arcs], capacity[graph.lower_end :])
    dense = buffer.array[arcs + 2 * 40 :].reshape(graph.dense_layers, 40, 40)
    np.testing.assert_array_equal(dense, mixed[1 : graph.dense_layers + 1])
    buffer.array[: graph.lower_end] = np.nan
    graph.give_back(buffer)
    values, status, reference = kernel_and_igraph(mixed, np.array([39]), monkeypatch)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    if pattern == "sinks":
        assert np.all(status == CERTIFIED)
        assert not buffer.complete
        assert np.isnan(buffer.array[: graph.lower_end]).all()
    else:
        assert np.any(status == SOLVED)
        assert buffer.complete
    graph.complete(buffer)
    np.testing.assert_array_equal(buffer.array[:arcs], capacity)


def test_last_heads_are_each_rows_last_non_zero_column() -> None:
    middle = _mixed(_sparse_causal(np.random.default_rng(5), 5, 16), 0.0)
    middle[0, 4] = 0.0  # rows without arcs: first, inside and last of a matrix
    middle[1, 0] = 0.0
    middle[2, 15] = 0.0
    arcs = engine._arcs(np.ascontiguousarray(middle))
    for layers in range(middle.shape[0] + 1):
        expected = [
            [np.flatnonzero(row > 0).max() if np.any(row > 0) else -1 for row in matrix]
            for matrix in middle[:layers]
        ]
        top = engine._last_heads(arcs, layers)
        assert top.shape == (layers, 16)
        assert top.tolist() == expected


def test_arc_lists_hold_each_row_non_zero_entries_strongest_first() -> None:
    middle = _mixed(_sparse_causal(np.random.default_rng(9), 4, 16), 0.0)
    middle[0, 3] *= 1e-30  # tiny capacities go to the last bucket, never lost
    arcs = engine._arcs(np.ascontiguousarray(middle))
    for i in range(middle.shape[0]):
        for j in range(16):
            part = slice(arcs.start[i, j], arcs.start[i, j + 1])
            heads = arcs.head[part].astype(np.int64)
            capacity = arcs.capacities(middle)[part]
            assert sorted(heads) == list(np.flatnonzero(middle[i, j] > 0))
            np.testing.assert_array_equal(capacity, middle[i, j, heads])
            exponents = np.minimum(np.frexp(capacity)[1], 1)
            classes = np.maximum(exponents, -61)
            assert np.all(np.diff(classes) <= 0)  # powers of two, down
            # within a power of two heads descend, and each class ends where it says
            ends = arcs.bucket_end[i, j]
            assert ends[-1] == heads.size
            assert np.all(np.diff(ends) >= 0)
            for first, last in zip(np.r_[0, ends[:-1]], ends, strict=True):
                assert np.all(np.diff(heads[first:last]) < 0)
                assert np.unique(classes[first:last]).size <= 1


def test_tasks_of_one_sequence_share_one_preparation() -> None:
    # Sinks split over tasks (as flow splits long problems) give the values of one task,
    # prepare the graph once, and the preparation goes when the array does.
    import gc

    mixed = _mixed(_causal(np.random.default_rng(10), 5, 26), 0.5)
    rows = np.array([25, 3])
    whole = solve_flow_task_with_status(FlowTask((), mixed, rows, rows, np.arange(26)))[0]
    built = []
    original = engine._Prepared.__init__

    def counting(self: engine._Prepared, array: np.ndarray) -> None:
        built.append(1)
        original(self, array)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine._Prepared, "__init__", counting)
        parts = [
            solve_flow_task_with_status(FlowTask((), mixed, rows, rows, sinks))[0]
            for sinks in np.array_split(np.arange(26), 4)
        ]
    assert len(built) == 0  # prepared by the first call already
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)
    assert any(entry.source() is mixed for entry in engine._PREPARED)
    del mixed
    gc.collect()
    assert all(entry.source() is not None for entry in engine._PREPARED)


def test_decoder_flow_through_the_public_call_equals_networkx() -> None:
    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.skip("once per matrix run, in the numpy session")
    weights = _causal(np.random.default_rng(12), 5, 12)
    got = attnflow.flow(weights, rows=-1, normalize_result=False, n_jobs=1)
    expected = oracle_flow(weights, rows=[11], normalize_result=False)[..., 0, :]
    np.testing.assert_allclose(got, expected, atol=1e-10, rtol=0)


# ----------------------------------------------------------- the kernel's search structures
# Heads descending within a strength class (a causal token's arcs into tokens that cannot
# reach the sink end each class: skipped), the lowest layers read dense through bit sets
# of the tokens still alive, and layer-2 tokens fanning out into layer 1: each must leave
# every max-flow exact, padded sequences and shallow graphs included.


@pytest.mark.parametrize("dense_layers", [1, 64])
@pytest.mark.parametrize("pattern", ["causal", "sparse-causal", "local-window"])
def test_dense_layers_and_fan_out_equal_igraph(
    pattern: str, dense_layers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    make = {"causal": _causal, "sparse-causal": _sparse_causal}.get(pattern) or PATTERNS[pattern]
    monkeypatch.setattr(engine, "DENSE_LAYERS", dense_layers)
    for layers, n in [(3, 70), (5, 66)]:  # more than 64 tokens: two words of bits
        mixed = _mixed(make(np.random.default_rng(layers + n), layers, n), 0.4)
        values, status, reference = kernel_and_igraph(mixed, np.array([n - 1, 40]), monkeypatch)
        np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
        assert np.all(status[reference > 0] > 0)


@pytest.mark.parametrize("padding", ["left", "right", "middle"])
def test_padded_causal_rows_equal_igraph(padding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Padded tokens reach nothing (an empty interval): with left padding the largest token
    # each token reaches still never decreases (dead heads end a class), otherwise not.
    n = 30
    weights = _causal(np.random.default_rng(3), 6, n)
    pad = {"left": np.arange(6), "right": np.arange(24, n), "middle": np.arange(12, 17)}[padding]
    weights[..., pad] = 0.0
    weights[..., pad, :] = 0.0
    real = np.setdiff1d(np.arange(n), pad)
    weights[..., real, real[0]] += 1e-3  # every real row keeps mass
    sums = weights.sum(axis=-1, keepdims=True)
    weights = np.divide(weights, sums, out=np.zeros_like(weights), where=sums > 0)
    fused = weights.mean(axis=1)
    mixed = np.ascontiguousarray(0.5 * fused + 0.5 * np.diag(np.isin(np.arange(n), real)))
    sorted_heads = engine._sorted_heads(engine._reach(mixed)[1])
    assert bool(sorted_heads.all()) is (padding == "left")
    rows = real[[-1, 3, 10]]
    values, _, reference = kernel_and_igraph(mixed, rows, monkeypatch)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    assert np.all(values[:, pad] == 0.0)


def test_prefetching_solver_on_a_graph_beyond_the_caches_equals_igraph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # From 16 MiB of residuals on, the solver prefetches: the arcs a source arc's token
    # takes down the layers (tokens whose strongest arc is their own: causal attention with
    # a residual), the dense row a path enters, the arcs a reset restores. Prefetches read
    # nothing the search would not: every max-flow stays exact.
    n = 720
    weights = _causal(np.random.default_rng(8), 5, n)[:, :1]  # one head: less memory
    mixed = _mixed(weights)
    graph = engine._prepared(mixed)
    buffer = graph.take_buffer(mixed)
    graph.give_back(buffer)
    assert buffer.array.nbytes >= 16 * 2**20
    task = FlowTask((), mixed, np.array([n - 1]), np.array([0]), np.array([0, 1, 400, n - 1]))
    values, status = solve_flow_task_with_status(task)
    with monkeypatch.context() as patch:
        patch.setattr(engine, "ENGINE", "igraph")
        reference, _ = solve_flow_task_with_status(task)
    np.testing.assert_allclose(values, reference, atol=EXACT, rtol=0)
    assert np.all(status[reference > 0] > 0)
