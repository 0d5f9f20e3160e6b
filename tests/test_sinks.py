"""Attention sinks and the explained position (issue 39, item 1): the core rule and the views.

The shares are checked against a loop over the definition; the views against what they
must leave out of the colour scale and of the strongest sources.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from attnflow._sinks import SINK_SHARE, drop_self, find_sinks, sink_shares, top_sources
from attnflow.explanation import Explanation
from attnflow.generation import GenerationExplanation


def _causal(rng: np.random.Generator, layers: int, heads: int, n: int) -> np.ndarray:
    logits = rng.normal(size=(layers, heads, n, n))
    logits[..., np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]] = -np.inf
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True)


def test_shares_follow_their_definition() -> None:
    weights = _causal(np.random.default_rng(0), 3, 2, 7)
    expected = np.zeros(7)
    for k in range(6):
        expected[k] = np.mean(
            [weights[l, h, i, k] for l in range(3) for h in range(2) for i in range(k + 1, 7)]
        )
    np.testing.assert_allclose(sink_shares(weights), expected, rtol=1e-12)
    np.testing.assert_allclose(sink_shares(weights.mean(1)), expected, rtol=1e-12)


def test_the_first_position_and_a_planted_sink_are_found() -> None:
    weights = _causal(np.random.default_rng(1), 2, 2, 8)
    assert find_sinks(weights, threshold=0.99) == (0,)  # the first position always
    planted = weights.copy()
    planted[..., 4:, :] *= 0.3
    planted[..., 4:, 3] += 0.7  # every later query gives position 3 at least 0.7
    assert 3 in find_sinks(planted)
    assert 7 not in find_sinks(planted, threshold=1e-9)  # no query after the last
    with pytest.raises(ValueError, match=r"`threshold` must be a share in \(0, 1\]"):
        find_sinks(weights, threshold=0)
    assert SINK_SHARE == 0.3


def test_drop_self_zeroes_the_own_entry_and_renormalises() -> None:
    scores = np.random.default_rng(2).random((2, 3, 5))
    rows = [0, 2, -1]
    got = drop_self(scores, rows, renormalize=True)
    for j, r in enumerate(rows):
        expected = scores[:, j].copy()
        expected[:, r % 5] = 0
        np.testing.assert_allclose(got[:, j], expected / expected.sum(-1, keepdims=True))
    kept = drop_self(scores[:, 1], 2, renormalize=False)
    assert not kept[:, 2].any()
    np.testing.assert_array_equal(np.delete(kept, 2, -1), np.delete(scores[:, 1], 2, -1))
    square = drop_self(scores[0, :, :3], None, renormalize=False)
    assert not np.diag(square).any()
    assert top_sources(np.array([0.5, 0.2, 0.2, 0.1]), count=3, leave_out=[0]) == [1, 2, 3]


def _explanation() -> Explanation:
    tokens = ["The", " cat", " sat", " on", " the"]
    scores = {
        "gradient_rollout": [[3.0, 0.2, 0.5, 0.1, 0.0]],
        "rollout": [[0.9, 0.02, 0.03, 0.01, 0.04]],
    }
    return Explanation(tokens, scores, rows=4, sinks=[0])


def test_explanation_leaves_sinks_and_the_explained_token_out(tmp_path: Path) -> None:
    e = _explanation()
    assert e.top(2) == [2, 1]  # not the sink "The" (3.0), not the explained " the"
    assert e.top(5, method="rollout") == [2, 1, 3]
    assert e._excluded(scale_special=False) == [0, 4]
    page = e.to_html()
    assert "Attention sinks left out of the colour scale" in page
    assert "&#x27;The&#x27; (0)" in page
    data = json.loads(re.findall(r'id="[^"]+-data">(.*?)</script>', page)[0])
    assert data["inScale"] == [False, True, True, True, False]
    out = io.StringIO()
    e.show(file=out)
    assert "  gradient_rollout: ' sat' 0.5, ' cat' 0.2, ' on' 0.1" in out.getvalue()
    assert Explanation.from_dict(e.to_dict()).sinks == (0,)
    assert Explanation.load(e.save(tmp_path / "e.npz")).sinks == (0,)
    with pytest.raises(ValueError, match=r"`sinks` must hold positions of the 5 tokens"):
        Explanation(list(e.tokens), e.scores, sinks=[5])
    with pytest.raises(TypeError, match=r"`sinks` must hold token positions \(int\)"):
        Explanation(list(e.tokens), e.scores, sinks=[0.0])
    with pytest.raises(ValueError, match=r"`method` must be one of"):
        e.top(method="flow")


def test_generation_views_leave_sinks_and_predicting_positions_out(tmp_path: Path) -> None:
    tokens = ["The", " cat", " sat", " on", " it"]  # P = 3, T = 2
    rollout = np.array([[0.8, 0.05, 0.15, 0.0], [0.7, 0.1, 0.05, 0.15]])
    g = GenerationExplanation(
        tokens, [4, 5], {"rollout": rollout}, prompt_length=3, sinks=[0], self_excluded=True
    )
    out = io.StringIO()
    g.show(file=out)
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("Attention sinks left out")
    assert "set to 0 (exclude_self)" in lines[2]
    assert lines[4].split()[1:] == ["[1]", "'", "cat'", "0.05"]  # not 'The', not ' sat' (2)
    assert lines[6].split()[1:3] == ["[1]", "'"]  # ' cat' 0.1, then ' sat'; never ' on' (3)
    page = g.to_html()
    data = json.loads(re.findall(r'id="[^"]+-data">(.*?)</script>', page)[0])
    assert data["inScale"] == [False, True, True, True, True]
    assert "Attention sinks left out" in page
    assert "predicted at 2" in page
    copy = GenerationExplanation.load(g.save(tmp_path / "g.npz"))
    assert copy.sinks == (0,)
    assert copy.self_excluded
