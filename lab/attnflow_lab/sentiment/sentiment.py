"""A sentiment task generated offline: short English reviews with a known label.

The paper's Table 3 fine-tunes DistilBERT on SST-2 and compares attention, attention
rollout and attention flow with input gradients on test sentences (Abnar & Zuidema 2020,
§4). SST-2 cannot be downloaded here, so this module writes reviews from a small,
seeded grammar whose label follows from rules a reader can check, and that a classifier
can only get right by reading the sentence: where the sentiment word is, whether it is
negated, and which clause of a two-clause sentence decides.

Every sentence has one of five constructions (:data:`CONSTRUCTIONS`):

``plain`` (30 %)
    One evaluative clause; the label is the polarity of its sentiment word, which an
    intensifier or downtoner does not change: *the plot was slightly predictable* -> 0.
``negated`` (25 %)
    One clause whose sentiment word is negated (*not*, *never*, *hardly*, *not at all*,
    *far from*, *in no way*, *did not*); negation flips the word's polarity:
    *the soundtrack was not very good* -> 0, *the film was never boring* -> 1.
``contrast`` (20 %)
    Two clauses of opposite polarity joined by *but*, *yet* or *; however,*; the clause
    after the connective decides: *the plot was dull, but the acting was wonderful* -> 1.
``concessive`` (10 %)
    Two clauses of opposite polarity, one a concession (*although*, *though*, *even
    though*); the main clause decides, whether it comes first or last:
    *the food was superb, although the service was slow* -> 1.
``compound`` (15 %)
    Two clauses of the same polarity joined by *and*: *the staff were rude and the room
    was dirty* -> 0.

Clauses of two-clause sentences are never negated, so the rule of each construction
holds word for word. A clause is copular (*the service was really friendly*), verbal
(*we loved the dessert*, *I did not enjoy the book*) or attributive (*it was a wonderful
film*). Around it come neutral material: an optional context sentence (*We went there
for a birthday dinner.*), opener (*to be fair,*) and trailer (*from start to finish*).
Sentences have 6 to 25 words (whitespace-separated, punctuation attached); a draw
outside that range, or one repeating an earlier sentence, is drawn again. Each review
is about one of five domains (films, restaurants, books, hotels, music), and the two
clauses of a sentence talk about two different aspects of the same thing.

The lexicon holds 34 positive and 34 negative adjectives and 10 positive and 10
negative verbs, chosen so that the MiniLM / BERT uncased WordPiece vocabulary keeps
almost all of them whole. Fillers and topics contain no lexicon word.

This module needs only the standard library and NumPy.

References
----------
.. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020,
   https://arxiv.org/abs/2005.00928
.. [2] R. Socher et al., "Recursive Deep Models for Semantic Compositionality Over a
   Sentiment Treebank", EMNLP 2013 (SST, whose constructions -- negation, contrastive
   *but* -- this grammar imitates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "CONSTRUCTIONS",
    "CONSTRUCTION_SHARES",
    "MAX_WORDS",
    "MIN_WORDS",
    "NEGATIVE_ADJECTIVES",
    "NEGATIVE_VERBS",
    "POSITIVE_ADJECTIVES",
    "POSITIVE_VERBS",
    "SentimentData",
    "accuracy_by_construction",
    "sentiment_data",
    "train_test_split",
]

CONSTRUCTIONS: tuple[str, ...] = ("plain", "negated", "contrast", "concessive", "compound")
"""The construction tags, in the order of :data:`CONSTRUCTION_SHARES`."""

CONSTRUCTION_SHARES: tuple[float, ...] = (0.30, 0.25, 0.20, 0.10, 0.15)
"""Share of each construction in a data set (exact up to rounding)."""

MIN_WORDS = 6
"""Fewest whitespace-separated words in a sentence."""
MAX_WORDS = 25
"""Most whitespace-separated words in a sentence."""

POSITIVE_ADJECTIVES: tuple[str, ...] = (
    "good", "great", "excellent", "wonderful", "brilliant", "superb", "delightful",
    "charming", "enjoyable", "pleasant", "lovely", "beautiful", "fantastic", "amazing",
    "impressive", "clever", "funny", "fresh", "moving", "solid", "perfect", "friendly",
    "elegant", "warm", "gripping", "stunning", "memorable", "touching", "powerful",
    "smart", "terrific", "magnificent", "gorgeous", "outstanding",
)  # fmt: skip
"""Adjectives of positive polarity."""

NEGATIVE_ADJECTIVES: tuple[str, ...] = (
    "bad", "terrible", "awful", "horrible", "boring", "dull", "poor", "weak", "bland",
    "disappointing", "annoying", "painful", "stupid", "ugly", "messy", "slow", "lazy",
    "rude", "dreadful", "pathetic", "clumsy", "silly", "predictable", "awkward", "flat",
    "stale", "sloppy", "miserable", "unpleasant", "shallow", "pointless", "useless",
    "mediocre", "tedious",
)  # fmt: skip
"""Adjectives of negative polarity."""

POSITIVE_VERBS: tuple[tuple[str, str], ...] = (
    ("loved", "love"), ("enjoyed", "enjoy"), ("liked", "like"), ("adored", "adore"),
    ("admired", "admire"), ("appreciated", "appreciate"), ("praised", "praise"),
    ("recommended", "recommend"), ("valued", "value"), ("celebrated", "celebrate"),
)  # fmt: skip
"""Verbs of positive polarity, as (past tense, base form)."""

NEGATIVE_VERBS: tuple[tuple[str, str], ...] = (
    ("hated", "hate"), ("disliked", "dislike"), ("despised", "despise"),
    ("resented", "resent"), ("regretted", "regret"), ("mocked", "mock"),
    ("condemned", "condemn"), ("criticized", "criticize"), ("detested", "detest"),
    ("loathed", "loathe"),
)  # fmt: skip
"""Verbs of negative polarity, as (past tense, base form)."""

# -- neutral material ------------------------------------------------------------------------
_INTENSIFIERS = ("very", "really", "truly", "extremely", "incredibly", "genuinely", "quite")
_DOWNTONERS = ("slightly", "somewhat", "rather", "fairly", "a bit", "a little")
_VERB_ADVERBS = ("really", "truly", "genuinely", "honestly")
# Negators of a copular clause; the flag says whether an intensifier may follow
# ("not very good", "never really boring"; not "hardly very good").
_COPULAR_NEGATORS: tuple[tuple[str, bool], ...] = (
    ("not", True),
    ("never", True),
    ("hardly", False),
    ("not at all", False),
    ("far from", False),
    ("in no way", False),
)
_NEGATION_INTENSIFIERS = ("very", "really", "particularly", "especially")
_SUBJECTS = ("i", "we", "my friends", "my parents")
_OPENERS = (
    "honestly",
    "frankly",
    "overall",
    "to be fair",
    "all in all",
    "in the end",
    "to be honest",
    "on the whole",
    "for what it is worth",
    "as far as i can tell",
)
_TRAILERS = (
    "from start to finish",
    "for most of the evening",
    "if you ask me",
    "in my opinion",
    "this time",
    "at least for me",
    "by the end",
    "for the most part",
    "as far as i am concerned",
    "according to my friends",
)
_CONTRAST = (", but", ", yet", "; however,")
_CONCESSIVE = ("although", "though", "even though")
_COMPOUND = (" and", ", and")
# Words after which "an" is not used although they start with a vowel letter.
_CONSONANT_SOUND = ("useless", "unique", "usual")


@dataclass(frozen=True)
class _Domain:
    topics: tuple[tuple[str, bool], ...]  # (noun phrase, plural)
    nouns: tuple[str, ...]  # what "it" is: "it was a wonderful film"
    contexts: tuple[str, ...]  # neutral sentences that may open the review


_DOMAINS: tuple[_Domain, ...] = (
    _Domain(
        topics=(
            ("the film", False), ("the movie", False), ("the plot", False),
            ("the acting", False), ("the soundtrack", False), ("the ending", False),
            ("the script", False), ("the cast", False), ("the dialogue", False),
            ("the story", False), ("the special effects", True), ("the jokes", True),
        ),
        nouns=("film", "movie", "story"),
        contexts=(
            "i watched it with my sister last week.",
            "we saw it on a sunday afternoon.",
            "i caught it at the local cinema.",
            "my friends picked this one for movie night.",
        ),
    ),
    _Domain(
        topics=(
            ("this restaurant", False), ("the food", False), ("the service", False),
            ("the staff", True), ("the dessert", False), ("the menu", False),
            ("the pasta", False), ("the waiter", False), ("the atmosphere", False),
            ("the wine list", False), ("the portions", True), ("the prices", True),
        ),
        nouns=("restaurant", "meal", "place"),
        contexts=(
            "we went there for a birthday dinner.",
            "i stopped by on a tuesday night.",
            "we booked a table for four.",
            "my parents took us there last month.",
        ),
    ),
    _Domain(
        topics=(
            ("the book", False), ("the novel", False), ("the writing", False),
            ("the characters", True), ("the prose", False), ("the first chapter", False),
            ("the ending", False), ("the translation", False), ("the cover", False),
        ),
        nouns=("book", "novel", "read"),
        contexts=(
            "i read it on a long train ride.",
            "my book club picked it this month.",
            "i finished it over the holidays.",
        ),
    ),
    _Domain(
        topics=(
            ("the hotel", False), ("the room", False), ("the breakfast", False),
            ("the pool", False), ("the reception", False), ("the beds", True),
            ("the view", False), ("the bathroom", False), ("the location", False),
        ),
        nouns=("hotel", "stay", "place"),
        contexts=(
            "we stayed there for three nights.",
            "i booked it for a work trip.",
            "we checked in late on a friday.",
        ),
    ),
    _Domain(
        topics=(
            ("the album", False), ("the concert", False), ("the band", False),
            ("the vocals", True), ("the lyrics", True), ("the guitar", False),
            ("the opening song", False), ("the production", False), ("the drummer", False),
        ),
        nouns=("album", "record", "concert"),
        contexts=(
            "i listened to it on the drive home.",
            "we saw them play last summer.",
            "a friend lent me the record.",
        ),
    ),
)  # fmt: skip

_T = TypeVar("_T")
_MAX_ATTEMPTS = 1000  # draws per sentence before giving up on a unique one


@dataclass(frozen=True, eq=False)
class SentimentData:
    """Sentences with their labels and constructions.

    Attributes
    ----------
    texts : tuple of str
        The sentences, all distinct.
    labels : ndarray of int64, shape (n,)
        0 for negative, 1 for positive. Read-only.
    constructions : tuple of str
        The construction of each sentence, one of :data:`CONSTRUCTIONS`.

    Examples
    --------
    >>> from attnflow_lab.sentiment.sentiment import sentiment_data
    >>> data = sentiment_data(10, seed=0)
    >>> len(data), data.labels.dtype.name, data.constructions[0] in CONSTRUCTIONS
    (10, 'int64', True)
    >>> len(data.take([0, 2]))
    2
    """

    texts: tuple[str, ...]
    labels: NDArray[np.int64]
    constructions: tuple[str, ...]

    def __post_init__(self) -> None:
        labels = np.array(self.labels, dtype=np.int64, copy=True)
        if labels.ndim != 1 or not (len(self.texts) == labels.size == len(self.constructions)):
            msg = (
                f"texts ({len(self.texts)}), labels (shape {labels.shape}) and constructions "
                f"({len(self.constructions)}) must have one entry per sentence."
            )
            raise ValueError(msg)
        if labels.size and not np.isin(labels, (0, 1)).all():
            msg = "labels must be 0 (negative) or 1 (positive)."
            raise ValueError(msg)
        unknown = sorted(set(self.constructions) - set(CONSTRUCTIONS))
        if unknown:
            msg = f"unknown constructions {unknown}; expected some of {CONSTRUCTIONS}."
            raise ValueError(msg)
        labels.setflags(write=False)
        object.__setattr__(self, "texts", tuple(str(text) for text in self.texts))
        object.__setattr__(self, "constructions", tuple(self.constructions))
        object.__setattr__(self, "labels", labels)

    def __len__(self) -> int:
        return len(self.texts)

    def take(self, indices: ArrayLike, /) -> SentimentData:
        """Select sentences by position.

        Parameters
        ----------
        indices : array_like of int
            Positions, in the order wanted.

        Returns
        -------
        SentimentData
            The selected sentences.
        """
        positions = np.asarray(indices, dtype=np.intp).reshape(-1)
        return SentimentData(
            texts=tuple(self.texts[i] for i in positions),
            labels=self.labels[positions],
            constructions=tuple(self.constructions[i] for i in positions),
        )


def sentiment_data(n_sentences: int, /, *, seed: int) -> SentimentData:
    r"""Generate distinct review sentences with known sentiment labels.

    The constructions come in the shares of :data:`CONSTRUCTION_SHARES` (counts rounded
    by largest remainder), labels are balanced within each construction (and so overall,
    up to one sentence per construction), and the order is shuffled. The grammar and its
    label rules are described in the module docstring: with :math:`p(w) \in \{0, 1\}`
    the polarity of a sentiment word,

    * plain: :math:`y = p(w)`; negated: :math:`y = 1 - p(w)`;
    * contrast (*A but B*): :math:`y = p(B)`; concessive (*although A, B* or *B,
      although A*): :math:`y = p(B)`; compound (*A and B*): :math:`y = p(A) = p(B)`.

    Parameters
    ----------
    n_sentences : int
        How many sentences (>= 0).
    seed : int
        Seed of the ``numpy.random.default_rng`` generator; the same seed gives the same
        sentences on every platform.

    Returns
    -------
    SentimentData
        `n_sentences` distinct sentences.

    Raises
    ------
    ValueError
        If `n_sentences` is negative, or so large that distinct sentences run out.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928 (Table 3: SST-2 sentiment).

    Examples
    --------
    >>> from attnflow_lab.sentiment.sentiment import sentiment_data
    >>> data = sentiment_data(6, seed=1)
    >>> data.constructions
    ('concessive', 'plain', 'negated', 'plain', 'compound', 'contrast')
    >>> data.labels
    array([0, 0, 0, 1, 1, 1])
    >>> data.texts[2]
    'The waiter was not at all gripping this time.'
    >>> data.texts[5]
    'My friends picked this one for movie night. The jokes were fairly awkward, yet it was a superb story.'
    """
    if isinstance(n_sentences, bool) or not isinstance(n_sentences, int | np.integer):
        msg = f"n_sentences must be an int; got {type(n_sentences).__name__}."
        raise TypeError(msg)
    if n_sentences < 0:
        msg = f"n_sentences must be >= 0; got {n_sentences}."
        raise ValueError(msg)
    rng = np.random.default_rng(seed)
    counts = _quota(int(n_sentences), CONSTRUCTION_SHARES)
    plan: list[tuple[str, int]] = []
    positives = 0
    for construction, count in zip(CONSTRUCTIONS, counts, strict=True):
        # Start each construction with the label that is behind, so that the whole set
        # is balanced up to one sentence.
        first = 1 if positives < len(plan) - positives else 0
        for k in range(count):
            label = first if k % 2 == 0 else 1 - first
            plan.append((construction, label))
            positives += label
    order = rng.permutation(len(plan))
    seen: set[str] = set()
    texts: list[str] = []
    for index in order:
        construction, label = plan[index]
        for _ in range(_MAX_ATTEMPTS):
            text = _sentence(rng, construction, label)
            if text not in seen and MIN_WORDS <= len(text.split()) <= MAX_WORDS:
                break
        else:
            msg = (
                f"could not draw {n_sentences} distinct sentences (stuck after "
                f"{len(texts)}); ask for fewer."
            )
            raise ValueError(msg)
        seen.add(text)
        texts.append(text)
    return SentimentData(
        texts=tuple(texts),
        labels=np.array([plan[i][1] for i in order], dtype=np.int64),
        constructions=tuple(plan[i][0] for i in order),
    )


def train_test_split(
    data: SentimentData, /, *, n_test: int, seed: int
) -> tuple[SentimentData, SentimentData]:
    """Split a data set in two, stratified by construction and label.

    Every (construction, label) group gives the test set its share of `n_test` (largest
    remainder), drawn at random; both sets keep the data's order. Since the sentences of
    a :class:`SentimentData` made by :func:`sentiment_data` are distinct, no sentence
    text is in both sets (checked).

    Parameters
    ----------
    data : SentimentData
        The sentences to split.
    n_test : int
        Size of the test set, ``0 <= n_test <= len(data)``.
    seed : int
        Seed of the ``numpy.random.default_rng`` generator that picks the test sentences.

    Returns
    -------
    train, test : SentimentData
        ``len(data) - n_test`` and `n_test` sentences.

    Raises
    ------
    ValueError
        If `n_test` is out of range, or a sentence text occurs in both sets (only
        possible with repeated texts in `data`).

    Examples
    --------
    >>> from attnflow_lab.sentiment.sentiment import sentiment_data, train_test_split
    >>> train, test = train_test_split(sentiment_data(100, seed=0), n_test=20, seed=0)
    >>> len(train), len(test), int(test.labels.sum())
    (80, 20, 10)
    >>> set(train.texts) & set(test.texts)
    set()
    """
    if isinstance(n_test, bool) or not isinstance(n_test, int | np.integer):
        msg = f"n_test must be an int; got {type(n_test).__name__}."
        raise TypeError(msg)
    if not 0 <= n_test <= len(data):
        msg = f"n_test must lie in [0, {len(data)}]; got {n_test}."
        raise ValueError(msg)
    rng = np.random.default_rng(seed)
    groups: dict[tuple[str, int], list[int]] = {}
    pairs = zip(data.constructions, data.labels.tolist(), strict=True)
    for i, (construction, label) in enumerate(pairs):
        groups.setdefault((construction, int(label)), []).append(i)
    keys = sorted(groups)
    sizes = [len(groups[key]) for key in keys]
    total = sum(sizes)
    quotas = _quota(int(n_test), [size / total for size in sizes] if total else [])
    chosen: list[int] = []
    for key, quota, size in zip(keys, quotas, sizes, strict=True):
        # Rounding may give a tiny group more than it has: the rest is topped up below.
        picks = rng.choice(size, size=min(quota, size), replace=False)
        chosen.extend(groups[key][int(p)] for p in picks)
    if len(chosen) < n_test:  # top up from what is left, at random
        left = np.setdiff1d(np.arange(len(data)), chosen)
        chosen.extend(rng.choice(left, size=n_test - len(chosen), replace=False).tolist())
    is_test = np.zeros(len(data), dtype=bool)
    is_test[chosen] = True
    train, test = data.take(np.flatnonzero(~is_test)), data.take(np.flatnonzero(is_test))
    if set(train.texts) & set(test.texts):
        msg = "a sentence text occurs in both the train and the test set (repeated in data)."
        raise ValueError(msg)
    return train, test


def accuracy_by_construction(
    data: SentimentData, predictions: ArrayLike, /
) -> dict[str, tuple[float, int]]:
    """Accuracy of predicted labels, overall and per construction.

    Parameters
    ----------
    data : SentimentData
        The sentences with their true labels.
    predictions : array_like of int, shape (n,)
        Predicted labels (0 or 1), one per sentence.

    Returns
    -------
    dict of str to (float, int)
        ``"all"`` and then each construction present in `data` (in the order of
        :data:`CONSTRUCTIONS`), mapped to (accuracy, number of sentences).

    Raises
    ------
    ValueError
        If `predictions` does not have one label per sentence.

    Examples
    --------
    >>> from attnflow_lab.sentiment.sentiment import accuracy_by_construction, sentiment_data
    >>> data = sentiment_data(20, seed=0)
    >>> accuracy_by_construction(data, data.labels)["all"]
    (1.0, 20)
    >>> accuracy_by_construction(data, 1 - data.labels)["negated"]
    (0.0, 5)
    """
    predicted = np.asarray(predictions).reshape(-1)
    if predicted.shape != data.labels.shape:
        msg = f"predictions has {predicted.size} entries for {len(data)} sentences."
        raise ValueError(msg)
    correct = predicted == data.labels
    tags = np.array(data.constructions, dtype=object)
    result = {"all": (float(correct.mean()) if correct.size else float("nan"), correct.size)}
    for construction in CONSTRUCTIONS:
        selected = tags == construction
        count = int(selected.sum())
        if count:
            result[construction] = (float(correct[selected].mean()), count)
    return result


# -- the grammar -----------------------------------------------------------------------------
def _quota(total: int, shares: Sequence[float]) -> list[int]:
    """Split `total` in proportion to `shares` by largest remainder (ties: first share)."""
    if not shares:
        return []
    weights = np.asarray(shares, dtype=np.float64)
    exact = total * weights / weights.sum()
    counts = np.floor(exact).astype(np.int64)
    remainder = exact - counts
    for i in np.argsort(-remainder, kind="stable")[: total - int(counts.sum())]:
        counts[i] += 1
    return [int(c) for c in counts]


def _pick(rng: np.random.Generator, options: Sequence[_T]) -> _T:
    return options[int(rng.integers(len(options)))]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" and not word.startswith(_CONSONANT_SOUND) else "a"


def _adjective(rng: np.random.Generator, polarity: int) -> str:
    return _pick(rng, POSITIVE_ADJECTIVES if polarity else NEGATIVE_ADJECTIVES)


def _verb(rng: np.random.Generator, polarity: int) -> tuple[str, str]:
    return _pick(rng, POSITIVE_VERBS if polarity else NEGATIVE_VERBS)


def _clause(
    rng: np.random.Generator,
    domain: _Domain,
    topic: tuple[str, bool],
    polarity: int,
    *,
    negated: bool,
    present: bool,
) -> str:
    """One evaluative clause whose sentiment (after any negation) is `polarity`."""
    word_polarity = 1 - polarity if negated else polarity
    kind = rng.random()
    subject, plural = topic
    if kind < 0.55:  # copular: "the plot was (very) dull", "the plot was not very dull"
        be = ("are" if plural else "is") if present else ("were" if plural else "was")
        adjective = _adjective(rng, word_polarity)
        if negated:
            negator, may_intensify = _pick(rng, _COPULAR_NEGATORS)
            if may_intensify and rng.random() < 0.35:
                negator = f"{negator} {_pick(rng, _NEGATION_INTENSIFIERS)}"
            return f"{subject} {be} {negator} {adjective}"
        return f"{subject} {be} {_degree(rng)}{adjective}"
    if kind < 0.85:  # verbal: "we loved the dessert", "i did not enjoy the book"
        person = _pick(rng, _SUBJECTS)
        past, base = _verb(rng, word_polarity)
        if negated:
            style = rng.random()
            if style < 0.6:
                auxiliary = "do not" if present else "did not"
                adverb = f"{_pick(rng, ('really', 'particularly'))} " if rng.random() < 0.3 else ""
                return f"{person} {auxiliary} {adverb}{base} {subject}"
            if style < 0.85:
                return f"{person} never {base if present else past} {subject}"
            return f"{person} hardly {base if present else past} {subject}"
        adverb = f"{_pick(rng, _VERB_ADVERBS)} " if rng.random() < 0.3 else ""
        return f"{person} {adverb}{base if present else past} {subject}"
    # attributive: "it was a really wonderful film", "it is not a funny movie"
    noun = _pick(rng, domain.nouns)
    adjective = _adjective(rng, word_polarity)
    be = "is" if present else "was"
    if negated:
        negator = _pick(rng, ("not", "never", "hardly", "in no way"))
        modifier = "very " if negator == "not" and rng.random() < 0.3 else ""
        phrase = f"{modifier}{adjective}"
        return f"it {be} {negator} {_article(phrase)} {phrase} {noun}"
    phrase = f"{_degree(rng)}{adjective}"
    return f"it {be} {_article(phrase)} {phrase} {noun}"


def _degree(rng: np.random.Generator) -> str:
    """Draw an optional intensifier or downtoner, with a trailing space."""
    draw = rng.random()
    if draw < 0.5:
        return ""
    if draw < 0.8:
        return f"{_pick(rng, _INTENSIFIERS)} "
    return f"{_pick(rng, _DOWNTONERS)} "


def _sentence(rng: np.random.Generator, construction: str, label: int) -> str:
    domain = _pick(rng, _DOMAINS)
    present = rng.random() < 0.25
    first = _pick(rng, domain.topics)
    if construction in ("plain", "negated"):
        body = _clause(
            rng, domain, first, label, negated=construction == "negated", present=present
        )
    else:
        second = _pick(rng, [topic for topic in domain.topics if topic[0] != first[0]])
        agree = construction == "compound"
        other = label if agree else 1 - label
        clause_a = _clause(rng, domain, first, other, negated=False, present=present)
        clause_b = _clause(rng, domain, second, label, negated=False, present=present)
        if construction == "contrast":
            body = f"{clause_a}{_pick(rng, _CONTRAST)} {clause_b}"
        elif construction == "compound":
            body = f"{clause_a}{_pick(rng, _COMPOUND)} {clause_b}"
        else:  # concessive: clause_b is the main clause, before or after the concession
            connective = _pick(rng, _CONCESSIVE)
            if rng.random() < 0.5:
                body = f"{connective} {clause_a}, {clause_b}"
            else:
                body = f"{clause_b}, {connective} {clause_a}"
    if rng.random() < 0.4:
        body = f"{_pick(rng, _OPENERS)}, {body}"
    if rng.random() < 0.35:
        body = f"{body} {_pick(rng, _TRAILERS)}"
    text = f"{body}."
    if rng.random() < 0.25:
        text = f"{_pick(rng, domain.contexts)} {text}"
    return _capitalise(text)


def _capitalise(text: str) -> str:
    """Capitalise the first word of each sentence and the pronoun "i"."""
    words = text.split(" ")
    out = []
    starts = True
    for word in words:
        if word == "i":
            out.append("I")
        elif starts:
            out.append(word[:1].upper() + word[1:])
        else:
            out.append(word)
        starts = word.endswith(".")
    return " ".join(out)
