"""Decoder views that show the source (issue 39, item 1).

On a causal LM, explain_text and explain_generation find the attention sinks in the
model's own weights and leave them, and the explained (predicting) position, out of the
colour scale and of every strongest-sources list; ``explain`` keeps raw scores but takes
``exclude_self`` for every method; generation never attributes to the predicting position
by default. References: the rows without the option, zeroed and renormalised by hand, and
``explain`` on each prefix.
"""

from __future__ import annotations

import copy
import io
import json
import re
from typing import Any

import numpy as np
import pytest

from attnflow._methods import method_spec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnflow._sinks import find_sinks
from attnflow.adapters import torch as adapter
from attnflow.adapters._torch_explain import DECODER_LEADING_METHOD


class _Tokenizer:
    """A stand-in for a Hugging Face tokenizer over ids 0..31 (no BOS: as SmolLM2)."""

    def __call__(self, text: str, return_tensors: str = "pt") -> dict[str, Any]:
        ids = torch.tensor([[2 + ord(c) % 30 for c in text]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"<{i}>" for i in ids]

    def get_special_tokens_mask(
        self, ids: list[int], already_has_special_tokens: bool
    ) -> list[int]:
        return [0] * len(ids)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def llama() -> Any:
    torch.manual_seed(39)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).double().eval()


def _eager_weights(model: Any, ids: list[int]) -> Any:
    """The model's own attention weights (eager ``output_attentions``), (L, H, n, n)."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        out = eager(input_ids=torch.tensor([ids]), output_attentions=True)
    return torch.stack(out.attentions, 1)[0]


@pytest.mark.parametrize("method", ["rollout", "flow", "raw", "alti"])
def test_explain_takes_exclude_self_for_every_method(llama, method):
    ids = {"input_ids": torch.tensor([[3, 9, 4, 17, 8, 11]])}
    plain = adapter.explain(llama, ids, method=method, rows=[-1, 2])
    dropped = adapter.explain(llama, ids, method=method, rows=[-1, 2], exclude_self=True)
    for j, own in enumerate((5, 2)):
        expected = plain[0, j].clone()
        expected[own] = 0
        torch.testing.assert_close(dropped[0, j], expected / expected.sum(), rtol=1e-12, atol=0)
    with pytest.raises(TypeError, match=r"`exclude_self` must be True or False"):
        adapter.explain(llama, ids, method=method, exclude_self="yes")


def test_generation_never_attributes_to_the_predicting_position(llama):
    common = {"max_new_tokens": 4, "methods": ("gradient_rollout", "rollout", "raw")}
    kept = adapter.explain_generation(llama, _Tokenizer(), "abcd", exclude_self=False, **common)
    g = adapter.explain_generation(llama, _Tokenizer(), "abcd", **common)
    assert g.self_excluded
    assert not kept.self_excluded
    ids = [*g.prompt_ids.tolist(), *g.generated_ids.tolist()]
    for t in range(4):
        own = 4 + t - 1
        for method in ("rollout", "raw"):
            expected = kept.scores[method][t].copy()
            assert expected[own] > 0  # the predicting position had a share before
            expected[own] = 0
            np.testing.assert_allclose(g.scores[method][t], expected / expected.sum(), atol=1e-12)
        prefix = torch.tensor([ids[: 4 + t]])
        gae = adapter.explain(
            llama,
            {"input_ids": prefix},
            method="gradient_rollout",
            rows=-1,
            target=ids[4 + t],
            exclude_self=True,
        )
        np.testing.assert_allclose(
            g.scores["gradient_rollout"][t, : 4 + t], gae[0].numpy(), atol=1e-10
        )
        assert all(values[t, own] == 0 for values in g.scores.values())
    assert 0 in g.sinks
    assert g.sinks == find_sinks(_eager_weights(llama, ids[:-1]))
    assert list(
        adapter.explain_generation(llama, _Tokenizer(), "ab", max_new_tokens=1).scores
    ) == list(dict.fromkeys((DECODER_LEADING_METHOD, "gradient_rollout", "rollout")))


def test_explain_text_finds_sinks_in_the_models_weights(llama):
    e = adapter.explain_text(llama, _Tokenizer(), "abcdefg")
    assert next(iter(e.scores)) == DECODER_LEADING_METHOD
    ids = _Tokenizer()("abcdefg")["input_ids"][0].tolist()
    assert e.sinks == find_sinks(_eager_weights(llama, ids))
    assert e.sinks[0] == 0
    for method in e.scores:
        assert set(e.top(3, method=method)).isdisjoint({*e.sinks, e.rows})


# -- SmolLM2: the prompt --------------------------------------------------------------
PROMPT = "The Eiffel Tower is in the city of"


def test_smollm2_page_and_table_show_the_source(smollm2, tmp_path):
    models, tokenizer = smollm2
    e = adapter.explain_text(models["sdpa"], tokenizer, PROMPT)
    assert e.sinks == (0,)  # SmolLM2 has no BOS: the sink is the word "The"
    assert next(iter(e.scores)) == DECODER_LEADING_METHOD
    for method in e.scores:  # the others put "The" first; the views no longer do
        first = int(np.argmax(e.scores[method][-1]))
        if method_spec(method).target_conditioned:  # they localise: a word of the text
            assert first not in (0, e.rows)
        else:
            assert first in (0, e.rows)
        assert set(e.top(3, method=method)).isdisjoint({0, e.rows})
    page = e.to_html(tmp_path / "e.html")
    data = json.loads(re.findall(r'id="[^"]+-data">(.*?)</script>', page)[0])
    assert data["inScale"][0] is False
    assert data["inScale"][e.rows] is False
    assert "Attention sinks left out of the colour scale" in page
    out = io.StringIO()
    e.show(file=out)
    assert "strongest sources (sinks 'The' and the explained token left out)" in out.getvalue()


# -- spans (issue 39, item 2) ----------------------------------------------------------------
def test_explain_sums_scores_over_token_spans(llama, monkeypatch):
    ids = {"input_ids": torch.tensor([[3, 9, 4, 17, 8, 11]])}
    full = adapter.explain(llama, ids, method="gradient_rollout", rows=-1)
    summed = adapter.explain(
        llama, ids, method="gradient_rollout", rows=-1, spans=[(0, 3), [3, 5], (5, 6)]
    )
    expected = torch.stack([full[0, :3].sum(), full[0, [3, 5]].sum(), full[0, 5]])
    torch.testing.assert_close(summed[0], expected, rtol=1e-12, atol=0)

    def ran(*args: Any, **kwargs: Any) -> None:
        msg = "the model ran before the spans were checked"
        raise AssertionError(msg)

    monkeypatch.setattr(llama, "forward", ran)
    with pytest.raises(ValueError, match=r"0 <= start < end <= 6; got \(4, 9\)"):
        adapter.explain(llama, ids, spans=[(4, 9)])


def test_smollm2_word_spans_come_from_the_tokenizers_offsets(smollm2):
    models, tokenizer = smollm2
    text = "The Eiffel Tower is in Paris. The tower is in the city of"
    e = adapter.explain_text(models["sdpa"], tokenizer, text, methods=["gradient_rollout"])
    assert e.offsets is not None
    words = e.aggregate("words")
    assert words.tokens == tuple(text.replace(".", " .").split())
    assert words.rows == len(words.tokens) - 1  # "of", the explained word
    # Each word's score: its tokens' scores summed, the sink and the explained token aside.
    values = e.scores["gradient_rollout"][-1].copy()
    values[[*e.sinks, e.rows]] = 0
    spans = [
        [i for i, (a, b) in enumerate(e.offsets) if a < end and b > start and b > a]
        for start, end in _word_ranges(text)
    ]
    assert spans[1] == [1, 2]  # " E" "iffel": one word, two tokens
    np.testing.assert_allclose(
        words.scores["gradient_rollout"][-1], [values[t].sum() for t in spans]
    )
    sentences = e.aggregate("sentences")
    assert sentences.tokens == ("The Eiffel Tower is in Paris.", "The tower is in the city of")


def _word_ranges(text: str) -> list[tuple[int, int]]:
    import re

    return [m.span() for m in re.finditer(r"\w+|[^\w\s]", text)]


def test_generation_sinks_are_found_on_a_bounded_window(llama, monkeypatch):
    from attnflow.adapters import _torch_generation

    monkeypatch.setattr(_torch_generation, "SINK_WINDOW", 4)
    g = adapter.explain_generation(llama, _Tokenizer(), "abcdef", max_new_tokens=2)
    ids = [*g.prompt_ids.tolist(), *g.generated_ids.tolist()]
    assert g.sinks == find_sinks(_eager_weights(llama, ids[:4]))
