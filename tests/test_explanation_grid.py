"""Explanation on a patch grid (an image): checks, summary, figure, round trips
(framework-free; explain_image itself is tested in tests/adapters/test_explain_image.py)."""

from __future__ import annotations

import io
import json
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
