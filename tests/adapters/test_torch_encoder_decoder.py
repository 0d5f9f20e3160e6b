"""encoder_decoder_rollout and encoder_decoder_flow on attention captured by attnflow.adapters.torch from real
encoder-decoder models (a small random BART built from its config, ``nn.Transformer``),
against the independent oracle run on the same captured tensors. Offline."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs PyTorch")

import attnflow
from attnflow.adapters import torch as adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import oracle_encoder_decoder, oracle_encoder_decoder_flow


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().double().numpy()


@pytest.fixture(scope="module")
def bart():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(
        vocab_size=100,
        d_model=32,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration._from_config(
        config, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def bart_batch():
    generator = torch.Generator().manual_seed(0)
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[0, 5:] = 0
    decoder_attention_mask = torch.ones(2, 5, dtype=torch.long)
    decoder_attention_mask[1, 4:] = 0
    return {
        "input_ids": torch.randint(3, 100, (2, 7), generator=generator),
        "attention_mask": attention_mask,
        "decoder_input_ids": torch.randint(3, 100, (2, 5), generator=generator),
        "decoder_attention_mask": decoder_attention_mask,
    }


def _check_against_oracle(cap, *, grads=None, **options):
    source_mask, target_mask = cap.mask, cap.decoder_mask
    attentions = (cap.encoder_attentions, cap.decoder_attentions, cap.cross_attentions)
    extra = {} if grads is None else {"rule": "gae", "gradients": grads}
    source, target = attnflow.encoder_decoder_rollout(
        *(a.detach() for a in attentions),
        source_mask=source_mask,
        target_mask=target_mask,
        **extra,
        **options,
    )
    want_s, want_t = oracle_encoder_decoder(
        *(_numpy(a) for a in attentions),
        gradients=None if grads is None else tuple(_numpy(g) for g in grads),
        source_mask=None if source_mask is None else source_mask.numpy(),
        target_mask=None if target_mask is None else target_mask.numpy(),
        rule="rollout" if grads is None else "gae",
        **options,
    )
    for got, want in ((source, want_s), (target, want_t)):
        # Relative to the magnitude: GAE relevance of a random model is ~1e-4.
        scale = max(float(np.abs(want).max()), 1e-3)
        np.testing.assert_allclose(_numpy(got), want, rtol=1e-5, atol=1e-5 * scale)
    return source, target


def test_bart_rollout_matches_the_oracle_and_rows_sum_to_one(bart, bart_batch):
    with torch.no_grad(), adapter.capture(bart) as cap:
        bart(**bart_batch)
    assert cap.cross_attentions.shape == (2, 3, 4, 5, 7)
    source, target = _check_against_oracle(cap, layers="all")
    totals = source.sum(-1) + target.sum(-1)  # (batch, L_d, T)
    real = cap.decoder_mask[:, None, :].expand_as(totals)
    torch.testing.assert_close(totals[real], torch.ones_like(totals[real]), atol=1e-5, rtol=0)
    assert bool((totals[~real] == 0).all())
    assert bool((source[0, ..., 5:] == 0).all())  # padded source tokens get nothing
    _check_against_oracle(cap, rows=[4, 0], residual=0.3)


def _check_flow_against_oracle(cap, **options):
    source_mask, target_mask = cap.mask, cap.decoder_mask
    attentions = (cap.encoder_attentions, cap.decoder_attentions, cap.cross_attentions)
    source, target = attnflow.encoder_decoder_flow(
        *(a.detach() for a in attentions),
        source_mask=source_mask,
        target_mask=target_mask,
        **options,
    )
    assert source.dtype == torch.float32
    assert isinstance(source, torch.Tensor)
    want_s, want_t = oracle_encoder_decoder_flow(
        *(_numpy(a) for a in attentions),
        source_mask=source_mask.numpy(),
        target_mask=target_mask.numpy(),
        **options,
    )
    np.testing.assert_allclose(_numpy(source), want_s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_numpy(target), want_t, rtol=1e-5, atol=1e-5)
    return source, target


def test_bart_flow_matches_the_networkx_oracle(bart, bart_batch):
    with torch.no_grad(), adapter.capture(bart) as cap:
        bart(**bart_batch)
    source, target = _check_flow_against_oracle(cap, rows=[4, 0], layers="all")
    assert bool((source[0, ..., 5:] == 0).all())  # padded source tokens get nothing
    assert bool((target[1, ..., 4:] == 0).all())  # nor padded target tokens
    _check_flow_against_oracle(cap, rows=2, residual=0.3, normalize_result=False)


def test_bart_gae_matches_the_oracle(bart, bart_batch):
    with adapter.capture(bart, gradients=True) as cap:
        out = bart(**bart_batch)
    out.logits[:, -2].max(-1).values.sum().backward()
    bart.zero_grad(set_to_none=True)
    grads = (cap.encoder_gradients, cap.decoder_gradients, cap.cross_gradients)
    source, _ = _check_against_oracle(cap, grads=grads, layers="all")
    assert bool((source != 0).any())
    _check_against_oracle(cap, grads=grads, rows=3, normalize_result=True)


def test_torch_transformer_rollout_matches_the_oracle():
    torch.manual_seed(0)
    model = torch.nn.Transformer(
        d_model=16,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=3,
        dim_feedforward=32,
        batch_first=True,
    ).eval()
    src, tgt = torch.randn(2, 7, 16), torch.randn(2, 5, 16)
    src_pad = torch.zeros(2, 7, dtype=torch.bool)
    src_pad[1, 6:] = True
    tgt_pad = torch.zeros(2, 5, dtype=torch.bool)
    tgt_pad[0, 4:] = True
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)  # True = not allowed, like the pads
    with torch.no_grad(), adapter.capture(model) as cap:
        model(
            src,
            tgt,
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
        )
    assert torch.equal(cap.mask, ~src_pad)
    assert torch.equal(cap.decoder_mask, ~tgt_pad)
    source, target = _check_against_oracle(cap)
    totals = source.sum(-1) + target.sum(-1)
    torch.testing.assert_close(totals[~tgt_pad], torch.ones(9), atol=1e-5, rtol=0)
    _check_flow_against_oracle(cap, rows=[0, 3])
    assert bool((totals[tgt_pad] == 0).all())
