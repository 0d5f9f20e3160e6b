"""`flow_cost`'s model against the engine it prices: what it reads, and which pairs are loose."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from backends import Variant
from flow_engines import softmax as _softmax

import attnflow
import attnflow._flow as flow_module
from attnflow import _maxflow as engine
from attnflow._flow_cost import PROFILE_ROWS, graph_profile, profile_rows


def _local(n: int, layers: int, decay: float, seed: int = 0) -> np.ndarray:
    """Strongly local attention ``(layers, 4, n, n)``: logits ``N(0, 1) - decay |i - j|``."""
    rng = np.random.default_rng(seed)
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    return _softmax(rng.standard_normal((layers, 4, n, n)) - decay * distance)


def _mixed(attention: np.ndarray) -> np.ndarray:
    n = attention.shape[-1]
    return np.ascontiguousarray(0.5 * attention.mean(axis=1) + 0.5 * np.eye(n))


@pytest.mark.skipif(not engine.KERNEL_AVAILABLE, reason="prices the compiled solver's statuses")
def test_the_reach_predicts_the_pairs_the_engine_solves_to_completion() -> None:
    # The engine's own statuses are the reference: beyond the profile's reach the bounds
    # are loose and pairs are solved to completion; within it they are certified.
    n, layers = 64, 8
    attention = _local(n, layers, 0.5, seed=3)
    mixed = _mixed(attention)
    sample = profile_rows(n)
    profile = graph_profile(attention.mean(axis=1)[:, sample], sample)
    task = engine.FlowTask((), mixed, np.array([0]), np.array([0]), np.arange(n))
    _, status = engine.solve_flow_task_with_status(task)
    loose = np.arange(n) > profile.reach(layers)
    solved = status[0] == engine.SOLVED
    assert 0.2 < solved.mean() < 0.95  # both kinds occur: the check can fail either way
    assert np.mean(loose == solved) >= 0.85
    # Global attention of the same shape reaches every token: nothing priced loose.
    rng = np.random.default_rng(4)
    spread = _softmax(rng.standard_normal((layers, 4, n, n)))
    assert graph_profile(spread[:, :, sample].mean(axis=1), sample).reach(2) > n


def test_local_attention_costs_more_than_global_attention_of_its_shape() -> None:
    # Pairs beyond the reach are solved to completion (here by push-relabel, priced at a
    # third of Dinic's phases: measured 0.032 against 0.003 CPU s).
    local = _local(96, 8, 0.5)
    spread = _local(96, 8, 0.0)
    assert (
        attnflow.flow_cost(local, rows=0).estimated_seconds
        > 3 * attnflow.flow_cost(spread, rows=0).estimated_seconds
    )


def test_the_profile_sees_causal_attention() -> None:
    n = 40
    causal = np.tril(np.ones((3, n, n))) / np.arange(1, n + 1)[:, None]
    sample = profile_rows(n)
    profile = graph_profile(causal[:, sample], sample)
    assert profile.causal
    np.testing.assert_allclose(profile.density, 1.0)  # the whole lower triangle
    full = graph_profile(np.full((3, len(sample), n), 1 / n), sample)
    assert not full.causal
    np.testing.assert_allclose(full.density, 1.0)
    # A decoder's last row costs less than a bidirectional one: half the arcs, and tokens
    # after the sink never carry its flow.
    decoder = attnflow.flow_cost(np.broadcast_to(causal, (4, 3, n, n)).swapaxes(0, 1), rows=-1)
    encoder = attnflow.flow_cost(np.full((3, 4, n, n), 1 / n), rows=-1)
    assert decoder.estimated_seconds < encoder.estimated_seconds


def test_flow_cost_reads_a_sample_of_rows_and_solves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import attnflow._prepare as prepare

    def refuse(*args: Any, **kwargs: Any) -> Any:
        msg = "flow_cost fused whole layers or solved"
        raise AssertionError(msg)

    seen: list[int] = []
    fuse = flow_module.apply_head_fusion

    def sampled(x: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(x.shape[-2])
        return fuse(x, *args, **kwargs)

    monkeypatch.setattr(prepare, "apply_head_fusion", refuse)
    monkeypatch.setattr(flow_module, "solve_flow_task", refuse)
    monkeypatch.setattr(flow_module, "apply_head_fusion", sampled)
    weights = _local(80, 4, 0.3)
    for heads in ("mean", "max", "each", [0.1, 0.2, 0.3, 0.4], lambda a: a.sum(axis=-3)):
        cost = attnflow.flow_cost(weights, rows=[0, 5], heads=heads)
        assert cost.max_flows == 2 * 80 * (4 if heads == "each" else 1)
    assert seen
    assert max(seen) <= PROFILE_ROWS < 80


def test_flow_cost_sums_over_a_batch_of_one_attention() -> None:
    one = _local(30, 4, 0.3)
    for options in ({}, {"rows": [0, 29]}, {"layers": "all"}, {"heads": "each", "rows": 0}):
        total = attnflow.flow_cost(np.broadcast_to(one, (5, *one.shape)), **options)
        part = attnflow.flow_cost(one, **options)
        assert total.max_flows == 5 * part.max_flows
        assert total.estimated_seconds == pytest.approx(5 * part.estimated_seconds, rel=1e-12)


@pytest.mark.parametrize("mask", [None, np.array([[1] * 40, [1] * 25 + [0] * 15], bool)])
def test_max_seconds_reads_the_same_estimate_before_any_solving(
    monkeypatch: pytest.MonkeyPatch, mask: np.ndarray | None
) -> None:
    weights = np.stack([_local(40, 6, 0.5, seed=1), _local(40, 6, 0.5, seed=2)])
    cost = attnflow.flow_cost(weights, rows=0, mask=mask)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        msg = "solved before refusing"
        raise AssertionError(msg)

    monkeypatch.setattr(flow_module, "solve_flow_task", refuse)
    with pytest.raises(ValueError, match="above `max_seconds`") as refused:
        attnflow.flow(weights, rows=0, mask=mask, max_seconds=cost.estimated_seconds / 1.5)
    assert str(cost) in str(refused.value)


def test_backends_get_the_estimate_of_numpy(backend: Variant, dtype_name: str) -> None:
    weights = _local(24, 4, 0.5).astype(dtype_name)
    mask = np.array([True] * 20 + [False] * 4)
    expected = attnflow.flow_cost(weights, rows=[0, 3], mask=mask)
    got = attnflow.flow_cost(backend.asarray(weights), rows=[0, 3], mask=backend.asarray(mask))
    assert got.max_flows == expected.max_flows
    assert got.estimated_seconds == pytest.approx(expected.estimated_seconds, rel=1e-9)


def test_the_dearest_profile_bounds_every_estimate() -> None:
    # flow() skips the profile where this bound already decides: it must be an upper bound.
    from attnflow._flow_cost import dearest_profile, kernel_task_seconds

    n = 48
    sample = profile_rows(n)
    causal = np.tril(np.ones((6, n, n))) / np.arange(1, n + 1)[:, None]
    for attention in (_local(n, 6, 0.5).mean(axis=1), _local(n, 6, 0.0).mean(axis=1), causal):
        profile = graph_profile(attention[:, sample], sample)
        for layers in (3, 6):
            for rows in (np.array([0]), np.array([n - 1, 7]), np.arange(n)):
                assert kernel_task_seconds(profile, layers, rows, n) <= kernel_task_seconds(
                    dearest_profile(6), layers, rows, n
                )


def test_a_small_call_is_decided_without_a_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    weights = _local(12, 4, 0.5)
    expected = attnflow.flow(weights, rows=0)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        msg = "profiled a call whose decisions its shapes settle"
        raise AssertionError(msg)

    monkeypatch.setattr(flow_module, "graph_profile", refuse)
    np.testing.assert_array_equal(attnflow.flow(weights, rows=0), expected)
    with pytest.raises(AssertionError, match="profiled"):  # a limit it could cross: profiled
        attnflow.flow(weights, rows=0, max_seconds=1e-9)


def test_loose_pairs_priced_by_push_relabel_on_small_graphs() -> None:
    # Where push-relabel solves the loose pairs (small graphs), they cost about a third of
    # Dinic's phases; certified pairs and graphs without loose pairs cost the same.
    from attnflow._flow_cost import kernel_task_seconds
    from attnflow._maxflow import push_relabel_fits

    n = 48
    sample = profile_rows(n)
    local = graph_profile(_local(n, 6, 0.5).mean(axis=1)[:, sample], sample)
    spread = graph_profile(_local(n, 6, 0.0).mean(axis=1)[:, sample], sample)
    rows = np.array([0])
    assert push_relabel_fits(6, n)
    assert not push_relabel_fits(12, 1024)
    cheaper = kernel_task_seconds(local, 6, rows, n, push_relabel=True)
    assert cheaper < 0.5 * kernel_task_seconds(local, 6, rows, n)
    assert kernel_task_seconds(spread, 6, rows, n, push_relabel=True) == kernel_task_seconds(
        spread, 6, rows, n
    )
