"""The flow engine's two solvers on one task (the compiled kernel and igraph's reference),
and the attention the flow tests build."""

from __future__ import annotations

import numpy as np
import pytest

import attnflow._maxflow as engine
from attnflow._maxflow import FlowTask, solve_flow_task_with_status

__all__ = ["kernel_and_igraph", "residual_mix", "softmax"]


def softmax(logits: np.ndarray) -> np.ndarray:
    """Attention rows from logits: a softmax over the last axis."""
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.asarray(weights / weights.sum(axis=-1, keepdims=True))


def residual_mix(attention: np.ndarray, residual: float = 0.5) -> np.ndarray:
    """``(1 - α) A + α I`` of fused attention ``(L, n, n)``, C-contiguous."""
    n = attention.shape[-1]
    return np.ascontiguousarray((1 - residual) * attention + residual * np.eye(n))


def kernel_and_igraph(
    mixed: np.ndarray, rows: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kernel values, kernel statuses and igraph's whole-graph values of every sink."""
    task = FlowTask((), mixed, rows, np.arange(rows.shape[0]), np.arange(mixed.shape[-1]))
    values, status = solve_flow_task_with_status(task)
    with monkeypatch.context() as patch:
        patch.setattr(engine, "ENGINE", "igraph")
        reference, _ = solve_flow_task_with_status(task)
    return values, status, reference
