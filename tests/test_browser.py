"""The HTML token views as a person sees them: rendered by headless Chromium (Debian's)."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backends import selected_variants
from devtools import Browser

import attnflow
from attnflow._sample import load_sample
from attnflow.html import InteractiveView, TokenView, _token_style

# The look of tokens left out of the colour scale (attnflow-unscaled in the style sheet):
# a grey that no ramp from white to the default hue passes through, a dashed outline.
NEUTRAL = "rgb(238, 238, 238)"

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("ATTNFLOW_REQUIRE_BROWSER"):
            pytest.fail("ATTNFLOW_REQUIRE_BROWSER is set but chromium is not installed")
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    return found


def _cls_rows_of_the_sample() -> tuple[list[str], dict[str, np.ndarray]]:
    """The real tokens of the shipped sample's first sentence, and its [CLS] rollout and flow."""
    sample = load_sample()
    real = np.flatnonzero(sample.mask[0])
    tokens = [sample.tokens[0][i] for i in real]
    one = sample.attentions[:1][..., real, :][..., real]
    return tokens, {
        "rollout": attnflow.rollout(one, rows=0)[0],
        "flow": attnflow.flow(one, rows=0)[0],
    }


def test_token_view_renders_in_headless_chromium(tmp_path: Path) -> None:
    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.skip("rendered once per matrix run, in the numpy session")
    chromium = _chromium()
    tokens, rows = _cls_rows_of_the_sample()
    page = TokenView(rows, tokens, title="[CLS]").save(tmp_path / "view.html")
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]

    dom = subprocess.run(
        [chromium, *FLAGS, *profile, "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert dom.count('class="attnflow-tok"') == 2 * len(tokens)
    best = tokens[int(np.argmax(rows["flow"]))]
    assert f'title="{best}: ' in dom

    shot = tmp_path / "view.png"
    subprocess.run(
        [chromium, *FLAGS, *profile, f"--screenshot={shot}", "--window-size=900,300",
         page.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    assert shot.read_bytes()[:4] == b"\x89PNG"
    image = pytest.importorskip("matplotlib.image").imread(shot)
    # Something is drawn in colour: the highest-scoring token's background is not white.
    coloured = (np.abs(image[..., 0] - image[..., 1]) > 0.2).sum()
    assert coloured > 100


# What the browser shows of every token after each input: value, tooltip, computed
# background, outline and class, whether it is the explained row; and the view's stated
# scale and choice.
SNAPSHOT = """(function () {
  var root = document.querySelector(".attnflow-interactive"), shown = {values: [],
    titles: [], colours: [], borders: [], unscaled: [], current: [],
    status: root.querySelector('[data-output="status"]').textContent,
    max: root.querySelector('[data-output="max"]').textContent,
    scale: root.querySelector(".attnflow-scale").textContent,
    headHidden: root.querySelector('[data-control="head-label"]').hidden};
  root.querySelectorAll(".attnflow-tok").forEach(function (span) {
    shown.values.push(span.getAttribute("data-value"));
    shown.titles.push(span.title);
    shown.colours.push(getComputedStyle(span).backgroundColor);
    shown.borders.push(getComputedStyle(span).borderTopStyle);
    shown.unscaled.push(span.classList.contains("attnflow-unscaled"));
    shown.current.push(span.getAttribute("aria-current") === "true");
  });
  return shown;
})()"""


def test_token_view_draws_excluded_tokens_neutral_in_headless_chromium(tmp_path: Path) -> None:
    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.skip("rendered once per matrix run, in the numpy session")
    chromium = _chromium()
    tokens, rows = _cls_rows_of_the_sample()
    n = len(tokens)
    assert all(float(v[0]) > float(v[1:-1].max()) for v in rows.values())  # [CLS], a sink
    view = TokenView(rows, tokens, scale_exclude=[0, n - 1])
    page = view.save(tmp_path / "view.html")
    looks = """(function () {
      function look(element) {
        var style = getComputedStyle(element);
        return [style.backgroundColor, style.borderTopStyle, style.borderTopColor, style.color];
      }
      var all = document.querySelectorAll(".attnflow-tok");
      var spans = Array.prototype.map.call(all, look);
      var after = Array.prototype.map.call(all, function (element) {
        return getComputedStyle(element, "::after").content;
      });
      return {spans: spans, after: after, key: look(document.querySelector(".attnflow-key")),
              scale: document.querySelector(".attnflow-scale").textContent};
    })()"""
    browser = Browser(chromium, FLAGS, page.as_uri(), tmp_path / "profile")
    try:
        browser.wait_for("document.querySelector('.attnflow-key') !== null")
        shown = browser.evaluate(looks)
    finally:
        browser.close()
    top = view.scale_max
    for r, values in enumerate(rows.values()):
        for i, value in enumerate(values):
            background, border, _, _ = shown["spans"][r * n + i]
            if i in (0, n - 1):  # the neutral look, as the legend's key, and the value
                assert shown["spans"][r * n + i] == shown["key"], (r, i)
                assert (background, border) == (NEUTRAL, "dashed"), (r, i)
                assert shown["after"][r * n + i] == f'"{float(value):.4g}"', (r, i)
            else:  # the ramp, whatever the sinks' values; the value only on hover
                assert background == view._background(float(value))[0], (r, i)
                assert border == "solid", (r, i)
                assert shown["after"][r * n + i] == "none", (r, i)
    assert shown["scale"].endswith(f"{top:.4g} (2 tokens left out of the scale)")


def _assert_shows(
    step: dict[str, Any],
    values: np.ndarray,
    tokens: list[str],
    in_scale: np.ndarray,
    row: int,
    index: int,
) -> float:
    """Check that every token shows its entry of `values`; return the scale's top.

    Value, tooltip, computed background (tokens in the scale on its ramp, the others
    neutral whatever their value), border and the current-row marker.
    """
    top = max(0.0, float(values[in_scale].max()))
    shown = [f"{float(v):.4g}" for v in values]
    assert step["values"] == shown, index
    assert step["titles"] == [f"{t}: {s}" for t, s in zip(tokens, shown, strict=True)]
    colours = [
        _token_style(float(v), top, (192, 57, 43))[0] if inside else NEUTRAL
        for v, inside in zip(values, in_scale, strict=True)
    ]
    assert step["colours"] == colours, index
    assert step["borders"] == ["solid" if inside else "dashed" for inside in in_scale]
    assert step["current"] == [i == row for i in range(len(values))], index
    return top


def test_interactive_view_follows_its_controls_in_headless_chromium(tmp_path: Path) -> None:
    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.skip("rendered once per matrix run, in the numpy session")
    chromium = _chromium()
    sample = load_sample()
    real = np.flatnonzero(sample.mask[0])
    tokens = [sample.tokens[0][i] for i in real]
    tokens[1] = "</script><b>x</b>"  # must stay text, and not end the page's scripts
    weights = sample.attentions[0][..., real, :][..., real]  # (layers, heads, n, n)
    layers, heads, n = weights.shape[0], weights.shape[1], len(tokens)
    view = InteractiveView(
        {"rollout": attnflow.rollout(weights, layers="all"), "raw": weights},
        tokens,
        scale_exclude=[0, n - 1],
    )
    page = view.save(tmp_path / "view.html")
    first = page.read_text(encoding="utf-8")  # as drawn before the script runs

    def focus(control: str) -> None:
        browser.evaluate(f"document.querySelector('[data-control=\"{control}\"]').focus()")

    # Each step is a person's input (keys on the focused control, a mouse click), then
    # the (method, layer, head, row) it must lead to.
    steps = [
        (lambda: None, ("rollout", layers - 1, 0, 0)),
        (lambda: (focus("method"), browser.press("ArrowDown")), ("raw", layers - 1, 0, 0)),
        (lambda: (focus("head"), browser.press("ArrowRight", 2)), ("raw", layers - 1, 2, 0)),
        (lambda: (focus("layer"), browser.press("ArrowLeft", layers - 2)), ("raw", 1, 2, 0)),
        (lambda: (focus("row"), browser.press("ArrowDown", 3)), ("raw", 1, 2, 3)),
        (lambda: browser.click(".attnflow-tok", 2), ("raw", 1, 2, 2)),
        # From the head slider, Tab walks the tokens; Enter explains the focused one.
        (
            lambda: (focus("head"), browser.press("Tab", 6), browser.press("Enter")),
            ("raw", 1, 2, 5),
        ),
        (lambda: browser.press("Tab"), ("raw", 1, 2, 5)),  # focus moves, nothing else
        (lambda: browser.press(" "), ("raw", 1, 2, 6)),
        (lambda: (focus("method"), browser.press("ArrowUp")), ("rollout", 1, 0, 6)),
    ]
    browser = Browser(chromium, FLAGS, page.as_uri(), tmp_path / "profile")
    try:
        # The view's script marks it ready once it has wired the controls and drawn.
        browser.wait_for("document.querySelector('[data-ready=\"1\"]') !== null")
        in_scale = np.ones(n, dtype=bool)
        in_scale[[0, -1]] = False
        for index, (act, (method, layer, head, row)) in enumerate(steps):
            act()
            step = browser.evaluate(SNAPSHOT)
            where = f"{method}, layer {layer + 1} of {layers}, row {row} ({tokens[row]})"
            if method == "raw":
                where += f", head {head + 1} of {heads}"
            assert step["status"] == where, index
            values = view.scores[method][layer, head, row]
            top = _assert_shows(step, values, tokens, in_scale, row, index)
            assert step["unscaled"] == (~in_scale).tolist(), index
            assert step["max"] == f"{top:.4g}"
            assert step["scale"].endswith(f"{top:.4g} (2 tokens left out of the scale)")
            assert step["headHidden"] == (method == "rollout")
            if index == 0:  # the script redraws exactly what the page drew without it
                assert re.findall(r'data-value="([^"]*)"', first) == step["values"]
                drawn = re.findall(r'class="attnflow-tok[^"]*"(?: style="[^"]*")?', first)
                assert ["attnflow-unscaled" in span for span in drawn] == step["unscaled"]
                colours = re.findall(r"background-color: (rgb\([^)]*\))", first)
                inside = zip(step["colours"], step["unscaled"], strict=True)
                assert colours == [colour for colour, out in inside if not out]
        assert browser.evaluate("document.activeElement.tagName") == "SELECT"
        shot = browser.call("Page.captureScreenshot", format="png")["data"]
        assert base64.b64decode(shot)[:4] == b"\x89PNG"
    finally:
        browser.close()


# Where the browser draws each grid cell, and how it shows every token and cell.
GRID_SNAPSHOT = """(function () {
  var root = document.querySelector(".attnflow-interactive"), shown = {values: [],
    titles: [], colours: [], borders: [], current: [], kinds: [], boxes: [],
    status: root.querySelector('[data-output="status"]').textContent};
  root.querySelectorAll(".attnflow-tok, .attnflow-cell").forEach(function (element) {
    var box = element.getBoundingClientRect();
    shown.values.push(element.getAttribute("data-value"));
    shown.titles.push(element.title);
    shown.colours.push(getComputedStyle(element).backgroundColor);
    shown.borders.push(getComputedStyle(element).borderTopStyle);
    shown.current.push(element.getAttribute("aria-current") === "true");
    shown.kinds.push(element.classList.contains("attnflow-cell") ? "cell" : "tok");
    shown.boxes.push([box.left, box.top, box.width, box.height]);
  });
  return shown;
})()"""


def test_interactive_grid_lays_out_and_follows_its_controls_in_headless_chromium(
    tmp_path: Path,
) -> None:
    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.skip("rendered once per matrix run, in the numpy session")
    chromium = _chromium()
    rows, cols, extra = 3, 5, 2  # not square: rows and columns cannot be mistaken
    tokens = ["[CLS]", "[REG1]"] + [f"({r},{c})" for r in range(rows) for c in range(cols)]
    n = len(tokens)
    rng = np.random.default_rng(7)
    weights = rng.random((3, 2, n, n)) ** 4  # (layers, heads, n, n), uneven
    weights /= weights.sum(-1, keepdims=True)
    excluded = [0, 1, extra + 6]  # the non-patch tokens and the patch (1,1)
    view = InteractiveView(
        {"rollout": attnflow.rollout(weights, layers="all"), "raw": weights},
        tokens,
        scale_exclude=excluded,
        grid=(rows, cols),
    )
    page = view.save(tmp_path / "view.html")
    in_scale = np.ones(n, dtype=bool)
    in_scale[excluded] = False

    def focus(control: str) -> None:
        browser.evaluate(f"document.querySelector('[data-control=\"{control}\"]').focus()")

    steps = [
        (lambda: None, ("rollout", 2, 0, 0)),
        (lambda: (focus("method"), browser.press("ArrowDown")), ("raw", 2, 0, 0)),
        (lambda: (focus("layer"), browser.press("ArrowLeft", 2)), ("raw", 0, 0, 0)),
        (lambda: (focus("head"), browser.press("ArrowRight")), ("raw", 0, 1, 0)),
        # A click on the cell (1,3) explains its row; Enter on the focused (2,0) too.
        (lambda: browser.click(".attnflow-cell", cols + 3), ("raw", 0, 1, extra + cols + 3)),
        (
            lambda: (
                browser.evaluate(
                    f"document.querySelectorAll('.attnflow-cell')[{2 * cols}].focus()"
                ),
                browser.press("Enter"),
            ),
            ("raw", 0, 1, extra + 2 * cols),
        ),
        (lambda: (focus("layer"), browser.press("ArrowRight")), ("raw", 1, 1, extra + 2 * cols)),
        (lambda: (focus("method"), browser.press("ArrowUp")), ("rollout", 1, 0, extra + 2 * cols)),
    ]
    browser = Browser(chromium, FLAGS, page.as_uri(), tmp_path / "profile")
    try:
        browser.wait_for("document.querySelector('[data-ready=\"1\"]') !== null")
        for index, (act, (method, layer, head, row)) in enumerate(steps):
            act()
            step = browser.evaluate(GRID_SNAPSHOT)
            where = f"{method}, layer {layer + 1} of 3, row {row} ({tokens[row]})"
            if method == "raw":
                where += f", head {head + 1} of 2"
            assert step["status"] == where, index
            assert step["kinds"] == ["tok"] * extra + ["cell"] * (rows * cols)
            # Every token and cell shows its entry of the array: value, tooltip, colour.
            _assert_shows(step, view.scores[method][layer, head, row], tokens, in_scale, row, index)
            # The cells in rows x cols: a grid row shares its top, columns go left to right,
            # rows top to bottom; cells are square; the leading tokens are above the grid.
            boxes = np.array(step["boxes"])
            cells = boxes[extra:].reshape(rows, cols, 4)
            left, top_edge, width, height = (cells[..., k] for k in range(4))
            assert (top_edge == top_edge[:, :1]).all(), index
            assert (np.diff(left, axis=1) > 0).all(), index
            assert (left == left[:1]).all(), index
            assert (np.diff(top_edge, axis=0) > 0).all(), index
            assert (width == height).all(), index
            assert (width > 10).all(), index
            assert (boxes[:extra, 1] + boxes[:extra, 3] <= top_edge.min()).all(), index
        shot = browser.call("Page.captureScreenshot", format="png")["data"]
        assert base64.b64decode(shot)[:4] == b"\x89PNG"
    finally:
        browser.close()


# The patch grids of a page as drawn: the picture under each, and every cell's colour.
IMAGE_GRID_SNAPSHOT = """(function () {
  var grids = Array.prototype.map.call(document.querySelectorAll(".attnflow-grid"),
    function (grid) {
      var box = grid.getBoundingClientRect(), style = getComputedStyle(grid);
      return {image: style.backgroundImage, size: style.backgroundSize,
              box: [box.left, box.top, box.width, box.height], inView:
                grid.closest("noscript") === null && box.width > 0};
    });
  var root = document.querySelector(".attnflow-interactive");
  var cells = Array.prototype.map.call(root.querySelectorAll(".attnflow-cell"),
    function (cell) {
      var box = cell.getBoundingClientRect();
      /* A point a fifth of the way into the cell: clear of its centred label. */
      return [getComputedStyle(cell).backgroundColor, box.left + box.width / 5,
              box.top + box.height / 5];
    });
  return {grids: grids, cells: cells, dpr: window.devicePixelRatio};
})()"""


def _rgba(css: str) -> tuple[float, float, float, float]:
    """Parse a computed CSS colour, "rgb(r, g, b)" or "rgba(r, g, b, a)"."""
    numbers = [float(x) for x in re.findall(r"[\d.]+", css)]
    return (*numbers[:3], numbers[3] if len(numbers) == 4 else 1.0)  # type: ignore[return-value]


def test_image_explanation_page_draws_the_picture_under_its_grid_in_headless_chromium(
    tmp_path: Path,
) -> None:
    """The picture the model saw lies under the patch grid and shows through its cells."""
    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.skip("rendered once per matrix run, in the numpy session")
    from png_reference import read_png

    from attnflow._png import png_data_url
    from attnflow.explanation import Explanation

    chromium = _chromium()
    rows, cols, patch = 3, 4, 16
    # Each patch one flat colour, so the pixel under a cell's centre is known exactly.
    rng = np.random.default_rng(3)
    colours = rng.integers(20, 236, size=(rows, cols, 3), dtype=np.uint8)
    image = np.repeat(np.repeat(colours, patch, axis=0), patch, axis=1)  # (48, 64, 3)
    tokens = ["[CLS]"] + [f"({r},{c})" for r in range(rows) for c in range(cols)]
    n = len(tokens)
    scores = rng.random((2, 2, n))  # (methods, layers, n)
    scores[0, -1, 1 + 5] = 0.0  # patch (1,1): a score of 0, the picture alone
    explanation = Explanation(
        tokens,
        {"rollout": scores[0], "flow": scores[1]},
        special=[True] + [False] * (n - 1),
        grid=(rows, cols),
        image=image,
    )
    page = tmp_path / "image.html"
    explanation.to_html(page)
    browser = Browser(chromium, [*FLAGS, "--window-size=900,900"], page.as_uri(), tmp_path / "p")
    try:
        browser.wait_for("document.querySelector('[data-ready=\"1\"]') !== null")
        before = browser.evaluate(IMAGE_GRID_SNAPSHOT)
        (grid,) = [g for g in before["grids"] if g["inView"]]
        left, top, width, height = grid["box"]
        clip = {"x": left, "y": top, "width": width, "height": height, "scale": 1}
        shot = browser.call("Page.captureScreenshot", format="png", clip=clip)["data"]
        browser.evaluate(
            "(function () { var m = document.querySelector('[data-control=\"method\"]');"
            " m.value = '1'; m.dispatchEvent(new Event('change')); })()"
        )
        after = browser.evaluate(IMAGE_GRID_SNAPSHOT)
    finally:
        browser.close()
    # The grid has the picture under it, stretched to the grid: the PNG attnflow encoded
    # (the static grids for readers without scripts, in <noscript>, name it too).
    url = png_data_url(image)
    assert [g["image"] for g in before["grids"]] == [f'url("{url}")']
    assert grid["size"] == "100% 100%"
    assert page.read_text(encoding="utf-8").count(f"--attnflow-image: url('{url}')") == 2
    # Each cell in the scale is the hue (192, 57, 43) at an opacity of 0.75 x score / max,
    # before and after the script recolours the cells for another method.
    for shown, method in ((before, 0), (after, 1)):
        values = scores[method, -1, 1:]
        for (css, _, _), value in zip(shown["cells"], values, strict=True):
            red, green, blue, alpha = _rgba(css)
            assert (red, green, blue) == (192, 57, 43)
            assert alpha == pytest.approx(0.75 * value / values.max(), abs=1 / 255 + 1e-3)
    # What a person sees: in each cell the blend of the hue over the picture's pixel there
    # (exactly the picture where the score is 0).
    pixels = read_png(base64.b64decode(shot))[..., :3].astype(float)
    scale = before["dpr"]
    values = scores[0, -1, 1:]
    for index, (css, x, y) in enumerate(before["cells"]):
        alpha = _rgba(css)[3]
        below = colours[index // cols, index % cols].astype(float)
        blend = alpha * np.array([192.0, 57.0, 43.0]) + (1 - alpha) * below
        seen = pixels[round((y - top) * scale), round((x - left) * scale)]
        assert np.abs(seen - blend).max() <= 4, (index, seen, blend)
        if values[index] == 0:
            assert np.abs(seen - below).max() <= 2


def test_interactive_view_draws_a_signed_method_diverging_in_headless_chromium(
    tmp_path: Path,
) -> None:
    """The script colours a signed method on the diverging scale as the page drew it."""
    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.skip("rendered once per matrix run, in the numpy session")
    from attnflow import _colours

    chromium = _chromium()
    tokens = ["<s>", "Paris", " is", " in", " France"]
    signed = np.array([[0.0, 1.0, -0.5, 0.25, 0.1], [0.0, 2.0, -1.5, 0.5, -0.25]])
    unsigned = np.abs(signed) / 4
    view = InteractiveView(
        {"direct_logit": signed, "rollout": unsigned}, tokens, signed=["direct_logit"]
    )
    page = view.save(tmp_path / "signed.html")
    first = page.read_text(encoding="utf-8")
    browser = Browser(chromium, FLAGS, page.as_uri(), tmp_path / "profile")
    try:
        browser.wait_for("document.querySelector('[data-ready=\"1\"]') !== null")
        step = browser.evaluate(SNAPSHOT)
        top = 2.0  # the last layer's largest absolute score
        expected = [
            "rgb({}, {}, {})".format(*_colours.signed_rgb(float(v), top)) for v in signed[1]
        ]
        assert step["colours"] == expected
        assert re.findall(r"background-color: (rgb\([^)]*\))", first) == expected
        blue = _colours.SIGNED_STOPS[0]
        assert step["colours"][2] != "rgb(255, 255, 255)"  # a negative token is not blank
        assert step["scale"] == "-22"
        assert "rgb({}, {}, {})".format(*blue) in browser.evaluate(
            "document.querySelector('[data-output=\"bar\"]').style.background"
        )
        # An unsigned method: the ramp from white, its legend from 0.
        browser.evaluate("document.querySelector('[data-control=\"method\"]').focus()")
        browser.press("ArrowDown")
        step = browser.evaluate(SNAPSHOT)
        top = float(unsigned[1].max())
        assert step["colours"] == [
            _token_style(float(v), top, (192, 57, 43))[0] for v in unsigned[1]
        ]
        assert step["scale"] == f"0{top:.4g}"
        # Back to the signed method, at the first layer: its own symmetric scale.
        browser.evaluate("document.querySelector('[data-control=\"method\"]').focus()")
        browser.press("ArrowUp")
        browser.evaluate("document.querySelector('[data-control=\"layer\"]').focus()")
        browser.press("ArrowLeft")
        step = browser.evaluate(SNAPSHOT)
        assert step["colours"] == [
            "rgb({}, {}, {})".format(*_colours.signed_rgb(float(v), 1.0)) for v in signed[0]
        ]
        assert step["scale"] == "-11"
    finally:
        browser.close()
