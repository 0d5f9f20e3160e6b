"""attnflow.explanation.Explanation: views, round trips and checks (framework-free)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest

from attnflow.explanation import Explanation
from attnflow.html import TokenView

TOKENS = ["[CLS]", "the", "<b>cat</b>", "sat", "[SEP]"]
SPECIAL = [True, False, False, False, True]


def _explanation() -> Explanation:
    rng = np.random.default_rng(0)
    rollout = rng.random((3, 5))
    rollout[:, 0] = 5.0  # a [CLS] sink that would wash out the colour scale
    return Explanation(
        TOKENS,
        {"raw": rng.random((3, 5)), "rollout": rollout, "gradient_rollout": rng.random(5)},
        rows=0,
        special=SPECIAL,
        target=1,
        predicted=1,
        probabilities=[0.2, 0.8],
        labels=["negative", "positive"],
        text="the cat sat",
    )


def test_show_prints_one_line_per_token_at_the_chosen_layer() -> None:
    e = _explanation()
    out = io.StringIO()
    e.show(layer=1, file=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "row 0 ([CLS]), layer 2 of 3; predicted 1 (positive), p = 0.800; target 1 (positive)"
    )
    assert lines[1].split() == ["token", "raw", "rollout", "gradient_rollout"]
    assert len(lines) == 2 + len(TOKENS)
    cat = lines[2 + 2].split()
    assert cat[0] == "<b>cat</b>"
    assert float(cat[1]) == pytest.approx(e.scores["raw"][1, 2], abs=5e-5)
    assert float(cat[3]) == pytest.approx(e.scores["gradient_rollout"][0, 2], abs=5e-5)


def test_special_tokens_stay_in_the_data_but_out_of_the_colour_scale(tmp_path: Path) -> None:
    e = _explanation()
    page = e.to_html(tmp_path / "e.html")
    assert (tmp_path / "e.html").read_text(encoding="utf-8") == page
    assert 'title="[CLS]: 5"' in page  # shown, with its value
    assert "&lt;b&gt;cat&lt;/b&gt;" in page  # escaped
    last = e.at_layer(-1)
    others = max(float(v[1:4].max()) for v in last.values())
    view = TokenView(last, TOKENS, scale_exclude=[0, 4])
    assert view.scale_max == pytest.approx(others)
    assert TokenView(last, TOKENS).scale_max == 5.0
    with pytest.raises(FileExistsError):
        e.to_html(tmp_path / "e.html")
    full = e.to_html(scale_special=True)
    assert full != page
    # In the page (the interactive view and its static fallback), the special tokens are
    # drawn out of the scale, not in its full colour; the words keep the scale's colours.
    spans = re.findall(r'<span class="attnflow-tok[^"]*"[^>]*>', page)
    assert len(spans) == 5 * (1 + 3)  # the interactive row, then one static row per method
    for i, span in enumerate(spans):
        assert ("attnflow-unscaled" in span) == SPECIAL[i % 5], span
        assert ("background-color" in span) != SPECIAL[i % 5], span
    assert page.count("></span>2 tokens left out of the scale)") == 2  # after its key
    unscaled = re.findall(r'<span class="[^"]*attnflow-unscaled', e.to_html(scale_special=True))
    assert unscaled == []  # every token on the scale: no token, no key drawn out of it


def test_dict_and_npz_round_trips_keep_everything(tmp_path: Path) -> None:
    e = _explanation()
    data = e.to_dict()
    json.dumps(data)  # serialisable as it is
    for copy in (Explanation.from_dict(data), Explanation.load(e.save(tmp_path / "e.npz"))):
        assert copy.tokens == e.tokens
        assert copy.scores.keys() == e.scores.keys()
        for name in e.scores:
            np.testing.assert_array_equal(copy.scores[name], e.scores[name])
        np.testing.assert_array_equal(copy.special, e.special)
        np.testing.assert_array_equal(copy.probabilities, e.probabilities)
        assert (copy.rows, copy.target, copy.predicted) == (0, 1, 1)
        assert (copy.labels, copy.text) == (e.labels, e.text)
    with np.load(tmp_path / "e.npz", allow_pickle=False) as stored:  # no pickle inside
        assert sorted(stored.files) == [
            "meta",
            "probabilities",
            "scores/gradient_rollout",
            "scores/raw",
            "scores/rollout",
        ]
    with pytest.raises(FileExistsError):
        e.save(tmp_path / "e.npz")


def test_plot_draws_one_map_per_method_scaled_without_special_tokens() -> None:
    pytest.importorskip("matplotlib")
    e = _explanation()
    figure = e.plot(methods=["raw", "rollout"])
    images = [image for ax in figure.axes for image in ax.get_images()]
    assert len(images) == 2
    assert all(image.get_clim()[1] < 5.0 for image in images)  # the sink does not set it
    with pytest.raises(ValueError, match="`methods` must name scored methods"):
        e.plot(methods=["flow"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tokens": "abc"}, TypeError, "`tokens` must be a sequence of str"),
        ({"scores": {}}, ValueError, "`scores` must be a non-empty mapping"),
        ({"scores": {"rollout": np.ones((2, 4))}}, ValueError, r"shape \(layers, 5\)"),
        ({"special": [True]}, ValueError, "`special` must hold one bool per token"),
        ({"predicted": 1.5}, TypeError, "`predicted` must be an int or None"),
    ],
)
def test_bad_arguments_are_refused_clearly(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    arguments: dict[str, object] = {"tokens": TOKENS, "scores": {"rollout": np.ones(5)}}
    arguments.update(kwargs)
    tokens, scores = arguments.pop("tokens"), arguments.pop("scores")
    with pytest.raises(error, match=match):
        Explanation(tokens, scores, **arguments)  # type: ignore[arg-type]


def test_scale_exclude_is_checked() -> None:
    with pytest.raises(IndexError, match="`scale_exclude` must index the 5 tokens"):
        TokenView(np.ones(5), TOKENS, scale_exclude=[5])
    with pytest.raises(TypeError, match="`scale_exclude` must hold token positions"):
        TokenView(np.ones(5), TOKENS, scale_exclude=[True])


def test_page_picks_method_and_layer_interactively_with_a_static_fallback(
    tmp_path: Path,
) -> None:
    e = _explanation()
    page = e.to_html(tmp_path / "e.html", layer=1)
    assert (tmp_path / "e.html").read_text(encoding="utf-8") == page
    found = re.findall(r'<script type="application/json" id="[^"]+">(.*?)</script>', page)
    assert len(found) == 1
    data = json.loads(found[0])
    assert [m["name"] for m in data["methods"]] == ["raw", "rollout", "gradient_rollout"]
    assert [m["layers"] for m in data["methods"]] == [3, 3, 1]
    for method in data["methods"]:
        stored = np.array(method["values"])[:, 0, 0]  # (layers, heads, rows, n)
        np.testing.assert_array_equal(stored, e.scores[method["name"]])
    assert data["rows"] == [0]
    assert data["inScale"] == [not s for s in SPECIAL]
    assert data["initial"]["layer"] == 1
    # Readers without scripts get every method at the chosen layer, as before.
    static = page.split("<noscript>", 1)[1]
    assert static.count('class="attnflow-label"') == 3
    assert "layer 2 of 3" in static
    assert "<script" not in e.to_html(scale_special=True).split("<noscript>", 1)[1]
    fragment = e._repr_html_()
    assert "<html" not in fragment
    assert fragment.count('type="application/json"') == 1
    with pytest.raises(IndexError, match="`layer` must index the 3 layers"):
        e.to_html(layer=3)


def test_one_method_at_one_layer_keeps_the_static_page() -> None:
    e = Explanation(TOKENS, {"flow": np.arange(5.0)}, special=SPECIAL)
    for text in (e.to_html(), e._repr_html_()):
        assert "<script" not in text
        assert 'title="sat: 3"' in text


def test_labels_of_some_classes_for_a_vocabulary(tmp_path):
    # A language model's classes are its vocabulary: only some token ids get a name.
    probabilities = np.full(50, 0.01)
    probabilities[7] = 0.51
    e = Explanation(
        ["The", " capital", " is"],
        {"rollout": np.array([0.5, 0.3, 0.2])},
        rows=2,
        predicted=7,
        probabilities=probabilities,
        labels={7: " Paris", 9: " Rome"},
        target=9,
    )
    assert e.labels == {7: " Paris", 9: " Rome"}
    heading = e._heading(None)
    assert "predicted 7 (' Paris'), p = 0.510" in heading
    assert "target 9 (' Rome')" in heading
    loaded = Explanation.load(e.save(tmp_path / "lm.npz"))
    assert loaded.labels == e.labels
    np.testing.assert_array_equal(loaded.probabilities, probabilities)
    with pytest.raises(TypeError, match="int class indices"):
        Explanation(["a"], {"m": np.ones(1)}, labels={"7": "x"})
    with pytest.raises(TypeError, match="sequence of class names or a mapping"):
        Explanation(["a"], {"m": np.ones(1)}, labels="ab")


def test_the_explained_position_never_sets_the_colour_scale(tmp_path):
    # Issue 22.10: [CLS] (the explained row) and specials take most of the mass; the
    # words must be readable. The page says what was left out, and shows their values.
    tokens = ["[CLS]", "the", "key", "is", "here", "[SEP]"]
    values = np.array([0.66, 0.02, 0.12, 0.03, 0.07, 0.10])
    e = Explanation(
        tokens,
        {"rollout": values},
        rows=0,
        special=[False] * 6,  # not marked special: the row is left out all the same
        notes=["A note on the scores."],
    )
    page = e.to_html()
    view = TokenView({"rollout": values}, tokens, scale_exclude=[0])
    assert view.scale_max == 0.12
    assert 'class="attnflow-tok attnflow-unscaled" title="[CLS]: 0.66"' in page
    assert "Left out of the colour scale" in page
    assert "A note on the scores." in page
    assert page.index("attnflow-note") < page.index('class="attnflow-view"')
    in_scale = Explanation(tokens, {"rollout": values}, rows=0).to_html(scale_special=True)
    assert "attnflow-unscaled" not in in_scale.split("</style>")[-1]
    assert "Left out of the colour scale" not in in_scale
    loaded = Explanation.load(e.save(tmp_path / "e.npz"))
    assert loaded.notes == ("A note on the scores.",)
    out = io.StringIO()
    e.show(file=out)
    assert out.getvalue().splitlines()[1] == "A note on the scores."
    with pytest.raises(TypeError, match="`notes` must be a sequence of str"):
        Explanation(tokens, {"rollout": values}, notes="one string")


def test_the_old_spelling_row_still_works_with_a_warning() -> None:
    # `row` was renamed `rows` (the core's name) before 0.1; it keeps working one release.
    tokens, values = ["[CLS]", "a", "b"], np.array([[0.2, 0.5, 0.3]])
    with pytest.warns(DeprecationWarning, match="`row` is renamed `rows`"):
        old = Explanation(tokens, {"rollout": values}, row=1)
    assert old.rows == 1
    with pytest.warns(DeprecationWarning, match="`Explanation.row` is renamed"):
        assert old.row == 1
    with pytest.raises(TypeError, match="pass `rows` only"):
        Explanation(tokens, {"rollout": values}, rows=2, row=1)
    # Files written before the rename (their metadata says "row") still load.
    data = Explanation(tokens, {"rollout": values}, rows=2).to_dict()
    data["row"] = data.pop("rows")
    assert Explanation.from_dict(data).rows == 2
