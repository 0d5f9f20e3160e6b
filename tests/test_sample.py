"""The shipped samples: the text attention sample and the digits ViT (attnflow.data)."""

from __future__ import annotations

import numpy as np
import pytest

from attnflow.data import Sample, load_image_sample, load_sample


@pytest.fixture(scope="module")
def sample() -> Sample:
    return load_sample()


def test_sample_shapes_and_dtypes(sample: Sample) -> None:
    batch, layers, heads, n, n2 = sample.attentions.shape
    assert (batch, layers, heads) == (3, 6, 12)
    assert n == n2
    assert sample.attentions.dtype == np.float32
    assert sample.mask.dtype == np.bool_
    assert sample.mask.shape == (batch, n)
    assert len(sample.tokens) == batch
    assert all(len(row) == n for row in sample.tokens)
    assert all(isinstance(token, str) for row in sample.tokens for token in row)
    assert len(sample.sentences) == batch
    assert all(isinstance(sentence, str) for sentence in sample.sentences)
    assert "all-MiniLM-L6-v2" in sample.source
    assert "transformers" in sample.source
    # The batch is really padded: the sample exercises masks.
    assert not sample.mask.all()


def test_sample_mask_marks_exactly_the_real_tokens(sample: Sample) -> None:
    tokens = np.array(sample.tokens)
    np.testing.assert_array_equal(sample.mask, tokens != "[PAD]")
    for row, keep in zip(sample.tokens, sample.mask, strict=True):
        real = [token for token, k in zip(row, keep, strict=True) if k]
        assert real[0] == "[CLS]"
        assert real[-1] == "[SEP]"
        # Right padding: real tokens first.
        assert keep[: len(real)].all()


def test_sample_real_rows_are_row_stochastic(sample: Sample) -> None:
    for b in range(sample.attentions.shape[0]):
        k = int(sample.mask[b].sum())
        real = sample.attentions[b, :, :, :k, :]
        assert np.isfinite(real).all()
        assert (real >= 0).all()
        np.testing.assert_allclose(real.sum(axis=-1), 1.0, atol=1e-5)
        # The model gives padded keys exactly zero weight.
        np.testing.assert_array_equal(real[..., k:], 0.0)


def test_sample_is_read_only(sample: Sample) -> None:
    with pytest.raises(ValueError, match="read-only"):
        sample.attentions[0, 0, 0, 0, 0] = 1.0
    with pytest.raises(ValueError, match="read-only"):
        sample.mask[0, 0] = False


def test_sample_sentences_match_tokens(sample: Sample) -> None:
    for sentence, row in zip(sample.sentences, sample.tokens, strict=True):
        words = [t for t in row if t not in {"[CLS]", "[SEP]", "[PAD]"}]
        joined = "".join(w.removeprefix("##") for w in words)
        assert joined.lower() == "".join(sentence.lower().split())


def test_image_sample_is_a_trained_vit_on_digits() -> None:
    digits = load_image_sample()
    assert digits.attentions.shape == (6, 4, 4, 17, 17)
    assert digits.images.shape == (6, 8, 8)
    np.testing.assert_allclose(digits.attentions.sum(axis=-1), 1.0, atol=1e-5)
    assert (digits.predictions == digits.labels).mean() >= 5 / 6
    assert "test accuracy" in digits.source
