"""Signed scores (direct_logit, alti_logit) drawn on a diverging scale centred at 0.

A scale starting at 0 drew a token that pushes the target down blank, like a token that
does nothing. The pages, the figures and the legend now draw a signed method on a
diverging, perceptually uniform scale with symmetric limits: checked here on the colours
they emit (the CSS of the pages, the RGBA of the figures' images, the page's script in
headless Chromium), the scale's uniformity from an independent sRGB -> CIELAB conversion,
and unsigned methods unchanged.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backends import selected_variants
from html_pages import parse, scale_legend

from attnflow import _colours
from attnflow.explanation import Explanation
from attnflow.generation import GenerationExplanation
from attnflow.html import InteractiveView, TokenView

TOKENS = ["<s>", "Paris", " is", " in", " France"]
#: A signed row: " is" pushes the target down, "Paris" up; one exact zero.
SIGNED = np.array([0.0, 2.0, -1.5, 0.5, -0.25])


def _rgb(css: str) -> tuple[int, int, int]:
    found = re.fullmatch(r"rgb\((\d+), (\d+), (\d+)\)", css)
    assert found is not None, css
    red, green, blue = (int(x) for x in found.groups())
    return red, green, blue


def _backgrounds(page: str) -> list[tuple[int, int, int]]:
    """The background colour of every token span drawn in the scale, in order."""
    return [
        _rgb(css)
        for css in re.findall(
            r'class="attnflow-tok[^"]*" style="background-color: (rgb\([^)]*\))', page
        )
    ]


def _page_data(page: str) -> dict[str, Any]:
    """The JSON data of the (first) interactive view of a page."""
    found = re.search(r'<script type="application/json"[^>]*>(.*?)</script>', page, re.DOTALL)
    assert found is not None
    data: dict[str, Any] = json.loads(found[1])
    return data


def _lab(rgb: np.ndarray) -> np.ndarray:
    """sRGB in [0, 1] -> CIELAB (D65), written out from the standards, not attnflow's code."""
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    matrix = np.array(
        [[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750],
         [0.0193339, 0.1191920, 0.9503041]]
    )  # fmt: skip
    xyz = linear @ matrix.T / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack(
        [116 * f[:, 1] - 16, 500 * (f[:, 0] - f[:, 1]), 200 * (f[:, 1] - f[:, 2])], axis=-1
    )


def test_the_signed_scale_is_diverging_light_at_zero_and_perceptually_uniform() -> None:
    palette = _colours.signed_palette(65)
    lab = _lab(palette)
    lightness = lab[:, 0]
    middle = 32
    assert lightness[middle] > 95  # near white at 0: a score of 0 reads as nothing
    # Lightness falls steadily with the size of the score on both sides (grey print).
    assert (np.diff(lightness[middle:]) < 0).all()
    assert (np.diff(lightness[: middle + 1]) > 0).all()
    np.testing.assert_allclose(lightness[0], lightness[-1], atol=0.5)  # symmetric
    # Equal steps of the score, equal steps of colour (CIE76 difference), to 3 %.
    steps = np.linalg.norm(np.diff(lab, axis=0), axis=1)
    assert steps.max() / steps.min() < 1.03
    # The ends are in the sRGB gamut (not clipped) and of opposite hues: blue, red.
    low, high = palette[0], palette[-1]
    assert low.min() > 0
    assert high.max() < 1
    assert low[2] > low[0]
    assert high[0] > high[2]


def test_a_signed_token_view_colours_negative_tokens_blue_on_a_symmetric_scale() -> None:
    page = TokenView(SIGNED, TOKENS, signed=True).to_html()
    colours = _backgrounds(page)
    top = float(np.abs(SIGNED).max())
    assert colours == [_colours.signed_rgb(float(v), top) for v in SIGNED]
    zero, up, down, _, slightly_down = colours
    assert down[2] > down[0] + 60
    assert up[0] > up[2] + 60
    assert min(zero) > 235  # near white at 0
    assert slightly_down[2] > slightly_down[0]  # small negatives are blue, not blank
    assert sum(down) < sum(slightly_down)  # and darker the more negative
    parse(page)
    assert scale_legend(page) == "-22"  # the legend runs from -2 to 2
    assert re.search(r"linear-gradient\(to right, rgb\(4, 92, 187\), .*rgb\(170, 52, 43\)\)", page)


def test_an_unsigned_token_view_is_unchanged() -> None:
    page = TokenView(SIGNED, TOKENS).to_html()
    colours = _backgrounds(page)
    assert colours[2] == (255, 255, 255)
    assert colours[4] == (255, 255, 255)
    assert colours[1] == (192, 57, 43)  # the default hue at the maximum
    assert scale_legend(page) == "02"


def test_explanation_pages_draw_signed_methods_diverging(tmp_path: Path) -> None:
    rollout = np.abs(SIGNED) / np.abs(SIGNED).sum()
    e = Explanation(TOKENS, {"direct_logit": SIGNED, "rollout": rollout}, rows=-1)
    page = e.to_html(tmp_path / "e.html")
    # The interactive view starts on direct_logit: on the diverging scale, ±2 (the
    # explained position, the last token, is left out of the scale).
    top = float(np.abs(SIGNED[:-1]).max())
    data = _page_data(page)
    assert [m["signed"] for m in data["methods"]] == [True, False]
    assert [tuple(stop) for stop in data["stops"]] == list(_colours.SIGNED_STOPS)
    drawn = _backgrounds(page.split("<noscript>")[0])
    assert drawn[2] == _colours.signed_rgb(-1.5, top)
    assert drawn[2][2] > drawn[2][0]
    # Without a signed method the page has no diverging scale.
    plain = Explanation(TOKENS, {"rollout": rollout}, rows=-1).to_html()
    assert "signed" not in plain or '"signed": true' not in plain
    assert all(min(c) >= 0 for c in _backgrounds(plain))
    assert "rgb(4, 92, 187)" not in plain


def test_the_generation_page_draws_a_signed_method_diverging() -> None:
    scores = np.zeros((2, 4))
    scores[0, :3] = [0.5, -1.0, 0.25]
    scores[1, :4] = [-0.2, 0.1, 0.4, -0.8]
    g = GenerationExplanation(
        ["<s>", "a", "b", " c", " d"],
        [7, 8],
        {"direct_logit": scores},
        prompt_length=3,
        prompt_ids=[1, 2, 3],
        special=[True, False, False, False, False],
    )
    page = g.to_html()
    data = _page_data(page)
    assert data["methods"][0]["signed"] is True
    colours = _backgrounds(page.split("<noscript>")[0])  # "<s>" is special: out of scale
    # Step 1 first: "a" scores -1.0, the largest in size of the tokens in the scale.
    assert colours[0] == _colours.signed_rgb(-1.0, 1.0) == _colours.SIGNED_STOPS[0]
    assert colours[1] == _colours.signed_rgb(0.25, 1.0)


def test_figures_draw_signed_scores_with_a_symmetric_diverging_norm() -> None:
    pytest.importorskip("matplotlib")
    from attnflow.plot import SIGNED_CMAP, layer_token_map, token_heatmap

    figure = token_heatmap(SIGNED, tokens=TOKENS, signed=True)
    image = figure.axes[0].images[0]
    assert image.get_cmap().name == SIGNED_CMAP
    assert (image.norm.vmin, image.norm.vmax) == (-2.0, 2.0)
    rgba = image.to_rgba(SIGNED[None, :])[0]
    assert rgba[2, 2] > rgba[2, 0] + 0.2  # " is" (-1.5): blue
    assert rgba[1, 0] > rgba[1, 2] + 0.2  # "Paris" (2.0): red
    assert rgba[0, :3].min() > 0.9  # 0: near white
    # The Explanation's figure: direct_logit diverging, rollout on its own scale.
    maps = np.stack([SIGNED, SIGNED * 0.5])
    e = Explanation(TOKENS, {"direct_logit": maps, "rollout": np.abs(maps) / 4}, rows=-1)
    figure = e.plot()
    first = figure.axes[0].images[0]
    assert first.norm.vmin == -first.norm.vmax
    assert first.to_rgba(maps)[1, 2, 2] > first.to_rgba(maps)[1, 2, 0]  # negative: blue
    # Unsigned maps keep the sequential default and limits from 0.
    plain = layer_token_map({"rollout": np.abs(maps)}, tokens=TOKENS)
    assert plain.axes[0].images[0].get_cmap().name == "magma_r"
    assert plain.axes[0].images[0].norm.vmin == 0.0


def test_signed_is_checked() -> None:
    with pytest.raises(TypeError, match="`signed` must be a bool"):
        TokenView(SIGNED, TOKENS, signed="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`signed` must name methods"):
        InteractiveView({"a": np.stack([SIGNED, SIGNED])}, TOKENS, signed=["b"])
    if "numpy" in {v.library for v in selected_variants()}:
        pytest.importorskip("matplotlib")
        from attnflow.plot import layer_token_map

        with pytest.raises(ValueError, match="one per map"):
            layer_token_map({"a": np.ones((2, 5))}, tokens=TOKENS, signed=[True, False])
