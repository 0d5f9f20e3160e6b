"""Small Hugging Face models and a word-level tokenizer, built offline for the integrations."""

from __future__ import annotations

from typing import Any

import pytest

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = [*SPECIAL, "the", "key", "to", "cabinets", "is", "on", "table", "a", "cat", "sat", "mat"]


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """A PreTrainedTokenizerFast over a word-level vocabulary: no download needed."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocabulary = {word: index for index, word in enumerate(WORDS)}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<unk>"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


@pytest.fixture(scope="session", params=["sdpa", "eager"])
def gpt2(request: pytest.FixtureRequest) -> Any:
    """A GPT-2-like decoder: 3 layers, 2 heads, random weights (either attention kernel)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(WORDS),
        n_positions=32,
        n_embd=16,
        n_layer=3,
        n_head=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation=request.param,
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="session")
def bart() -> Any:
    """A BART-like encoder-decoder: 2 encoder and 3 decoder layers, random weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    config = transformers.BartConfig(
        vocab_size=len(WORDS),
        d_model=16,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    return transformers.BartForConditionalGeneration(config).eval()
