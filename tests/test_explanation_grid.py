"""Explanation on a patch grid (an image): checks, summary, figure, round trips
(framework-free; explain_image itself is tested in tests/adapters/test_explain_image.py)."""

from __future__ import annotations

import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from attnflow.explanation import Explanation

# CLS and one register, then 2 x 3 patches row by row.
TOKENS = ["[CLS]", "[REG1]", "(0,0)", "(0,1)", "(0,2)", "(1,0)", "(1,1)", "(1,2)"]
SPECIAL = [True, True, False, False, False, False, False, False]


def _explanation(image: object = None) -> Explanation:
    rollout = np.array(
        [
            [0.3, 0.2, 0.05, 0.05, 0.1, 0.1, 0.1, 0.1],
            [0.4, 0.1, 0.0, 0.1, 0.2, 0.05, 0.05, 0.1],
        ]
    )
    raw = rollout[:, ::-1].copy()
    return Explanation(
        TOKENS, {"raw": raw, "rollout": rollout}, special=SPECIAL, grid=(2, 3), image=image
    )


def test_the_grid_and_the_non_patch_tokens() -> None:
    e = _explanation()
    assert e.grid == (2, 3)
    assert e.extra_tokens == 2
    assert Explanation(["a", "b"], {"raw": [0.5, 0.5]}).extra_tokens == 0
    assert Explanation(["a", "b"], {"raw": [0.5, 0.5]}).grid is None


def test_show_summarises_the_patches() -> None:
    out = io.StringIO()
    _explanation().show(file=out, top=2)
    assert out.getvalue().splitlines() == [
        "row 0 ([CLS]), layer 2 of 2; 2 x 3 patches after 2 other tokens",
        "token            raw     rollout",
        "[CLS]         0.1000      0.4000",
        "[REG1]        0.0500      0.1000",
        "(1,2)         0.4000      0.1000",  # the top patches by the first method, raw
        "(0,1)         0.2000      0.1000",
        "patches (darkest . to brightest @, each map on its own scale):",
        "raw  rollout",
        ":+-  .+@",
        ".-@  --+",
    ]
    out = io.StringIO()
    _explanation().show(0, file=out, top=0)
    assert out.getvalue().splitlines()[1:4] == [
        "token            raw     rollout",
        "[CLS]         0.1000      0.3000",
        "[REG1]        0.1000      0.2000",
    ]
    with pytest.raises(ValueError, match="`top` must be an int >= 0"):
        _explanation().show(top=-1)


def test_plot_draws_each_method_over_the_image() -> None:
    pytest.importorskip("matplotlib")
    image = np.zeros((20, 30, 3), dtype=np.uint8)
    figure = _explanation(image).plot(methods=["rollout"], layer=0)
    panels = [axes for axes in figure.axes if axes.get_title()]
    assert [axes.get_title() for axes in panels] == ["rollout"]
    heat = panels[0].images[1].get_array()
    assert heat.shape == (20, 30)
    # Non-patch tokens left out: the colour scale spans the patch scores only.
    assert panels[0].images[1].get_clim() == (0.05, 0.1)
    # Without an image: the patch map alone, one block per patch.
    bare = _explanation().plot()
    heat = next(axes for axes in bare.axes if axes.get_title() == "raw").images[1].get_array()
    np.testing.assert_array_equal(heat, [[0.05, 0.2, 0.1], [0.0, 0.1, 0.4]])


def test_round_trips_keep_the_grid_and_the_image(tmp_path: Path) -> None:
    image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    e = _explanation(image)
    data = json.loads(json.dumps(e.to_dict()))
    for copy in (Explanation.from_dict(data), Explanation.load(e.save(tmp_path / "e.npz"))):
        assert copy.grid == (2, 3)
        assert copy.extra_tokens == 2
        assert copy.image is not None
        assert copy.image.dtype == np.uint8
        np.testing.assert_array_equal(copy.image, image)
        np.testing.assert_array_equal(copy.scores["rollout"], e.scores["rollout"])
    with np.load(tmp_path / "e.npz", allow_pickle=False) as saved:
        assert "image" in saved.files
        assert json.loads(str(saved["meta"]))["image"] is None  # stored as an array
    # A file from before grids existed reads as a text explanation.
    old = Explanation(["a", "b"], {"raw": [0.5, 0.5]}).to_dict()
    del old["grid"], old["image"]
    assert Explanation.from_dict(old).grid is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grid": (3, 3)}, r"has 9 patches, more than the 8 tokens"),
        ({"grid": (2, 0)}, "`grid` must be a pair of positive ints"),
        ({"grid": 6}, "`grid` must be a pair of positive ints"),
        ({"grid": None, "image": np.zeros((4, 4))}, "`image` needs `grid="),
        ({"image": np.zeros((4, 4, 2))}, r"`image` must have shape \(H, W\)"),
        ({"image": np.full((4, 4), 300)}, "8-bit values"),
    ],
)
def test_bad_grids_and_images_are_refused(kwargs: dict[str, object], match: str) -> None:
    arguments: dict[str, object] = {"grid": (2, 3), **kwargs}
    with pytest.raises(ValueError, match=match):
        Explanation(TOKENS, {"raw": np.ones(8) / 8}, **arguments)  # type: ignore[arg-type]


class Elements(HTMLParser):
    """The token spans and grid cells of a page, in order: (kind, label, value, section)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[str, str, str, str]] = []
        self.section = "view"
        self._open: list[str] | None = None
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "noscript":
            self.section = "noscript"
        classes = (dict(attrs).get("class") or "").split()
        if self._open is not None:
            self._depth += 1
        kind = next(
            (k for k in ("attnflow-tok", "attnflow-cell", "attnflow-grid") if k in classes), None
        )
        if kind == "attnflow-grid":
            self.found.append(("grid", "", "", self.section))
        elif kind is not None:
            self._open = [kind, "", dict(attrs).get("data-value") or ""]
            self._depth = 1

    def handle_endtag(self, tag: str) -> None:
        if self._open is not None:
            self._depth -= 1
            if not self._depth:
                kind, label, value = self._open
                self.found.append((kind.removeprefix("attnflow-"), label, value, self.section))
                self._open = None

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open[1] += data


def test_to_html_draws_the_patch_grid_below_the_non_patch_tokens(tmp_path: Path) -> None:
    e = _explanation()
    for text in (e.to_html(), e._repr_html_(), e.to_html(tmp_path / "e.html")):
        parser = Elements()
        parser.feed(text)
        raw = e.scores["raw"][-1]  # the first method at the last layer, shown first
        shown = [f"{v:.4g}" for v in raw]
        view = [found[:3] for found in parser.found if found[3] == "view"]
        assert view == [
            ("tok", "[CLS]", shown[0]),
            ("tok", "[REG1]", shown[1]),
            ("grid", "", ""),
            *(("cell", label, value) for label, value in zip(TOKENS[2:], shown[2:], strict=True)),
        ]
        # For readers without scripts: every method at that layer, each its own grid.
        static = [found[:2] for found in parser.found if found[3] == "noscript"]
        one = [
            ("tok", "[CLS]"),
            ("tok", "[REG1]"),
            ("grid", ""),
            *(("cell", t) for t in TOKENS[2:]),
        ]
        assert static == one * 2
        assert 'data-rows="2" data-cols="3"' in text
        # The non-patch tokens (special) are out of the scale; the patches on it.
        assert len(re.findall(r'class="attnflow-cell" style="background-color: rgb', text)) == 18
    # One method, one layer: the static view alone, with the grid.
    single = Explanation(TOKENS, {"flow": np.linspace(0, 1, 8)}, special=SPECIAL, grid=(2, 3))
    assert single.to_html().count('class="attnflow-cell"') == 6
    assert "<script" not in single.to_html()
    # A text explanation: a line of tokens, no grid.
    text = Explanation(["a", "b"], {"raw": [[0.5, 0.5], [0.2, 0.8]]}).to_html()
    assert 'class="attnflow-cell' not in text
    assert 'class="attnflow-row"' in text
