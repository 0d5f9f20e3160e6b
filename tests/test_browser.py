"""The HTML token views as a person sees them: rendered by headless Chromium (Debian's)."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from backends import selected_variants

import attnflow
from attnflow._sample import load_sample
from attnflow.html import InteractiveView, TokenView, _token_style

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


def test_token_view_renders_in_headless_chromium(tmp_path: Path) -> None:
    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.skip("rendered once per matrix run, in the numpy session")
    chromium = _chromium()
    sample = load_sample()
    real = np.flatnonzero(sample.mask[0])
    tokens = [sample.tokens[0][i] for i in real]
    one = sample.attentions[:1][..., real, :][..., real]
    rows = {
        "rollout": attnflow.rollout(one, rows=0)[0],
        "flow": attnflow.flow(one, rows=0)[0],
    }
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


# Drives the page through its own controls (setting a control's value and firing the event
# a person's input fires, clicking a token, pressing Enter on one) and records what the
# browser then shows of every token: its value, tooltip, computed background and marker.
HARNESS = """
<script>
(function () {
  var steps = [], root = document.querySelector(".attnflow-interactive");
  function record(label) {
    var shown = {label: label, values: [], titles: [], colours: [], current: [],
      status: root.querySelector('[data-output="status"]').textContent,
      max: root.querySelector('[data-output="max"]').textContent,
      headHidden: root.querySelector('[data-control="head-label"]').hidden};
    root.querySelectorAll(".attnflow-tok").forEach(function (span) {
      shown.values.push(span.getAttribute("data-value"));
      shown.titles.push(span.title);
      shown.colours.push(getComputedStyle(span).backgroundColor);
      shown.current.push(span.getAttribute("aria-current") === "true");
    });
    steps.push(shown);
  }
  function set(name, value, type) {
    var control = root.querySelector('[data-control="' + name + '"]');
    control.value = value;
    control.dispatchEvent(new Event(type, {bubbles: true}));
  }
  var tokens = root.querySelectorAll(".attnflow-tok");
  try {
    record("initial");
    set("method", "1", "change"); record("method raw");
    set("head", "3", "input"); record("head 3");
    set("layer", "2", "input"); record("layer 2");
    set("row", "3", "change"); record("row 3 from the menu");
    tokens[2].click(); record("row 2 by a click");
    tokens[5].focus();
    tokens[5].dispatchEvent(new KeyboardEvent("keydown", {key: "Enter", bubbles: true}));
    record("row 5 by Enter");
    set("method", "0", "change"); record("method rollout");
  } catch (error) {
    steps.push({error: String(error)});
  }
  var out = document.createElement("pre");
  out.id = "attnflow-test-steps";
  out.textContent = JSON.stringify(steps);
  document.body.appendChild(out);
})();
</script>
"""


def test_interactive_view_follows_its_controls_in_headless_chromium(tmp_path: Path) -> None:
    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.skip("rendered once per matrix run, in the numpy session")
    chromium = _chromium()
    sample = load_sample()
    real = np.flatnonzero(sample.mask[0])
    tokens = [sample.tokens[0][i] for i in real]
    tokens[1] = "</script><b>x</b>"  # must stay text, and not end the page's scripts
    weights = sample.attentions[0][..., real, :][..., real]  # (layers, heads, n, n)
    view = InteractiveView(
        {"rollout": attnflow.rollout(weights, layers="all"), "raw": weights},
        tokens,
        scale_exclude=[0, len(tokens) - 1],
    )
    page = tmp_path / "view.html"
    page.write_text(view.to_html().replace("</body>", HARNESS + "</body>"), encoding="utf-8")

    dom = subprocess.run(
        [chromium, *FLAGS, "--user-data-dir=" + str(tmp_path / "profile"), "--dump-dom",
         page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    found = re.search(r'<pre id="attnflow-test-steps">(.*?)</pre>', dom, re.DOTALL)
    assert found, dom[-2000:]
    steps = json.loads(html.unescape(found.group(1)))
    assert "error" not in steps[-1], steps[-1]
    layers = weights.shape[0]
    # (method, layer, head, row) after each step, as a person would read the controls.
    expected = [
        ("rollout", layers - 1, 0, 0),
        ("raw", layers - 1, 0, 0),
        ("raw", layers - 1, 2, 0),
        ("raw", 1, 2, 0),
        ("raw", 1, 2, 3),
        ("raw", 1, 2, 2),
        ("raw", 1, 2, 5),
        ("rollout", 1, 0, 5),
    ]
    assert len(steps) == len(expected)
    in_scale = np.ones(len(tokens), dtype=bool)
    in_scale[[0, -1]] = False
    for step, (method, layer, head, row) in zip(steps, expected, strict=True):
        values = view.scores[method][layer, head, row]
        top = max(0.0, float(values[in_scale].max()))
        shown = [f"{float(v):.4g}" for v in values]
        assert step["values"] == shown, step["label"]
        assert step["titles"] == [f"{t}: {s}" for t, s in zip(tokens, shown, strict=True)]
        colours = [_token_style(float(v), top, (192, 57, 43))[0] for v in values]
        assert step["colours"] == colours, step["label"]
        assert step["current"] == [i == row for i in range(len(tokens))], step["label"]
        assert step["max"] == f"{top:.4g}"
        assert step["headHidden"] == (method == "rollout")
        where = f"{method}, layer {layer + 1} of {layers}, row {row} ({tokens[row]})"
        if method == "raw":
            where += f", head {head + 1} of {weights.shape[1]}"
        assert step["status"] == where
    # The first render (before the script) already showed the initial choice.
    first = view.to_html()
    assert re.findall(r'data-value="([^"]*)"', first) == steps[0]["values"]
    assert re.findall(r"background-color: (rgb\([^)]*\))", first) == steps[0]["colours"]

    shot = tmp_path / "view.png"
    subprocess.run(
        [chromium, *FLAGS, "--user-data-dir=" + str(tmp_path / "profile"),
         f"--screenshot={shot}", "--window-size=900,260", page.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    assert shot.read_bytes()[:4] == b"\x89PNG"
