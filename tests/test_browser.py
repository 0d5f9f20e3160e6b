"""The HTML token view as a person sees it: rendered by headless Chromium (Debian's)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from backends import selected_variants

import attnflow
from attnflow._sample import load_sample
from attnflow.html import TokenView

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
