"""One call on a causal LM: explain() with a vocabulary target, explain_text at the last position."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnflow
from attnflow.adapters import torch as adapter
from attnflow.explanation import Explanation


@pytest.fixture(scope="module")
def eager_gradients(smollm2, left_padded):
    """d logit[b, -1, t_b] / d A by retain_grad on eager output_attentions (the reference)."""
    models, _ = smollm2
    model = models["eager"]
    out = model(**left_padded, output_attentions=True)
    for weights in out.attentions:
        weights.retain_grad()
    tokens = out.logits[:, -1].argmax(-1)
    out.logits[torch.arange(len(tokens)), -1, tokens].sum().backward()
    model.zero_grad(set_to_none=True)
    weights = torch.stack([w.detach() for w in out.attentions], dim=1)
    gradients = torch.stack([w.grad for w in out.attentions], dim=1)
    return weights, gradients, tokens


def test_gradient_rollout_explains_the_predicted_token_at_the_row(
    smollm2, left_padded, eager_gradients
):
    models, _ = smollm2
    weights, gradients, tokens = eager_gradients
    mask = left_padded["attention_mask"].bool()
    expected = attnflow.gradient_rollout(weights, gradients, rows=-1, mask=mask)
    result = adapter.explain(models["sdpa"], left_padded, method="gradient_rollout", rows=-1)
    assert result.shape == mask.shape
    scale = expected.abs().max()
    torch.testing.assert_close(result / scale, expected / scale, atol=1e-4, rtol=0)
    assert bool((result[~mask] == 0).all())
    # The default target is the argmax at the row: naming it gives the same answer.
    named = adapter.explain(
        models["sdpa"], left_padded, method="gradient_rollout", rows=-1, target=tokens
    )
    torch.testing.assert_close(named, result, atol=0, rtol=0)


def test_gradient_rollout_each_row_has_its_own_target(smollm2, left_padded):
    models, _ = smollm2
    model = models["sdpa"]
    both = adapter.explain(model, left_padded, method="gradient_rollout", rows=[-1, -2])
    assert both.shape == (2, 2, left_padded["input_ids"].shape[1])
    for index, row in enumerate((-1, -2)):
        alone = adapter.explain(model, left_padded, method="gradient_rollout", rows=row)
        torch.testing.assert_close(both[:, index], alone, atol=1e-6, rtol=1e-5)
    # Another vocabulary target changes the answer (the score really is that logit).
    other = adapter.explain(model, left_padded, method="gradient_rollout", rows=-1, target=13)
    assert not torch.allclose(other, both[:, 0])
    with pytest.raises(ValueError, match="classes"):
        adapter.explain(model, left_padded, method="gradient_rollout", rows=-1, target=10**6)
    with pytest.raises(ValueError, match="`rows` must be positions"):
        adapter.explain(model, left_padded, method="gradient_rollout", rows=99)


def test_explain_text_on_a_causal_lm(smollm2, tmp_path):
    models, tokenizer = smollm2
    text = "The capital of France is"
    e = adapter.explain_text(models["sdpa"], tokenizer, text)
    n = len(tokenizer(text)["input_ids"])
    assert e.rows == n - 1  # the position that predicts the next token
    # The leading one first: the method that localises a decoder's sources best.
    assert list(e.scores) == ["direct_logit", "raw", "rollout", "flow", "gradient_rollout"]
    assert all(values.shape == (30, n) for values in e.scores.values())
    assert e.labels is not None
    assert e.labels[e.predicted] == " Paris"
    assert e.probabilities is not None
    assert e.probabilities.shape == (models["sdpa"].config.vocab_size,)
    assert e.probabilities.argmax() == e.predicted
    # The scores are those of the library's functions on the captured weights.
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad(), adapter.capture(models["sdpa"]) as cap:
        models["sdpa"](**ids)
    rollout = attnflow.rollout(cap.attentions, rows=-1, layers="all")[0]
    np.testing.assert_allclose(e.scores["rollout"], rollout.double().numpy(), atol=1e-6)
    gae = adapter.explain(
        models["sdpa"],
        dict(ids),
        method="gradient_rollout",
        rows=-1,
        layers="all",
        exclude_self=True,
    )[0]
    np.testing.assert_allclose(e.scores["gradient_rollout"], gae.double().numpy(), atol=1e-5)
    # direct_logit's layers as running sums: the top layer is the method itself.
    direct = adapter.explain(models["sdpa"], dict(ids), method="direct_logit", rows=-1)[0]
    np.testing.assert_allclose(e.scores["direct_logit"][-1], direct.double().numpy(), atol=1e-5)
    assert "' Paris'" in repr(e)
    saved = Explanation.load(e.save(tmp_path / "lm.npz"))
    assert saved.labels == e.labels
    np.testing.assert_array_equal(saved.probabilities, e.probabilities)
    # An explicit target names its token too.
    chosen = adapter.explain_text(
        models["sdpa"], tokenizer, text, methods=["gradient_rollout"], target=e.predicted + 1
    )
    assert chosen.target == e.predicted + 1
    assert set(chosen.labels) == {e.predicted, e.predicted + 1}


def test_explain_text_passes_the_decoder_options(smollm2):
    models, tokenizer = smollm2
    text = "Anna lives in Paris. Anna lives in"
    e = adapter.explain_text(
        models["sdpa"],
        tokenizer,
        text,
        methods=["rollout", "flow"],
        exclude=0,
        receptive_field=True,
    )
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad(), adapter.capture(models["sdpa"]) as cap:
        models["sdpa"](**ids)
    options = {"rows": -1, "layers": "all", "exclude": 0, "receptive_field": True}
    for name, function in (("rollout", attnflow.rollout), ("flow", attnflow.flow)):
        expected = function(cap.attentions, **options)[0].double().numpy()
        np.testing.assert_allclose(e.scores[name], expected, atol=1e-6)
        assert (e.scores[name][:, 0] == 0).all()


def test_a_byte_level_tokens_label_is_its_text(smollm2):
    """Labels are what each token stands for (`Ġis` -> ' is'), not byte-level stand-ins."""
    from attnflow.adapters._token_text import token_labels

    models, tokenizer = smollm2
    text = "The café's menu:\nsoup,\tnaïve 🙂"
    ids = tokenizer(text)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert any(p.startswith("Ġ") for p in pieces)  # byte-level pieces
    assert "Ċ" in pieces
    e = adapter.explain_text(models["sdpa"], tokenizer, text, methods=["raw"])
    # Put together, the labels are the text, with its controls written as escapes.
    assert "".join(e.tokens) == text.replace("\n", "\\n").replace("\t", "\\t")
    assert e.tokens == tuple(token_labels(tokenizer, ids))
    assert "\\n" in e.tokens
    assert " menu" in e.tokens
    # A character split over tokens: its pieces decode to U+FFFD alone, so they stay pieces
    # (two different byte pieces never get the same label).
    split = tokenizer("\U0001d518 \u9f98")["input_ids"]  # Fraktur U, a rare CJK character
    labels = token_labels(tokenizer, split)
    assert labels[:2] == tokenizer.convert_ids_to_tokens(split)[:2]
    assert "\ufffd" not in "".join(labels)


def test_the_command_explains_a_causal_lm_at_its_last_position(
    smollm2, capsys: pytest.CaptureFixture[str]
):
    from llm_models import smollm2_folder

    from attnflow._cli import main

    folder = str(smollm2_folder())
    code = main(["explain", "--model", folder, "The capital of France is", "--method", "raw"])
    assert code == 0, capsys.readouterr().err
    heading = capsys.readouterr().out.splitlines()[0]
    assert heading.startswith("row 4 (' is'), layer 30 of 30; predicted 7042 (' Paris')")


def test_the_command_explains_the_log_probability(smollm2, tmp_path, capsys):
    """--target-score log_probability: the GAE of explain(target_score="log_probability")."""
    from llm_models import smollm2_folder

    from attnflow._cli import main

    models, tokenizer = smollm2
    text = "List: apple, river, stone. Again: apple,"
    saved = tmp_path / "logp.npz"
    argv = ["explain", "--model", str(smollm2_folder()), text, "--method", "gradient_rollout"]
    code = main([*argv, "--target-score", "log_probability", "--save", str(saved)])
    assert code == 0, capsys.readouterr().err
    e = Explanation.load(saved)
    assert any("log-probability" in note for note in e.notes)
    expected = adapter.explain(
        models["sdpa"],
        dict(tokenizer(text, return_tensors="pt")),
        method="gradient_rollout",
        rows=-1,
        target_score="log_probability",
        layers="all",
        exclude_self=True,
    )[0]
    np.testing.assert_allclose(e.scores["gradient_rollout"], expected.double().numpy(), atol=1e-5)
