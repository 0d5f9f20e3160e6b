"""``attnflow evaluate agreement``: the reproduction end to end, on a small scale."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from backends import selected_variants

if "torch" in {v.library for v in selected_variants()}:
    import torch  # requested: it must be installed
else:
    torch = pytest.importorskip("torch", reason="the reproduction runs in the torch session")

from attnflow._cli import main
from attnflow.experiments.reproduction import PAPER_TABLES, comparison_markdown


def test_small_reproduction_runs_resumes_and_compares_with_the_paper(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "agreement"
    arguments = [
        "evaluate",
        "agreement",
        "-o",
        str(folder),
        "--sentences",
        "24",
        "--train-sentences",
        "300",
        "--fractions",
        "0.2,0.5",
        "--chunk-size",
        "8",
        "--quiet",
    ]
    assert main(arguments) == 0
    first = capsys.readouterr().out
    record = json.loads((folder / "training.json").read_text())
    assert record["train_sentences"] == 300
    assert 0.0 <= record["test_accuracy"] <= 1.0
    assert sorted(p.name for p in folder.glob("rows-*")) == ["rows-0", "rows-max"]
    assert len(list((folder / "rows-0").glob("chunk-*.npz"))) == 3
    report = (folder / "report.md").read_text()
    assert "Beside the paper" in report
    assert "(0.69 ± 0.27)" in report  # Table 1, raw attention at layer 1
    # The rerun trains nothing and computes nothing: the same tables.
    weights = (folder / "model" / "weights.npz").stat().st_mtime_ns
    assert main(arguments) == 0
    assert capsys.readouterr().out == first
    assert (folder / "model" / "weights.npz").stat().st_mtime_ns == weights
    # Another training size in the same folder is refused.
    other = [*arguments]
    other[other.index("300")] = "301"
    assert main(other) == 1
    assert "holds a model trained with 300" in capsys.readouterr().err


def test_comparison_table_lists_every_layer() -> None:
    from attnflow.evaluate import FaithfulnessReport

    samples = {
        f"correlation.{m}.input_gradients": np.linspace(0, 1, 12).reshape(2, 6)
        for m in PAPER_TABLES["blank_out"]
    }
    report = FaithfulnessReport(
        samples, ("raw", "rollout", "flow"), ("input_gradients",), "spearman", "drop", 0
    )
    lines = comparison_markdown(report, "input_gradients").splitlines()
    assert lines[0].split("|")[1:-1][-1].strip() == "L6"
    assert "(0.61 ± 0.28)" in lines[-1]  # Table 2, flow at layer 6
