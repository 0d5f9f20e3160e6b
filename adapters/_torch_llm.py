"""The model-facing functions of :func:`attnflow.evaluate.ground_truth` for a PyTorch causal LM.

:func:`next_token_log_probabilities` and :func:`ground_truth_methods` turn a Hugging Face
causal LM (any module whose output has ``.logits`` of shape ``(batch, n, vocab)``) into the
plain callables that :func:`attnflow.evaluate.ground_truth` takes. Attention weights (and
their gradients, for gradient rollout) are captured once per item and shared by every
method.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import attnflow
from attnflow.evaluate import TaskTokens, max_attention, max_contribution

__all__ = ["METHODS", "ground_truth_methods", "next_token_log_probabilities"]

METHODS = (
    "raw",
    "rollout",
    "rollout (receptive_field, exclude=0)",
    "flow (exclude=0)",
    "gradient rollout",
    "max attention",
    "gradient rollout (log-probability)",
    "max norm contribution",
    "rollout of ALTI contributions",
)
"""The methods of :func:`ground_truth_methods`, in table order."""


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        msg = f"`model` must be a torch.nn.Module (a causal LM); got {type(model).__name__}."
        raise TypeError(msg)
    return model


def next_token_log_probabilities(
    model: nn.Module, /, *, batch_size: int = 16
) -> Callable[[Any], np.ndarray]:
    """``ids (B, n) -> (B, vocab)``: log-softmax of the logits at the last position.

    Runs `model` without gradients in batches of `batch_size` sequences, in float64 on
    the host. For :func:`attnflow.evaluate.ground_truth`.
    """
    model = _check_model(model)
    size: object = batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        msg = f"`batch_size` must be a positive int; got {batch_size!r}."
        raise ValueError(msg)
    device = next(model.parameters()).device
    # Hugging Face causal LMs can skip the vocabulary projection of all but the last position.
    keep = (
        {"logits_to_keep": 1}
        if "logits_to_keep" in inspect.signature(model.forward).parameters
        else {}
    )

    def log_probabilities(ids: Any) -> np.ndarray:
        tokens = torch.as_tensor(np.asarray(ids), dtype=torch.long, device=device)
        parts = []
        with torch.no_grad():
            for start in range(0, tokens.shape[0], batch_size):
                logits = model(tokens[start : start + batch_size], **keep).logits[:, -1]
                parts.append(torch.log_softmax(logits.double(), dim=-1).cpu().numpy())
        return np.concatenate(parts)

    return log_probabilities


class _Captured:
    """Attention weights and gradients of one item, computed at most once."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.key: tuple[bytes, int] | None = None
        self.weights: torch.Tensor | None = None
        self.gradients: torch.Tensor | None = None
        self.log_gradients: tuple[np.ndarray, np.ndarray] | None = None
        self.matrices: dict[str, np.ndarray] = {}

    def _select(self, item: TaskTokens) -> torch.Tensor:
        key = (item.ids.tobytes(), item.answer_id)
        if key != self.key:
            self.key, self.weights, self.gradients = key, None, None
            self.log_gradients, self.matrices = None, {}
        device = next(self.model.parameters()).device
        return torch.as_tensor(item.ids[None], dtype=torch.long, device=device)

    def attentions(self, item: TaskTokens) -> np.ndarray:
        """``(layers, heads, n, n)`` float64."""
        ids = self._select(item)
        if self.weights is None:
            from ._torch_capture import capture

            with torch.no_grad(), capture(self.model) as recorded:
                self.model(ids)
            self.weights = recorded.attentions[0].double().cpu()
        return self.weights.numpy()

    def attention_gradients(self, item: TaskTokens) -> tuple[np.ndarray, np.ndarray]:
        """Weights and ``d logit[answer] / d weights`` at the last position."""
        ids = self._select(item)
        if self.gradients is None:
            from ._torch_gradients import attention_gradients

            answer = item.answer_id
            weights, gradients = attention_gradients(
                self.model, ids, target=lambda out: out.logits[0, -1, answer]
            )
            self.weights = weights[0].double().cpu()
            self.gradients = gradients[0].double().cpu()
        assert self.weights is not None
        return self.weights.numpy(), self.gradients.numpy()

    def log_probability_gradients(self, item: TaskTokens) -> tuple[np.ndarray, np.ndarray]:
        """Weights and ``d log p(answer) / d weights`` at the last position (log-softmax)."""
        ids = self._select(item)
        if self.log_gradients is None:
            from ._torch_gradients import attention_gradients

            answer = item.answer_id
            weights, gradients = attention_gradients(
                self.model,
                ids,
                target=lambda out: torch.log_softmax(out.logits[0, -1], dim=-1)[answer],
            )
            self.log_gradients = (
                weights[0].double().cpu().numpy(),
                gradients[0].double().cpu().numpy(),
            )
        return self.log_gradients

    def contributions(self, item: TaskTokens, method: str) -> np.ndarray:
        """``(layers, n, n)`` float64 value-aware matrices (``capture(contributions=...)``)."""
        ids = self._select(item)
        if method not in self.matrices:
            from ._torch_capture import capture

            with torch.no_grad(), capture(self.model, contributions=method) as recorded:  # type: ignore[arg-type]
                self.model(ids)
            self.matrices[method] = recorded.contributions[0].double().cpu().numpy()
        return self.matrices[method]


def ground_truth_methods(
    model: nn.Module, /, *, methods: Sequence[str] = METHODS
) -> dict[str, Callable[[TaskTokens], np.ndarray]]:
    """Build the attribution methods of the ground-truth table: ``item -> scores (layers, n)``.

    Each explains the last position of the prompt, on weights captured from `model`
    (float64), with every layer reported (``layers="all"``):

    - ``"raw"``: :func:`attnflow.raw`, head mean;
    - ``"rollout"``: :func:`attnflow.rollout` (residual 0.5);
    - ``"rollout (receptive_field, exclude=0)"``: the decoder normalisation;
    - ``"flow (exclude=0)"``: :func:`attnflow.flow`;
    - ``"gradient rollout"``: :func:`attnflow.gradient_rollout` (GAE) of the answer
      token's logit at the last position;
    - ``"max attention"``: :func:`attnflow.evaluate.max_attention` (one row, no layers);
    - ``"gradient rollout (log-probability)"``: GAE of the answer's log-probability
      ``log_softmax(logits)[answer]`` at the last position instead of its logit, i.e. of
      ``∇ logit_a - Σ_v p_v ∇ logit_v``: the gradient of what makes the answer *more
      likely than the other tokens*, not of what raises every logit;
    - ``"max norm contribution"``: :func:`attnflow.evaluate.max_contribution` of the
      norm-based contributions (``capture(model, contributions="norm")``, one row);
    - ``"rollout of ALTI contributions"``: :func:`attnflow.rollout` of the ALTI matrices
      (``capture(model, contributions="alti")``, ``heads=None, residual=0.0,
      renormalize=True``: the matrices carry the residual).

    Parameters
    ----------
    model : torch.nn.Module
        A causal LM in eval mode whose output has ``.logits`` ``(batch, n, vocab)``.
    methods : sequence of str, default METHODS
        The methods to build, a subset of :data:`METHODS`.

    Returns
    -------
    dict of str to callable
    """
    model = _check_model(model)
    unknown = [m for m in methods if m not in METHODS]
    if isinstance(methods, str) or unknown:
        msg = f"`methods` must be a sequence of names from {METHODS}; unknown: {unknown or methods!r}."
        raise ValueError(msg)
    captured = _Captured(model)

    def raw(item: TaskTokens) -> np.ndarray:
        return np.asarray(attnflow.raw(captured.attentions(item), rows=-1, layers="all"))

    def rollout(item: TaskTokens) -> np.ndarray:
        return np.asarray(attnflow.rollout(captured.attentions(item), rows=-1, layers="all"))

    def rollout_decoder(item: TaskTokens) -> np.ndarray:
        return np.asarray(
            attnflow.rollout(
                captured.attentions(item),
                rows=-1,
                layers="all",
                receptive_field=True,
                exclude=0,
            )
        )

    def flow(item: TaskTokens) -> np.ndarray:
        return np.asarray(
            attnflow.flow(captured.attentions(item), rows=-1, layers="all", exclude=0)
        )

    def gradient_rollout(item: TaskTokens) -> np.ndarray:
        weights, gradients = captured.attention_gradients(item)
        return np.asarray(attnflow.gradient_rollout(weights, gradients, rows=-1, layers="all"))

    def maximum(item: TaskTokens) -> np.ndarray:
        return np.asarray(max_attention(captured.attentions(item), rows=-1))

    def gradient_rollout_log(item: TaskTokens) -> np.ndarray:
        weights, gradients = captured.log_probability_gradients(item)
        return np.asarray(attnflow.gradient_rollout(weights, gradients, rows=-1, layers="all"))

    def max_norm(item: TaskTokens) -> np.ndarray:
        return np.asarray(max_contribution(captured.contributions(item, "norm"), rows=-1))

    def alti_rollout(item: TaskTokens) -> np.ndarray:
        matrices = captured.contributions(item, "alti")
        return np.asarray(
            attnflow.rollout(
                matrices, heads=None, residual=0.0, renormalize=True, rows=-1, layers="all"
            )
        )

    built = {
        "raw": raw,
        "rollout": rollout,
        "rollout (receptive_field, exclude=0)": rollout_decoder,
        "flow (exclude=0)": flow,
        "gradient rollout": gradient_rollout,
        "max attention": maximum,
        "gradient rollout (log-probability)": gradient_rollout_log,
        "max norm contribution": max_norm,
        "rollout of ALTI contributions": alti_rollout,
    }
    return {name: built[name] for name in methods}
