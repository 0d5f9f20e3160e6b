"""Spans (issue 39, item 2): scores summed over words, sentences or character ranges.

The sums are checked against sums by hand over the tokens each span's characters overlap;
bad spans are refused before any work.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnflow._spans import check_token_spans, sum_spans, token_spans
from attnflow.explanation import Explanation

TEXT = "Cats sleep. Dogs don't!"
TOKENS = ["C", "ats", " sleep", ".", " Dogs", " don", "'t", "!"]
OFFSETS = [(0, 1), (1, 4), (4, 10), (10, 11), (11, 16), (16, 20), (20, 22), (22, 23)]


def _explanation(**kwargs: object) -> Explanation:
    scores = np.random.default_rng(0).random((3, len(TOKENS)))
    return Explanation(
        TOKENS,
        {"rollout": scores, "raw": scores[::-1]},
        rows=7,
        text=TEXT,
        offsets=OFFSETS,
        **kwargs,  # type: ignore[arg-type]
    )


def test_words_and_sentences_follow_the_offsets() -> None:
    words = token_spans(TEXT, OFFSETS, "words")
    assert words == [
        ("Cats", (0, 1)),
        ("sleep", (2,)),
        (".", (3,)),
        ("Dogs", (4,)),
        ("don't", (5, 6)),
        ("!", (7,)),
    ]
    assert token_spans(TEXT, OFFSETS, "sentences") == [
        ("Cats sleep.", (0, 1, 2, 3)),
        ("Dogs don't!", (4, 5, 6, 7)),
    ]
    assert token_spans(TEXT, OFFSETS, [(2, 8)]) == [("ts sle", (1, 2))]


def test_aggregate_sums_each_spans_tokens_at_every_layer(tmp_path: Path) -> None:
    e = _explanation(sinks=[0])
    for count_all in (True, False):
        words = e.aggregate("words", count_all=count_all)
        assert words.tokens == ("Cats", "sleep", ".", "Dogs", "don't", "!")
        values = e.scores["rollout"].copy()
        if not count_all:
            values[:, [0, 7]] = 0  # the sink and the explained token are not counted
        expected = [
            values[:, [0, 1]].sum(1),
            values[:, 2],
            values[:, 3],
            values[:, 4],
            values[:, [5, 6]].sum(1),
            values[:, 7],
        ]
        np.testing.assert_allclose(words.scores["rollout"], np.stack(expected, 1))
        assert words.rows == 5  # the span of the explained "!"
        assert words.sinks == ()  # "Cats" is not only the sink "C"
    assert e.aggregate("sentences").tokens == ("Cats sleep.", "Dogs don't!")
    page = e.aggregate("words").to_html(tmp_path / "words.html")
    assert "don&#x27;t" in page
    assert "Scores summed over spans of the text" in page


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        ([(5, 99)], r"inside the text \(0 <= start < end <= 23\); got \(5, 99\)"),
        ([(3, 3)], r"inside the text"),
        ("paragraphs", r'`spans` must be "words", "sentences" or a non-empty sequence'),
        ([(1, 2, 3)], r"character ranges \(start, end\), pairs of int"),
        ([], r"non-empty sequence"),
    ],
)
def test_bad_spans_are_refused(spans: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _explanation().aggregate(spans)


def test_spans_need_the_text_and_offsets() -> None:
    e = Explanation(TOKENS, {"rollout": np.ones(len(TOKENS))})
    with pytest.raises(ValueError, match=r"needs the text and the tokens' character offsets"):
        e.aggregate("words")
    with pytest.raises(ValueError, match=r"covers no token"):
        token_spans("ab  cd", [(0, 2), (4, 6)], [(2, 4)])


def test_token_spans_and_their_sums() -> None:
    spans = check_token_spans([(0, 2), [5, 3]], 6)
    assert spans == [("0:2", (0, 1)), ("5,3", (3, 5))]
    scores = np.arange(12.0).reshape(2, 6)
    np.testing.assert_array_equal(sum_spans(scores, spans), [[1, 8], [13, 20]])
    with pytest.raises(ValueError, match=r"0 <= start < end <= 6"):
        check_token_spans([(4, 7)], 6)
    with pytest.raises(ValueError, match=r"positions of the 6 tokens"):
        check_token_spans([[6]], 6)
    with pytest.raises(ValueError, match=r"aggregate\('words'\)"):
        check_token_spans("words", 6)
