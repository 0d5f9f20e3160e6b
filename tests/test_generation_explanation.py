"""GenerationExplanation (issue 21, item 4): views, the page, save/load and damaged files.

No model here: the result class alone, built from hand-written scores (the rows that
explain_generation fills are tested against each prefix in tests/llm/test_generation.py).
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
from html_pages import parse, unscaled

from attnflow.explanation import Explanation
from attnflow.generation import GenerationExplanation

TOKENS = ["<s>", "The", "<cat>", " sat", " on", " it"]  # P = 3, T = 3
SPECIAL = [True, False, False, False, False, False]


def _scores() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    values = {}
    for name in ("rollout", "gradient_rollout"):
        rows = np.zeros((3, 5))
        for step in range(3):
            row = rng.random(3 + step)
            rows[step, : 3 + step] = row / row.sum()
        values[name] = rows
    return values


def _explained() -> GenerationExplanation:
    return GenerationExplanation(
        TOKENS,
        [41, 42, 43],
        _scores(),
        prompt_length=3,
        prompt_ids=[1, 7, 9],
        special=SPECIAL,
        prompt="The <cat>",
        generated_text=" sat on it",
    )


def test_show_lists_the_strongest_sources_of_each_generated_token() -> None:
    g = _explained()
    out = io.StringIO()
    g.show(top=2, file=out)
    lines = out.getvalue().splitlines()
    assert (
        lines[0]
        == "3 tokens generated after a prompt of 3; the 2 strongest sources of each, by method"
    )
    assert lines[1].startswith("Each generated token is attributed to the prompt")
    assert lines[2] == "[3] ' sat' (id 41), predicted at position 2"
    assert len(lines) == 2 + 3 * 3
    for step in range(3):
        row = g.scores["rollout"][step].copy()
        # Never the special token nor the position that predicted the token.
        row[np.asarray(SPECIAL[: row.size])] = -np.inf
        row[2 + step] = -np.inf
        best = int(np.argmax(row))
        assert lines[3 + 3 * step].split()[1] == f"[{best}]"
    full = io.StringIO()
    g.show(step=-1, file=full)  # the last token: every token before it, both methods
    table = full.getvalue().splitlines()
    assert table[0] == "row 4 (' on'), layer 1 of 1; target 43"
    assert len(table) == 2 + 5


def test_explanation_of_one_step_is_its_prefix() -> None:
    g = _explained()
    one = g.explanation(1)
    assert isinstance(one, Explanation)
    assert one.tokens == tuple(TOKENS[:4])
    assert one.rows == 3
    assert one.target == 42
    np.testing.assert_array_equal(one.scores["rollout"][0], g.scores["rollout"][1, :4])
    with pytest.raises(IndexError, match=r"`step` must index the 3 generated tokens"):
        g.explanation(3)
    with pytest.raises(TypeError, match=r"`step` must be an int"):
        g.explanation(1.0)  # type: ignore[arg-type]


def test_page_picks_a_generated_token_and_colours_the_tokens_before_it(tmp_path: Path) -> None:
    g = _explained()
    page = g.to_html(tmp_path / "g.html")
    assert (tmp_path / "g.html").read_text(encoding="utf-8") == page
    with pytest.raises(FileExistsError, match=r"pass `overwrite=True`"):
        g.to_html(tmp_path / "g.html")
    parsed = parse(page)
    found = re.findall(r'<script type="application/json" id="[^"]+">(.*?)</script>', page)
    assert len(found) == 1
    data = json.loads(found[0])
    assert data["tokens"] == TOKENS
    assert data["rows"] == [3, 4, 5]  # one row per generated token, at its own position
    assert [m["name"] for m in data["methods"]] == ["rollout", "gradient_rollout"]
    for method in data["methods"]:
        stored = np.array(method["values"])[0, 0]  # (layers, heads, rows, n)
        np.testing.assert_array_equal(stored[:, :5], g.scores[method["name"]])
        assert not stored[:, 5].any()  # the last token explains nothing before itself
    assert data["inScale"] == [not s for s in SPECIAL]  # BOS out of the colour scale
    # The first render shows generated token 0 (" sat"), outlined; clicks pick the others.
    interactive = parsed.tokens[: len(TOKENS)]
    assert [t["text"] for t in interactive] == ["<s>", "The", "<cat>", " sat", " on", " it"]
    assert interactive[3].get("aria-current") == "true"
    assert [t.get("data-row") for t in interactive] == [None, None, None, "0", "1", "2"]
    assert unscaled(interactive[0])
    assert "&lt;cat&gt;" in page
    assert "<cat>" not in page.replace('"<cat>"', "")  # escaped, in the JSON as text only
    # Readers without scripts: the first method's rows, one line per generated token.
    static = page.split("<noscript>", 1)[1]
    assert static.count('class="attnflow-label"') == 3
    assert "3:  sat (rollout; predicted at 2)" in static
    assert "http" not in page.replace("http-equiv", "")  # loads nothing
    fragment = g._repr_html_()
    assert "<html" not in fragment
    assert fragment.count('type="application/json"') == 1
    with_special = json.loads(
        re.findall(r'id="[^"]+-data">(.*?)</script>', g.to_html(scale_special=True))[0]
    )
    assert all(with_special["inScale"])


def test_npz_round_trip_keeps_everything(tmp_path: Path) -> None:
    g = _explained()
    path = g.save(tmp_path / "g.npz")
    for copy in (GenerationExplanation.load(path), GenerationExplanation.from_dict(g.to_dict())):
        assert copy.tokens == g.tokens
        assert copy.prompt_length == 3
        assert copy.generated_ids.tolist() == [41, 42, 43]
        assert copy.prompt_ids is not None
        assert copy.prompt_ids.tolist() == [1, 7, 9]
        assert copy.special.tolist() == SPECIAL
        assert (copy.prompt, copy.generated_text) == ("The <cat>", " sat on it")
        assert list(copy.scores) == list(g.scores)
        for name, values in g.scores.items():
            np.testing.assert_array_equal(copy.scores[name], values)
    with np.load(path, allow_pickle=False) as stored:  # no pickle inside
        assert sorted(stored.files) == [
            "generated_ids",
            "meta",
            "prompt_ids",
            "scores/gradient_rollout",
            "scores/rollout",
            "special",
        ]
    with pytest.raises(FileExistsError, match=r"pass overwrite=True"):
        g.save(path)
    g.save(path, overwrite=True)
    with pytest.raises(ValueError, match=r"`path` must end in \.npz"):
        g.save(tmp_path / "g.json")


def _one_line(error: pytest.ExceptionInfo[ValueError], path: Path) -> str:
    text = str(error.value)
    assert "\n" not in text
    assert str(path) in text
    return text


def test_load_refuses_damaged_files_with_one_line(tmp_path: Path) -> None:
    good = _explained().save(tmp_path / "good.npz")
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"truncated or not a zip archive") as error:
        GenerationExplanation.load(truncated)
    _one_line(error, truncated)
    missing = tmp_path / "missing.npz"
    with pytest.raises(ValueError, match=r"does not exist") as error:
        GenerationExplanation.load(missing)
    _one_line(error, missing)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, meta=np.array([{"format": "x"}], dtype=object))
    with pytest.raises(ValueError, match=r"never unpickles") as error:
        GenerationExplanation.load(pickled)
    _one_line(error, pickled)
    other = Explanation(["a", "b"], {"rollout": [0.5, 0.5]}).save(tmp_path / "other.npz")
    with pytest.raises(ValueError, match=r"format 'attnflow\.Explanation/1', expected") as error:
        GenerationExplanation.load(other)
    _one_line(error, other)


def _rewrite(source: Path, target: Path, **changes: object) -> Path:
    """Copy a saved file, replacing arrays (None deletes one)."""
    with np.load(source, allow_pickle=False) as stored:
        arrays = {name: stored[name] for name in stored.files}
    for name, value in changes.items():
        key = name.replace("__", "/")
        if value is None:
            del arrays[key]
        else:
            arrays[key] = np.asarray(value)
    np.savez(target, **arrays)
    return target


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"meta": json.dumps({"format": "attnflow.Explanation/1"})}, r"format 'attnflow\.Exp"),
        ({"meta": "{not json"}, r"'meta' array is not JSON"),
        ({"meta": "[1, 2]"}, r"'meta' array is not a JSON object"),
        ({"meta": None}, r"no 'meta' array"),
        ({"image": np.zeros(2)}, r"'image' of shape \(2,\): not part of a generation expl"),
        (
            {"scores__rollout": np.ones((3, 5))},
            r"must be zero beyond each row.s prefix .*; row 0 has a score at position 3 or later",
        ),
        ({"scores__rollout": np.zeros((2, 5))}, r"must have shape \(T, P \+ T - 1\) = \(3, 5\)"),
        ({"scores__rollout": np.zeros(5)}, r"scores must be a 2-d float array"),
        ({"scores__rollout": np.full((3, 5), np.nan)}, r"must be finite"),
        ({"generated_ids": np.array([1.5, 2, 3])}, r"token ids must be a 1-d integer array"),
        ({"generated_ids": np.array([1, 2])}, r"must hold 3 integer token ids"),
        ({"special": np.array([True])}, r"one bool per token \(6\)"),
    ],
)
def test_load_refuses_files_that_are_not_generation_explanations(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    good = _explained().save(tmp_path / "good.npz")
    bad = _rewrite(good, tmp_path / "bad.npz", **changes)
    with pytest.raises(ValueError, match=message) as error:
        GenerationExplanation.load(bad)
    _one_line(error, bad)


def test_a_zip_member_that_is_not_an_array_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr("meta.npy", b"not an array at all")
    with pytest.raises(ValueError, match=r"not a plain NumPy array file") as error:
        GenerationExplanation.load(bad)
    _one_line(error, bad)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tokens": "abc"}, TypeError, r"`tokens` must be a sequence of str"),
        ({"prompt_length": 0}, ValueError, r"`prompt_length` must be an int >= 1"),
        ({"prompt_length": 6}, ValueError, r"at least one generated token"),
        ({"generated_ids": [1.0, 2.0, 3.0]}, TypeError, r"must hold 3 integer token ids"),
        ({"scores": {}}, ValueError, r"non-empty mapping"),
        ({"special": [True]}, ValueError, r"one bool per token"),
        ({"prompt": 3}, TypeError, r"`prompt` must be a str or None"),
    ],
)
def test_bad_arguments_are_refused_clearly(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    arguments: dict[str, object] = {
        "tokens": TOKENS,
        "generated_ids": [41, 42, 43],
        "scores": _scores(),
        "prompt_length": 3,
        **kwargs,
    }
    with pytest.raises(error, match=message):
        GenerationExplanation(**arguments)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`top` must be an int >= 1"):
        _explained().show(top=0)
