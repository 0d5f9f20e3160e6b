"""capture on a real pretrained decoder: SmolLM2-135M-Instruct (Llama, GQA, RoPE).

The reference is Hugging Face's own ``output_attentions=True`` under eager attention.
Grouped-query attention (9 query heads over 3 key-value heads) and rotary position
embeddings are inside what is compared; the batch is left-padded, as for generation.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import attnflow
from attnflow.adapters import torch as adapter


@pytest.fixture(scope="module")
def reference(smollm2, left_padded):
    models, _ = smollm2
    with torch.no_grad():
        out = models["eager"](**left_padded, output_attentions=True)
    return torch.stack(out.attentions, dim=1), out.logits


def test_the_model_is_the_real_pretrained_decoder(smollm2):
    models, tokenizer = smollm2
    config = models["sdpa"].config
    assert (config.num_hidden_layers, config.num_attention_heads) == (30, 9)
    assert config.num_key_value_heads == 3  # grouped-query attention
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = models["sdpa"].generate(**ids, max_new_tokens=2, do_sample=False)
    assert tokenizer.decode(out[0, ids["input_ids"].shape[1] :]).startswith(" Paris")


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_capture_equals_output_attentions(smollm2, left_padded, reference, implementation):
    models, _ = smollm2
    expected, logits = reference
    model = models[implementation]
    with torch.no_grad():
        plain = model(**left_padded).logits
        with adapter.capture(model) as cap:
            out = model(**left_padded)
    batch, n = left_padded["input_ids"].shape
    assert cap.attentions.shape == (batch, 30, 9, n, n)
    mask = left_padded["attention_mask"].bool()
    assert torch.equal(cap.mask, mask)
    # Real query rows agree with eager output_attentions; padded query rows are the
    # frameworks' business (eager and SDPA fill them differently) and attnflow ignores them.
    real_rows = mask[:, None, None, :, None]
    torch.testing.assert_close(
        torch.where(real_rows, cap.attentions, 0),
        torch.where(real_rows, expected, 0),
        atol=2e-5,
        rtol=0,
    )
    # Causal and padding structure: no weight on a later token or on padding.
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    for b in range(batch):
        real = cap.attentions[b][..., mask[b], :]  # (layers, heads, real rows, n)
        assert bool((real[..., ~mask[b]] == 0).all())
        assert bool((real[..., upper[mask[b]]] == 0).all())
    # The model's outputs are those of an ordinary call.
    torch.testing.assert_close(out.logits[mask], plain[mask], atol=2e-3, rtol=1e-4)
    torch.testing.assert_close(out.logits[mask], logits[mask], atol=2e-3, rtol=1e-4)


def test_rollout_of_captured_weights_ignores_left_padding(smollm2, left_padded, reference):
    expected, _ = reference
    mask = left_padded["attention_mask"].bool()
    rows = attnflow.rollout(expected, rows=-1, mask=mask)
    assert rows.shape == (2, mask.shape[1])
    assert bool((rows[~mask] == 0).all())
    torch.testing.assert_close(rows.sum(-1), torch.ones(2), atol=1e-5, rtol=0)
    # The shorter prompt alone, unpadded, gives the same row.
    models, _ = smollm2
    short = mask[0].sum()
    ids = left_padded["input_ids"][0, mask[0]][None]
    with torch.no_grad(), adapter.capture(models["sdpa"]) as cap:
        models["sdpa"](input_ids=ids)
    alone = attnflow.rollout(cap.attentions, rows=-1)
    torch.testing.assert_close(rows[0, mask[0]], alone[0], atol=2e-5, rtol=0)
    assert alone.shape == (1, int(short))
