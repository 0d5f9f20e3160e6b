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


def _vit_class() -> Any:
    """A small vision transformer on grey images; built lazily so that torch stays optional."""
    import torch
    from torch import nn

    class TinyViT(nn.Module):
        """[CLS], `registers` register tokens, then `patch` x `patch` patches row by row.

        Images have `channels` channels: 1 (grey, the digits) or 3 (RGB).
        """

        def __init__(
            self,
            height: int = 8,
            width: int = 8,
            patch: int = 2,
            registers: int = 0,
            size: int = 16,
            layers: int = 2,
            channels: int = 1,
        ) -> None:
            super().__init__()
            self.num_prefix_tokens = 1 + registers  # timm's name for it
            tokens = self.num_prefix_tokens + (height // patch) * (width // patch)
            self.embed = nn.Conv2d(channels, size, kernel_size=patch, stride=patch)
            self.prefix = nn.Parameter(torch.randn(1, self.num_prefix_tokens, size) * 0.02)
            self.position = nn.Parameter(torch.randn(1, tokens, size) * 0.02)
            layer = nn.TransformerEncoderLayer(
                size,
                nhead=2,
                dim_feedforward=2 * size,
                dropout=0.0,
                batch_first=True,
                norm_first=True,
            )
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(size, 10)

        def forward(self, images: Any) -> Any:
            patches = self.embed(images).flatten(2).transpose(1, 2)  # row by row
            prefix = self.prefix.expand(images.shape[0], -1, -1)
            tokens = torch.cat([prefix, patches], dim=1) + self.position
            return self.head(self.encoder(tokens)[:, 0])

    return TinyViT


@pytest.fixture(scope="session")
def vit_class() -> Any:
    """The TinyViT class (a fixture: the test modules cannot import this file)."""
    pytest.importorskip("torch")
    return _vit_class()


@pytest.fixture(scope="session")
def digits_vit(vit_class: Any) -> Any:
    """TinyViT trained for seconds on scikit-learn's 8x8 digits; (model, images, labels).

    The images and labels are held-out test digits, ``(n, 1, 8, 8)`` float32 in [0, 1].
    """
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    images = torch.from_numpy(digits.images / 16.0).float()[:, None]
    labels = torch.from_numpy(digits.target)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(images), generator=generator)
    train, test = order[:1400], order[1400:]
    torch.manual_seed(0)
    model = vit_class()
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    # Tiny matrices: one thread is ten times faster than several on a busy 2-core machine.
    torch.set_num_threads(1)
    try:
        for _ in range(10):
            shuffled = train[torch.randperm(len(train), generator=generator)]
            for start in range(0, len(shuffled), 128):
                batch = shuffled[start : start + 128]
                loss = torch.nn.functional.cross_entropy(model(images[batch]), labels[batch])
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    with torch.no_grad():
        accuracy = (model(images[test]).argmax(1) == labels[test]).float().mean().item()
    # A model that learnt the digits, so the metrics below run on a real explanation.
    assert accuracy > 0.8, accuracy
    return model, images[test], labels[test]
