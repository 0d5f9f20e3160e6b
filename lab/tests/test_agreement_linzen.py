"""Agreement prefixes matched to Linzen et al.'s statistics (agreement_linzen), NumPy only."""

from __future__ import annotations

import numpy as np
import pytest

from attnflow_lab.agreement.agreement import (
    CLS,
    EOS,
    NOUN_NUMBER,
    PAD,
    AgreementData,
    agreement_data,
    with_end_token,
)
from attnflow_lab.agreement.agreement_linzen import (
    LINZEN_ATTRACTOR_COUNTS,
    LINZEN_MAX_LENGTH,
    _ZipfDraws,
    linzen_matched_data,
)

N = 4000


@pytest.fixture(scope="module")
def data() -> AgreementData:
    return linzen_matched_data(N, seed=3)


def test_the_same_seed_gives_the_same_arrays(data: AgreementData) -> None:
    again = linzen_matched_data(N, seed=3)
    np.testing.assert_array_equal(again.ids, data.ids)
    np.testing.assert_array_equal(again.labels, data.labels)
    assert not np.array_equal(linzen_matched_data(N, seed=4).ids[:50], data.ids[:50])


def test_labels_subjects_and_padding(data: AgreementData) -> None:
    rows = np.arange(N)
    assert int(data.labels.sum()) == N // 2
    assert (data.ids[:, 0] == CLS).all()
    assert (data.ids[~data.mask] == PAD).all()
    np.testing.assert_array_equal(NOUN_NUMBER[data.ids[rows, data.subject]], data.labels)


def test_attractors_are_the_opposite_number_nouns_after_the_subject(data: AgreementData) -> None:
    # An oracle from the tokens alone: every noun after the subject's head intervenes.
    numbers = NOUN_NUMBER[data.ids]
    after = (np.arange(data.ids.shape[1])[None, :] > data.subject[:, None]) & data.mask
    opposite = (numbers == (1 - data.labels)[:, None]) & after
    same = (numbers == data.labels[:, None]) & after
    np.testing.assert_array_equal(opposite.sum(axis=1), data.attractors)
    np.testing.assert_array_equal((opposite | same).sum(axis=1), data.intervening)


def test_the_attractor_profile_is_linzens(data: AgreementData) -> None:
    expected = np.asarray(LINZEN_ATTRACTOR_COUNTS, dtype=float)
    expected /= expected.sum()
    assert expected[0] == pytest.approx(0.9465, abs=1e-4)  # 1,146,330 of 1,211,080
    observed = np.bincount(data.attractors, minlength=5) / N
    sd = np.sqrt(expected * (1 - expected) / N)
    assert (np.abs(observed - expected) <= 4 * sd + 1e-3).all(), (observed, expected)
    # The grammar's default draws half its sentences with attractors: a different profile.
    assert (agreement_data(N, seed=3).attractors == 0).mean() < 0.6


def test_prefixes_are_longer_and_capped_at_50_words(data: AgreementData) -> None:
    lengths = data.lengths
    assert lengths.max() <= LINZEN_MAX_LENGTH == 51
    grammar = agreement_data(N, seed=3).lengths
    assert lengths.mean() > grammar.mean() + 2.5
    assert np.percentile(lengths, 90) > np.percentile(grammar, 90) + 5
    assert 15.5 < lengths.mean() + 1 < 19.5  # about 17 tokens with <bos> and <eos>
    eos = with_end_token(data)
    assert (eos.ids[np.arange(N), lengths] == EOS).all()


def test_picks_follow_zipfs_law() -> None:
    draws = _ZipfDraws(np.random.default_rng(0))
    options = tuple(range(8))
    counts = np.bincount([draws.pick(options) for _ in range(40_000)], minlength=8)
    expected = 1.0 / np.arange(1, 9)
    expected *= 40_000 / expected.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (counts, expected)  # 7 degrees of freedom: p < 1e-4 above 30
    uniform = np.full(8, 5_000.0)
    assert float(((counts - uniform) ** 2 / uniform).sum()) > 1_000.0


def test_exclude_keeps_test_sentences_out_of_training() -> None:
    test = linzen_matched_data(300, seed=np.random.SeedSequence(0).spawn(1)[0])
    train = linzen_matched_data(2000, seed=0, exclude=test)
    keys = {row[: int(n)].tobytes() for row, n in zip(test.ids, test.lengths, strict=True)}
    assert not any(
        row[: int(n)].tobytes() in keys for row, n in zip(train.ids, train.lengths, strict=True)
    )


@pytest.mark.parametrize("bad", [-1, 2.5, True, "10"])
def test_bad_sentence_counts_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="n_sentences"):
        linzen_matched_data(bad, seed=0)  # type: ignore[arg-type]


def test_empty_set() -> None:
    assert len(linzen_matched_data(0, seed=0)) == 0
