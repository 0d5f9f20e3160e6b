"""Small classifiers for the evaluation tests, one per backend of the matrix.

`TokenClassifier` maps token ids ``(B, n)`` (and an optional padding mask) to class
probabilities with position-dependent, non-additive evidence. `predict_for` runs it in a
backend's own library (array-API code: a PyTorch, JAX, under ``jax.jit`` for the jit
variant, Dask or array-api-strict model; TensorFlow through NumPy), so the evaluation
functions see the arrays each library's users pass. The reference loops in the tests call
the float64 NumPy version (`probabilities`) one perturbed sequence at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import array_api_compat
import numpy as np
from backends import Variant

__all__ = ["TokenClassifier", "predict_for"]


class TokenClassifier:
    """Embeddings, position weights, a tanh layer and a softmax over `classes`."""

    def __init__(self, vocabulary: int = 12, width: int = 5, classes: int = 3, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.embeddings = rng.normal(size=(vocabulary, width))
        self.position = rng.normal(size=(64, width))
        self.hidden = rng.normal(size=(width, width))
        self.output = rng.normal(size=(width, classes))

    def probabilities(self, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """NumPy forward pass: ``(B, n)`` ids to ``(B, classes)`` float64 probabilities."""
        n = ids.shape[1]
        states = np.tanh(self.embeddings[ids] + self.position[:n])
        if mask is not None:
            states = states * mask[..., None]
        pooled = np.tanh(states.sum(axis=1) @ self.hidden)
        logits = pooled @ self.output
        logits = logits - logits.max(axis=1, keepdims=True)
        e = np.exp(logits)
        return e / e.sum(axis=1, keepdims=True)


def predict_for(
    backend: Variant, model: TokenClassifier, dtype_name: str, *, calls: list[Any] | None = None
) -> Callable[..., Any]:
    """``predict(ids[, mask])`` taking and returning arrays of `backend`'s library."""

    def forward(ids: Any, mask: Any = None) -> Any:
        xp = array_api_compat.array_namespace(ids)
        device = array_api_compat.device(ids)
        dtype = getattr(xp, dtype_name)

        def weights(values: np.ndarray) -> Any:
            return xp.asarray(values, dtype=dtype, device=device)

        batch, n = ids.shape
        flat = xp.take(weights(model.embeddings), xp.reshape(ids, (-1,)), axis=0)
        states = xp.tanh(xp.reshape(flat, (batch, n, -1)) + weights(model.position[:n]))
        if mask is not None:
            states = states * xp.astype(mask, dtype)[..., None]
        pooled = xp.tanh(xp.sum(states, axis=1) @ weights(model.hidden))
        logits = pooled @ weights(model.output)
        logits = logits - xp.max(logits, axis=1, keepdims=True)
        e = xp.exp(logits)
        return e / xp.sum(e, axis=1, keepdims=True)

    compiled = backend.modules["jax"].jit(forward) if backend.jit else forward

    def predict(ids: Any, mask: Any = None) -> Any:
        if calls is not None:
            calls.append((ids, mask))
        if backend.library == "tensorflow":
            assert type(ids).__module__.startswith("tensorflow"), type(ids)
            host_mask = None if mask is None else mask.numpy()
            probabilities = model.probabilities(ids.numpy(), host_mask).astype(dtype_name)
            return backend.asarray(probabilities)
        expected = array_api_compat.array_namespace(backend.asarray(np.zeros(1)))
        assert array_api_compat.array_namespace(ids) is expected, type(ids)
        return compiled(ids) if mask is None else compiled(ids, mask)

    return predict
