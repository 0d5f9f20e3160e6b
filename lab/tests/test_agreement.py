"""The synthetic subject-verb agreement data (attnflow_lab.agreement.agreement), NumPy only."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from attnflow_lab.agreement import agreement
from attnflow_lab.agreement.agreement import (
    CATEGORIES,
    CLS,
    MAX_ATTRACTORS,
    NOUN_NUMBER,
    OPENINGS,
    PAD,
    STRUCTURES,
    UNK,
    VERB_NUMBER,
    VOCABULARY,
    AgreementData,
    agreement_data,
    agreement_split,
    decode,
    encode,
)

N = 3000


@pytest.fixture(scope="module")
def data() -> AgreementData:
    return agreement_data(N, seed=7)


ARRAYS = ("ids", "mask", "labels", "subject", "attractors", "intervening", "structure", "opening")


def test_the_same_seed_gives_the_same_arrays(data: AgreementData) -> None:
    again = agreement_data(N, seed=7)
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(again, name), getattr(data, name))
    other = agreement_data(N, seed=8)
    assert not np.array_equal(other.labels, data.labels)


def test_a_known_seed_gives_known_sentences() -> None:
    # Guards the draws against accidental changes (same arrays on every platform).
    data = agreement_data(3, seed=0)
    assert [data.text(i) for i in range(3)] == [
        "the big NNP door which probably helps many strong neighbors sometimes",
        (
            "to the young famous players , the red empty man that painted the players to "
            "[UNK] dark reports above his leaders"
        ),
        "the teacher knows that some songs that visit the old songs with the modern companies",
    ]
    assert data.structure.tolist() == ["subject_rc", "subject_rc", "subject_rc"]
    assert data.opening.tolist() == ["none", "pp", "complement"]
    assert data.labels.tolist() == [0, 0, 1]
    assert data.subject.tolist() == [4, 10, 6]
    assert data.attractors.tolist() == [1, 3, 0]


def test_the_arrays_have_their_documented_types(data: AgreementData) -> None:
    n = data.ids.shape[1]
    assert data.ids.dtype == np.int64
    assert data.mask.dtype == np.bool_
    for name in ("labels", "subject", "attractors", "intervening"):
        assert getattr(data, name).dtype == np.int64
        assert getattr(data, name).shape == (N,)
    assert data.ids.shape == data.mask.shape == (N, n)
    assert data.structure.shape == data.opening.shape == (N,)
    for name in ARRAYS:
        assert not getattr(data, name).flags.writeable
    assert data.vocabulary == VOCABULARY
    assert data.replacement == UNK == VOCABULARY.index("[UNK]")
    assert PAD == 0
    assert VOCABULARY[CLS] == "[CLS]"


def test_labels_are_balanced(data: AgreementData) -> None:
    assert set(np.unique(data.labels).tolist()) == {0, 1}
    assert int(data.labels.sum()) == N // 2
    odd = agreement_data(11, seed=1)
    assert int((odd.labels == 0).sum()) == 6


def test_cls_first_and_padding_follows_the_mask(data: AgreementData) -> None:
    assert (data.ids[:, 0] == CLS).all()
    assert data.mask[:, 0].all()
    # The mask is a prefix of True values, padding is PAD, real tokens are never PAD.
    lengths = data.mask.sum(axis=1)
    expected = np.arange(data.ids.shape[1])[None, :] < lengths[:, None]
    np.testing.assert_array_equal(data.mask, expected)
    assert (data.ids[~data.mask] == PAD).all()
    assert (data.ids[data.mask] != PAD).all()
    assert not (data.ids[:, 1:] == CLS).any()
    assert data.ids.shape[1] == lengths.max()
    assert lengths.max() <= agreement.DEFAULT_MAX_LENGTH


def test_the_label_is_the_number_of_the_subject(data: AgreementData) -> None:
    rows = np.arange(N)
    subject_words = data.ids[rows, data.subject]
    assert (data.subject >= 1).all()
    assert data.mask[rows, data.subject].all()
    np.testing.assert_array_equal(NOUN_NUMBER[subject_words], data.labels)
    assert data.noun_number is NOUN_NUMBER


def test_attractors_are_the_opposite_number_nouns_after_the_subject(data: AgreementData) -> None:
    numbers = NOUN_NUMBER[data.ids]  # -1 for every word that is not a noun
    after = np.arange(data.ids.shape[1])[None, :] > data.subject[:, None]
    after &= data.mask
    opposite = (numbers == (1 - data.labels)[:, None]) & after
    same = (numbers == data.labels[:, None]) & after
    np.testing.assert_array_equal(opposite.sum(axis=1), data.attractors)
    np.testing.assert_array_equal((opposite | same).sum(axis=1), data.intervening)


def test_attractor_counts_decay(data: AgreementData) -> None:
    counts = np.bincount(data.attractors, minlength=MAX_ATTRACTORS + 1)
    assert len(counts) == MAX_ATTRACTORS + 1
    assert (counts[:-1] > counts[1:]).all(), counts
    assert counts[MAX_ATTRACTORS] > 0
    # Same-number intervening nouns occur too, with and without attractors.
    same = data.intervening - data.attractors
    assert ((same > 0) & (data.attractors == 0)).any()
    assert ((same > 0) & (data.attractors > 0)).any()
    # Attractors are not a cue to the label.
    for k in range(MAX_ATTRACTORS + 1):
        share = data.labels[data.attractors == k].mean()
        assert 0.35 < share < 0.65, (k, share)


def test_every_structure_and_opening_occurs(data: AgreementData) -> None:
    assert set(data.structure.tolist()) == set(STRUCTURES)
    assert set(data.opening.tolist()) == set(OPENINGS)
    simple = data.structure == "simple"
    assert (data.intervening[simple] == 0).all()
    for tag in ("pp", "nested_pp", "object_rc"):
        assert (data.intervening[data.structure == tag] >= 1).all(), tag
    assert (data.intervening[data.structure == "nested_pp"] >= 2).mean() > 0.8
    # With an opening, the subject is not the first word.
    assert (data.subject[data.opening != "none"] >= 2).all()


def test_relative_clause_verbs_agree_with_their_own_subjects(data: AgreementData) -> None:
    # Subject relative clauses: "the author who writes ...": the first verb after the
    # subject agrees with it (when it is present tense and not blanked out).
    checked = 0
    for i in np.flatnonzero(data.structure == "subject_rc").tolist():
        words = data.ids[i][data.mask[i]].tolist()
        verbs = [w for w in words[data.subject[i] + 1 :] if CATEGORIES[w] in ("verb", "special")]
        if verbs and VERB_NUMBER[verbs[0]] >= 0:  # not [UNK], not a past tense
            assert VERB_NUMBER[verbs[0]] == data.labels[i], data.text(i)
            checked += 1
    assert checked > 300
    # Object relative clauses carry verbs of the other number when the clause's subject
    # is an attractor: a real cue that the model must not use for the main verb.
    verbs = VERB_NUMBER[data.ids] == (1 - data.labels)[:, None]
    assert verbs[data.structure == "object_rc"].any(axis=1).mean() > 0.1


def test_rare_words_and_placeholders_occur(data: AgreementData) -> None:
    words = data.ids[data.mask]
    share_unknown = (words == UNK).mean()
    assert 0.005 < share_unknown < 0.03, share_unknown
    for tag in ("NN", "NNS", "NNP"):
        assert (words == VOCABULARY.index(tag)).any(), tag
    # Nouns and [CLS] are never blanked out by the generator.
    assert (NOUN_NUMBER[data.ids[data.ids != UNK]] >= -1).all()
    assert (data.ids[np.arange(N), data.subject] != UNK).all()


def test_the_vocabulary_tables() -> None:
    assert len(set(VOCABULARY)) == len(VOCABULARY)
    assert VOCABULARY[:3] == ("[PAD]", "[CLS]", "[UNK]")
    assert len(CATEGORIES) == len(NOUN_NUMBER) == len(VERB_NUMBER) == len(VOCABULARY)
    nouns = [w for w, c in zip(VOCABULARY, CATEGORIES, strict=True) if c == "noun"]
    assert all(NOUN_NUMBER[VOCABULARY.index(w)] in (0, 1) for w in nouns)
    assert (NOUN_NUMBER[[i for i, c in enumerate(CATEGORIES) if c != "noun"]] == -1).all()
    assert NOUN_NUMBER[VOCABULARY.index("key")] == 0
    assert NOUN_NUMBER[VOCABULARY.index("cabinets")] == 1
    assert NOUN_NUMBER[VOCABULARY.index("NNP")] == 0
    assert NOUN_NUMBER[VOCABULARY.index("NNS")] == 1
    assert VERB_NUMBER[VOCABULARY.index("holds")] == 0
    assert VERB_NUMBER[VOCABULARY.index("hold")] == 1
    assert VERB_NUMBER[VOCABULARY.index("held")] == -1
    assert sum(NOUN_NUMBER == 1) >= 40
    assert not NOUN_NUMBER.flags.writeable


def test_split_is_disjoint_and_deterministic() -> None:
    train, test = agreement_split(2000, 500, seed=3)
    assert len(train) == 2000
    assert len(test) == 500
    seen = {train.ids[i][train.mask[i]].tobytes() for i in range(len(train))}
    assert all(test.ids[i][test.mask[i]].tobytes() not in seen for i in range(len(test)))
    assert int(test.labels.sum()) == 250
    # The training set is agreement_data with the same seed.
    np.testing.assert_array_equal(train.ids, agreement_data(2000, seed=3).ids)
    again = agreement_split(2000, 500, seed=3)[1]
    np.testing.assert_array_equal(again.ids, test.ids)


def test_exclude_removes_the_excluded_sentences() -> None:
    # Short sentences repeat: excluding a set removes every copy.
    base = agreement_data(500, seed=4)
    repeat = agreement_data(500, seed=4, exclude=base)
    seen = {base.text(i) for i in range(len(base))}
    assert not {repeat.text(i) for i in range(len(repeat))} & seen


def test_take_and_words(data: AgreementData) -> None:
    chosen = data.take(data.attractors == 3)
    assert len(chosen) == int((data.attractors == 3).sum())
    assert (chosen.attractors == 3).all()
    assert chosen.ids.shape[1] == chosen.mask.sum(axis=1).max()
    first = int(np.flatnonzero(data.attractors == 3)[0])
    assert chosen.words(0) == data.words(first)
    assert data.words(first)[0] == "[CLS]"
    assert data.text(first) == " ".join(data.words(first)[1:])
    assert decode(data.ids[first]) == data.words(first)
    np.testing.assert_array_equal(encode(data.text(first)), data.ids[first][data.mask[first]])
    assert encode(["the", "zebra"]).tolist() == [CLS, VOCABULARY.index("the"), UNK]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: agreement_data(-1, seed=0), "n_sentences"),
        (lambda: agreement_data(5, seed=0, max_length=8), "max_length"),
    ],
)
def test_bad_arguments(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_empty_set() -> None:
    empty = agreement_data(0, seed=0)
    assert len(empty) == 0
    assert empty.ids.shape[0] == 0


def test_importing_the_generator_imports_no_framework() -> None:
    code = (
        "import sys, attnflow_lab.agreement.agreement as a\n"
        "a.agreement_data(10, seed=0)\n"
        "print(sorted(m for m in ('torch', 'jax', 'tensorflow') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_with_end_token_writes_eos_at_the_verb_position(data: AgreementData) -> None:
    small = data.take(np.arange(50))
    ended = agreement.with_end_token(small)
    lengths = small.lengths
    assert ended.vocabulary == (*VOCABULARY, "<eos>") == agreement.EOS_VOCABULARY
    assert ended.vocabulary[agreement.EOS] == "<eos>"
    np.testing.assert_array_equal(ended.lengths, lengths + 1)
    np.testing.assert_array_equal(ended.ids[np.arange(50), lengths], agreement.EOS)
    for i in range(50):  # the sentence is unchanged before <eos>, padding after it
        assert ended.words(i) == [*small.words(i), "<eos>"]
        assert (ended.ids[i, lengths[i] + 1 :] == PAD).all()
    for name in ("labels", "subject", "attractors", "intervening", "structure", "opening"):
        np.testing.assert_array_equal(getattr(ended, name), getattr(small, name))
    assert ended.replacement == UNK
    assert not ended.ids.flags.writeable
    # take() keeps the vocabulary; the noun table covers <eos> (not a noun).
    assert ended.take([3, 1]).vocabulary == ended.vocabulary
    assert ended.noun_number[agreement.EOS] == -1
    assert len(ended.noun_number) == len(ended.vocabulary)
    with pytest.raises(ValueError, match="plain vocabulary"):
        agreement.with_end_token(ended)
