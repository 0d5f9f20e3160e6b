"""Attention flow against an independent max-flow (networkx Edmonds-Karp, the paper's way)."""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from backends import Variant, selected_variants
from oracle import oracle_flow, oracle_rollout, softmax_attention

import attnflow

EXACT = 1e-12  # the README's promise: equal to the independent max-flow within 1e-12 (float64)


def _random(seed: int, shape: tuple[int, ...], *, sparse: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = softmax_attention(rng, shape, scale=2.0)
    if sparse:  # exact zeros, as causal or top-k attention has; every row keeps its diagonal
        cut = (rng.random(shape) < 0.5) & ~np.eye(shape[-1], dtype=bool)
        weights = np.where(cut, 0.0, weights)
        weights /= weights.sum(axis=-1, keepdims=True)
    return weights


CASES: list[tuple[tuple[int, ...], dict[str, Any]]] = [
    ((3, 4, 5, 5), {}),
    ((3, 4, 5, 5), {"normalize_result": False}),
    ((3, 2, 5, 5), {"rows": 0}),
    ((3, 2, 5, 5), {"rows": [4, 1], "normalize_result": False}),
    ((4, 2, 4, 4), {"layers": "all"}),
    ((4, 2, 4, 4), {"layers": "all", "rows": -1, "normalize_result": False}),
    ((4, 2, 4, 4), {"layers": 1, "rows": [0, 3]}),
    ((2, 3, 3, 6, 6), {"rows": 0, "layers": "all"}),
    ((2, 3, 3, 6, 6), {"heads": "max", "normalize_result": False}),
    ((2, 3, 3, 6, 6), {"heads": "min", "rows": [0, 5]}),
    ((2, 3, 3, 6, 6), {"heads": [0.2, 0.3, 0.5], "residual": 0.3}),
    ((3, 1, 5, 5), {"residual": 0.0, "normalize_result": False}),
    ((3, 1, 5, 5), {"residual": 1.0, "normalize_result": False}),
    ((1, 3, 5, 5), {"layers": "all"}),
]


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize(("shape", "options"), CASES, ids=[str(o) or "default" for _, o in CASES])
def test_flow_equals_the_independent_max_flow(
    shape: tuple[int, ...], options: dict[str, Any], sparse: bool
) -> None:
    weights = _random(sum(shape), shape, sparse=sparse)
    result = attnflow.flow(weights, n_jobs=1, **options)
    oracle_options = {
        k: np.array(v) if k == "heads" and isinstance(v, list) else v for k, v in options.items()
    }
    np.testing.assert_allclose(result, oracle_flow(weights, **oracle_options), atol=EXACT, rtol=0)


@pytest.mark.parametrize("normalize_result", [True, False])
@pytest.mark.parametrize("fill", ["zeros", "nan", "uniform"])
def test_masked_flow_equals_the_cropped_sequences(normalize_result: bool, fill: str) -> None:
    weights = _random(5, (3, 3, 2, 6, 6))
    lengths = np.array([6, 4, 2])
    mask = np.arange(6)[None, :] < lengths[:, None]
    weights = np.where(mask[:, None, None, None, :], weights, 0.0)
    weights /= weights.sum(axis=-1, keepdims=True)
    padded_rows = ~mask[:, None, None, :, None]
    weights = np.where(padded_rows, {"zeros": 0.0, "nan": np.nan, "uniform": 1 / 6}[fill], weights)
    for options in ({}, {"rows": 0, "layers": "all"}):
        result = attnflow.flow(
            weights, mask=mask, normalize_result=normalize_result, n_jobs=1, **options
        )
        expected = oracle_flow(weights, mask=mask, normalize_result=normalize_result, **options)
        np.testing.assert_allclose(result, expected, atol=EXACT, rtol=0)
        for item, length in enumerate(lengths):
            assert np.all(result[item, ..., length:] == 0)


@pytest.mark.parametrize("residual", [0.0, 0.3, 0.5, 1.0])
def test_first_layer_flow_equals_rollout_equals_mixed_attention(residual: float) -> None:
    weights = _random(11, (2, 3, 4, 7, 7))
    first_flow = attnflow.flow(weights, layers=0, residual=residual, normalize_result=False)
    first_rollout = attnflow.rollout(weights, layers=0, residual=residual)
    mixed = (1 - residual) * weights[:, 0].mean(axis=1) + residual * np.eye(7)
    np.testing.assert_allclose(first_flow, mixed, atol=1e-12)
    np.testing.assert_allclose(first_rollout, mixed, atol=1e-12)
    np.testing.assert_allclose(
        attnflow.flow(weights, layers="all", residual=residual)[:, 0], mixed, atol=1e-12
    )


def test_flow_never_exceeds_one_nor_the_capacity_into_the_sink() -> None:
    weights = _random(3, (2, 4, 3, 6, 6))
    raw = attnflow.flow(weights, normalize_result=False, layers="all")
    assert np.all(raw >= 0)
    assert np.all(raw <= 1 + 1e-12)
    mixed_first = 0.5 * weights[:, 0].mean(axis=1) + 0.5 * np.eye(6)
    into_sink = mixed_first.sum(axis=-2)  # capacity of all edges into input token m
    assert np.all(raw <= into_sink[:, None, None, :] + 1e-12)
    # Flow is at least the share rollout routes proportionally (a feasible flow).
    rolled = oracle_rollout(weights, layers="all")
    assert np.all(raw >= rolled - 1e-12)


def test_parallel_processes_equal_serial() -> None:
    weights = _random(8, (2, 4, 2, 8, 8))
    serial = attnflow.flow(weights, rows=[0, 3], layers="all", n_jobs=1)
    parallel = attnflow.flow(weights, rows=[0, 3], layers="all", n_jobs=2)
    np.testing.assert_array_equal(parallel, serial)
    with ThreadPoolExecutor(max_workers=2) as executor:
        threaded = attnflow.flow(weights, rows=[0, 3], layers="all", executor=executor)
    np.testing.assert_array_equal(threaded, serial)


@pytest.mark.with_backend("dask")
def test_dask_local_cluster_equals_serial() -> None:
    if "dask" in {v.library for v in selected_variants()}:
        import distributed  # requested with dask: it must be installed
    else:
        distributed = pytest.importorskip(
            "distributed", reason="the Dask cluster test runs in the dask session"
        )
    weights = _random(9, (3, 3, 2, 7, 7))
    serial = attnflow.flow(weights, rows=0, layers="all", n_jobs=1)
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        clustered = attnflow.flow(weights, rows=0, layers="all", executor=client.get_executor())
    np.testing.assert_array_equal(clustered, serial)


@pytest.mark.with_backend("dask")
def test_a_dask_worker_killed_mid_run_still_gives_the_serial_result() -> None:
    if "dask" in {v.library for v in selected_variants()}:
        import distributed  # requested with dask: it must be installed
    else:
        distributed = pytest.importorskip(
            "distributed", reason="the Dask cluster test runs in the dask session"
        )
    import os
    import signal
    import threading
    import time

    weights = _random(12, (48, 4, 2, 40, 40))
    serial = attnflow.flow(weights, n_jobs=1)
    killed: list[float] = []
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        pids = client.run(os.getpid)
        victim = min(pids.values())

        def kill_one_worker() -> None:
            # Once the first results are in: the run is under way and the worker has tasks.
            while not any(f.status == "finished" for f in list(client.futures.values())):
                time.sleep(0.01)
            os.kill(victim, signal.SIGKILL)
            killed.append(time.perf_counter())

        killer = threading.Thread(target=kill_one_worker, daemon=True)
        killer.start()
        clustered = attnflow.flow(weights, executor=client.get_executor())
        finished = time.perf_counter()
        killer.join(timeout=30)
    assert killed, "no worker was killed"
    assert killed[0] < finished, "the run ended before the worker was killed"
    np.testing.assert_array_equal(clustered, serial)


@pytest.mark.parametrize(
    ("heads", "shape"), [(None, (4, 7, 7)), ("mean", (4, 1, 7, 7)), ("mean", (4, 3, 7, 7))]
)
def test_flow_leaves_the_callers_attention_untouched(
    heads: str | None, shape: tuple[int, ...]
) -> None:
    # The residual is mixed in place into head fusion's own array, never into the caller's
    # (fused input, or one head whose mean is itself); the values do not depend on it.
    rng = np.random.default_rng(3)
    attention = softmax_attention(rng, shape)
    kept = attention.copy()
    values = attnflow.flow(attention, heads=heads, rows=-1)
    np.testing.assert_array_equal(attention, kept)
    fused = attention if heads is None else attention.mean(axis=1)
    reference = attnflow.flow(fused[:, None], heads="mean", rows=-1)
    np.testing.assert_array_equal(values, reference)


def test_progress_bar_counts_max_flows(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    attnflow.flow(_random(2, (3, 2, 5, 5)), rows=[0, 1], progress=True, n_jobs=1)
    err = capsys.readouterr().err
    assert "attention flow" in err
    assert "10/10" in err


def test_cost_is_known_before_running_and_absurd_requests_fail_early() -> None:
    vit = np.full((12, 12, 197, 197), 1 / 197)
    cost = attnflow.flow_cost(vit, rows=0)
    assert cost.max_flows == 197
    assert cost.largest_graph_edges == 197 + 197 + 10 * 197 * 197
    assert cost.edge_visits == 197 * cost.largest_graph_edges
    full = attnflow.flow_cost(np.broadcast_to(vit, (32, *vit.shape)))
    assert full.max_flows == 32 * 197 * 197
    with pytest.raises(ValueError, match=r"above `max_seconds`.*rows=0.*max_seconds=None"):
        attnflow.flow(np.broadcast_to(vit, (32, *vit.shape)), max_seconds=10)
    with (
        pytest.warns(DeprecationWarning, match=r"`max_work` .* is replaced by `max_seconds`"),
        pytest.raises(ValueError, match=r"above `max_work`.*rows=0.*max_work=None"),
    ):
        attnflow.flow(np.broadcast_to(vit, (32, *vit.shape)), max_work=2.5e10)
    masked = attnflow.flow_cost(
        np.ones((2, 2, 1, 4, 4)) / 4, mask=np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool)
    )
    assert masked.max_flows == 4 + 16


def test_flow_cost_fuses_no_whole_layer_and_sums_over_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import attnflow._prepare as prepare

    def no_fusing(*args: Any, **kwargs: Any) -> Any:
        msg = "flow_cost fused heads"
        raise AssertionError(msg)

    monkeypatch.setattr(prepare, "apply_head_fusion", no_fusing)
    rng = np.random.default_rng(5)
    mask = rng.random((300, 7)) < 0.7
    mask[:, 0] = True
    # Only a sample of rows is read (`tests/test_flow_cost.py`); NaN attention has no arcs
    # to profile, so every sequence costs what its shape and mask cost, and they add up.
    weights = np.full((300, 4, 3, 7, 7), np.nan)
    for options in ({}, {"rows": [0, 6]}, {"layers": "all"}, {"heads": "each", "rows": 0}):
        total = attnflow.flow_cost(weights, mask=mask, **options)
        parts = [attnflow.flow_cost(weights[i], mask=mask[i], **options) for i in range(300)]
        assert total.max_flows == sum(p.max_flows for p in parts)
        assert total.largest_graph_edges == max(p.largest_graph_edges for p in parts)
        assert total.edge_visits == pytest.approx(sum(p.edge_visits for p in parts), rel=1e-12)
        seconds = sum(p.estimated_seconds for p in parts)
        assert total.estimated_seconds == pytest.approx(seconds, rel=1e-12)


def test_backends_get_their_own_arrays_back(backend: Variant, dtype_name: str) -> None:
    weights = _random(4, (2, 3, 2, 5, 5)).astype(dtype_name)
    mask = np.array([[True] * 5, [True, True, True, False, False]])
    native = backend.asarray(weights)
    if backend.refuses_jit("flow", native, rows=0):
        return
    result = attnflow.flow(native, rows=[0, 2], layers="all", mask=backend.asarray(mask))
    values = backend.check(result, dtype_name=dtype_name, shape=(2, 3, 2, 5))
    expected = oracle_flow(weights.astype(np.float64), rows=[0, 2], layers="all", mask=mask)
    tol = 1e-10 if dtype_name == "float64" else 1e-5
    np.testing.assert_allclose(values, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"n_jobs": 0}, ValueError, r"`n_jobs` must be None .* got 0"),
        ({"n_jobs": 1.5}, ValueError, r"`n_jobs`"),
        (
            {"n_jobs": 2, "executor": ThreadPoolExecutor(1)},
            ValueError,
            r"either `executor` or `n_jobs`",
        ),
        ({"executor": "dask"}, TypeError, r"`executor` must be a concurrent.futures.Executor"),
        ({"progress": "yes"}, TypeError, r"`progress` must be True or False"),
        ({"normalize_result": 1}, TypeError, r"`normalize_result` must be True or False"),
        ({"max_seconds": -1}, ValueError, r"`max_seconds` must be a positive number"),
        ({"rows": 9}, IndexError, r"`rows` must index the 5 output positions"),
    ],
)
def test_bad_options(options: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        attnflow.flow(_random(1, (2, 1, 5, 5)), **options)


@pytest.mark.with_backend("torch")
def test_torch_input_is_detached_and_comes_back_as_torch() -> None:
    torch = pytest.importorskip("torch")
    if "torch" not in {v.library for v in selected_variants()}:
        pytest.skip("torch is not in this session's backends")
    weights = torch.asarray(_random(6, (2, 2, 4, 4)), requires_grad=True)
    result = attnflow.flow(weights, rows=0)
    assert isinstance(result, torch.Tensor)
    assert not result.requires_grad  # flow is not differentiable, and says so


def test_compiled_solver_and_igraph_agree_at_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    # n = 80: the compiled solver against igraph on the whole graph, and on a prefix of the
    # tokens against networkx itself (slow: once per matrix run, in the numpy session).
    import attnflow._maxflow as engine

    weights = _random(22, (4, 3, 80, 80))
    fast = attnflow.flow(weights, rows=[0, 7], normalize_result=False, n_jobs=1)
    monkeypatch.setattr(engine, "ENGINE", "igraph")
    whole = attnflow.flow(weights, rows=[0, 7], normalize_result=False, n_jobs=1)
    np.testing.assert_allclose(fast, whole, atol=1e-12, rtol=0)
    if "numpy" not in {v.library for v in selected_variants()}:
        return
    monkeypatch.setattr(engine, "ENGINE", "kernel")
    prefix = weights[:, :, :40, :40] / weights[:, :, :40, :40].sum(axis=-1, keepdims=True)
    got = attnflow.flow(prefix, rows=0, normalize_result=False, n_jobs=1)
    np.testing.assert_allclose(got, oracle_flow(prefix, rows=0, normalize_result=False), atol=EXACT)


@pytest.mark.parametrize(
    "options",
    [{}, {"heads": "each", "discard": 0.3}, {"receptive_field": True, "exclude": 0}],
    ids=["plain", "heads=each,discard", "receptive_field"],
)
def test_flow_copies_its_mask_to_the_host_once(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    # Causal attention (receptive_field needs it), two sequences padded differently.
    rng = np.random.default_rng(8)
    n = 6
    causal = np.tril(np.ones((n, n), dtype=bool))
    weights = softmax_attention(rng, (2, 3, 2, n, n))
    weights = np.where(causal, weights, 0.0)
    weights /= weights.sum(axis=-1, keepdims=True)
    mask = np.ones((2, n), dtype=bool)
    mask[0, 0] = False
    mask[1, -2:] = False
    flow_module = importlib.import_module("attnflow._flow")
    copies: list[tuple[str, tuple[int, ...]]] = []
    to_host = flow_module.to_host

    def counted(x: Any, *, name: str = "attentions", keep_dtype: bool = False) -> Any:
        copies.append((name, tuple(x.shape)))
        return to_host(x, name=name, keep_dtype=keep_dtype)

    monkeypatch.setattr(flow_module, "to_host", counted)
    result = attnflow.flow(weights, rows=[1, 3], mask=mask, **options)
    assert [shape for name, shape in copies if name == "mask"] == [(2, n)]  # once, (*batch, n)
    monkeypatch.undo()
    # The one copy serves every step: padded tokens get exactly zero, and the result is
    # that of the cropped sequence (its mask-free flow), sequence by sequence.
    for item, keep in enumerate(mask):
        real = np.flatnonzero(keep)
        cropped = weights[item][..., real[:, None], real]
        cropped = cropped / cropped.sum(axis=-1, keepdims=True)
        rows = [int(np.searchsorted(real, r)) for r in (1, 3) if keep[r]]
        exclude = options.get("exclude")
        alone_options = dict(options)
        if exclude is not None:
            if not keep[exclude]:
                continue  # the sink is padded here: nothing to compare it with
            alone_options["exclude"] = int(np.searchsorted(real, exclude))
        alone = attnflow.flow(cropped, rows=rows, **alone_options)
        real_rows = [i for i, r in enumerate((1, 3)) if keep[r]]
        got = result[item][..., real_rows, :]
        np.testing.assert_allclose(got[..., real], alone, rtol=1e-10, atol=1e-12)
        assert np.all(np.delete(got, real, axis=-1) == 0)


def test_non_finite_scan_takes_an_overflowing_sum_the_long_way() -> None:
    # Finite capacities whose sum overflows are finite: nothing cleared, nothing NaN out;
    # one infinity among them is cleared and reported.
    from attnflow._nonfinite import clear_non_finite

    huge = np.full((2, 3, 3), 1e308)
    clean, _, nan_out = clear_non_finite(huge, None, rows=None, all_layers=True, whole_rows=False)
    assert clean is huge
    assert nan_out is None
    huge[0, 1, 2] = np.inf
    clean, _, nan_out = clear_non_finite(huge, None, rows=None, all_layers=True, whole_rows=False)
    assert clean[0, 1, 2] == 0.0
    assert np.isfinite(clean).all()
    assert nan_out is not None
    assert nan_out[0, 1, 2]
