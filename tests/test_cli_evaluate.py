"""``attnflow evaluate`` on saved model outputs: tables, files, resumption and errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import attnflow
from attnflow._cli import main

SAMPLES, LAYERS, HEADS, N = 9, 3, 2, 6


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(SAMPLES, LAYERS, HEADS, N, N)) * 2
    attentions = np.exp(logits)
    attentions /= attentions.sum(axis=-1, keepdims=True)
    mask = np.arange(N)[None, :] < rng.integers(3, N + 1, size=SAMPLES)[:, None]
    blank = np.where(mask, rng.random((SAMPLES, N)), np.nan)
    arrays = {
        "attentions": attentions,
        "mask": mask,
        "blank_out": blank,
        "input_gradients": rng.random((SAMPLES, N)),
        "predictions": rng.integers(0, 2, SAMPLES),
        "labels": rng.integers(0, 2, SAMPLES),
    }
    path = tmp_path_factory.mktemp("saved") / "outputs.npz"
    np.savez(path, **arrays)
    return path, arrays


def test_tables_equal_the_api_and_a_rerun_resumes(
    tmp_path: Path, saved: tuple[Path, dict[str, np.ndarray]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, arrays = saved
    folder = tmp_path / "run"
    arguments = ["evaluate", str(path), "-o", str(folder), "--quiet", "--rows", "0,max"]
    assert main([*arguments, "--chunk-size", "4"]) == 0
    printed = capsys.readouterr().out
    expected = attnflow.evaluate.faithfulness_from_outputs(
        arrays["attentions"],
        {"blank_out": arrays["blank_out"], "input_gradients": arrays["input_gradients"]},
        mask=arrays["mask"],
        rows="max",
    )
    assert expected.to_markdown() in printed
    report = (folder / "report.md").read_text()
    assert expected.to_markdown() in report
    summary = json.loads((folder / "report.json").read_text())
    assert set(summary) == {"0", "max"}
    accuracy = np.mean(arrays["predictions"] == arrays["labels"])
    assert summary["0"]["accuracy"] == pytest.approx(accuracy)
    assert "<table>" in (folder / "report.html").read_text()
    assert sorted(p.name for p in folder.glob("rows-*")) == ["rows-0", "rows-max"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (folder / "faithfulness-max.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The second run finds every chunk and prints the same tables.
    chunks = {p: p.stat().st_mtime_ns for p in folder.glob("rows-*/chunk-*.npz")}
    assert main([*arguments, "--chunk-size", "4"]) == 0
    assert capsys.readouterr().out == printed
    assert {p: p.stat().st_mtime_ns for p in folder.glob("rows-*/chunk-*.npz")} == chunks
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]  # replaced whole
    # Other settings in the same folder are refused, and nothing is touched.
    assert main([*arguments, "--chunk-size", "5"]) == 1
    assert "differs in chunk_size" in capsys.readouterr().err


def test_errors_are_one_line(
    tmp_path: Path, saved: tuple[Path, dict[str, np.ndarray]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, arrays = saved
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert main(["evaluate", str(path), "-o", str(foreign)]) == 2
    assert "did not write" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "keep me"

    no_references = tmp_path / "attentions-only.npz"
    np.savez(no_references, attentions=arrays["attentions"])
    assert main(["evaluate", str(no_references), "-o", str(tmp_path / "a")]) == 2
    error = capsys.readouterr().err
    assert "holds no reference scores" in error
    assert len(error.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists()  # a refused input leaves no empty folder behind
    (tmp_path / "kept").mkdir()  # ... but a folder the user made stays
    assert main(["evaluate", str(no_references), "-o", str(tmp_path / "kept")]) == 2
    assert (tmp_path / "kept").is_dir()
    capsys.readouterr()

    assert main(["evaluate", str(tmp_path / "missing.npz"), "-o", str(tmp_path / "b")]) == 2
    assert "is not a file of saved model outputs" in capsys.readouterr().err
    assert main(["evaluate", str(path), "-o", str(tmp_path / "c"), "--rows", "first"]) == 2
    assert "--rows takes" in capsys.readouterr().err


def test_a_damaged_chunk_fails_the_command_and_force_recomputes_it(
    tmp_path: Path, saved: tuple[Path, dict[str, np.ndarray]], capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 22.2: a chunk copied over another, or cut, once printed a table over the
    # wrong samples ("over 7 samples" of 9) and exited 0.
    path, _ = saved
    folder = tmp_path / "run"
    arguments = ["evaluate", str(path), "-o", str(folder), "--quiet", "--chunk-size", "2"]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    chunks = folder / "rows-0"
    (chunks / "chunk-000001.npz").write_bytes((chunks / "chunk-000002.npz").read_bytes())
    with np.load(chunks / "chunk-000003.npz") as loaded:
        cut = {
            name: loaded[name] if loaded[name].ndim == 0 else loaded[name][:1] for name in loaded
        }
    (chunks / "chunk-000003.npz").unlink()
    np.savez(chunks / "chunk-000003.npz", **cut)
    assert main(arguments) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "chunk-000001.npz holds chunk 2 (samples 4-5), not chunk 1 (samples 2-3)" in captured.err
    assert "rerun with --force" in captured.err
    assert main([*arguments, "--force"]) == 0
    assert capsys.readouterr().out == printed
    assert f"over {SAMPLES} samples" in printed


def test_the_authors_correlation_equals_the_api_and_last_token_needs_blank_out(
    tmp_path: Path, saved: tuple[Path, dict[str, np.ndarray]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, arrays = saved
    folder = tmp_path / "dense"
    arguments = ["evaluate", str(path), "-o", str(folder), "--quiet"]
    assert main([*arguments, "--correlation", "spearman_dense"]) == 0
    expected = attnflow.evaluate.faithfulness_from_outputs(
        arrays["attentions"],
        {"blank_out": arrays["blank_out"], "input_gradients": arrays["input_gradients"]},
        mask=arrays["mask"],
        correlation="spearman_dense",
    )
    printed = capsys.readouterr().out
    assert expected.to_markdown() in printed
    assert "dense ranks" in printed
    # The paper's reproductions are the lab's command: said in one line, nothing written.
    refused = tmp_path / "agreement"
    assert main(["evaluate", "agreement", "-o", str(refused)]) == 2
    error = capsys.readouterr().err
    assert "attnflow-lab evaluate agreement" in error
    assert len(error.strip().splitlines()) == 1
    assert not refused.exists()
