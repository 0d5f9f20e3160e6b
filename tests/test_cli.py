"""The ``attnflow`` command line (``attnflow demo``); the sample itself is in test_sample.py."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from backends import selected_variants

import attnflow
from attnflow import _cli_common, _demo
from attnflow._cli import EXIT_FAILURE, EXIT_USAGE, main
from attnflow._sample import Sample, load_sample

# One table line per real token: position, token, raw, rollout, flow, then the bar.
ROW = re.compile(r"^\s+(\d+)\s+(\S+)\s+(\d+\.\d{4})\s+(\d+\.\d{4})\s+(\d+\.\d{4})\b")
HEADING = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")


@pytest.fixture(scope="module")
def sample() -> Sample:
    return load_sample()


@pytest.fixture(autouse=True)
def _in_a_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `attnflow demo` writes ./attnflow-demo; keep it out of the checkout.
    monkeypatch.chdir(tmp_path)


def parse_demo(text: str) -> dict[int, list[tuple[int, str, float, float, float]]]:
    """Rows of each sentence's table, keyed by the sentence's 0-based index."""
    tables: dict[int, list[tuple[int, str, float, float, float]]] = {}
    current: int | None = None
    for line in text.splitlines():
        if heading := HEADING.match(line):
            current = int(heading.group(1)) - 1
            tables[current] = []
        elif (row := ROW.match(line)) and current is not None:
            position, token, raw, rollout, flow = row.groups()
            tables[current].append((int(position), token, float(raw), float(rollout), float(flow)))
    return tables


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONIOENCODING"] = "utf-8"
    return env


# -- attnflow demo -------------------------------------------------------------------------


def test_demo_prints_every_real_token_of_the_first_sentence(
    sample: Sample, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--no-files"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert sample.sentences[0] in out
    tables = parse_demo(out)
    real = [token for token, k in zip(sample.tokens[0], sample.mask[0], strict=True) if k]
    assert [token for _, token, *_ in tables[0]] == real
    # The header names the model, the method and the paper.
    assert "all-MiniLM-L6-v2" in out
    assert "rollout" in out
    assert "Quantifying Attention Flow in Transformers" in out


def test_demo_values_equal_the_library(sample: Sample, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--no-files"]) == 0
    tables = parse_demo(capsys.readouterr().out)
    assert sorted(tables) == list(range(len(sample.sentences)))
    # Each sentence explains its [MASK] word (the page does too), else [CLS].
    rows = [list(t).index("[MASK]") if "[MASK]" in t else 0 for t in sample.tokens]
    picked = np.arange(len(rows)), np.asarray(rows)
    expected_rollout = attnflow.rollout(sample.attentions, mask=sample.mask)[picked]
    expected_raw = attnflow.raw(sample.attentions, mask=sample.mask)[picked]
    expected_flow = attnflow.flow(sample.attentions, mask=sample.mask)[picked]
    assert rows[:2] != [0, 0]  # the sample has [MASK] sentences: the check can fail
    for b, table in tables.items():
        positions = [position for position, *_ in table]
        np.testing.assert_array_equal(positions, np.flatnonzero(sample.mask[b]))
        printed_raw = np.array([raw for _, _, raw, _, _ in table])
        printed_rollout = np.array([rollout for _, _, _, rollout, _ in table])
        np.testing.assert_allclose(printed_rollout, expected_rollout[b, positions], atol=5e-5)
        np.testing.assert_allclose(printed_raw, expected_raw[b, positions], atol=5e-5)
        printed_flow = np.array([flow for *_, flow in table])
        np.testing.assert_allclose(printed_flow, expected_flow[b, positions], atol=5e-5)
        # Padding is skipped, and carries nothing.
        np.testing.assert_array_equal(expected_rollout[b, ~sample.mask[b]], 0.0)


def test_demo_rollout_is_not_the_raw_attention(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--no-files"]) == 0
    table = parse_demo(capsys.readouterr().out)[0]
    assert any(abs(raw - rollout) > 0.01 for _, _, raw, rollout, _ in table)


def test_demo_ascii_bars() -> None:
    sample = load_sample()
    values = np.array([[0.5, 0.25, 0.25]])
    lines = _demo.render_demo(
        ["a b"],
        [["[CLS]", "a", "b"]],
        np.array([[True, True, True]]),
        values,
        values,
        values,
        source="test",
        layers=sample.attentions.shape[1],
        heads=sample.attentions.shape[2],
        unicode=False,
        bar_width=8,
    )
    rows = [line for line in lines if ROW.match(line)]
    assert rows[0].endswith(" " + "#" * 8)
    assert rows[1].endswith(" " + "#" * 4)
    assert all(line.isascii() for line in lines)


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [(0.0, ""), (1.0, "\u2588" * 3), (0.5, "\u2588\u258c"), (1 / 24, "\u258f")],
)
def test_bar(fraction: float, expected: str) -> None:
    assert _cli_common.bar(fraction, 3, unicode=True) == expected


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [[], ["nonsense"], ["demo", "--bogus"]])
def test_usage_errors_are_one_line_with_status_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("attnflow: error: ")


def test_failure_is_one_line_with_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing() -> Sample:
        msg = "the attention sample is not installed"
        raise FileNotFoundError(msg)

    monkeypatch.setattr("attnflow._sample.load_sample", missing)
    assert main(["demo"]) == EXIT_FAILURE
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("attnflow demo: error: the attention sample is not installed")
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["--debug", "demo"], ["demo", "--debug"]])
def test_debug_shows_the_exception(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Sample:
        msg = "boom"
        raise RuntimeError(msg)

    monkeypatch.setattr("attnflow._sample.load_sample", broken)
    with pytest.raises(RuntimeError, match="boom"):
        main(argv)


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"attnflow {attnflow.__version__}"
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["demo", "--help"]) == 0
    assert "usage: attnflow demo" in capsys.readouterr().out


# -- entry points --------------------------------------------------------------------------


def console_script() -> str | None:
    """The installed ``attnflow`` script: next to this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / ("attnflow.exe" if os.name == "nt" else "attnflow")
    return str(beside) if beside.is_file() else shutil.which("attnflow")


def test_console_script_runs_the_demo(sample: Sample) -> None:
    script = console_script()
    if script is None:
        pytest.skip("the attnflow console script is not installed")
    # The entry point is under test, not the figures (test_demo_writes_its_page_... draws
    # them): --no-files spares a second drawing of all seven.
    done = subprocess.run(
        [script, "demo", "--no-files"], capture_output=True, text=True, encoding="utf-8",
        env=environment(), check=False, timeout=120, cwd=Path.cwd(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert parse_demo(done.stdout).keys() == set(range(len(sample.sentences)))


def test_python_m_attnflow(sample: Sample) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "attnflow", "demo", "--no-files"], capture_output=True,
        text=True, encoding="utf-8", env=environment(), check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    tables = parse_demo(done.stdout)
    assert [token for _, token, *_ in tables[0]] == [
        t for t, k in zip(sample.tokens[0], sample.mask[0], strict=True) if k
    ]


def test_python_m_attnflow_usage_error_status() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "attnflow", "nonsense"], capture_output=True, text=True,
        env=environment(), check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == EXIT_USAGE
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1
    assert "Traceback" not in done.stderr


def test_import_attnflow_does_not_import_the_cli() -> None:
    code = (
        "import sys, attnflow; "
        "print(sorted(m for m in ('attnflow._cli', 'attnflow._sample', 'argparse') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_demo_writes_its_page_and_figures_and_keeps_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from html.parser import HTMLParser

    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.skip("drawn once per matrix run, in the numpy session")
    assert main(["demo", "-o", "out"]) == 0
    out = capsys.readouterr().out
    page = tmp_path / "out" / "index.html"
    assert f"open {Path('out') / 'index.html'}" in out
    text = page.read_text(encoding="utf-8")
    HTMLParser().feed(text)  # well-formed enough to parse
    for token in ("sara", "[MASK]", "cabinets"):
        assert token in text
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    if importlib.util.find_spec("matplotlib") is None:
        assert pngs == []
        assert "attnflow[plot]" in text
    else:
        expected = [f"sentence-{b}-{k}.png" for b in (1, 2, 3) for k in ("graph", "layers")]
        assert pngs == ["digits.png", *expected]
        for png in pngs:
            assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = page.read_bytes()
    assert main(["demo", "-o", "out"]) == EXIT_USAGE  # never overwrites without --force
    refused = capsys.readouterr()
    assert "pass --force" in refused.err
    assert refused.out == ""  # refused before the table, not after it
    assert page.read_bytes() == before
    assert main(["demo", "-o", "out", "--force"]) == 0
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.endswith(".tmp")]


def test_explain_takes_one_row_and_says_where_several_go(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Refused while parsing, before any model folder is read (none exists here).
    argv = ["explain", "--model", str(tmp_path / "none"), "some text", "--rows", "0,4"]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--rows takes one integer, got '0,4'" in err
    assert "attnflow rollout/flow --rows 0,4" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["rollout", "x.npy", "--row", "0"], "did you mean --rows for --row?"),
        (["flow", "x.npy", "--job", "2"], "did you mean --jobs for --job?"),
        (["flow", "x.npy", "--resdual=0.3"], "did you mean --residual for --resdual?"),
        (["plot", "x.npy", "-o", "p.png", "--knd", "graph"], "did you mean --kind for --knd?"),
    ],
)
def test_abbreviations_are_refused_and_typos_get_the_closest_flag(
    tmp_path: Path, argv: list[str], suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # An abbreviation is a typo too: argparse would otherwise read --row as --rows and
    # --job as --jobs, and a later option could change what it means.
    np.save(tmp_path / "x.npy", np.full((2, 1, 3, 3), 1 / 3))
    argv = [str(tmp_path / a) if a == "x.npy" else a for a in argv]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err
    assert suggestion in err
    assert err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]
