"""The PyTorch adapter's timed functions: capture, blockwise LLM rows, generation.

Models are built from configs (random weights, no download). Baselines, timed in the
same run (``conftest.compare``): the model's own forward pass for the capture, the
materialised path (every layer's attention held) for the blockwise rows, and
``model.generate`` alone for the explained generation.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnflow.adapters.torch import capture, explain, explain_generation


@pytest.fixture(scope="module")
def bert() -> object:
    config = transformers.BertConfig(
        vocab_size=1000,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


@pytest.fixture(scope="module")
def llama() -> object:
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_capture(compare, bert) -> None:
    ids = torch.randint(1000, (4, 64))

    def captured() -> tuple[object, object]:
        with torch.no_grad(), capture(bert) as cap:
            output = bert(input_ids=ids).last_hidden_state
        return output, cap.attentions

    def forward() -> object:
        with torch.no_grad():
            return bert(input_ids=ids).last_hidden_state

    (output, attentions), expected = compare(captured, forward, label="the model's forward")
    torch.testing.assert_close(output, expected)  # the capture leaves the outputs alone
    assert attentions.shape == (4, 6, 12, 64, 64)
    torch.testing.assert_close(attentions.sum(-1), torch.ones(4, 6, 12, 64))


def test_blockwise_llm_rows(compare, llama) -> None:
    inputs = {"input_ids": torch.randint(2, 512, (1, 512))}
    got, expected = compare(
        lambda: explain(llama, inputs, rows=-1, blockwise=True),
        lambda: explain(llama, inputs, rows=-1, blockwise=False),
        label="materialised attention",
        rounds=3,
    )
    torch.testing.assert_close(got, expected)


class _Tokenizer:
    """A stand-in for a Hugging Face tokenizer over the model's ids."""

    def __call__(self, text: str, return_tensors: str = "pt") -> dict[str, object]:
        ids = torch.tensor([[1] + [2 + ord(c) % 500 for c in text]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"t{i}" for i in ids]

    def get_special_tokens_mask(
        self, ids: list[int], already_has_special_tokens: bool = True
    ) -> list[int]:
        return [int(i == 1) for i in ids]

    def decode(self, ids: list[int], **kwargs: object) -> str:
        return " ".join(f"t{i}" for i in ids)


def test_generation(compare, llama) -> None:
    tokenizer = _Tokenizer()
    prompt = "attention flow through a decoder, token by token"
    inputs = tokenizer(prompt)

    def generate() -> object:
        with torch.no_grad():
            return llama.generate(**inputs, max_new_tokens=16, do_sample=False)

    got, expected = compare(
        lambda: explain_generation(llama, tokenizer, prompt, max_new_tokens=16),
        generate,
        label="model.generate alone",
        rounds=3,
    )
    assert got.scores["rollout"].shape[0] == expected.shape[1] - inputs["input_ids"].shape[1]
