"""`attnflow.html.TokenView`: a well-formed, escaped, self-contained page of token scores."""

from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import attnflow
from attnflow._sample import load_sample
from attnflow.html import TokenView

VOID = {"meta", "br", "hr", "img", "input", "link"}


class Page(HTMLParser):
    """Parse a page, check tags nest, and collect the token spans."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.tags: list[str] = []
        self.errors: list[str] = []
        self.tokens: list[dict[str, str]] = []  # attributes plus "text"
        self.labels: list[str] = []
        self._in_token: dict[str, str] | None = None
        self._in_label = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        attributes = {name: value or "" for name, value in attrs}
        classes = attributes.get("class", "").split()
        if "attnflow-tok" in classes:
            self._in_token = {**attributes, "text": ""}
        if "attnflow-label" in classes:
            self._in_label = True
            self.labels.append("")
        if tag not in VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.open or self.open[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.open[-1] if self.open else None}>")
            return
        self.open.pop()
        if tag == "span" and self._in_token is not None:
            self.tokens.append(self._in_token)
            self._in_token = None
        self._in_label = False

    def handle_data(self, data: str) -> None:
        if self._in_token is not None:
            self._in_token["text"] += data
        if self._in_label:
            self.labels[-1] += data


def parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    assert page.errors == []
    assert page.open == []
    return page


def rgb(style: str) -> tuple[int, int, int]:
    match = re.search(r"background-color: rgb\((\d+), (\d+), (\d+)\)", style)
    assert match, style
    red, green, blue = (int(group) for group in match.groups())
    return red, green, blue


def test_page_is_well_formed_and_self_contained() -> None:
    view = TokenView(np.array([0.1, 0.7, 0.2]), ["[CLS]", "cats", "sleep"], title="rollout")
    text = view.to_html()
    assert text.startswith("<!DOCTYPE html>")
    page = parse(text)
    assert page.tags[:2] == ["html", "head"]
    assert "body" in page.tags
    assert "script" not in page.tags
    assert "link" not in page.tags
    assert "http" not in text  # no external resources
    assert "<title>rollout</title>" in text
    assert [token["text"] for token in page.tokens] == ["[CLS]", "cats", "sleep"]


def test_every_token_carries_its_value() -> None:
    scores = np.array([0.12345678, 0.5, 0.375, 0.0])
    tokens = ["a", "b", "c", "d"]
    page = parse(TokenView(scores, tokens).to_html())
    assert len(page.tokens) == 4
    for token, value, span in zip(tokens, scores, page.tokens, strict=True):
        assert float(span["data-value"]) == pytest.approx(value, rel=1e-3)
        name, shown = span["title"].rsplit(": ", 1)
        assert name == token
        assert float(shown) == pytest.approx(value, rel=1e-3)
    # The hover tooltip is CSS only.
    assert "content: attr(data-value)" in TokenView(scores, tokens).to_html()


def test_colour_goes_from_white_to_the_hue_by_value_over_max() -> None:
    scores = np.array([0.0, 0.25, 0.5, 1.0])
    page = parse(TokenView(scores, list("abcd"), color="#0000ff").to_html())
    colours = [rgb(span["style"]) for span in page.tokens]
    assert colours[0] == (255, 255, 255)
    assert colours[-1] == (0, 0, 255)
    assert colours[2] == (128, 128, 255)  # half the maximum: half way to the hue
    reds = [colour[0] for colour in colours]
    assert reds == sorted(reds, reverse=True)


def test_tokens_are_escaped() -> None:
    tokens = ["<script>alert(1)</script>", 'say "hi"', "a&b", "<b>"]
    view = TokenView(np.array([0.1, 0.2, 0.3, 0.4]), tokens, title="<i>x</i>")
    for text in (view.to_html(), view._repr_html_()):
        assert "<script>" not in text
        assert "<b>" not in text
        assert "<i>" not in text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
        page = parse(text)
        assert "script" not in page.tags
        # The parser unescapes them back to exactly the tokens.
        assert [span["text"] for span in page.tokens] == tokens
        assert [span["title"].rsplit(": ", 1)[0] for span in page.tokens] == tokens


def test_several_rows_share_one_scale() -> None:
    rows = {
        "raw": np.array([0.2, 0.3, 0.5]),
        "rollout": np.array([0.1, 0.8, 0.1]),
        "flow": np.array([0.3, 0.4, 0.3]),
    }
    view = TokenView(rows, ["x", "y", "z"], color="#ff0000")
    assert repr(view) == "TokenView(rows=['raw', 'rollout', 'flow'], tokens=3)"
    assert view.scale_max == pytest.approx(0.8)
    page = parse(view.to_html())
    assert page.labels == ["raw", "rollout", "flow"]
    assert len(page.tokens) == 9
    colours = [rgb(span["style"]) for span in page.tokens]
    # Only rollout's "y" (the largest value anywhere) reaches the full hue.
    assert colours.count((255, 0, 0)) == 1
    assert colours[4] == (255, 0, 0)
    # Equal values look equal in every row: 0.3 in raw and in flow.
    assert colours[1] == colours[6] == colours[8]


def test_repr_html_is_a_fragment_with_its_style() -> None:
    fragment = TokenView(np.array([0.5, 0.5]), ["a", "b"])._repr_html_()
    assert "<html" not in fragment
    assert "<!DOCTYPE" not in fragment
    assert fragment.startswith("<style>")
    assert len(parse(fragment).tokens) == 2


def test_save_writes_atomically_and_refuses_to_overwrite(tmp_path: Path) -> None:
    view = TokenView(np.array([0.4, 0.6]), ["a", "b"])
    target = tmp_path / "view.html"
    assert view.save(target) == target
    assert target.read_text(encoding="utf-8") == view.to_html()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]

    other = TokenView(np.array([0.9, 0.1]), ["c", "d"])
    with pytest.raises(FileExistsError, match=re.escape(str(target))):
        other.save(target)
    assert target.read_text(encoding="utf-8") == view.to_html()  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]  # no temp file

    other.save(str(target), overwrite=True)
    assert target.read_text(encoding="utf-8") == other.to_html()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]


def test_save_leaves_no_temp_file_when_writing_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    view = TokenView(np.array([0.4, 0.6]), ["a", "b"])

    def broken(self: TokenView) -> str:
        msg = "disk full"
        raise OSError(msg)

    monkeypatch.setattr(TokenView, "to_html", broken)
    with pytest.raises(OSError, match="disk full"):
        view.save(tmp_path / "view.html")
    assert list(tmp_path.iterdir()) == []


def test_with_real_rollout_and_flow(tmp_path: Path) -> None:
    sample = load_sample()
    n = int(sample.mask[0].sum())
    attentions, tokens = sample.attentions[0, :, :, :n, :n], sample.tokens[0][:n]
    position = tokens.index("[MASK]")
    rows: dict[str, Any] = {
        name: getattr(attnflow, name)(attentions, rows=position)
        for name in ("raw", "rollout", "flow")
    }
    path = TokenView(rows, tokens, title=sample.sentences[0]).save(tmp_path / "sample.html")
    page = parse(path.read_text(encoding="utf-8"))
    assert page.labels == ["raw", "rollout", "flow"]
    assert [span["text"] for span in page.tokens] == tokens * 3
    shown = np.array([float(span["data-value"]) for span in page.tokens]).reshape(3, n)
    np.testing.assert_allclose(shown, np.stack(list(rows.values())), rtol=1e-3)


def test_accepts_every_backend(backend: Any) -> None:
    native = backend.asarray(np.array([0.25, 0.75]), "float32")
    page = parse(TokenView(native, ["a", "b"]).to_html())
    assert [float(span["data-value"]) for span in page.tokens] == [0.25, 0.75]


def test_importing_attnflow_html_imports_no_plotting_library() -> None:
    code = (
        "import sys, attnflow.html\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'IPython'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


def test_bad_input_names_the_parameter(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`tokens` has 2 entries but `scores` has 3"):
        TokenView(np.ones(3), ["a", "b"])
    with pytest.raises(ValueError, match=r"`scores\['raw'\]` must be one row.*\(2, 2\)"):
        TokenView({"raw": np.ones((2, 2))}, ["a", "b"])
    with pytest.raises(ValueError, match=r"same 2 tokens; row 'flow' has 3"):
        TokenView({"raw": np.ones(2), "flow": np.ones(3)}, ["a", "b"])
    with pytest.raises(ValueError, match=r"`scores` is an empty mapping"):
        TokenView({}, ["a"])
    with pytest.raises(ValueError, match=r"`scores` must be finite"):
        TokenView(np.array([np.inf, 1.0]), ["a", "b"])
    with pytest.raises(TypeError, match=r"`tokens` must be a sequence of 2 strings"):
        TokenView(np.ones(2), "ab")
    with pytest.raises(ValueError, match=r"`color` must be a hex colour '#rrggbb'; got 'red'"):
        TokenView(np.ones(2), ["a", "b"], color="red")
    with pytest.raises(ValueError, match=r"`precision` must be a positive int; got 0"):
        TokenView(np.ones(2), ["a", "b"], precision=0)
