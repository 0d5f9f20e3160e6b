"""Properties of the value-aware token mixing for every attention block."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from oracle import oracle_contributions, oracle_rollout, oracle_terms

import attnflow

ATOL = 1e-9


@dataclass(frozen=True)
class Block:
    alpha: np.ndarray  # (B, H, n, n)
    values: np.ndarray  # (B, H, n, d)
    x: np.ndarray  # (B, n, d)
    bias: np.ndarray | None
    norm: tuple[np.ndarray, np.ndarray, float] | None


@st.composite
def blocks(draw: st.DrawFn) -> Block:
    batch = draw(st.integers(1, 2))
    heads, n, d = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(2, 5))
    floats = st.floats(-3, 3, width=32)
    logits = draw(hnp.arrays(np.float64, (batch, heads, n, n), elements=floats))
    alpha = np.exp(logits - logits.max(-1, keepdims=True))
    alpha /= alpha.sum(-1, keepdims=True)
    values = draw(hnp.arrays(np.float64, (batch, heads, n, d), elements=floats))
    x = draw(hnp.arrays(np.float64, (batch, n, d), elements=floats))
    bias = draw(st.none() | hnp.arrays(np.float64, (d,), elements=floats))
    norm = None
    if draw(st.booleans()):
        gamma = draw(hnp.arrays(np.float64, (d,), elements=st.floats(0.125, 2, width=32)))
        beta = draw(hnp.arrays(np.float64, (d,), elements=floats))
        norm = (gamma, beta, 1e-5)
    return Block(alpha, values, x, bias, norm)


def _forward(block: Block) -> np.ndarray:
    u = block.x + np.einsum("bhij,bhjd->bid", block.alpha, block.values)
    if block.bias is not None:
        u = u + block.bias
    if block.norm is None:
        return u
    gamma, beta, eps = block.norm
    centred = u - u.mean(-1, keepdims=True)
    return gamma * centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps) + beta


@given(blocks())
def test_terms_sum_to_the_block_output(block: Block) -> None:
    terms, offset = attnflow.attention_terms(
        block.alpha, block.values, block.x, bias=block.bias, norm=block.norm
    )
    output = _forward(block)
    scale = max(1.0, float(np.abs(output).max()))
    np.testing.assert_allclose(terms.sum(-2) + offset, output, atol=ATOL * scale * 1e3)


@given(blocks(), st.sampled_from(["norm", "globenc", "alti"]))
def test_matrices_match_the_oracle_and_compose(block: Block, method: str) -> None:
    matrices = attnflow.contributions(
        block.alpha, block.values, block.x, method=method, bias=block.bias, norm=block.norm
    )
    bias = np.zeros(block.x.shape[-1]) if block.bias is None else block.bias
    expected = np.stack(
        [
            oracle_contributions(
                block.alpha[b], block.values[b], block.x[b], bias, block.norm, method
            )
            for b in range(block.x.shape[0])
        ]
    )
    scale = max(1.0, float(np.abs(expected).max()))
    compared = np.ones(matrices.shape[:-1], dtype=bool)
    if method == "alti":
        # A row whose clipped contributions are rounding noise (every term within rounding
        # of no closer to y_i than nothing, e.g. constant values under a LayerNorm) is
        # normalised noise: ALTI is undefined there, so only the other rows are compared.
        for b in range(block.x.shape[0]):
            terms, offset, _ = oracle_terms(
                block.alpha[b], block.values[b], block.x[b], bias, block.norm
            )
            y = terms.sum(1) + offset
            size = np.abs(y).sum(-1)
            gain = size[:, None] - np.abs(y[:, None, :] - terms).sum(-1)
            compared[b] = np.maximum(gain, 0).sum(-1) > 1e-6 * (size + np.abs(terms).sum((1, 2)))
    np.testing.assert_allclose(matrices[compared], expected[compared], atol=1e-7 * scale, rtol=1e-7)
    assert np.all(matrices >= 0)
    if method == "alti":
        sums = matrices.sum(-1)
        assert np.all((np.abs(sums - 1) < 1e-9) | (sums == 0))
    # Rolled out over two layers with rows renormalised: rows sum to one.
    stacked = np.stack([matrices, matrices], axis=1)
    rolled = attnflow.rollout(stacked, heads=None, residual=0.0, normalize_layers=True)
    np.testing.assert_allclose(rolled.sum(-1), 1.0, atol=ATOL)
    safe = stacked.sum(-1, keepdims=True)
    eye = np.broadcast_to(np.eye(stacked.shape[-1]), stacked.shape)
    renormalised = np.where(safe > 0, stacked / np.where(safe > 0, safe, 1.0), eye)
    np.testing.assert_allclose(
        rolled, oracle_rollout(renormalised, heads=None, residual=0.0), atol=ATOL
    )
