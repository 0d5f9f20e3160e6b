"""The offline sentiment task: determinism, balance, splits and the label rules."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnflow_lab.sentiment import sentiment
from attnflow_lab.sentiment.sentiment import (
    CONSTRUCTION_SHARES,
    CONSTRUCTIONS,
    MAX_WORDS,
    MIN_WORDS,
    NEGATIVE_ADJECTIVES,
    NEGATIVE_VERBS,
    POSITIVE_ADJECTIVES,
    POSITIVE_VERBS,
    SentimentData,
    accuracy_by_construction,
    sentiment_data,
    train_test_split,
)

POLARITY = dict.fromkeys(POSITIVE_ADJECTIVES, 1) | dict.fromkeys(NEGATIVE_ADJECTIVES, 0)
POLARITY |= {form: 1 for forms in POSITIVE_VERBS for form in forms}
POLARITY |= {form: 0 for forms in NEGATIVE_VERBS for form in forms}
NEGATION = re.compile(r"\b(?:not|never|hardly|no)\b|\bfar from\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def data() -> SentimentData:
    return sentiment_data(3000, seed=7)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def polar(text: str) -> list[int]:
    """Polarities of the lexicon words of a text, in order."""
    return [POLARITY[word] for word in words(text) if word in POLARITY]


# -- determinism, balance, shape -------------------------------------------------------------
def test_same_seed_same_data_other_seed_other_data() -> None:
    first, second = sentiment_data(200, seed=3), sentiment_data(200, seed=3)
    assert first.texts == second.texts
    assert first.constructions == second.constructions
    np.testing.assert_array_equal(first.labels, second.labels)
    assert sentiment_data(200, seed=4).texts != first.texts
    # A prefix is not promised, but a fresh generator per call is: no hidden state.
    assert sentiment_data(50, seed=3).texts == sentiment_data(50, seed=3).texts


@pytest.mark.parametrize("n", [0, 1, 7, 20, 101, 1000])
def test_balanced_labels_and_exact_construction_shares(n: int) -> None:
    data = sentiment_data(n, seed=0)
    assert len(data) == len(data.texts) == data.labels.size == len(data.constructions) == n
    assert data.labels.dtype == np.int64
    positives = int(data.labels.sum())
    assert abs(positives - (n - positives)) <= 1
    counts = Counter(data.constructions)
    for construction, share in zip(CONSTRUCTIONS, CONSTRUCTION_SHARES, strict=True):
        assert abs(counts[construction] - share * n) < 1
        labels = data.labels[np.array(data.constructions) == construction]
        assert abs(int(labels.sum()) - (labels.size - int(labels.sum()))) <= 1


def test_every_construction_occurs() -> None:
    assert set(sentiment_data(20, seed=11).constructions) == set(CONSTRUCTIONS)


def test_texts_distinct_lengths_in_range_and_varied(data: SentimentData) -> None:
    assert len(set(data.texts)) == len(data)
    lengths = np.array([len(text.split()) for text in data.texts])
    assert lengths.min() >= MIN_WORDS
    assert lengths.max() <= MAX_WORDS
    assert lengths.min() <= 7
    assert lengths.max() >= 22
    assert 9 <= lengths.mean() <= 16


def test_labels_are_read_only(data: SentimentData) -> None:
    with pytest.raises(ValueError, match="read-only"):
        data.labels[0] = 1


def test_import_does_not_import_torch_or_transformers() -> None:
    code = (
        "import sys\n"
        "import attnflow_lab.sentiment.sentiment as s\n"
        "s.sentiment_data(5, seed=0)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# -- the lexicon ------------------------------------------------------------------------------
def test_lexicon_sizes_and_no_word_of_both_polarities() -> None:
    assert len(POSITIVE_ADJECTIVES) == len(set(POSITIVE_ADJECTIVES)) >= 30
    assert len(NEGATIVE_ADJECTIVES) == len(set(NEGATIVE_ADJECTIVES)) >= 30
    assert len(POSITIVE_VERBS) >= 10
    assert len(NEGATIVE_VERBS) >= 10
    positive = set(POSITIVE_ADJECTIVES) | {f for forms in POSITIVE_VERBS for f in forms}
    negative = set(NEGATIVE_ADJECTIVES) | {f for forms in NEGATIVE_VERBS for f in forms}
    assert not positive & negative


def test_neutral_material_holds_no_lexicon_or_negation_word() -> None:
    neutral = [
        *sentiment._OPENERS,
        *sentiment._TRAILERS,
        *sentiment._SUBJECTS,
        *(context for domain in sentiment._DOMAINS for context in domain.contexts),
        *(topic for domain in sentiment._DOMAINS for topic, _ in domain.topics),
        *(noun for domain in sentiment._DOMAINS for noun in domain.nouns),
    ]
    for phrase in neutral:
        assert not set(words(phrase)) & set(POLARITY), phrase
        assert not NEGATION.search(phrase), phrase


# -- the label rules --------------------------------------------------------------------------
def test_plain_label_is_the_polarity_of_its_word(data: SentimentData) -> None:
    for text, label, construction in zip(data.texts, data.labels, data.constructions, strict=True):
        if construction == "plain":
            assert polar(text) == [label], text
            assert not NEGATION.search(text), text


def test_negation_flips_the_polarity_of_its_word(data: SentimentData) -> None:
    for text, label, construction in zip(data.texts, data.labels, data.constructions, strict=True):
        if construction == "negated":
            assert polar(text) == [1 - label], text
            assert NEGATION.search(text), text


def test_contrast_the_clause_after_the_connective_decides(data: SentimentData) -> None:
    seen = Counter[str]()
    for text, label, construction in zip(data.texts, data.labels, data.constructions, strict=True):
        if construction != "contrast":
            continue
        (connective,) = [c for c in (", but ", ", yet ", "; however, ") if c in text]
        seen[connective] += 1
        before, after = text.split(connective)
        assert polar(before) == [1 - label], text
        assert polar(after) == [label], text
        assert not NEGATION.search(text), text
    assert len(seen) == 3


def test_concessive_the_main_clause_decides_first_or_last(data: SentimentData) -> None:
    positions = Counter[str]()
    for text, label, construction in zip(data.texts, data.labels, data.constructions, strict=True):
        if construction != "concessive":
            continue
        last_sentence = text.split(". ")[-1].lower()
        match = re.search(r"(?:^|, )((?:even )?though|although) ", last_sentence)
        assert match is not None, text
        head, _, rest = last_sentence.partition(match.group(0))
        if match.start() == 0 or not polar(head):  # "although A, B": B decides, comes last
            conceded, main = rest.split(", ", 1)
            positions["main last"] += 1
        else:  # "B, although A": B decides, comes first
            main, conceded = head, rest
            positions["main first"] += 1
        assert polar(main) == [label], text
        assert polar(conceded) == [1 - label], text
    assert positions["main first"] > 0
    assert positions["main last"] > 0


def test_compound_both_clauses_agree_with_the_label(data: SentimentData) -> None:
    for text, label, construction in zip(data.texts, data.labels, data.constructions, strict=True):
        if construction == "compound":
            assert polar(text) == [label, label], text
            assert " and " in text, text


def test_hand_checkable_sentences() -> None:
    # From the docstring (seed 1): a negated positive word is negative; after "yet" the
    # positive clause decides.
    data = sentiment_data(6, seed=1)
    assert data.texts[2] == "The waiter was not at all gripping this time."
    assert (data.constructions[2], int(data.labels[2])) == ("negated", 0)
    assert data.texts[5].endswith("The jokes were fairly awkward, yet it was a superb story.")
    assert (data.constructions[5], int(data.labels[5])) == ("contrast", 1)


def test_common_phrases_have_the_expected_label() -> None:
    data = sentiment_data(20000, seed=0)
    rules = {
        r"\b(?:was|is|were|are) not (?:very |really )?good\b": 0,
        r"\b(?:was|is|were|are) never (?:very |really )?boring\b": 1,
        r"\bdid not (?:really )?(?:love|enjoy|like)\b": 0,
        r"\bdid not (?:really )?hate\b": 1,
        r"\b(?:was|is|were|are) (?:very |really )?dull, but\b": 1,
        r"\b(?:was|is|were|are) (?:very |really )?wonderful, but\b": 0,
        r"\bhardly (?:a |an )?(?:funny|good|great)\b": 0,
    }
    for pattern, expected in rules.items():
        hits = [
            int(label)
            for text, label in zip(data.texts, data.labels, strict=True)
            if re.search(pattern, text.lower())
        ]
        assert hits, pattern
        assert set(hits) == {expected}, pattern


def test_intensifiers_and_downtoners_keep_polarity() -> None:
    data = sentiment_data(5000, seed=2)
    for degree in ("very", "slightly", "somewhat", "extremely", "a bit"):
        hits = [
            (text, int(label))
            for text, label, construction in zip(
                data.texts, data.labels, data.constructions, strict=True
            )
            if construction == "plain" and f" {degree} " in text
        ]
        assert hits, degree
        assert all(polar(text) == [label] for text, label in hits)


# -- splits -----------------------------------------------------------------------------------
def test_split_is_disjoint_stratified_and_deterministic(data: SentimentData) -> None:
    train, test = train_test_split(data, n_test=500, seed=1)
    assert (len(train), len(test)) == (2500, 500)
    assert not set(train.texts) & set(test.texts)
    assert sorted(train.texts + test.texts) == sorted(data.texts)
    assert int(test.labels.sum()) == 250
    counts = Counter(test.constructions)
    for construction, share in zip(CONSTRUCTIONS, CONSTRUCTION_SHARES, strict=True):
        assert abs(counts[construction] - share * 500) <= 1
    again_train, again_test = train_test_split(data, n_test=500, seed=1)
    assert again_test.texts == test.texts
    assert again_train.texts == train.texts
    assert train_test_split(data, n_test=500, seed=2)[1].texts != test.texts
    # Order is kept.
    position = {text: i for i, text in enumerate(data.texts)}
    assert [position[t] for t in test.texts] == sorted(position[t] for t in test.texts)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 60), data_seed=st.integers(0, 5), split=st.data())
def test_split_sizes_for_any_n(n: int, data_seed: int, split: st.DataObject) -> None:
    data = sentiment_data(n, seed=data_seed)
    n_test = split.draw(st.integers(0, n))
    train, test = train_test_split(data, n_test=n_test, seed=data_seed)
    assert (len(train), len(test)) == (n - n_test, n_test)
    assert not set(train.texts) & set(test.texts)
    assert set(train.texts) | set(test.texts) == set(data.texts)


def test_split_refuses_repeated_texts() -> None:
    data = SentimentData(
        texts=("a b c d e f",) * 4, labels=[0, 1, 0, 1], constructions=("plain",) * 4
    )
    with pytest.raises(ValueError, match="both"):
        train_test_split(data, n_test=2, seed=0)


# -- errors and helpers -----------------------------------------------------------------------
def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        sentiment_data(-1, seed=0)
    with pytest.raises(TypeError, match="int"):
        sentiment_data(2.0, seed=0)  # type: ignore[arg-type]
    data = sentiment_data(10, seed=0)
    with pytest.raises(ValueError, match=r"\[0, 10\]"):
        train_test_split(data, n_test=11, seed=0)
    with pytest.raises(ValueError, match="one entry per sentence"):
        SentimentData(texts=("a",), labels=[0, 1], constructions=("plain",))
    with pytest.raises(ValueError, match="0 \\(negative\\) or 1"):
        SentimentData(texts=("a",), labels=[2], constructions=("plain",))
    with pytest.raises(ValueError, match="unknown constructions"):
        SentimentData(texts=("a",), labels=[0], constructions=("sarcasm",))


def test_take_and_accuracy_by_construction() -> None:
    data = sentiment_data(40, seed=5)
    picked = data.take([3, 1])
    assert picked.texts == (data.texts[3], data.texts[1])
    np.testing.assert_array_equal(picked.labels, data.labels[[3, 1]])
    wrong_on_negated = np.where(
        np.array(data.constructions) == "negated", 1 - data.labels, data.labels
    )
    report = accuracy_by_construction(data, wrong_on_negated)
    assert list(report) == ["all", *CONSTRUCTIONS]
    assert report["negated"] == (0.0, 10)
    assert report["plain"] == (1.0, 12)
    assert report["all"] == (30 / 40, 40)
    with pytest.raises(ValueError, match="entries"):
        accuracy_by_construction(data, data.labels[:-1])
