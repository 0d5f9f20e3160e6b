"""`attnflow.plot`: the figures show the data they are given, where it belongs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="attnflow.plot needs matplotlib (the `plot` extra)")

from matplotlib.axes import Axes
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure

import attnflow
from attnflow._sample import Sample, load_sample
from attnflow.plot import attention_graph, image_overlay, layer_token_map, token_heatmap

TOKENS = ["[CLS]", "the", "key", "to", "the", "cabinets", "[SEP]"]


@pytest.fixture(scope="module")
def sample() -> Sample:
    return load_sample()


def real(sample: Sample, index: int) -> tuple[np.ndarray, list[str]]:
    """Attention ``(layers, heads, n, n)`` and tokens of one sample sentence, padding cut."""
    n = int(sample.mask[index].sum())
    return sample.attentions[index, :, :, :n, :n], sample.tokens[index][:n]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from the PNG header."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def saved(figure: Figure, path: Path) -> None:
    """Save at dpi 50 and check the file is a PNG of the figure's size."""
    figure.savefig(path, dpi=50)
    assert path.is_file()
    width, height = figure.get_size_inches() * 50
    got_width, got_height = png_size(path)
    assert abs(got_width - width) <= 1
    assert abs(got_height - height) <= 1


def tick_texts(ax: Axes) -> list[str]:
    return [label.get_text() for label in ax.get_xticklabels()]


def image_data(ax: Axes, index: int = 0) -> np.ndarray:
    return np.asarray(ax.images[index].get_array())


# -- importing --------------------------------------------------------------------------------


def test_importing_attnflow_plot_does_not_import_matplotlib() -> None:
    code = (
        "import sys, attnflow\n"
        "print('attnflow.plot' in sys.modules)\n"  # a submodule, imported explicitly
        "import attnflow.plot, attnflow.html\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out == ["False", "[]"]


def test_no_pyplot_state_is_touched() -> None:
    code = (
        "import sys, numpy as np\n"
        "from attnflow.plot import token_heatmap\n"
        "fig = token_heatmap(np.array([0.2, 0.8]), tokens=['a', 'b'])\n"
        "print('matplotlib.pyplot' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "False"


# -- token_heatmap ----------------------------------------------------------------------------


def test_token_heatmap_puts_the_largest_score_under_its_token(tmp_path: Path) -> None:
    scores = np.array([0.05, 0.1, 0.5, 0.05, 0.1, 0.15, 0.05])
    figure = token_heatmap(scores, tokens=TOKENS, title="rollout")
    assert isinstance(figure, Figure)
    ax = figure.axes[0]
    data = image_data(ax)
    assert data.shape == (1, len(TOKENS))
    np.testing.assert_allclose(data[0], scores)
    assert int(np.argmax(data)) == 2
    assert tick_texts(ax) == TOKENS
    assert ax.get_title() == "rollout"
    norm = ax.images[0].norm
    assert (norm.vmin, norm.vmax) == (0.0, 0.5)
    assert len(figure.axes) == 2  # the strip and its colour bar
    # Few tokens: each value is written in its cell.
    assert [text.get_text() for text in ax.texts] == [f"{v:.2f}" for v in scores]
    saved(figure, tmp_path / "heatmap.png")


def test_token_heatmap_annotation_and_limits_are_options() -> None:
    scores = np.linspace(0.0, 1.0, 30)
    tokens = [f"t{i}" for i in range(30)]
    auto = token_heatmap(scores, tokens=tokens)
    assert list(auto.axes[0].texts) == []  # many tokens: no numbers
    forced = token_heatmap(scores, tokens=tokens, annotate=True, vmin=0.2, vmax=0.8)
    assert len(forced.axes[0].texts) == 30
    norm = forced.axes[0].images[0].norm
    assert (norm.vmin, norm.vmax) == (0.2, 0.8)
    # Many tokens: labels rotated so they do not collide.
    assert auto.axes[0].get_xticklabels()[0].get_rotation() == pytest.approx(45.0)


def test_token_heatmap_draws_into_a_given_axes() -> None:
    figure = Figure()
    left, right = figure.subplots(1, 2)
    returned = token_heatmap(np.array([0.3, 0.7]), tokens=["a", "b"], ax=right)
    assert returned is figure
    assert len(right.images) == 1
    assert len(left.images) == 0


def test_token_heatmap_with_real_rollout(sample: Sample, tmp_path: Path) -> None:
    attentions, tokens = real(sample, 0)
    scores = attnflow.rollout(attentions, rows=0)
    figure = token_heatmap(scores, tokens=tokens)
    data = image_data(figure.axes[0])[0]
    np.testing.assert_allclose(data, scores, rtol=1e-6)
    assert tick_texts(figure.axes[0]) == tokens
    assert int(np.argmax(data)) == int(np.argmax(scores))
    saved(figure, tmp_path / "rollout.png")


def test_token_heatmap_accepts_every_backend(backend: Any) -> None:
    scores = np.array([0.1, 0.2, 0.7])
    native = backend.asarray(scores, "float32")
    figure = token_heatmap(native, tokens=["a", "b", "c"])
    np.testing.assert_allclose(image_data(figure.axes[0])[0], scores, rtol=1e-6)


def test_token_heatmap_bad_input_names_the_parameter() -> None:
    with pytest.raises(ValueError, match=r"`tokens` has 2 entries but `scores` has 3"):
        token_heatmap(np.ones(3), tokens=["a", "b"])
    with pytest.raises(ValueError, match=r"`scores` must be one row.*\(2, 3\)"):
        token_heatmap(np.ones((2, 3)), tokens=["a", "b", "c"])
    with pytest.raises(TypeError, match=r"`tokens` must be a sequence of 3 strings.*str"):
        token_heatmap(np.ones(3), tokens="abc")
    with pytest.raises(TypeError, match=r"tokens\[1\] is int"):
        token_heatmap(np.ones(3), tokens=["a", 1, "c"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"`scores` must be finite"):
        token_heatmap(np.array([0.1, np.nan]), tokens=["a", "b"])
    with pytest.raises(TypeError, match=r"`ax` must be a matplotlib Axes.*str"):
        token_heatmap(np.ones(2), tokens=["a", "b"], ax="left")  # type: ignore[arg-type]


# -- layer_token_map --------------------------------------------------------------------------


def test_layer_token_map_puts_layer_one_at_the_bottom(tmp_path: Path) -> None:
    layers, n = 4, 5
    maps = np.full((layers, n), 0.1)
    maps[0, 3] = 0.9  # layer 1, token 3
    maps[3, 1] = 0.6  # layer 4, token 1
    tokens = ["a", "b", "c", "d", "e"]
    figure = layer_token_map(maps, tokens=tokens)
    ax = figure.axes[0]
    image = ax.images[0]
    assert image.origin == "lower"  # row 0 (layer 1) drawn at the bottom
    data = image_data(ax)
    np.testing.assert_allclose(data, maps)
    assert tuple(int(i) for i in np.unravel_index(np.argmax(data), data.shape)) == (0, 3)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "2", "3", "4"]
    assert ax.get_ylabel() == "layer"
    assert tick_texts(ax) == tokens
    # Where the image actually lands: the bottom row of the axes is layer 1.
    bottom, top = ax.get_ylim()
    assert bottom < top
    saved(figure, tmp_path / "one.png")
    # The maps of heads="each" at one layer: the rows are heads.
    assert layer_token_map(maps, tokens=tokens, ylabel="head").axes[0].get_ylabel() == "head"


def test_layer_token_map_shares_one_colour_scale(tmp_path: Path) -> None:
    tokens = ["a", "b", "c"]
    maps = {
        "raw": np.array([[0.2, 0.3, 0.5], [0.3, 0.3, 0.4]]),
        "rollout": np.array([[0.1, 0.8, 0.1], [0.05, 0.9, 0.05]]),
        "flow": np.array([[0.3, 0.4, 0.3], [0.3, 0.4, 0.3]]),
    }
    figure = layer_token_map(maps, tokens=tokens)
    panels = figure.axes[:3]
    assert [ax.get_title() for ax in panels] == ["raw", "rollout", "flow"]
    norms = [ax.images[0].norm for ax in panels]
    assert {(norm.vmin, norm.vmax) for norm in norms} == {(0.0, 0.9)}
    assert len(figure.axes) == 4  # three panels and one colour bar
    for ax, expected in zip(panels, maps.values(), strict=True):
        np.testing.assert_allclose(image_data(ax), expected)
    saved(figure, tmp_path / "shared.png")

    separate = layer_token_map(maps, tokens=tokens, shared_scale=False, titles=["A", "B", "C"])
    assert [ax.get_title() for ax in separate.axes[:3]] == ["A", "B", "C"]
    highs = [ax.images[0].norm.vmax for ax in separate.axes if ax.images]
    assert highs == [0.5, 0.9, 0.4]
    assert len(separate.axes) == 6  # a colour bar per panel


def test_layer_token_map_with_real_raw_rollout_and_flow(sample: Sample, tmp_path: Path) -> None:
    attentions, tokens = real(sample, 0)
    position = tokens.index("[MASK]")
    maps = {
        name: getattr(attnflow, name)(attentions, rows=position, layers="all")
        for name in ("raw", "rollout", "flow")
    }
    figure = layer_token_map(maps, tokens=tokens, title="[MASK]")
    vmax = max(float(m.max()) for m in maps.values())
    for ax, (name, expected) in zip(figure.axes[:3], maps.items(), strict=True):
        assert ax.get_title() == name
        data = image_data(ax)
        assert data.shape == (6, len(tokens))
        np.testing.assert_allclose(data, expected, rtol=1e-6)
        assert ax.images[0].norm.vmax == pytest.approx(vmax)
        # The brightest cell is where the data put it.
        assert np.unravel_index(np.argmax(data), data.shape) == np.unravel_index(
            np.argmax(expected), expected.shape
        )
    # First-layer equivalence shows in the picture: rollout and flow agree at layer 1.
    np.testing.assert_allclose(image_data(figure.axes[1])[0], image_data(figure.axes[2])[0])
    saved(figure, tmp_path / "paper.png")


def test_layer_token_map_accepts_sequences_and_stacks() -> None:
    a, b = np.eye(3)[:2], np.eye(3)[1:]
    assert len(layer_token_map([a, b], tokens=["x", "y", "z"]).axes) == 3
    assert len(layer_token_map(np.stack([a, b]), tokens=["x", "y", "z"]).axes) == 3


def test_layer_token_map_bad_input_names_the_parameter() -> None:
    with pytest.raises(ValueError, match=r"`tokens` has 2 entries but `maps` has 3"):
        layer_token_map(np.ones((2, 3)), tokens=["a", "b"])
    with pytest.raises(ValueError, match=r"`titles` must be a sequence of 2 strings"):
        layer_token_map([np.ones((2, 3))] * 2, tokens=["a", "b", "c"], titles=["x"])
    with pytest.raises(ValueError, match=r"`maps\['raw'\]` must be a \(layers, n\) map.*\(3,\)"):
        layer_token_map({"raw": np.ones(3)}, tokens=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"same 3 tokens; map 1 has shape \(2, 4\)"):
        layer_token_map([np.ones((2, 3)), np.ones((2, 4))], tokens=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"`maps` is an empty mapping"):
        layer_token_map({}, tokens=["a"])
    with pytest.raises(ValueError, match=r"`maps` must be one \(layers, n\) map.*\(1, 2, 3, 4\)"):
        layer_token_map(np.ones((1, 2, 3, 4)), tokens=["a", "b", "c", "d"])


def _drawn(figure: Figure) -> Any:
    """Draw `figure` with Agg and return its renderer (for the extents of what it drew)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return canvas.get_renderer()


def _inside(extent: Any, figure: Figure) -> bool:
    box = figure.bbox
    return bool(
        extent.x0 >= box.x0 - 0.5
        and extent.y0 >= box.y0 - 0.5
        and extent.x1 <= box.x1 + 0.5
        and extent.y1 <= box.y1 + 0.5
    )


#: The documentation's content width (px) at which a figure must stay legible.
PAGE_WIDTH = 800


@pytest.mark.parametrize(("panels", "n", "columns"), [(3, 11, 3), (4, 12, 2), (2, 11, 2)])
def test_layer_token_map_stays_legible_at_page_width(panels: int, n: int, columns: int) -> None:
    """The gallery's figures: tick labels of 9 px or more when shown 800 px wide."""
    rng = np.random.default_rng(0)
    tokens = ["<|endoftext|>"] + [f"word{i}" for i in range(n - 1)]
    names = ["rollout", "receptive_field=True", "exclude=0", "both"][:panels]
    maps = {name: rng.dirichlet(np.ones(n), size=6) for name in names}
    figure = layer_token_map(maps, tokens=tokens, title="last token")
    renderer = _drawn(figure)
    width = figure.get_figwidth()
    drawn = figure.axes[:panels]
    assert len({round(ax.get_position().x0, 3) for ax in drawn}) == columns
    for ax in drawn:
        for label in [*ax.get_xticklabels(), *ax.get_yticklabels()]:
            if label.get_visible() and label.get_text():
                # Its size in px when the whole figure is scaled to the page's width.
                assert label.get_fontsize() / 72 * PAGE_WIDTH / width >= 9, width
                assert _inside(label.get_window_extent(renderer), figure), label.get_text()
        assert _inside(ax.title.get_window_extent(renderer), figure)
    # No panel overlaps another, nor the colour bar.
    boxes = [ax.get_window_extent(renderer) for ax in figure.axes]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b)
    # Every panel still shows its map, layer 1 at the bottom.
    for ax, expected in zip(drawn, maps.values(), strict=True):
        np.testing.assert_allclose(image_data(ax), expected)


def test_layer_token_map_columns_and_bad_columns() -> None:
    maps = [np.full((2, 3), 1 / 3)] * 4
    figure = layer_token_map(maps, tokens=["a", "b", "c"], columns=1)
    assert len({round(ax.get_position().x0, 3) for ax in figure.axes[:4]}) == 1
    with pytest.raises(ValueError, match=r"`columns` must be a positive int .*got 0"):
        layer_token_map(maps, tokens=["a", "b", "c"], columns=0)


# -- faithfulness_by_layer --------------------------------------------------------------------


def _report(layers: int = 6, references: tuple[str, ...] = ("blank_out", "input_gradients")) -> Any:
    from attnflow.evaluate import FaithfulnessReport

    rng = np.random.default_rng(0)
    methods = ("raw", "rollout", "flow")
    samples = {
        f"correlation.{m}.{r}": rng.normal(shift, 0.2, (20, layers))
        for m, shift in zip(methods, (0.1, 0.5, 0.6), strict=True)
        for r in references
    }
    return FaithfulnessReport(samples, methods, references, "spearman", "drop", 0)


def test_faithfulness_figure_keeps_its_title_and_legend_inside() -> None:
    """Two panels, six legend entries and a long title: nothing is cut at the edges."""
    from attnflow.plot import faithfulness_by_layer

    paper = {r: {m: [0.3] * 6 for m in ("raw", "rollout", "flow")} for r in ("blank_out",)}
    title = (
        "Abnar & Zuidema (2020), Table 3 analogue: MiniLM on offline sentiment: [CLS] row, "
        "input gradients as the gradient norm (l2)"
    )
    for figure in (
        faithfulness_by_layer(_report(), paper=paper, title=title),
        faithfulness_by_layer(_report(references=("blank_out",)), paper=paper, title=title),
    ):
        renderer = _drawn(figure)
        suptitle = figure.get_suptitle()
        assert suptitle.replace("\n", " ") == title
        assert _inside(figure._suptitle.get_window_extent(renderer), figure)  # type: ignore[union-attr]
        (legend,) = figure.legends
        assert [t.get_text() for t in legend.get_texts()] == [
            "raw", "raw (paper)", "rollout", "rollout (paper)", "flow", "flow (paper)"
        ]  # fmt: skip
        assert _inside(legend.get_window_extent(renderer), figure)
        for ax in figure.axes:
            assert _inside(ax.get_tightbbox(renderer), figure)
            assert not ax.get_window_extent(renderer).overlaps(legend.get_window_extent(renderer))


def test_faithfulness_figure_draws_the_papers_layers_beside_a_smaller_model() -> None:
    """The paper's six layers beside a three-layer model: each line over its own layers."""
    from attnflow.plot import faithfulness_by_layer

    published = [0.32, 0.38, np.nan, 0.62, 0.70, 0.71]  # a layer the table skips
    figure = faithfulness_by_layer(_report(layers=3), paper={"blank_out": {"rollout": published}})
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    np.testing.assert_array_equal(lines["rollout"].get_xdata(), [1, 2, 3])
    np.testing.assert_array_equal(lines["rollout (paper)"].get_xdata(), [1, 2, 4, 5, 6])
    np.testing.assert_allclose(lines["rollout (paper)"].get_ydata(), [0.32, 0.38, 0.62, 0.70, 0.71])
    assert list(figure.axes[0].get_xticks()) == [1, 2, 3, 4, 5, 6]


# -- image_overlay ----------------------------------------------------------------------------


def patch_of(heat: np.ndarray, grid: tuple[int, int]) -> tuple[int, int]:
    """The patch (row, col) holding the maximum of an upsampled map."""
    row, col = np.unravel_index(np.argmax(heat), heat.shape)
    return int(row * grid[0] // heat.shape[0]), int(col * grid[1] // heat.shape[1])


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest"])
def test_image_overlay_square_grid_with_cls(interpolation: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    scores = rng.uniform(0.0, 0.1, 1 + 14 * 14)
    scores[0] = 5.0  # the CLS token: dropped, must not win
    scores[1 + 3 * 14 + 10] = 1.0  # patch (3, 10)
    image = rng.uniform(0.0, 1.0, (224, 224, 3))
    figure = image_overlay(scores, image, interpolation=interpolation)  # type: ignore[arg-type]
    ax = figure.axes[0]
    np.testing.assert_allclose(image_data(ax, 0), image)
    heat = image_data(ax, 1)
    assert heat.shape == (224, 224)
    assert patch_of(heat, (14, 14)) == (3, 10)
    assert 0.9 < heat.max() <= 1.0  # bilinear: pixel centres sit near the patch centre
    assert ax.images[1].norm.vmax == pytest.approx(1.0)  # CLS is not in the scale
    saved(figure, tmp_path / "overlay.png")


def test_image_overlay_nearest_blocks_are_exact_patches() -> None:
    scores = np.r_[0.0, np.arange(6.0)]  # 2 x 3 grid
    figure = image_overlay(scores, np.zeros((20, 30)), grid=(2, 3), interpolation="nearest")
    heat = image_data(figure.axes[0], 1)
    np.testing.assert_array_equal(heat, np.kron(np.arange(6.0).reshape(2, 3), np.ones((10, 10))))


def test_image_overlay_non_square_grid_with_registers(tmp_path: Path) -> None:
    grid = (12, 20)  # a 192 x 320 image in 16-pixel patches
    scores = np.full(5 + 12 * 20, 0.01)
    scores[:5] = 3.0  # CLS + 4 registers: dropped
    scores[5 + 9 * 20 + 2] = 0.8  # patch (9, 2)
    image = (np.arange(192 * 320).reshape(192, 320) % 256).astype(np.uint8)  # grey, 8-bit
    figure = image_overlay(scores, image, grid=grid, extra_tokens=5, alpha=0.3)
    ax = figure.axes[0]
    heat = image_data(ax, 1)
    assert heat.shape == image.shape
    assert patch_of(heat, grid) == (9, 2)
    assert ax.images[1].get_alpha() == 0.3
    background = image_data(ax, 0)
    assert background.shape == image.shape
    assert background.max() <= 1.0
    saved(figure, tmp_path / "registers.png")


def test_image_overlay_accepts_channel_first_and_normalised_images() -> None:
    rng = np.random.default_rng(1)
    image = rng.normal(size=(3, 32, 48))  # (C, H, W), mean/std normalised
    figure = image_overlay(np.ones(1 + 2 * 3), image, grid=(2, 3))
    shown = image_data(figure.axes[0], 0)
    assert shown.shape == (32, 48, 3)
    assert shown.min() == pytest.approx(0.0)
    assert shown.max() == pytest.approx(1.0)


def test_image_overlay_with_real_rollout_as_patches(sample: Sample) -> None:
    # The sample is text; read its 9 non-CLS tokens as a 3 x 3 patch grid.
    attentions, _ = real(sample, 0)
    scores = attnflow.rollout(attentions, rows=0)
    figure = image_overlay(scores, np.ones((30, 30, 3)), grid=(3, 3), interpolation="nearest")
    heat = image_data(figure.axes[0], 1)
    best = int(np.argmax(scores[1:]))
    assert patch_of(heat, (3, 3)) == divmod(best, 3)


def test_image_overlay_bad_input_names_the_parameter() -> None:
    image = np.zeros((28, 28))
    with pytest.raises(ValueError, match=r"15 patch scores.*`extra_tokens`=1.*`grid=\(rows"):
        image_overlay(np.ones(16), image)
    with pytest.raises(ValueError, match=r"`grid`=\(3, 4\) has 12 patches.*16 patch scores"):
        image_overlay(np.ones(17), image, grid=(3, 4))
    with pytest.raises(ValueError, match=r"`grid` must be a pair of positive ints"):
        image_overlay(np.ones(17), image, grid=(16,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`extra_tokens` must be an int in \[0, 17\).*-1"):
        image_overlay(np.ones(17), image, extra_tokens=-1)
    with pytest.raises(ValueError, match=r"`alpha` must be in \[0, 1\]; got 2"):
        image_overlay(np.ones(17), image, alpha=2)
    with pytest.raises(ValueError, match=r"`image` must have shape.*\(28, 28, 2\)"):
        image_overlay(np.ones(17), np.zeros((28, 28, 2)))
    with pytest.raises(ValueError, match=r"`scores` must be one row.*\(2, 17\)"):
        image_overlay(np.ones((2, 17)), image)


# -- attention_graph --------------------------------------------------------------------------


def edges_of(figure: Figure) -> LineCollection:
    (edges,) = [c for c in figure.axes[0].collections if isinstance(c, LineCollection)]
    return edges


def test_attention_graph_draws_one_edge_per_weight(tmp_path: Path) -> None:
    weights = np.zeros((2, 3, 3))
    weights[0] = [[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]]
    weights[1] = [[0.1, 0.0, 0.9], [0.4, 0.6, 0.0], [0.0, 0.0, 1.0]]
    figure = attention_graph(weights, tokens=["a", "b", "c"])
    edges = edges_of(figure)
    segments = [np.asarray(s) for s in edges.get_segments()]
    assert len(segments) == int(np.count_nonzero(weights))
    widths = np.asarray(edges.get_linewidth())
    assert widths.shape == (len(segments),)
    # Widths and opacities are proportional to the weights (largest weight: 1.0 -> 5 pt).
    alphas = np.asarray(edges.get_colors())[:, 3]
    for segment, width, alpha in zip(segments, widths, alphas, strict=True):
        (query, upper), (key, lower) = segment
        assert upper == lower + 1
        weight = weights[int(lower), int(query), int(key)]
        assert width == pytest.approx(5.0 * weight)
        assert alpha == pytest.approx(weight)
    # The thickest edge is drawn last (on top) and is the heaviest weight's edge.
    assert widths[-1] == widths.max()
    (query, upper), (key, lower) = segments[-1]
    assert weights[int(lower), int(query), int(key)] == weights.max()
    ax = figure.axes[0]
    assert tick_texts(ax) == ["a", "b", "c"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["input", "layer 1", "layer 2"]
    saved(figure, tmp_path / "graph.png")


def test_attention_graph_with_real_fused_attention(sample: Sample, tmp_path: Path) -> None:
    attentions, tokens = real(sample, 2)  # "the key to the cabinets": 7 tokens
    fused = attnflow.fuse_heads(attentions)
    figure = attention_graph(fused, tokens=tokens, min_weight=0.05)
    edges = edges_of(figure)
    assert len(edges.get_segments()) == int(np.count_nonzero(fused > 0.05))
    layer, query, key = (int(i) for i in np.unravel_index(np.argmax(fused), fused.shape))
    (q, upper), (k, lower) = np.asarray(edges.get_segments()[-1])
    assert (int(lower), int(q), int(k)) == (layer, query, key)
    assert upper == layer + 1
    assert np.asarray(edges.get_linewidth()).max() == pytest.approx(5.0)
    saved(figure, tmp_path / "real-graph.png")


def test_attention_graph_bad_input_names_the_parameter() -> None:
    with pytest.raises(ValueError, match=r"13 tokens, more than `max_tokens`=12"):
        attention_graph(np.full((1, 13, 13), 1 / 13), tokens=["t"] * 13)
    attention_graph(np.full((1, 13, 13), 1 / 13), tokens=["t"] * 13, max_tokens=13)
    with pytest.raises(ValueError, match=r"shape \(layers, n, n\); got shape \(2, 4, 4, 4\)"):
        attention_graph(np.ones((2, 4, 4, 4)), tokens=["a"] * 4)
    with pytest.raises(ValueError, match=r"`tokens` has 3 entries but `attentions_fused` has 4"):
        attention_graph(np.ones((2, 4, 4)), tokens=["a"] * 3)
    with pytest.raises(ValueError, match=r"must be non-negative"):
        attention_graph(-np.ones((1, 2, 2)), tokens=["a", "b"])


def test_default_colour_maps_are_perceptually_uniform() -> None:
    # Lightness (CIELAB L*, from the sRGB colours) must rise or fall steadily along the
    # map: equal steps in value look like equal steps. Rainbow maps (jet, turbo) fail.
    from matplotlib import colormaps

    def lightness(name: str) -> np.ndarray:
        rgb = colormaps[name](np.linspace(0, 1, 64))[:, :3]
        linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
        y = linear @ np.array([0.2126, 0.7152, 0.0722])
        return np.where(y > (6 / 29) ** 3, 116 * np.cbrt(y) - 16, 903.3 * y)

    figures = {
        "token_heatmap": token_heatmap(np.array([0.1, 0.9]), tokens=["a", "b"]),
        "layer_token_map": layer_token_map(np.full((2, 2), 0.5), tokens=["a", "b"]),
        "image_overlay": image_overlay(np.full(5, 0.2), np.zeros((4, 4))),
    }
    for function, figure in figures.items():
        names = {image.get_cmap().name for ax in figure.axes for image in ax.get_images()}
        names.discard("gray")  # the image under the overlay
        assert names, function
        for name in names:
            steps = np.diff(lightness(name))
            assert np.all(steps > 0) or np.all(steps < 0), (function, name)
    assert np.any(np.diff(lightness("turbo")) > 0)
    assert np.any(np.diff(lightness("turbo")) < 0)  # the check can fail


def test_attention_graph_marks_the_row_and_explains_edge_widths(tmp_path: Path) -> None:
    weights = np.zeros((2, 3, 3))
    weights[0] = [[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]]
    weights[1] = [[0.1, 0.0, 0.8], [0.4, 0.6, 0.0], [0.0, 0.0, 1.0]]
    figure = attention_graph(weights, tokens=["a", "b", "c"], row=2, residual=True)
    ax = figure.axes[0]
    legend = ax.get_legend()
    assert legend.get_title().get_text() == "edge weight (residual included)"
    assert [t.get_text() for t in legend.get_texts()] == ["1", "0.5", "0.25"]
    widths = [line.get_linewidth() for line in legend.get_lines()]
    assert widths == pytest.approx([5.0, 2.5, 1.25])  # as the edges of those weights
    assert any(t.get_text() == "explained: c" for t in ax.texts)
    marked = ax.collections[-1].get_offsets()
    assert np.asarray(marked).tolist() == [[2.0, 2.0]]  # top layer, position 2
    plain = attention_graph(weights, tokens=["a", "b", "c"], residual=False, legend=True)
    assert plain.axes[0].get_legend().get_title().get_text() == "edge weight (no residual)"
    assert (
        attention_graph(weights, tokens=["a", "b", "c"], legend=False).axes[0].get_legend() is None
    )
    with pytest.raises(ValueError, match="`row` must index the 3 tokens"):
        attention_graph(weights, tokens=["a", "b", "c"], row=3)
    saved(figure, tmp_path / "graph.png")
