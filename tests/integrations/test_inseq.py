"""inseq methods "attention_rollout" and "attention_flow" against attnflow on captured weights.

The reference is attnflow itself, applied to the weights that
``attnflow.adapters.torch.capture`` records from the same model on the same tokens; the
test checks that inseq's result is that map, transposed (tokens x generated steps), with
the attribution of step ``t + 1`` taken from decoder position ``t``. Prompt, source and
target lengths all differ, so a transpose or an off-by-one fails.
"""

from __future__ import annotations

from typing import Any

import pytest

# First: importing the integration registers the methods (and imports inseq quietly).
pytest.importorskip("attnflow.integrations.inseq")
inseq = pytest.importorskip("inseq")
torch = pytest.importorskip("torch")

import attnflow
from attnflow.adapters.torch import capture

PROMPT = "the key to the"  # 4 tokens
GENERATED = "the key to the cabinets is on"  # 7 tokens: 3 generated steps
SOURCE = "the key to cabinets is"  # 5 tokens
TARGET = "the key is on the table"  # 6 tokens, 7 with the decoder start token
ATOL = 1e-6


def _ids(tokenizer: Any, text: str) -> Any:
    return tokenizer(text, return_tensors="pt").input_ids


def test_methods_are_registered() -> None:
    methods = inseq.list_feature_attribution_methods()
    assert {"attention_rollout", "attention_flow", "gradient_rollout"} <= set(methods)


@pytest.mark.parametrize("method", ["rollout", "flow"])
def test_decoder_only_equals_attnflow(gpt2: Any, tokenizer: Any, method: str) -> None:
    model = inseq.load_model(gpt2, f"attention_{method}", tokenizer=tokenizer)
    out = model.attribute(PROMPT, GENERATED, show_progress=False)
    result = out.sequence_attributions[0]
    scores = result.target_attributions
    assert [token.token for token in result.target] == GENERATED.split()
    assert scores.shape == (7, 3)  # all tokens x generated steps
    with torch.no_grad(), capture(gpt2) as cap:
        gpt2(_ids(tokenizer, GENERATED))
    reference = getattr(attnflow, method)(cap.attentions)[0]  # rows = positions
    start = len(PROMPT.split())
    for step in range(3):
        position = start + step - 1  # generating token `start + step` reads this row
        known = scores[: position + 1, step]
        torch.testing.assert_close(known, reference[position, : position + 1], atol=ATOL, rtol=0)
        # Causal: later positions are not inputs of this step (inseq leaves them NaN).
        assert torch.isnan(scores[position + 1 :, step]).all()


@pytest.mark.parametrize("method", ["rollout", "flow"])
def test_encoder_decoder_equals_attnflow(bart: Any, tokenizer: Any, method: str) -> None:
    model = inseq.load_model(bart, f"attention_{method}", tokenizer=tokenizer)
    out = model.attribute(SOURCE, TARGET, attribute_target=True, show_progress=False)
    result = out.sequence_attributions[0]
    decoder_ids = torch.tensor([[token.id for token in result.target]])
    assert decoder_ids[0, 0] == bart.config.decoder_start_token_id
    with torch.no_grad(), capture(bart) as cap:
        bart(input_ids=_ids(tokenizer, SOURCE), decoder_input_ids=decoder_ids)
    source, target = getattr(attnflow, f"encoder_decoder_{method}")(
        cap.encoder_attentions, cap.decoder_attentions, cap.cross_attentions
    )
    source, target = source[0], target[0]  # (T, S) = (7, 5) and (T, T)
    steps = 6  # every target token after the start token
    assert result.source_attributions.shape == (5, steps)
    assert result.target_attributions.shape == (7, steps)
    torch.testing.assert_close(result.source_attributions, source[:steps].T, atol=ATOL, rtol=0)
    for step in range(steps):
        torch.testing.assert_close(
            result.target_attributions[: step + 1, step],
            target[step, : step + 1],
            atol=ATOL,
            rtol=0,
        )
    # Source and target shares of a step sum to one (rollout model; flow normalised).
    total = result.source_attributions.sum(0) + result.target_attributions.nansum(0)
    torch.testing.assert_close(total, torch.ones(steps), atol=1e-5, rtol=0)


def test_source_only_when_target_not_attributed(bart: Any, tokenizer: Any) -> None:
    model = inseq.load_model(bart, "attention_rollout", tokenizer=tokenizer)
    out = model.attribute(SOURCE, TARGET, show_progress=False)
    result = out.sequence_attributions[0]
    assert result.target_attributions is None
    assert result.source_attributions.shape == (5, 6)


def test_options_reach_attnflow(bart: Any, tokenizer: Any) -> None:
    model = inseq.load_model(bart, "attention_rollout", tokenizer=tokenizer)
    out = model.attribute(
        SOURCE,
        TARGET,
        attribute_target=True,
        show_progress=False,
        residual=0.3,
        layers=0,
        heads="max",
    )
    result = out.sequence_attributions[0]
    decoder_ids = torch.tensor([[token.id for token in result.target]])
    with torch.no_grad(), capture(bart) as cap:
        bart(input_ids=_ids(tokenizer, SOURCE), decoder_input_ids=decoder_ids)
    source, _ = attnflow.encoder_decoder_rollout(
        cap.encoder_attentions,
        cap.decoder_attentions,
        cap.cross_attentions,
        residual=0.3,
        layers=0,
        heads="max",
    )
    torch.testing.assert_close(result.source_attributions, source[0, :6].T, atol=ATOL, rtol=0)
    # One decoder layer: the source share of every position is 1 - α = 0.7.
    torch.testing.assert_close(
        result.source_attributions.sum(0), torch.full((6,), 0.7), atol=1e-5, rtol=0
    )


def test_padded_batch_equals_each_sequence(bart: Any, tokenizer: Any) -> None:
    sources = [SOURCE, "a cat sat"]
    targets = [TARGET, "a cat"]
    model = inseq.load_model(bart, "attention_rollout", tokenizer=tokenizer)
    out = model.attribute(sources, targets, attribute_target=True, show_progress=False)
    for index, (text, result) in enumerate(zip(sources, out.sequence_attributions, strict=True)):
        decoder_ids = torch.tensor([[token.id for token in result.target]])
        with torch.no_grad(), capture(bart) as cap:
            bart(input_ids=_ids(tokenizer, text), decoder_input_ids=decoder_ids)
        source, _ = attnflow.encoder_decoder_rollout(
            cap.encoder_attentions, cap.decoder_attentions, cap.cross_attentions
        )
        steps = len(targets[index].split())
        assert result.source_attributions.shape == (len(text.split()), steps)
        torch.testing.assert_close(
            result.source_attributions, source[0, :steps].T, atol=ATOL, rtol=0
        )


def _gae_next_token(model: Any, call: dict[str, Any], token: int) -> Any:
    """Reference: capture with gradients, d logit(token) at the last position / d A."""
    with capture(model, gradients=True) as cap:
        logits = model(**call).logits
    logits[0, -1, token].backward()
    return cap


def test_gradient_rollout_decoder_only_per_step(gpt2: Any, tokenizer: Any) -> None:
    model = inseq.load_model(gpt2, "gradient_rollout", tokenizer=tokenizer)
    out = model.attribute(PROMPT, GENERATED, show_progress=False)
    scores = out.sequence_attributions[0].target_attributions
    assert scores.shape == (7, 3)
    assert (scores.nan_to_num() > 0).any()
    ids = _ids(tokenizer, GENERATED)
    start = len(PROMPT.split())
    for step in range(3):
        position = start + step  # the token generated at this step, from the prefix before it
        gpt2.zero_grad()
        cap = _gae_next_token(gpt2, {"input_ids": ids[:, :position]}, int(ids[0, position]))
        reference = attnflow.gradient_rollout(cap.attentions.detach(), cap.gradients, rows=-1)
        torch.testing.assert_close(scores[:position, step], reference[0], atol=ATOL, rtol=0)
        assert torch.isnan(scores[position:, step]).all()
    # The parameters' gradients are left alone by the method.
    gpt2.zero_grad(set_to_none=True)
    model.attribute(PROMPT, GENERATED, show_progress=False)
    assert all(p.grad is None for p in gpt2.parameters())


def test_gradient_rollout_encoder_decoder_per_step(bart: Any, tokenizer: Any) -> None:
    model = inseq.load_model(bart, "gradient_rollout", tokenizer=tokenizer)
    out = model.attribute(SOURCE, TARGET, attribute_target=True, show_progress=False)
    result = out.sequence_attributions[0]
    decoder_ids = torch.tensor([[token.id for token in result.target]])
    assert result.source_attributions.shape == (5, 6)
    assert result.target_attributions.shape == (7, 6)
    assert (result.source_attributions > 0).any()  # a real comparison, not of zeros
    for step in range(6):
        call = {
            "input_ids": _ids(tokenizer, SOURCE),
            "decoder_input_ids": decoder_ids[:, : step + 1],
        }
        cap = _gae_next_token(bart, call, int(decoder_ids[0, step + 1]))
        source, target = attnflow.encoder_decoder_rollout(
            cap.encoder_attentions.detach(),
            cap.decoder_attentions.detach(),
            cap.cross_attentions.detach(),
            rule="gae",
            gradients=(cap.encoder_gradients, cap.decoder_gradients, cap.cross_gradients),
            rows=-1,
        )
        torch.testing.assert_close(
            result.source_attributions[:, step], source[0], atol=ATOL, rtol=0
        )
        torch.testing.assert_close(
            result.target_attributions[: step + 1, step], target[0], atol=ATOL, rtol=0
        )
    bart.zero_grad(set_to_none=True)


def test_generation_then_show(gpt2: Any, tokenizer: Any, capsys: Any) -> None:
    """The plain call: inseq generates, attnflow explains every generated token, show() prints."""
    model = inseq.load_model(gpt2, "attention_rollout", tokenizer=tokenizer)
    out = model.attribute(PROMPT, generation_args={"max_new_tokens": 3, "do_sample": False})
    result = out.sequence_attributions[0]
    ids = torch.tensor([[token.id for token in result.target]])
    steps = ids.shape[1] - 4  # after the 4 prompt tokens: 3, or fewer if </s> came first
    assert 1 <= steps <= 3
    assert result.target_attributions.shape == (ids.shape[1], steps)
    with torch.no_grad(), capture(gpt2) as cap:
        gpt2(ids)
    reference = attnflow.rollout(cap.attentions)[0]
    for step in range(steps):
        position = 3 + step
        torch.testing.assert_close(
            result.target_attributions[: position + 1, step],
            reference[position, : position + 1],
            atol=ATOL,
            rtol=0,
        )
    out.show()
    assert "Target Saliency Heatmap" in capsys.readouterr().out


def test_show_renders(gpt2: Any, tokenizer: Any) -> None:
    model = inseq.load_model(gpt2, "attention_rollout", tokenizer=tokenizer)
    out = model.attribute(PROMPT, GENERATED, show_progress=False)
    html = out.show(display=False, return_html=True)
    assert "cabinets" in html


@pytest.mark.parametrize(("layers", "error"), [("all", ValueError), (1.5, TypeError)])
def test_bad_layers_fail_before_the_model_runs(
    bart: Any, tokenizer: Any, layers: object, error: type[Exception]
) -> None:
    model = inseq.load_model(bart, "attention_rollout", tokenizer=tokenizer)
    with pytest.raises(error, match="`layers` must be"):
        model.attribute(SOURCE, TARGET, show_progress=False, layers=layers)


def test_unknown_argument_layout_is_an_error_not_wrong_numbers() -> None:
    from attnflow.integrations.inseq import _model_inputs

    embeddings = torch.zeros(1, 3, 4)
    with pytest.raises(RuntimeError, match="'input_ids' at position 0"):
        _model_inputs(False, (embeddings,), (embeddings, None, None, None))


@pytest.mark.parametrize("method", ["rollout", "flow"])
def test_receptive_field_and_exclude_reach_attnflow(gpt2: Any, tokenizer: Any, method: str) -> None:
    """Both options change the maps, and each column is attnflow's map with them."""
    model = inseq.load_model(gpt2, f"attention_{method}", tokenizer=tokenizer)
    options = {"receptive_field": True, "exclude": 0, "residual": 0.3}
    out = model.attribute(PROMPT, GENERATED, show_progress=False, **options)
    scores = out.sequence_attributions[0].target_attributions
    plain = model.attribute(PROMPT, GENERATED, show_progress=False)
    assert not torch.allclose(
        scores.nan_to_num(), plain.sequence_attributions[0].target_attributions.nan_to_num()
    )
    with torch.no_grad(), capture(gpt2) as cap:
        gpt2(_ids(tokenizer, GENERATED))
    reference = getattr(attnflow, method)(cap.attentions, **options)[0]
    start = len(PROMPT.split())
    for step in range(3):
        position = start + step - 1
        known = scores[: position + 1, step]
        assert known[0] == 0  # the excluded first column
        torch.testing.assert_close(known, reference[position, : position + 1], atol=ATOL, rtol=0)


def test_gradient_rollout_takes_receptive_field_and_exclude(gpt2: Any, tokenizer: Any) -> None:
    model = inseq.load_model(gpt2, "gradient_rollout", tokenizer=tokenizer)
    options = {"receptive_field": True, "exclude": 0}
    out = model.attribute(PROMPT, GENERATED, show_progress=False, **options)
    scores = out.sequence_attributions[0].target_attributions
    ids = _ids(tokenizer, GENERATED)
    position = len(PROMPT.split())  # the first generated token
    gpt2.zero_grad()
    cap = _gae_next_token(gpt2, {"input_ids": ids[:, :position]}, int(ids[0, position]))
    reference = attnflow.gradient_rollout(
        cap.attentions.detach(), cap.gradients, rows=-1, **options
    )
    gpt2.zero_grad(set_to_none=True)
    assert scores[0, 0] == 0
    torch.testing.assert_close(scores[:position, 0], reference[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("method", ["attention_rollout", "attention_flow", "gradient_rollout"])
def test_a_misspelt_option_is_refused_by_name(gpt2: Any, tokenizer: Any, method: str) -> None:
    model = inseq.load_model(gpt2, method, tokenizer=tokenizer)
    calls = []
    handle = gpt2.register_forward_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(
            ValueError, match=r"`residul`.*did you mean `residual`.*accepts: .*\bresidual\b"
        ):  # generating 3 tokens would call the model
            model.attribute(PROMPT, generation_args={"max_new_tokens": 3}, residul=0.3)
    finally:
        handle.remove()
    assert calls == []  # refused before any work
    with pytest.raises(ValueError, match=r"`layer`.*did you mean `layers`"):
        model.attribute(PROMPT, GENERATED, show_progress=False, attribution_args={"layer": 1})


def test_decoder_only_options_are_refused_on_an_encoder_decoder(bart: Any, tokenizer: Any) -> None:
    model = inseq.load_model(bart, "attention_rollout", tokenizer=tokenizer)
    for option in ("receptive_field", "exclude"):
        with pytest.raises(ValueError, match=rf"`{option}`.*encoder-decoder.*accepts"):
            model.attribute(SOURCE, TARGET, show_progress=False, **{option: 0})


def test_gradient_rollout_takes_target_score_and_exclude_self(gpt2: Any, tokenizer: Any) -> None:
    """Issue 39: the log-probability GAE that the LLM docs trust is reachable through inseq."""
    model = inseq.load_model(gpt2, "gradient_rollout", tokenizer=tokenizer)
    options = {"target_score": "log_probability", "exclude_self": True}
    out = model.attribute(PROMPT, GENERATED, show_progress=False, **options)
    scores = out.sequence_attributions[0].target_attributions
    logit = model.attribute(PROMPT, GENERATED, show_progress=False)
    ids = _ids(tokenizer, GENERATED)
    position = len(PROMPT.split())  # the first generated token
    with capture(gpt2, gradients=True) as cap:
        logits = gpt2(input_ids=ids[:, :position]).logits
    torch.log_softmax(logits[0, -1], dim=-1)[int(ids[0, position])].backward()
    reference = attnflow.gradient_rollout(
        cap.attentions.detach(), cap.gradients, rows=-1, exclude_self=True
    )
    gpt2.zero_grad(set_to_none=True)
    assert scores[position - 1, 0] == 0  # the predicting position's own relevance
    torch.testing.assert_close(scores[:position, 0], reference[0], atol=ATOL, rtol=0)
    assert not torch.allclose(
        scores.nan_to_num(), logit.sequence_attributions[0].target_attributions.nan_to_num()
    )
    with pytest.raises(ValueError, match=r'`target_score` must be "logit"'):
        model.attribute(PROMPT, GENERATED, show_progress=False, target_score="probability")


@pytest.mark.parametrize("method", ["rollout", "flow"])
def test_exclude_self_reaches_rollout_and_flow(gpt2: Any, tokenizer: Any, method: str) -> None:
    model = inseq.load_model(gpt2, f"attention_{method}", tokenizer=tokenizer)
    out = model.attribute(PROMPT, GENERATED, show_progress=False, exclude_self=True)
    scores = out.sequence_attributions[0].target_attributions
    with torch.no_grad(), capture(gpt2) as cap:
        gpt2(_ids(tokenizer, GENERATED))
    reference = getattr(attnflow, method)(cap.attentions)[0]
    start = len(PROMPT.split())
    for step in range(3):
        position = start + step - 1
        expected = reference[position, : position + 1].clone()
        expected[position] = 0
        expected = expected / expected.sum()
        torch.testing.assert_close(scores[: position + 1, step], expected, atol=ATOL, rtol=0)
    with pytest.raises(TypeError, match=r"`exclude_self` must be True or False"):
        model.attribute(PROMPT, GENERATED, show_progress=False, exclude_self="yes")


def test_generation_explanation_renders_with_token_texts(gpt2: Any, tokenizer: Any) -> None:
    """Issue 39: attnflow renders inseq's result with token texts, not byte-level pieces."""
    from attnflow.integrations.inseq import generation_explanation

    model = inseq.load_model(gpt2, "gradient_rollout", tokenizer=tokenizer)
    out = model.attribute(PROMPT, GENERATED, show_progress=False, exclude_self=True)
    scores = out.sequence_attributions[0].target_attributions
    g = generation_explanation(out, tokenizer)
    start = len(PROMPT.split())
    assert g.prompt_length == start
    assert g.n_generated == 3
    assert g.tokens == tuple(GENERATED.split())
    for t in range(3):
        torch.testing.assert_close(
            torch.from_numpy(g.scores["gradient_rollout"][t, : start + t]),
            scores[: start + t, t].double(),
        )
    assert "cabinets" in g.to_html()
    # A byte-level BPE tokenizer's pieces become their texts.
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = {"the": 0, "Ġkey": 1, "Ġto": 2, "Ġthe": 3, "Ġcabinets": 4, "Ġis": 5, "Ġon": 6}
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(words, merges=[]))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    byte_level = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe)
    out.sequence_attributions[0].target = [
        type(token)(token=("Ġ" if i else "") + token.token, id=i)
        for i, token in enumerate(out.sequence_attributions[0].target)
    ]
    g = generation_explanation(out, byte_level)
    assert g.tokens == ("the", " key", " to", " the", " cabinets", " is", " on")
