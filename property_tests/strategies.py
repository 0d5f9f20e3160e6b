"""Hypothesis strategies for valid attention tensors.

Logits are drawn and passed through a NumPy softmax, so every draw is a valid
row-stochastic tensor with no `assume` churn. Some draws cut keys out of rows (exact
zeros, as causal or sparse attention has), which is what makes min fusion leave rows
without mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

__all__ = ["AttentionCase", "attention_cases", "masks_for"]


@dataclass(frozen=True)
class AttentionCase:
    weights: np.ndarray  # (*batch, layers, heads, n, n), float64, rows sum to 1
    residual: float
    heads: str


@st.composite
def attention_tensors(
    draw: st.DrawFn,
    *,
    min_layers: int = 1,
    max_layers: int = 4,
    max_heads: int = 3,
    max_tokens: int = 6,
    batch: tuple[int, ...] | None = None,
) -> np.ndarray:
    if batch is None:
        batch = draw(st.sampled_from([(), (2,), (1, 2)]))
    n_layers = draw(st.integers(min_layers, max_layers))
    n_heads = draw(st.integers(1, max_heads))
    n = draw(st.integers(1, max_tokens))
    shape = (*batch, n_layers, n_heads, n, n)
    logits = draw(hnp.arrays(np.float64, shape, elements=st.floats(-6, 6, width=32)))
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    if draw(st.booleans()):
        cut = draw(hnp.arrays(np.bool_, shape))
        # Every row keeps one key, not always the same across heads, so that min fusion
        # can leave a row with no mass.
        kept = draw(hnp.arrays(np.intp, shape[:-1], elements=st.integers(0, n - 1)))
        cut &= np.arange(n) != kept[..., None]
        weights = np.where(cut, 0.0, weights)
    return weights / weights.sum(axis=-1, keepdims=True)


@st.composite
def attention_cases(draw: st.DrawFn, **kwargs: int) -> AttentionCase:
    weights = draw(attention_tensors(**kwargs))
    residual = draw(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0.0, 1.0))
    heads = draw(st.sampled_from(["mean", "max", "min"]))
    return AttentionCase(weights, residual, heads)


@st.composite
def masks_for(draw: st.DrawFn, batch: tuple[int, ...], n: int) -> np.ndarray:
    mask = draw(hnp.arrays(np.bool_, (*batch, n)))
    first_real = draw(st.integers(0, n - 1))
    mask[..., first_real] = True  # at least one real token per sequence
    return mask
