"""Encoder-decoder attention flow (issue 9, item 4, "with flow wherever the variant is
defined on a graph") against the independent networkx oracle of ``oracle.py``, on every
backend of the matrix, with masks and batches; closed forms and properties; messages.

Since issue 25 (item 3) it runs on flow's engine: the graph laid out in layers, solved by
the compiled solver (every path of it: the flow stopped at its bound, run to completion,
igraph), priced by flow's cost model and run by flow's runner (threads, executors, lost
workers). Those tests are at the end.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from backends import Variant, tolerance
from oracle import oracle_encoder_decoder_flow, softmax_attention

import attnflow
import attnflow._encoder_decoder_flow as ed_flow
import attnflow._maxflow as engine
from attnflow._encoder_decoder_graph import decoder_capacities, source_capacities

EXACT = 1e-12  # float64: equal to the independent max-flow within 1e-12, as for flow

BATCH, L_E, L_D, H, S, T = 2, 2, 2, 2, 5, 4
SOURCE_MASK = np.array([[True] * S, [False] + [True] * 3 + [False]])
TARGET_MASK = np.array([[True] * T, [True] * 3 + [False]])


def _causal(weights: np.ndarray) -> np.ndarray:
    lower = np.tril(np.ones(weights.shape[-2:], bool))
    weights = np.where(lower, weights, 0.0)
    return weights / weights.sum(axis=-1, keepdims=True)


@functools.cache
def _inputs(dtype_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(20261124)
    encoder = softmax_attention(rng, (BATCH, L_E, H, S, S), scale=2.0)
    decoder = _causal(softmax_attention(rng, (BATCH, L_D, H, T, T), scale=2.0))
    cross = softmax_attention(rng, (BATCH, L_D, H, T, S), scale=2.0)
    return encoder.astype(dtype_name), decoder.astype(dtype_name), cross.astype(dtype_name)


def _shapes(options: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lead: tuple[int, ...] = (BATCH, L_D) if options.get("layers") == "all" else (BATCH,)
    rows = options.get("rows")
    middle: tuple[int, ...] = (
        (T,) if rows is None else () if isinstance(rows, int) else (len(rows),)
    )
    return (*lead, *middle, S), (*lead, *middle, T)


CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "raw": {"normalize_result": False},
    "rows=0,layers=all": {"rows": 0, "layers": "all"},
    "rows=[3,1],raw": {"rows": [3, 1], "normalize_result": False},
    "layers=0,residual=0.2": {"layers": 0, "residual": 0.2, "normalize_result": False},
}


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_networkx_oracle(
    backend: Variant, dtype_name: str, case: str, masked: bool
) -> None:
    options = CASES[case]
    arrays = _inputs(dtype_name)
    native = [backend.asarray(x) for x in arrays]
    masks = {"source_mask": SOURCE_MASK, "target_mask": TARGET_MASK} if masked else {}
    native_masks = {name: backend.asarray(m) for name, m in masks.items()}
    if backend.jit:
        jax = backend.modules["jax"]
        with pytest.raises(TypeError, match=r"outside `jax\.jit`"):
            jax.jit(lambda *a: tuple(attnflow.encoder_decoder_flow(*a, **options)))(*native)
        return
    source, target = attnflow.encoder_decoder_flow(*native, **native_masks, **options)
    source_shape, target_shape = _shapes(options)
    got_s = backend.check(source, dtype_name=dtype_name, shape=source_shape)
    got_t = backend.check(target, dtype_name=dtype_name, shape=target_shape)
    want_s, want_t = oracle_encoder_decoder_flow(
        *(x.astype(np.float64) for x in arrays), **masks, **options
    )
    tol = EXACT if dtype_name == "float64" else tolerance(dtype_name)
    rtol = 0.0 if dtype_name == "float64" else tol
    np.testing.assert_allclose(got_s, want_s, rtol=rtol, atol=tol)
    np.testing.assert_allclose(got_t, want_t, rtol=rtol, atol=tol)
    if masked and "rows" not in options:  # padding gets nothing and carries nothing
        assert np.all(got_s[1, ..., 0] == 0)
        assert np.all(got_s[1, ..., 4] == 0)
        assert np.all(got_s[1, ..., 3, :] == 0)
        assert np.all(got_t[1, ..., 3, :] == 0)
        assert np.all(got_t[1, ..., 3] == 0)


def test_one_layer_each_is_the_closed_form() -> None:
    # x_1[t] -> x_0[u] is one edge; x_1[t] -> e_1[s'] -> e_0[s] are parallel paths.
    encoder, decoder, cross = (x[0, :1] for x in _inputs("float64"))
    for alpha in (0.0, 0.3, 0.5, 1.0):
        source, target = attnflow.encoder_decoder_flow(
            encoder, decoder, cross, residual=alpha, normalize_result=False
        )
        e = (1 - alpha) * encoder[0].mean(0) + alpha * np.eye(S)
        d = alpha * ((1 - alpha) * decoder[0].mean(0) + alpha * np.eye(T))
        c = (1 - alpha) * cross[0].mean(0)
        paths = np.minimum(c[:, :, None], e[None, :, :]).sum(axis=1)  # (T, S)
        np.testing.assert_allclose(source, paths, atol=1e-14)
        np.testing.assert_allclose(target, d, atol=1e-14)


def test_full_residual_attributes_each_position_to_itself() -> None:
    source, target = attnflow.encoder_decoder_flow(*_inputs("float64"), residual=1.0)
    assert np.all(source == 0)
    np.testing.assert_array_equal(target, np.broadcast_to(np.eye(T), target.shape))


def test_raw_flow_is_at_most_one_and_layers_all_repeats_each_layer() -> None:
    arrays = _inputs("float64")
    every = attnflow.encoder_decoder_flow(*arrays, layers="all", normalize_result=False)
    # Each max-flow is at most the capacity out of x_l[t], which is one (each token is
    # its own problem: the values of a row are not shares of one unit).
    assert np.all(every.source <= 1 + 1e-12)
    assert np.all(every.target <= 1 + 1e-12)
    assert np.all(every.source >= 0)
    assert np.all(every.target >= 0)
    for layer in range(L_D):
        one = attnflow.encoder_decoder_flow(*arrays, layers=layer, normalize_result=False)
        np.testing.assert_array_equal(one.source, every.source[:, layer])
        np.testing.assert_array_equal(one.target, every.target[:, layer])


def test_causal_decoder_flows_only_to_earlier_positions() -> None:
    _, target = attnflow.encoder_decoder_flow(*_inputs("float64"), layers="all")
    upper = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(target[..., upper] == 0)


def test_fused_input_equals_the_mean_over_heads() -> None:
    arrays = _inputs("float64")
    fused = attnflow.encoder_decoder_flow(*(x.mean(axis=-3) for x in arrays), heads=None)
    plain = attnflow.encoder_decoder_flow(*arrays)
    for got, expected in zip(fused, plain, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-14)


def test_nan_input_without_validation_gives_nan_not_a_guess() -> None:
    encoder, decoder, cross = (x.copy() for x in _inputs("float64"))
    encoder[1, 0, 0, 2, 2] = np.nan
    source, target = attnflow.encoder_decoder_flow(encoder, decoder, cross, validate=False)
    assert np.all(np.isnan(source[1]))
    assert np.all(np.isnan(target[1]))
    assert np.all(np.isfinite(source[0]))
    assert np.all(np.isfinite(target[0]))


def test_progress_bar_counts_every_max_flow(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    attnflow.encoder_decoder_flow(*_inputs("float64"), rows=[0, 1], progress=True)
    assert f"{BATCH * 2 * (S + T)}/{BATCH * 2 * (S + T)}" in capsys.readouterr().err


ERRORS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "max_seconds": ({"max_seconds": 1e-9}, ValueError, r"above `max_seconds`=1e-09.*`rows=`"),
    "max_seconds nan": (
        {"max_seconds": float("nan")},
        ValueError,
        r"`max_seconds` must be a positive number of seconds",
    ),
    "max_seconds str": ({"max_seconds": "1"}, ValueError, r"`max_seconds` must be a positive"),
    "n_jobs": ({"n_jobs": 0}, ValueError, r"`n_jobs` must be"),
    "executor": ({"executor": object()}, TypeError, r"`executor` must be a concurrent"),
    "executor and n_jobs": (
        {"executor": ThreadPoolExecutor(1), "n_jobs": 2},
        ValueError,
        r"pass either `executor` or `n_jobs`",
    ),
    "progress": ({"progress": "yes"}, TypeError, "`progress` must be True or False"),
    "normalize_result": (
        {"normalize_result": 1},
        TypeError,
        "`normalize_result` must be True or False",
    ),
    "rows": ({"rows": T}, IndexError, "`rows` must index"),
    "layers": ({"layers": L_D}, IndexError, "`layers` must index"),
    "shapes": ({"cross": np.ones((L_D, H, T, S + 1))}, ValueError, "S = 5 key columns"),
    "row sums": ({"cross": np.ones((L_D, H, T, S))}, ValueError, "rows must sum to 1"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_validation_messages(case: str) -> None:
    options, error, match = ERRORS[case]
    encoder, decoder, cross = (x[0] for x in _inputs("float64"))
    cross = options.pop("cross", cross)
    with pytest.raises(error, match=match):
        attnflow.encoder_decoder_flow(encoder, decoder, cross, **options)


# --- flow's engine, cost model and runner (issue 25, item 3) ---------------------------

DEEP = {"L_E": 3, "L_D": 3, "S": 7, "T": 6}
DEEP_SOURCE_MASK = np.array([[True] * 7, [True] * 5 + [False] * 2])
DEEP_TARGET_MASK = np.array([[True] * 6, [True] * 4 + [False] * 2])


@functools.cache
def _deep() -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, np.ndarray]]:
    """A deeper masked batch (graphs of 4 to 6 layers: the compiled solver's), and its oracle.

    Peaked attention with exact zeros (a causal decoder, cut encoder weights), so that
    flows are limited inside the graph, not only at its ends.
    """
    rng = np.random.default_rng(25)
    n_e, n_d, n_s, n_t = DEEP["L_E"], DEEP["L_D"], DEEP["S"], DEEP["T"]
    encoder = softmax_attention(rng, (2, n_e, 2, n_s, n_s), scale=4.0)
    cut = (rng.random(encoder.shape) < 0.4) & ~np.eye(n_s, dtype=bool)
    encoder = np.where(cut, 0.0, encoder)
    encoder /= encoder.sum(axis=-1, keepdims=True)
    decoder = _causal(softmax_attention(rng, (2, n_d, 2, n_t, n_t), scale=4.0))
    cross = softmax_attention(rng, (2, n_d, 2, n_t, n_s), scale=4.0)
    masks = {"source_mask": DEEP_SOURCE_MASK, "target_mask": DEEP_TARGET_MASK}
    oracle = oracle_encoder_decoder_flow(
        encoder, decoder, cross, **masks, layers="all", normalize_result=False
    )
    return (encoder, decoder, cross), oracle


@pytest.mark.parametrize("path", ["kernel", "kernel run to completion", "igraph"])
def test_every_engine_path_equals_the_networkx_oracle(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    arrays, (want_s, want_t) = _deep()
    masks = {"source_mask": DEEP_SOURCE_MASK, "target_mask": DEEP_TARGET_MASK}
    solved: list[int] = []
    real = engine._solve_with_kernel

    def counting(mixed: np.ndarray, rows: np.ndarray, sinks: np.ndarray) -> Any:
        values, status = real(mixed, rows, sinks)
        solved.extend(status.ravel().tolist())
        return values, status

    monkeypatch.setattr(engine, "_solve_with_kernel", counting)
    if path == "igraph":
        monkeypatch.setattr(engine, "ENGINE", "igraph")
    elif path == "kernel run to completion":
        monkeypatch.setattr(engine, "TARGET_TOLERANCE", -1.0)  # no bound is ever reached
    got = attnflow.encoder_decoder_flow(
        *arrays, **masks, layers="all", normalize_result=False, n_jobs=1
    )
    np.testing.assert_allclose(got.source, want_s, atol=EXACT, rtol=0)
    np.testing.assert_allclose(got.target, want_t, atol=EXACT, rtol=0)
    if path == "igraph":
        assert solved == []
    else:  # every layer is deep enough for the solver; statuses say how it found each
        expected = engine.SOLVED if path == "kernel run to completion" else engine.CERTIFIED
        assert solved
        assert expected in solved
        assert set(solved) <= {0, engine.CERTIFIED, engine.SOLVED}


def test_the_layered_graphs_keep_every_max_flow_of_the_graph() -> None:
    # The source tokens' layered graph and the decoder's graph (times alpha), solved as
    # FlowTasks, equal networkx on the encoder-decoder graph itself (the pass-through
    # copies change no max-flow), with a pass-through edge the tightest it may be: the
    # largest row sum, one.
    arrays, (want_s, want_t) = _deep()
    n_e, n_s = DEEP["L_E"], DEEP["S"]
    for item in range(2):
        real_s, real_t = DEEP_SOURCE_MASK[item], DEEP_TARGET_MASK[item]
        keep = [
            (real_s[:, None] & real_s[None, :]),
            (real_t[:, None] & real_t[None, :]),
            (real_t[:, None] & real_s[None, :]),
        ]
        fused = []  # each head renormalised over the real keys, then the mean (the oracle's)
        for k, x in zip(keep, arrays, strict=True):
            masked = np.where(k, x[item], 0.0)
            totals = masked.sum(axis=-1, keepdims=True)
            fused.append((masked / np.where(totals > 0, totals, 1.0)).mean(axis=-3))
        graph = source_capacities(*fused, real_s, real_t, alpha=0.5)
        assert graph.shape == (n_e + DEEP["L_D"], n_s + DEEP["T"], n_s + DEEP["T"])
        np.testing.assert_allclose(graph.sum(axis=-1).max(), 1.0, atol=1e-12)
        decoder = decoder_capacities(fused[1], real_t, alpha=0.5)
        rows = np.flatnonzero(real_t)
        for layer in range(DEEP["L_D"]):
            top = np.ascontiguousarray(graph[: n_e + layer + 1])
            sinks = np.arange(n_s)
            task = engine.FlowTask((), top, n_s + rows, np.arange(rows.size), sinks)
            values = engine.solve_flow_task(task)
            np.testing.assert_allclose(values, want_s[item, layer][real_t], atol=EXACT, rtol=0)
            sinks = np.arange(DEEP["T"])
            task = engine.FlowTask((), decoder[: layer + 1], rows, np.arange(rows.size), sinks)
            values = 0.5 * engine.solve_flow_task(task)
            np.testing.assert_allclose(values, want_t[item, layer][real_t], atol=EXACT, rtol=0)


def test_the_cost_model_counts_the_pairs_and_edges_the_engine_solves() -> None:
    # Dense attention (no zero weight, a decoder that is not causal): every edge the cost
    # model counts is in the graph; the max-flows are the pairs of the tasks, and the
    # estimate is flow's, on the same constants.
    rng = np.random.default_rng(7)
    encoder = softmax_attention(rng, (2, 3, 2, 5, 5))
    decoder = softmax_attention(rng, (2, 2, 2, 4, 4))
    cross = softmax_attention(rng, (2, 2, 2, 4, 5))
    source_real = np.ones((2, 5), dtype=bool)
    target_real = np.array([[True] * 4, [True, True, True, False]])
    shape = ed_flow._Shape(n_enc=3, n_src=5, n_tgt=4, n_heads=2)
    cost = ed_flow._cost(shape, [0, 1], [0, 3], source_real, target_real)
    fused = [x.mean(axis=-3) for x in (encoder, decoder, cross)]
    graphs = ed_flow._Graphs(
        source_capacities(*fused, source_real, target_real, alpha=0.5),
        decoder_capacities(fused[1], target_real, alpha=0.5),
    )
    full = np.count_nonzero(graphs.source[0, : 3 + 2] > 0)
    assert cost.largest_graph_edges == full  # sequence 0: every token real
    tasks = ed_flow._plan(
        graphs,
        shape,
        [0, 1],
        [0, 3],
        source_real,
        target_real,
        undefined=np.zeros(2, bool),
        targets=True,
        workers=1,
    )
    # Row 3 of sequence 1 is padding: it sends nothing.
    assert cost.max_flows == sum(task.n_maxflows for task in tasks) == 2 * (2 * 9 + 1 * 8)
    assert cost.edge_visits <= cost.max_flows * cost.largest_graph_edges
    assert 0 < cost.estimated_seconds < 1.0
    many = ed_flow._cost(shape, [0, 1], [0, 3], np.ones((4, 5), bool), np.ones((4, 4), bool))
    assert many.max_flows == 4 * 2 * 2 * 9  # four unpadded sequences, two layers, two rows


def test_long_problems_are_cut_into_short_tasks_with_the_same_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    arrays, _ = _deep()
    whole = attnflow.encoder_decoder_flow(*arrays, normalize_result=False, n_jobs=1)
    monkeypatch.setattr(ed_flow, "TASK_SECONDS", 1e-9)  # every task above it: one per sink
    planned: list[int] = []
    real = ed_flow._plan

    def counting(*args: Any, **kwargs: Any) -> Any:
        tasks = real(*args, **kwargs)
        planned.append(len(tasks))
        return tasks

    monkeypatch.setattr(ed_flow, "_plan", counting)
    cut = attnflow.encoder_decoder_flow(*arrays, normalize_result=False, n_jobs=2)
    assert planned == [2 * (DEEP["S"] + DEEP["T"])]  # one task per sequence and sink
    np.testing.assert_array_equal(cut.source, whole.source)
    np.testing.assert_array_equal(cut.target, whole.target)


def test_threads_and_executors_equal_serial() -> None:
    arrays, _ = _deep()
    options: dict[str, Any] = {"rows": [5, 0], "layers": "all"}
    serial = attnflow.encoder_decoder_flow(*arrays, n_jobs=1, **options)
    threads = attnflow.encoder_decoder_flow(*arrays, n_jobs=2, **options)
    with ThreadPoolExecutor(max_workers=2) as executor:
        pooled = attnflow.encoder_decoder_flow(*arrays, executor=executor, **options)
    for got in (threads, pooled):
        np.testing.assert_array_equal(got.source, serial.source)
        np.testing.assert_array_equal(got.target, serial.target)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_killed_worker_process_is_reported() -> None:
    class KillingPool(ProcessPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            return super().submit(os.abort)  # the worker kills itself (SIGABRT)

    # Never fork the test process: JAX and PyTorch may run threads in it.
    pool = KillingPool(max_workers=1, mp_context=multiprocessing.get_context("forkserver"))
    try:
        with pytest.raises(attnflow.WorkersLostError, match=r"died before finishing"):
            attnflow.encoder_decoder_flow(*_inputs("float64"), executor=pool)
    finally:
        pool.shutdown()


@pytest.mark.parametrize("scale", [0.6, 1.7])
def test_unvalidated_rows_that_sum_above_one_give_the_exact_max_flow(
    scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With validate=False rows may sum above one: the engine's bounds clamp each token at
    # its own row sum (not at 1), so its flows are still the whole-graph max-flows.
    arrays = [scale * x for x in _deep()[0]]
    options: dict[str, Any] = {"layers": "all", "normalize_result": False, "validate": False}
    got = attnflow.encoder_decoder_flow(*arrays, **options)
    monkeypatch.setattr(engine, "ENGINE", "igraph")  # no bound: whole-graph max-flows
    want = attnflow.encoder_decoder_flow(*arrays, **options)
    np.testing.assert_allclose(got.source, want.source, atol=EXACT, rtol=0)
    np.testing.assert_allclose(got.target, want.target, atol=EXACT, rtol=0)


def test_progress_bar_counts_the_real_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    masks = {"source_mask": SOURCE_MASK, "target_mask": TARGET_MASK}
    attnflow.encoder_decoder_flow(*_inputs("float64"), **masks, progress=True)
    pairs = T * (S + T) + (T - 1) * (3 + 3)  # sequence 1: 3 rows, 3 sources, 3 targets real
    assert f"{pairs}/{pairs}" in capsys.readouterr().err


def test_max_seconds_none_lifts_the_limit() -> None:
    arrays = _inputs("float64")
    limited = attnflow.encoder_decoder_flow(*arrays)
    lifted = attnflow.encoder_decoder_flow(*arrays, max_seconds=None)
    np.testing.assert_array_equal(lifted.source, limited.source)


def test_the_deprecated_max_work_keeps_its_meaning_one_release() -> None:
    arrays = _inputs("float64")
    plain = attnflow.encoder_decoder_flow(*arrays)
    with pytest.warns(DeprecationWarning, match=r"`max_work` .* is replaced by `max_seconds`"):
        lifted = attnflow.encoder_decoder_flow(*arrays, max_work=None)
    np.testing.assert_array_equal(lifted.source, plain.source)
    # Edge visits, as before: 2 sequences x 4 rows x 9 tokens x (2 x 25 + 2 x (16 + 20)).
    visits = 2 * 4 * 9 * (2 * 25 + 2 * (16 + 20))
    with pytest.warns(DeprecationWarning, match="max_seconds"):
        attnflow.encoder_decoder_flow(*arrays, max_work=visits)
    with (
        pytest.warns(DeprecationWarning, match="max_seconds"),
        pytest.raises(ValueError, match=re.escape(f"({visits:.3g} edge visits), above `max_work`")),
    ):
        attnflow.encoder_decoder_flow(*arrays, max_work=visits - 1)
    with pytest.raises(TypeError, match=r"pass `max_seconds` only"):
        attnflow.encoder_decoder_flow(*arrays, max_work=1e9, max_seconds=5.0)


# --- one estimate with flow: the profile-based cost model (issue 21/25 follow-up) ------

#: flow's refusal and encoder_decoder_flow's, in one shape: the call, the estimate in
#: words (str(FlowCost)), the limit, then what to change.
REFUSAL = re.compile(
    r"^this (attention|encoder-decoder) flow would take [\d,]+ max-flows on graphs of up to "
    r"[\d,]+ edges \([\d.e+]+ edge visits, roughly ([\d.]+) (s|min|h) on one core\), above "
    r"`max_seconds`=([\d.e+-]+)\. Explain fewer .*`max_seconds=None` to run it anyway\.$"
)


def _fused(rng: np.random.Generator, n_e: int, n_d: int, s: int, t: int, decay: float) -> tuple:
    """Head-fused attention of the three families (heads=None); logits fall by `decay` per
    token of distance (0: spread over the sequence, 0.5: strongly local)."""

    def attention(shape: tuple[int, ...]) -> np.ndarray:
        q, k = shape[-2:]
        distance = np.abs(np.arange(q)[:, None] - np.arange(k)[None, :])
        logits = rng.standard_normal(shape) - decay * distance
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return weights / weights.sum(axis=-1, keepdims=True)

    return attention((n_e, s, s)), _causal(attention((n_d, t, t))), attention((n_d, t, s))


class _Refused(Exception):
    pass


def _estimate(monkeypatch: pytest.MonkeyPatch, *arrays: np.ndarray, **options: Any) -> Any:
    """The estimate encoder_decoder_flow decides from (read where it refuses or not)."""
    seen = []

    def record(estimate: Any, *args: Any) -> None:
        seen.append(estimate)
        raise _Refused

    with monkeypatch.context() as patch:
        patch.setattr(ed_flow, "_refuse_above_limit", record)
        with pytest.raises(_Refused):
            attnflow.encoder_decoder_flow(*arrays, heads=None, **options)
    return seen[0]


def test_a_clearly_too_expensive_call_is_refused_before_any_work_as_flow_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(21)
    arrays = _fused(rng, 6, 6, 320, 320, decay=0.3)  # local: pairs solved to completion

    def refuse(*args: Any, **kwargs: Any) -> Any:
        msg = "built a graph or solved before refusing"
        raise AssertionError(msg)

    for name in ("source_capacities", "decoder_capacities", "_run"):
        monkeypatch.setattr(ed_flow, name, refuse)
    with pytest.raises(ValueError, match="above `max_seconds`") as refused:
        attnflow.encoder_decoder_flow(*arrays, heads=None)  # the default limit, 600 s
    message = str(refused.value)
    assert "this encoder-decoder flow would take" in message
    shape = REFUSAL.match(message)
    assert shape is not None, message
    amount, unit, limit = float(shape[2]), shape[3], float(shape[4])
    assert limit == 600
    assert amount * {"s": 1, "min": 60, "h": 3600}[unit] > 5 * 600  # clearly above
    # flow's own refusal has the same shape.
    with pytest.raises(ValueError, match="above `max_seconds`") as by_flow:
        attnflow.flow(arrays[1], heads=None, max_seconds=1e-9)
    assert REFUSAL.match(str(by_flow.value)), str(by_flow.value)
    # A cheap call of the same kind is not refused, and is decided without a profile.
    monkeypatch.undo()
    small = _fused(rng, 2, 2, 12, 10, decay=0.0)
    monkeypatch.setattr(ed_flow, "graph_profile", refuse)
    result = attnflow.encoder_decoder_flow(*small, heads=None, rows=[0, 9])
    assert np.all(np.isfinite(result.source))


def test_the_estimate_reads_the_attention_as_flows_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # Same shapes: strongly local attention is priced above attention spread over the
    # sequence (pairs beyond its reach are solved to completion), as flow's cost model
    # prices a single stack.
    rng = np.random.default_rng(4)
    local = _fused(rng, 4, 4, 48, 40, decay=0.5)
    spread = _fused(rng, 4, 4, 48, 40, decay=0.0)
    options = {"rows": [0, 39], "max_seconds": 1e-9}
    assert _estimate(monkeypatch, *local, **options).estimated_seconds > 3 * (
        _estimate(monkeypatch, *spread, **options).estimated_seconds
    )


def test_backends_get_the_estimate_of_numpy(
    backend: Variant, dtype_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The profiled path (a limit it could cross), with masks: the sampled rows are read
    # in the caller's library.
    arrays = [a.astype(dtype_name) for a in _fused(np.random.default_rng(5), 3, 3, 20, 16, 0.3)]
    masks = {"source_mask": np.arange(20) < 17, "target_mask": np.arange(16) < 12}
    options = {"rows": [0, 5], "max_seconds": 1e-9}
    expected = _estimate(monkeypatch, *arrays, **masks, **options)
    got = _estimate(
        monkeypatch,
        *(backend.asarray(a) for a in arrays),
        **{name: backend.asarray(m) for name, m in masks.items()},
        **options,
    )
    assert got.max_flows == expected.max_flows
    assert got.estimated_seconds == pytest.approx(expected.estimated_seconds, rel=1e-9)
