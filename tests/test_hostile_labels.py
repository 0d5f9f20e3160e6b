"""Token and class names from the model are shortened and marked in titles (issue 40, item 7).

A model whose label names hold HTML put the whole payload in the explanation page's
``<title>`` and heading (escaped, so nothing ran, but it took over the line and read as the
page's own words). Plain labels are shown as before.
"""

from __future__ import annotations

import html
import re

import numpy as np

from attnflow._model_text import model_text
from attnflow.explanation import Explanation
from attnflow.html import InteractiveView

PAYLOAD = '<img src=x onerror="alert(document.domain)">' * 20
TOKENS = ["<s>" + PAYLOAD, "the", "cat"]


def _explanation(labels: list[str], tokens: list[str] = TOKENS) -> Explanation:
    rng = np.random.default_rng(7)
    return Explanation(
        tokens,
        {"rollout": rng.random((2, 3)), "raw": rng.random((2, 3))},
        rows=0,
        predicted=1,
        probabilities=[0.3, 0.7],
        labels=labels,
    )


def _title(page: str) -> str:
    match = re.search(r"<title>(.*?)</title>", page, re.DOTALL)
    assert match is not None
    return html.unescape(match.group(1))


def test_a_hostile_label_and_token_are_shortened_and_marked_in_the_title() -> None:
    page = _explanation(["negative", PAYLOAD]).to_html()
    title = _title(page)
    assert len(title) < 160, title
    assert title.count("model text '") == 2, title  # the row's token and the class
    assert PAYLOAD not in title
    assert PAYLOAD[:40] not in title
    heading = re.search(r'<div class="attnflow-title">(.*?)</div>', page)
    assert heading is not None
    assert html.unescape(heading.group(1)) == title


def test_the_status_line_and_row_menu_mark_hostile_tokens() -> None:
    view = InteractiveView(
        {"rollout": np.full((1, 2, 3, 3), 1 / 3)}, TOKENS, rows=[0, 1, 2], title="t"
    )
    page = view.to_html()
    status = re.search(r'data-output="status">(.*?)<', page)
    assert status is not None
    assert "row 0 (model text '<s><img" in html.unescape(status.group(1))
    assert len(html.unescape(status.group(1))) < 120
    options = re.findall(r"<option value=\"\d\"(?: selected)?>(.*?)</option>", page)
    assert any(o.startswith("0: model text ") for o in options), options
    assert view._data()["headings"][0] == model_text(TOKENS[0])  # the script's status line


def test_plain_labels_are_shown_as_before() -> None:
    e = _explanation(["negative", "positive"], tokens=["[CLS]", "the", "cat"])
    assert e._heading(None) == "row 0 ([CLS]); predicted 1 (positive), p = 0.700"
    assert model_text(" Paris") == " Paris"
    assert model_text("x" * 33).startswith("model text 'xxx")
    assert model_text("a\nb") == "model text 'a\\nb'"
