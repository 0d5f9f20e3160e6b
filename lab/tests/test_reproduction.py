"""``attnflow-lab evaluate agreement``: the reproduction end to end, on a small scale."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reproduction needs PyTorch")

from attnflow_lab.agreement.reproduction import PAPER_TABLES, comparison_markdown
from attnflow_lab.cli import main


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
    record = json.loads((folder / "model" / "training.json").read_text())
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


# -- what the folder holds cannot be mixed or left broken (issue 22) ---------------------------
TINY_RUN = ["--sentences", "8", "--train-sentences", "300", "--fractions", "none", "--quiet"]
TINY_RUN += ["--rows", "0", "--methods", "raw,rollout", "--chunk-size", "4"]


def _tiny_model(seed: int) -> Any:
    from attnflow_lab.agreement.agreement import VOCABULARY
    from attnflow_lab.agreement.agreement_torch import AgreementConfig, AgreementTransformer

    torch.manual_seed(seed)
    # Six layers as the paper's: the report's figure draws its six published layers.
    config = AgreementConfig(len(VOCABULARY), n_layers=6, n_heads=2, hidden=8)
    return AgreementTransformer(config).eval()


@pytest.fixture
def fake_training(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Replace the 148 s training by an untrained tiny model; count the calls."""
    from attnflow_lab.agreement import reproduction

    calls: list[int] = []

    def train(data: Any, *, seed: int, progress: bool) -> Any:
        calls.append(seed)
        return _tiny_model(seed)

    monkeypatch.setattr(reproduction, "train_agreement_model", train)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models gain nothing from more
    yield calls
    torch.set_num_threads(threads)


def test_another_models_run_on_a_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_training: list[int]
) -> None:
    # `evaluate agreement --model M2` on M1's folder printed M1's table under M2's
    # accuracy and exited 0.
    from attnflow_lab.agreement.agreement_torch import save_agreement_model

    metadata = {"data": {"seed": 0, "n_train": 300}}
    first, second = tmp_path / "m1", tmp_path / "m2"
    save_agreement_model(_tiny_model(1), first, metadata=metadata)
    save_agreement_model(_tiny_model(2), second, metadata=metadata)
    folder = str(tmp_path / "run")
    assert main(["evaluate", "agreement", "-o", folder, "--model", str(first), *TINY_RUN]) == 0
    capsys.readouterr()
    assert main(["evaluate", "agreement", "-o", folder, "--model", str(second), *TINY_RUN]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    # Named by its class and a hash of its weights.
    assert "differs in model (the folder's: attnflow_lab.agreement.agreement_torch" in captured.err
    assert "rerun with --force" in captured.err
    arguments = ["evaluate", "agreement", "-o", folder, "--model", str(second), *TINY_RUN]
    assert main([*arguments, "--force"]) == 0
    forced = capsys.readouterr().out
    assert main(["evaluate", "agreement", "-o", str(tmp_path / "fresh"), *arguments[4:]]) == 0
    assert capsys.readouterr().out == forced  # M2's own table
    assert fake_training == []


def test_a_model_without_its_training_record_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_training: list[int]
) -> None:
    # The state a kill between saving the model and writing training.json left behind:
    # every rerun trained for minutes, then failed with "pass force=True".
    from attnflow_lab.agreement.agreement_torch import save_agreement_model

    folder = tmp_path / "run"
    save_agreement_model(_tiny_model(0), folder / "model")
    arguments = ["evaluate", "agreement", "-o", str(folder), *TINY_RUN]
    assert main(arguments) == 1
    error = capsys.readouterr().err
    assert "incomplete model (no training.json)" in error
    assert "rerun with --force" in error
    assert fake_training == []  # refused before any training
    assert main([*arguments, "--force"]) == 0
    assert fake_training == [0]
    record = json.loads((folder / "model" / "training.json").read_text())
    assert record["train_sentences"] == 300
    capsys.readouterr()
    assert main(arguments) == 0  # reused: no training
    assert fake_training == [0]


@pytest.mark.parametrize("killed_at", [1, 2, 3])
def test_a_kill_while_saving_the_model_leaves_no_partial_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_training: list[int], killed_at: int
) -> None:
    # Ctrl-C at the weights, the configuration or the training record: the folder has a
    # whole model or none, and the rerun trains once and goes on.
    import os

    from attnflow_lab.agreement.agreement import agreement_split
    from attnflow_lab.agreement.reproduction import _model

    train, test = agreement_split(300, 8, seed=0)
    writes: list[int] = []
    fsync = os.fsync

    def killed(descriptor: int) -> None:
        writes.append(descriptor)
        if len(writes) == killed_at:
            raise KeyboardInterrupt
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        _model(tmp_path, train, test, seed=0, progress=False)
    monkeypatch.setattr(os, "fsync", fsync)
    assert not (tmp_path / "model").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging folder left either
    model, record = _model(tmp_path, train, test, seed=0, progress=False)
    assert fake_training == [0, 0]
    assert record["train_sentences"] == 300
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == [
        "config.json",
        "training.json",
        "weights.npz",
    ]
    again, _ = _model(tmp_path, train, test, seed=0, progress=False)
    assert fake_training == [0, 0]  # loaded
    ids = torch.from_numpy(test.ids[:2].copy())
    assert torch.equal(again(ids), model(ids))


def test_the_authors_protocol_options_reach_the_evaluation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_training: list[int]
) -> None:
    """--correlation spearman_dense and --blank-out-last-token zero, as faithfulness has them.

    The folder records both settings, and the blank-out scores of the last real token are
    0 unevaluated (``last_token="zero"``) where the default run evaluates them.
    """
    folder = tmp_path / "authors"
    protocol = ["--correlation", "spearman_dense", "--blank-out-last-token", "zero"]
    assert main(["evaluate", "agreement", "-o", str(folder), *TINY_RUN, *protocol]) == 0
    settings = json.loads((folder / "rows-0" / "evaluation.json").read_text())
    assert settings["correlation"] == "spearman_dense"
    assert settings["blank_out_last_token"] == "zero"
    default = tmp_path / "default"
    assert main(["evaluate", "agreement", "-o", str(default), *TINY_RUN]) == 0
    capsys.readouterr()

    def blank_out(run: Path) -> np.ndarray:
        chunks = sorted((run / "rows-0").glob("chunk-*.npz"))
        parts = []
        for chunk in chunks:
            with np.load(chunk) as loaded:
                parts.append(loaded["reference.blank_out"])
        return np.concatenate(parts)

    zeroed, evaluated = blank_out(folder), blank_out(default)
    last = [np.flatnonzero(~np.isnan(row))[-1] for row in evaluated]
    rows = np.arange(len(last))
    assert (zeroed[rows, last] == 0).all()
    assert (evaluated[rows, last] != 0).any()
    for row, end in zip(rows, last, strict=True):  # the other tokens are scored alike
        np.testing.assert_allclose(zeroed[row, :end], evaluated[row, :end], rtol=1e-12)
