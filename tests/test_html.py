"""`attnflow.html.TokenView`: a well-formed, escaped, self-contained page of token scores."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from html_pages import parse, ramp, rgb, scale_legend, unscaled

import attnflow
from attnflow._html_script import INTERACTIVE_CSS
from attnflow._sample import load_sample
from attnflow.html import _CSS, InteractiveView, TokenView


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


# -- tokens left out of the scale ---------------------------------------------------------


def test_excluded_tokens_get_no_colour_of_the_scale_but_the_neutral_look() -> None:
    # [CLS] and [SEP] take most of the mass: clipped to full colour they would read as
    # the strongest tokens. They must look out of the scale instead.
    scores = {"rollout": np.array([0.7, 0.1, 0.04, 0.16]), "flow": np.array([0.5, 0.2, 0.1, 0.2])}
    tokens = ["[CLS]", "cats", "sleep", "[SEP]"]
    hue = (192, 57, 43)
    view = TokenView(scores, tokens, scale_exclude=[0, -1])
    page = parse(view.to_html())
    assert view.scale_max == pytest.approx(0.2)  # over the words only
    for row, values in enumerate(scores.values()):
        spans = page.tokens[4 * row : 4 * row + 4]
        assert [unscaled(span) for span in spans] == [True, False, False, True]
        for span, value in zip(spans[1:3], values[1:3], strict=True):
            assert rgb(span["style"]) == ramp(float(value), 0.2, hue)  # the ramp, as before
        # Their values are shown exactly as the others' are.
        assert [span["data-value"] for span in spans] == [f"{v:.4g}" for v in values]
        assert [span["title"] for span in spans] == [
            f"{t}: {v:.4g}" for t, v in zip(tokens, values, strict=True)
        ]
    assert rgb(page.tokens[5]["style"]) == hue  # flow's "cats", the largest in the scale
    # The legend counts them, next to a key drawn as they are.
    text = view.to_html()
    assert scale_legend(text) == "00.2 (2 tokens left out of the scale)"
    assert '(<span class="attnflow-unscaled attnflow-key" aria-hidden="true"></span>2 tok' in text
    one = TokenView(np.array([0.9, 0.1]), ["[CLS]", "a"], scale_exclude=[0])
    assert scale_legend(one.to_html()).endswith("0.1 (1 token left out of the scale)")
    # Without exclusions: no out-of-scale token, no note, and the colours of old.
    plain = TokenView(scores, tokens)
    assert not any(unscaled(span) for span in parse(plain.to_html()).tokens)
    assert "left out of the scale" not in plain.to_html()
    assert "attnflow-unscaled" not in plain._body()


def test_the_out_of_scale_look_is_one_class_of_the_shared_style_sheet() -> None:
    rule = re.compile(r"\.attnflow-unscaled\s*\{([^}]*)\}")
    assert len(rule.findall(_CSS)) == 1
    assert "attnflow-unscaled" not in INTERACTIVE_CSS
    (body,) = rule.findall(_CSS)
    assert "dashed" in body
    assert "background-color: #eeeeee" in body  # neutral grey, on no hue's ramp from white
    for text in (
        TokenView(np.ones(2), ["a", "b"], scale_exclude=[0]).to_html(),
        _interactive(scale_exclude=[0, 5]).to_html(),
        _interactive(scale_exclude=[0, 5])._repr_html_(),
    ):
        assert len(rule.findall(text)) == 1


def test_importing_attnflow_html_imports_no_plotting_library() -> None:
    """Nor does drawing a picture under a grid (its PNG encoder is zlib and struct)."""
    code = (
        "import sys, numpy as np, attnflow.html\n"
        "attnflow.html.TokenView(np.ones(5), list('abcde'), grid=(2, 2), image=np.zeros((4, 4)))"
        ".to_html()\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'IPython', 'PIL'}), "
        "'attnflow.plot' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[] False"  # nor attnflow.plot, the module that imports matplotlib


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


# -- InteractiveView ----------------------------------------------------------------------

XSS = ["[CLS]", "</script><script>alert(1)</script>", "a&b", '"q"', "<!--", "[SEP]"]


def _interactive(**options: Any) -> InteractiveView:
    rng = np.random.default_rng(1)
    weights = rng.random((3, 2, 6, 6))
    weights /= weights.sum(-1, keepdims=True)
    scores = {"rollout": attnflow.rollout(weights, layers="all"), "raw": weights}
    return InteractiveView(scores, XSS, **options)


def _data(text: str) -> list[dict[str, Any]]:
    """The JSON data of every view in `text`, by the id of its element."""
    found = re.findall(r'<script type="application/json" id="([^"]+)-data">(.*?)</script>', text)
    return [{"id": uid, **json.loads(payload)} for uid, payload in found]


def test_interactive_page_is_well_formed_self_contained_and_escaped() -> None:
    view = _interactive(title="<i>x</i>", scale_exclude=[0, -1])
    text = view.to_html()
    assert text.startswith("<!DOCTYPE html>")
    page = parse(text)
    assert page.tags.count("script") == 2  # its data and its code, both inline
    assert "<script src" not in text
    assert "link" not in page.tags
    assert "http" not in text  # loads nothing
    assert "//" not in text
    # The tokens are text everywhere: spans, titles, menu and JSON data.
    assert [span["text"] for span in page.tokens] == XSS
    assert [span["title"].rsplit(": ", 1)[0] for span in page.tokens] == XSS
    for raw in ("<i>", "<script>alert", "<!--", "<b>"):
        assert raw not in text
    assert text.count("</script>") == 2
    (data,) = _data(text)
    assert data["tokens"] == XSS


def test_interactive_data_equals_the_arrays() -> None:
    view = _interactive(scale_exclude=[0, 5])
    (data,) = _data(view.to_html())
    assert [m["name"] for m in data["methods"]] == ["rollout", "raw"]
    assert [(m["layers"], m["heads"]) for m in data["methods"]] == [(3, 0), (3, 2)]
    for method in data["methods"]:
        stored = np.array(method["values"])
        assert stored.shape == view.scores[method["name"]].shape
        np.testing.assert_array_equal(stored, view.scores[method["name"]])  # exactly
    assert view.scores["rollout"].shape == (3, 1, 6, 6)  # one head for non-head scores
    assert view.heads == {"rollout": None, "raw": 2}
    assert data["rows"] == list(range(6))
    assert data["inScale"] == [False, True, True, True, True, False]
    assert data["initial"] == {"method": 0, "layer": 2, "head": 0, "row": 0}


def test_interactive_first_render_shows_the_initial_choice() -> None:
    view = _interactive(scale_exclude=[0, 5], method="raw", layer=1, head=1, row=3)
    page = parse(view.to_html())
    values = view.scores["raw"][1, 1, 3]
    assert [span["data-value"] for span in page.tokens] == [f"{v:.4g}" for v in values]
    assert [unscaled(span) for span in page.tokens] == [True, False, False, False, False, True]
    inside = page.tokens[1:5]
    assert [rgb(span["style"]) for span in inside].count((192, 57, 43)) >= 1
    for span, value in zip(inside, values[1:5], strict=True):
        expected = TokenView(values, XSS, scale_exclude=[0, 5])._background(float(value))[0]
        assert span["style"].startswith(f"background-color: {expected};")
    assert [span.get("aria-current") for span in page.tokens] == [None] * 3 + ["true"] + [None] * 2
    assert [span.get("data-row") for span in page.tokens] == [str(i) for i in range(6)]
    assert all(span.get("tabindex") == "0" for span in page.tokens)  # keyboard reachable
    assert "raw, layer 2 of 3, row 3 (" in view.to_html()
    assert scale_legend(view.to_html()).endswith(" (2 tokens left out of the scale)")


def test_interactive_ids_are_unique_across_views_on_one_page() -> None:
    first, second = _interactive(), _interactive(title="again")
    text = first._repr_html_() + first._repr_html_() + second._repr_html_()
    assert "<html" not in text
    ids = re.findall(r'\bid="([^"]+)"', text)
    assert len(ids) == 6
    assert len(set(ids)) == 6
    views = re.findall(r'class="attnflow-view attnflow-interactive" id="([^"]+)"', text)
    assert [d["id"] for d in _data(text)] == views
    assert re.findall(r'\}\)\("([^"]+)"\);', text) == views  # each script drives its own view


def test_interactive_shapes_rows_and_heads() -> None:
    tokens = ["a", "b", "c"]
    one = InteractiveView(np.array([0.2, 0.5, 0.3]), tokens)
    assert repr(one) == "InteractiveView(methods=['scores'], layers=1, rows=1, tokens=3)"
    assert one.rows is None
    spans = parse(one.to_html()).tokens
    assert not any("aria-current" in span or "data-row" in span for span in spans)
    by_layer = InteractiveView({"flow": np.ones((4, 3))}, tokens, rows=1)
    assert by_layer.rows == (1,)
    assert by_layer.scores["flow"].shape == (4, 1, 1, 3)
    two_rows = InteractiveView({"flow": np.ones((4, 2, 3))}, tokens, rows=[0, -1], row=2)
    assert two_rows.rows == (0, 2)
    assert _data(two_rows.to_html())[0]["initial"]["row"] == 1
    mixed = InteractiveView(
        {"raw": np.ones((4, 2, 3, 3)), "last": np.ones((1, 3, 3))}, tokens, layer=-1
    )
    assert (
        repr(mixed)
        == "InteractiveView(methods=['raw', 'last'], layers=4, heads=2, rows=3, tokens=3)"
    )


def test_interactive_bad_input_names_the_parameter() -> None:
    tokens = ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"have 2 rows of 3 tokens; pass `rows`"):
        InteractiveView(np.ones((1, 2, 3)), tokens)
    with pytest.raises(ValueError, match=r"one position per row of the scores \(2\)"):
        InteractiveView(np.ones((1, 2, 3)), tokens, rows=[0])
    with pytest.raises(ValueError, match=r"same 3 row\(s\) of 3 tokens; 'b' has 1"):
        InteractiveView({"a": np.ones((1, 3, 3)), "b": np.ones((1, 3))}, tokens)
    with pytest.raises(ValueError, match=r"must have shape \(n,\)"):
        InteractiveView(np.ones((1, 1, 1, 1, 3)), tokens)
    with pytest.raises(ValueError, match=r"`scores\['x'\]` must be finite"):
        InteractiveView({"x": np.array([np.nan, 1.0, 1.0])}, tokens)
    with pytest.raises(ValueError, match=r"`method` must be one of \['x'\]; got 'y'"):
        InteractiveView({"x": np.ones(3)}, tokens, method="y")
    with pytest.raises(ValueError, match=r"`layer` must index the 2 layers; got 2"):
        InteractiveView(np.ones((2, 3)), tokens, layer=2)
    with pytest.raises(ValueError, match=r"`row` must be one of the rows' positions"):
        InteractiveView(np.ones((2, 3)), tokens, row=1)
    with pytest.raises(IndexError, match=r"`scale_exclude` must index the 3 tokens"):
        InteractiveView(np.ones(3), tokens, scale_exclude=[3])
    with pytest.raises(ValueError, match=r"`precision` must be an int from 1 to 17"):
        InteractiveView(np.ones(3), tokens, precision=18)
    with pytest.raises(ValueError, match=r"`tokens` has 2 entries"):
        InteractiveView(np.ones(3), ["a", "b"])


def test_interactive_save_writes_atomically_and_refuses_to_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "view.html"
    assert _interactive().save(target) == target
    before = target.read_text(encoding="utf-8")
    assert len(_data(before)) == 1
    with pytest.raises(FileExistsError, match=re.escape(str(target))):
        _interactive().save(target)
    assert target.read_text(encoding="utf-8") == before
    _interactive(title="new").save(target, overwrite=True)
    assert "<title>new</title>" in target.read_text(encoding="utf-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]


def test_interactive_accepts_every_backend(backend: Any) -> None:
    native = backend.asarray(np.array([[0.25, 0.75], [0.5, 0.5]]), "float32")
    view = InteractiveView({"m": native}, ["a", "b"])
    np.testing.assert_array_equal(view.scores["m"][:, 0, 0], [[0.25, 0.75], [0.5, 0.5]])


# -- patch grids (images) -----------------------------------------------------------------

# A [CLS] and a register token, then 3 x 4 patches, row by row.
GRID = (3, 4)
PATCHES = [f"({r},{c})" for r in range(GRID[0]) for c in range(GRID[1])]
GRID_TOKENS = ["[CLS]", "[REG1]", *PATCHES]


def _grid_scores() -> np.ndarray:
    return np.random.default_rng(4).random(len(GRID_TOKENS))


def test_grid_draws_the_patches_as_cells_row_by_row_coloured_as_the_spans() -> None:
    scores = {"rollout": _grid_scores(), "flow": _grid_scores()[::-1].copy()}
    exclude = [0, 1, 2 + 5]  # the non-patch tokens and one patch, (1,1)
    view = TokenView(scores, GRID_TOKENS, scale_exclude=exclude, grid=GRID)
    line = TokenView(scores, GRID_TOKENS, scale_exclude=exclude)  # the same, on one line
    assert view.grid == GRID
    assert line.grid is None
    text = view.to_html()
    page, spans = parse(text), parse(line.to_html()).tokens
    assert "http" not in text
    assert "script" not in page.tags
    assert [grid["data-rows"] for grid in page.grids] == ["3", "3"]  # one grid per row
    assert [grid["data-cols"] for grid in page.grids] == ["4", "4"]
    assert all("grid-template-columns: repeat(4, " in grid["style"] for grid in page.grids)
    # Per row of scores: the two leading tokens as spans, the 12 patches as cells.
    assert [span["text"] for span in page.tokens] == ["[CLS]", "[REG1]"] * 2
    assert [cell["text"] for cell in page.cells] == PATCHES * 2  # row-major
    n = len(GRID_TOKENS)
    for r, values in enumerate(scores.values()):
        cells = page.cells[12 * r : 12 * r + 12]
        drawn = page.tokens[2 * r : 2 * r + 2] + cells
        for i, (element, value) in enumerate(zip(drawn, values, strict=True)):
            same = spans[n * r + i]  # the token's span with grid=None
            assert element["data-value"] == same["data-value"] == f"{value:.4g}", (r, i)
            assert element["title"] == same["title"] == f"{GRID_TOKENS[i]}: {value:.4g}"
            assert unscaled(element) == unscaled(same) == (i in exclude), (r, i)
            if i not in exclude:
                assert element["style"] == same["style"], (r, i)
                assert rgb(element["style"]) == ramp(float(value), view.scale_max, (192, 57, 43))
    # The leading tokens come before their grid, and the legend is the line view's.
    grids = [m.start() for m in re.finditer(r'class="attnflow-grid[ "]', text)]
    labels = [m.start() for m in re.finditer(r">\[REG1\]<", text)]
    assert len(grids) == len(labels) == 2
    assert labels[0] < grids[0] < labels[1] < grids[1]
    assert scale_legend(text) == scale_legend(line.to_html())
    assert page.labels == ["rollout", "flow"]


def test_interactive_grid_draws_the_initial_choice_in_its_cells() -> None:
    rng = np.random.default_rng(5)
    weights = rng.random((2, 2, 14, 14))
    weights /= weights.sum(-1, keepdims=True)
    scores = {"rollout": attnflow.rollout(weights, layers="all"), "raw": weights}
    options: dict[str, Any] = {"scale_exclude": [0, 9], "method": "raw", "layer": 0, "row": 4}
    view = InteractiveView(scores, GRID_TOKENS, grid=GRID, **options)
    line = InteractiveView(scores, GRID_TOKENS, **options)
    page, spans = parse(view.to_html()), parse(line.to_html()).tokens
    assert [span["text"] for span in page.tokens] == ["[CLS]", "[REG1]"]
    assert [cell["text"] for cell in page.cells] == PATCHES
    drawn = page.tokens + page.cells
    values = view.scores["raw"][0, 0, 4]
    assert [element["data-value"] for element in drawn] == [f"{v:.4g}" for v in values]
    for element, same in zip(drawn, spans, strict=True):
        assert element.get("style") == same.get("style")
        assert element["title"] == same["title"]
        assert unscaled(element) == unscaled(same)
        # Every token is a row: cells are clickable and focusable as the spans are.
        for name in ("data-row", "tabindex", "role", "aria-current"):
            assert element.get(name) == same.get(name), name
        assert element["class"].split()[1:] == same["class"].split()[1:]
    assert page.cells[2]["aria-current"] == "true"  # row 4: the cell (0,2)
    assert "attnflow-current" in page.cells[2]["class"].split()
    assert _data(view.to_html())[0]["tokens"] == GRID_TOKENS
    assert 'class="attnflow-row"' not in view.to_html()  # no line of all the tokens


def test_grid_cells_are_square_and_a_vit_grid_fits_about_500_px() -> None:
    def sizes(grid: tuple[int, int], extra: int = 1) -> tuple[int, bool]:
        n = extra + grid[0] * grid[1]
        text = TokenView(np.ones(n), [f"t{i}" for i in range(n)], grid=grid).to_html()
        (attributes,) = parse(text).grids
        found = re.search(r"repeat\((\d+), (\d+)px\); grid-auto-rows: (\d+)px", attributes["style"])
        assert found
        assert int(found.group(1)) == grid[1]
        assert found.group(2) == found.group(3)  # square
        return int(found.group(2)), "attnflow-grid-small" in attributes["class"].split()

    size, small = sizes((14, 14))
    assert 450 <= 14 * size + 13 * 2 <= 520
    assert small  # labels in the tooltip only
    size, small = sizes((2, 3), extra=0)
    assert size >= 48
    assert not small  # large enough for the labels
    size, _ = sizes((37, 37), extra=5)  # DINOv2 at 518 px
    assert 37 * size <= 600


@pytest.mark.parametrize(
    ("grid", "error", "match"),
    [
        ((0, 3), ValueError, r"`grid` must be a pair of positive ints .*got \(0, 3\)"),
        ((3, -1), ValueError, r"`grid` must be a pair of positive ints .*got \(3, -1\)"),
        ((3.0, 4), ValueError, r"`grid` must be a pair of positive ints .*got \(3\.0, 4\)"),
        ((True, 4), ValueError, r"`grid` must be a pair of positive ints"),
        ("34", ValueError, r"`grid` must be a pair of positive ints .*got '34'"),
        ((3, 4, 1), ValueError, r"`grid` must be a pair of positive ints"),
        (12, ValueError, r"`grid` must be a pair of positive ints .*got 12"),
        ((4, 4), ValueError, r"at most as many cells .* tokens \(14\).*got \(4, 4\), 16 cells"),
        ((1, 15), ValueError, r"got \(1, 15\), 15 cells"),
    ],
)
def test_bad_grids_are_refused_before_any_rendering(
    grid: object, error: type[Exception], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def render(*args: object) -> str:
        msg = "rendered"
        raise AssertionError(msg)

    import attnflow.html as module

    for name in ("_arranged", "_content", "_token_style"):
        monkeypatch.setattr(module, name, render)
    monkeypatch.setattr(TokenView, "_body", render)
    monkeypatch.setattr(InteractiveView, "_body", render)
    scores = _grid_scores()
    for make in (TokenView, InteractiveView):
        with pytest.raises(error, match=match) as raised:
            make(scores, GRID_TOKENS, grid=grid)  # type: ignore[arg-type]
        assert "e.g. grid=(14, 14)" in str(raised.value)  # and how to fix it
    # The largest grid the tokens allow, and a grid of numpy ints, are fine.
    assert TokenView(scores, GRID_TOKENS, grid=(2, 7)).grid == (2, 7)
    assert InteractiveView(scores, GRID_TOKENS, grid=(np.int64(3), np.int64(4))).grid == GRID


# -- the picture under a patch grid ----------------------------------------------------------


@pytest.mark.parametrize("shape", [(5, 7), (5, 7, 3), (5, 7, 4), (1, 1, 3), (300, 2, 3)], ids=str)
def test_png_encoder_round_trips_through_a_reader_written_from_the_spec(
    shape: tuple[int, ...],
) -> None:
    from png_reference import read_png

    from attnflow._png import encode_png

    pixels = np.random.default_rng(len(shape)).integers(0, 256, size=shape, dtype=np.uint8)
    decoded = read_png(encode_png(pixels))
    np.testing.assert_array_equal(decoded.reshape(shape), pixels)
    try:  # and through Pillow, where the environment has it (matplotlib brings it)
        from PIL import Image
    except ImportError:
        return
    import io

    with Image.open(io.BytesIO(encode_png(pixels))) as opened:
        np.testing.assert_array_equal(np.asarray(opened).reshape(shape), pixels)


def test_pictures_become_8_bit_as_the_figures_read_them() -> None:
    from attnflow._png import encode_png, to_uint8

    ramp01 = np.linspace(0.0, 1.0, 6).reshape(2, 3)
    np.testing.assert_array_equal(to_uint8(ramp01), [[0, 51, 102], [153, 204, 255]])
    np.testing.assert_array_equal(to_uint8(ramp01 * 255), to_uint8(ramp01))  # 8-bit floats
    normalised = ramp01 * 4 - 2  # a mean/std-normalised input: its own range
    np.testing.assert_array_equal(to_uint8(normalised), to_uint8(ramp01))
    ints = np.array([[0, 7], [200, 255]], dtype=np.int64)
    assert to_uint8(ints).dtype == np.uint8
    np.testing.assert_array_equal(to_uint8(ints), ints)
    # Long pictures are shrunk by an integer factor, each pixel the mean of its block.
    big = np.zeros((2050, 10), dtype=np.uint8)
    big[::2] = 200
    small = to_uint8(big)
    assert small.shape == (683, 3)
    np.testing.assert_array_equal(
        small, np.where(np.arange(683) % 2 == 0, 133, 67)[:, None] + np.zeros((1, 3), int)
    )
    with pytest.raises(ValueError, match="8-bit values"):
        to_uint8(np.array([[256]]))
    with pytest.raises(ValueError, match="`image` must be finite"):
        to_uint8(np.array([[np.nan]]))
    with pytest.raises(ValueError, match="`pixels` must be uint8"):
        encode_png(np.zeros((2, 2)))


def test_views_draw_the_picture_under_the_grid_and_their_cells_see_through() -> None:
    from png_reference import read_png

    image = np.random.default_rng(1).integers(0, 256, size=(30, 40, 3), dtype=np.uint8)
    scores = {"rollout": _grid_scores(), "flow": _grid_scores()[::-1].copy()}
    exclude = [0, 1, 2 + 5]
    plain = TokenView(scores, GRID_TOKENS, scale_exclude=exclude, grid=GRID)
    over = TokenView(scores, GRID_TOKENS, scale_exclude=exclude, grid=GRID, image=image)
    interactive = InteractiveView(
        {"rollout": scores["rollout"]}, GRID_TOKENS, scale_exclude=exclude, grid=GRID, image=image
    )
    for view, text in ((over, over.to_html()), (interactive, interactive.to_html())):
        (url,) = set(re.findall(r"--attnflow-image: url\('data:image/png;base64,([^']*)'\)", text))
        import base64

        np.testing.assert_array_equal(read_png(base64.b64decode(url)), image)
        page = parse(text)
        assert page.grids
        assert all("attnflow-grid-image" in g["class"] for g in page.grids)
        values = list(scores.values()) if view is over else [scores["rollout"]]
        top = max(
            float(v[[i for i in range(len(GRID_TOKENS)) if i not in exclude]].max()) for v in values
        )
        for r, row in enumerate(values):
            cells = page.cells[12 * r : 12 * r + 12]
            for i, (cell, value) in enumerate(zip(cells, row[2:], strict=True)):
                if i + 2 in exclude:
                    assert unscaled(cell)
                    continue
                alpha = np.floor(1000 * 0.75 * max(0.0, value) / top + 0.5) / 1000
                assert f"background-color: rgba(192, 57, 43, {alpha:g})" in cell["style"]
        # The leading tokens (not over the picture) keep the opaque ramp.
        assert all("rgba" not in span.get("style", "") for span in page.tokens)
    assert "attnflow-image" not in plain.to_html().split("</style>", 1)[1]
    # The style sheet: the picture fills each grid; cells out of the scale stay see-through.
    assert ".attnflow-grid-image { background-image: var(--attnflow-image);" in _CSS
    assert "background-color: rgba(238, 238, 238, 0.55)" in _CSS
    # The script's data says whether the cells are over a picture, and how opaque at most.
    data = interactive._data()
    assert (data["overImage"], data["cellOpacity"]) == (True, 0.75)


def test_an_image_needs_a_grid_and_must_be_a_picture() -> None:
    scores = _grid_scores()
    for make in (TokenView, InteractiveView):
        with pytest.raises(ValueError, match=r"`image` needs `grid=\(rows, cols\)`"):
            make(scores, GRID_TOKENS, image=np.zeros((4, 4)))
        with pytest.raises(ValueError, match=r"`image` must be a picture .*\(3, 8, 8\)"):
            make(scores, GRID_TOKENS, grid=GRID, image=np.zeros((3, 8, 8)))
        with pytest.raises(ValueError, match="8-bit values"):
            make(scores, GRID_TOKENS, grid=GRID, image=np.full((4, 4), 300))
