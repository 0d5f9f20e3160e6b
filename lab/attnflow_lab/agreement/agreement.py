"""Synthetic subject-verb agreement data, a stand-in for Linzen et al. (2016).

Abnar & Zuidema (2020, §2) train their model on the verb number prediction task: given
an English sentence up to (not including) a verb, predict whether the verb is singular
or plural. The data set of Linzen, Dupoux & Goldberg (2016) cannot be downloaded here,
so this module generates English-like prefixes from a small grammar with a known ground
truth: the position of the head noun of the verb's subject, its number, and the
*agreement attractors* (nouns of the opposite number between the subject and the verb).

Every sentence is ``[CLS]`` + an optional *opening* + the subject noun phrase + the
subject's postmodifier + an optional adverb; the verb itself is left out:

* openings (before the subject, never counted as attractors): none; an adverbial
  (``here``, ``yesterday ,``, ``in the morning ,``); a prepositional phrase
  (``near the cabinets ,``); a subordinate clause with its own verb, which agrees with
  its own subject when in the present tense (``although the man left ,``, ``when the
  dogs arrive ,``); a clause that embeds the sentence (``the men think that``);
* postmodifiers of the subject (the ``structure`` tag): none (``simple``); a
  prepositional phrase (``pp``), whose noun phrase may be modified in turn
  (``nested_pp``: ``the key to the cabinets near the door``); an object relative clause,
  whose verb agrees with the clause's own subject (``object_rc``: ``the key that the men
  hold``, also without the pronoun); a subject relative clause, whose verb agrees with
  the head subject (``subject_rc``: ``the author who writes the books``, ``the men who
  smile``). Relative clauses may contain prepositional phrases and the reverse;
* noun phrases: a determiner that agrees where English makes it agree (``a``, ``this``,
  ``these``, ``many``; ``the`` for both; plurals may be bare), adjectives, sometimes a
  noun modifier (``the NNP systems``), and the noun: one of 40 singular/plural pairs,
  a time noun in openings, or, as in Linzen's data for rare words, a part-of-speech
  placeholder: ``NN`` (singular), ``NNS`` (plural), ``NNP`` (a proper noun, singular).

How a sentence is drawn: its label (the subject's number; the classes alternate, so
they are balanced), its number of attractors ``k`` (0 to 4, probability proportional
to ``2**-k``) and its number of same-number intervening nouns (0 to 3, probability
proportional to ``2**-e``) are drawn first; a postmodifier structure with exactly
``k + e`` nouns is then grown at random, ``k`` of those nouns are made the opposite
number, and the words are filled in. About 2 % of the other words (not nouns, not
``[CLS]``, not punctuation) are replaced by ``[UNK]``, as rare words are unknown in
Linzen's data; ``[UNK]`` is also the blank-out replacement
(:attr:`AgreementData.replacement`). A sentence longer than `max_length` tokens is drawn
again.

Frequencies (100,000 sentences, seed 0): structures ``simple`` 19 %, ``pp`` 14 %,
``nested_pp`` 23 %, ``object_rc`` 18 %, ``subject_rc`` 26 %; openings none 50 %, adverbial
15 %, prepositional 10 %, subordinate 12 %, complement 13 %; 0 to 4 attractors 52, 26, 13,
7 and 3 %; mean length 11.6 tokens with ``[CLS]`` (median 11, 99th percentile 28,
longest 43); 1.2 % of the tokens are ``[UNK]``. The vocabulary has 280 words.

Only NumPy and the standard library are used, and all randomness comes from
``numpy.random.default_rng``, so a seed gives the same arrays on every platform.

References
----------
Linzen, T., Dupoux, E. & Goldberg, Y. (2016). Assessing the ability of LSTMs to learn
syntax-sensitive dependencies. TACL 4, 521-535.

Abnar, S. & Zuidema, W. (2020). Quantifying attention flow in transformers. ACL 2020,
https://arxiv.org/abs/2005.00928.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "CATEGORIES",
    "CLS",
    "DEFAULT_MAX_LENGTH",
    "EOS",
    "EOS_VOCABULARY",
    "MAX_ATTRACTORS",
    "NOUN_NUMBER",
    "OPENINGS",
    "PAD",
    "STRUCTURES",
    "UNK",
    "VERB_NUMBER",
    "VOCABULARY",
    "AgreementData",
    "agreement_data",
    "agreement_split",
    "decode",
    "encode",
    "with_end_token",
]

_T = TypeVar("_T")

# -- the lexicon ---------------------------------------------------------------------------------
_SPECIALS = ("[PAD]", "[CLS]", "[UNK]")
_NOUN_PAIRS = (
    ("key", "keys"),
    ("cabinet", "cabinets"),
    ("author", "authors"),
    ("book", "books"),
    ("man", "men"),
    ("woman", "women"),
    ("child", "children"),
    ("dog", "dogs"),
    ("cat", "cats"),
    ("house", "houses"),
    ("car", "cars"),
    ("teacher", "teachers"),
    ("student", "students"),
    ("doctor", "doctors"),
    ("article", "articles"),
    ("system", "systems"),
    ("report", "reports"),
    ("company", "companies"),
    ("city", "cities"),
    ("country", "countries"),
    ("friend", "friends"),
    ("officer", "officers"),
    ("player", "players"),
    ("picture", "pictures"),
    ("table", "tables"),
    ("door", "doors"),
    ("window", "windows"),
    ("letter", "letters"),
    ("girl", "girls"),
    ("boy", "boys"),
    ("farmer", "farmers"),
    ("bird", "birds"),
    ("tree", "trees"),
    ("road", "roads"),
    ("manager", "managers"),
    ("worker", "workers"),
    ("painting", "paintings"),
    ("song", "songs"),
    ("leader", "leaders"),
    ("neighbor", "neighbors"),
)
_SINGULAR_NOUNS = tuple(pair[0] for pair in _NOUN_PAIRS)
_PLURAL_NOUNS = tuple(pair[1] for pair in _NOUN_PAIRS)
_TIME_NOUNS = ("morning", "evening", "night", "week")  # singular, in openings only
_PLACEHOLDERS = {"NN": 0, "NNS": 1, "NNP": 0}  # Linzen's tags for rare nouns, and their number
# Determiners with their weights; None is a bare noun phrase (plural only).
_SINGULAR_DETERMINERS: dict[str | None, float] = {
    "the": 0.50,
    "a": 0.16,
    "this": 0.06,
    "every": 0.03,
    "each": 0.03,
    "another": 0.02,
    "his": 0.04,
    "her": 0.04,
    "their": 0.04,
    "our": 0.04,
    "no": 0.02,
}
_PLURAL_DETERMINERS: dict[str | None, float] = {
    "the": 0.50,
    "these": 0.06,
    "those": 0.04,
    "many": 0.04,
    "some": 0.06,
    "several": 0.04,
    "two": 0.03,
    "three": 0.02,
    "his": 0.04,
    "her": 0.04,
    "their": 0.04,
    "our": 0.04,
    "no": 0.02,
    None: 0.03,
}
_ADJECTIVES = (
    "big",
    "small",
    "old",
    "new",
    "red",
    "large",
    "young",
    "strong",
    "famous",
    "local",
    "ancient",
    "dark",
    "broken",
    "green",
    "quiet",
    "happy",
    "tall",
    "empty",
    "heavy",
    "modern",
)
_ADVERBS = (
    "often",
    "also",
    "really",
    "never",
    "usually",
    "certainly",
    "still",
    "always",
    "sometimes",
    "rarely",
    "probably",
    "clearly",
)
_PREPOSITIONS = (
    "to",
    "of",
    "near",
    "behind",
    "on",
    "in",
    "with",
    "for",
    "from",
    "under",
    "beside",
    "about",
    "at",
    "by",
    "without",
    "across",
    "above",
    "during",
)
_RELATIVES = ("that", "which", "who")
# (third person singular present, plural present, past): the past does not agree.
_TRANSITIVE = (
    ("holds", "hold", "held"),
    ("writes", "write", "wrote"),
    ("sees", "see", "saw"),
    ("likes", "like", "liked"),
    ("owns", "own", "owned"),
    ("finds", "find", "found"),
    ("builds", "build", "built"),
    ("makes", "make", "made"),
    ("takes", "take", "took"),
    ("brings", "bring", "brought"),
    ("describes", "describe", "described"),
    ("mentions", "mention", "mentioned"),
    ("visits", "visit", "visited"),
    ("calls", "call", "called"),
    ("helps", "help", "helped"),
    ("follows", "follow", "followed"),
    ("admires", "admire", "admired"),
    ("needs", "need", "needed"),
    ("carries", "carry", "carried"),
    ("paints", "paint", "painted"),
)
_INTRANSITIVE = (
    ("leaves", "leave", "left"),
    ("arrives", "arrive", "arrived"),
    ("sleeps", "sleep", "slept"),
    ("smiles", "smile", "smiled"),
    ("returns", "return", "returned"),
    ("waits", "wait", "waited"),
    ("laughs", "laugh", "laughed"),
    ("works", "work", "worked"),
)
_COMPLEMENT_VERBS = (
    ("says", "say", "said"),
    ("thinks", "think", "thought"),
    ("knows", "know", "knew"),
    ("believes", "believe", "believed"),
    ("claims", "claim", "claimed"),
    ("hopes", "hope", "hoped"),
    ("argues", "argue", "argued"),
)
_SUBORDINATORS = ("although", "when", "because", "while", "if")
_OPENING_ADVERBS = ("here", "today", "now", "perhaps", "yesterday", "meanwhile", "however")
_OPENING_ADVERBIALS = (
    ("here",),
    ("today",),
    ("now",),
    ("perhaps",),
    ("yesterday", ","),
    ("meanwhile", ","),
    ("however", ","),
    ("in", "the", "morning", ","),
    ("in", "the", "evening", ","),
    ("at", "night", ","),
    ("during", "the", "week", ","),
)


def _lexicon() -> dict[str, str]:
    """Every word with its category, in vocabulary order (specials first)."""
    entries: list[tuple[str, str]] = [(word, "special") for word in _SPECIALS]
    entries.append((",", "punctuation"))
    entries += [(word, "noun") for word in (*_SINGULAR_NOUNS, *_PLURAL_NOUNS, *_TIME_NOUNS)]
    entries += [(word, "noun") for word in _PLACEHOLDERS]
    determiners = dict.fromkeys([*_SINGULAR_DETERMINERS, *_PLURAL_DETERMINERS, "an"])
    entries += [(word, "determiner") for word in determiners if word is not None]
    entries += [(word, "adjective") for word in _ADJECTIVES]
    entries += [(word, "adverb") for word in _ADVERBS]
    entries += [(word, "adverb") for word in _OPENING_ADVERBS]
    entries += [(word, "preposition") for word in _PREPOSITIONS]
    entries += [(word, "relative") for word in _RELATIVES]
    entries += [(word, "subordinator") for word in _SUBORDINATORS]
    for forms in (*_TRANSITIVE, *_INTRANSITIVE, *_COMPLEMENT_VERBS):
        entries += [(word, "verb") for word in forms]
    lexicon: dict[str, str] = {}
    for word, category in entries:
        if lexicon.setdefault(word, category) != category:
            msg = f"the word {word!r} is both a {lexicon[word]} and a {category}"
            raise AssertionError(msg)
    return lexicon


_LEXICON = _lexicon()

VOCABULARY: tuple[str, ...] = tuple(_LEXICON)
"""The words; a word's id is its index. Specials first: ``[PAD]``, ``[CLS]``, ``[UNK]``."""

CATEGORIES: tuple[str, ...] = tuple(_LEXICON.values())
"""The category of each word (``"noun"``, ``"verb"``, ``"determiner"``, ...), by id."""

_ID = {word: index for index, word in enumerate(VOCABULARY)}
PAD: int = _ID["[PAD]"]
"""Id of the padding token (0)."""
CLS: int = _ID["[CLS]"]
"""Id of ``[CLS]``, the first token of every sentence."""
UNK: int = _ID["[UNK]"]
"""Id of ``[UNK]``: rare words and the blank-out replacement."""

EOS_VOCABULARY: tuple[str, ...] = (*VOCABULARY, "<eos>")
""":data:`VOCABULARY` with ``<eos>`` appended: the vocabulary of :func:`with_end_token`."""
EOS: int = len(VOCABULARY)
"""Id of ``<eos>`` in :data:`EOS_VOCABULARY` (the token at the verb position)."""


def _number_table(numbers: dict[str, int]) -> NDArray[np.int8]:
    table = np.full(len(VOCABULARY), -1, dtype=np.int8)
    for word, number in numbers.items():
        table[_ID[word]] = number
    table.setflags(write=False)
    return table


NOUN_NUMBER: NDArray[np.int8] = _number_table(
    {
        **dict.fromkeys(_SINGULAR_NOUNS, 0),
        **dict.fromkeys(_PLURAL_NOUNS, 1),
        **dict.fromkeys(_TIME_NOUNS, 0),
        **_PLACEHOLDERS,
    }
)
"""Number of each word by id: 0 for a singular noun, 1 for a plural noun, -1 otherwise."""

VERB_NUMBER: NDArray[np.int8] = _number_table(
    {
        **{forms[0]: 0 for forms in (*_TRANSITIVE, *_INTRANSITIVE, *_COMPLEMENT_VERBS)},
        **{forms[1]: 1 for forms in (*_TRANSITIVE, *_INTRANSITIVE, *_COMPLEMENT_VERBS)},
    }
)
"""Number of each word by id: 0 for a singular present verb, 1 for a plural one, else -1."""

STRUCTURES: tuple[str, ...] = ("simple", "pp", "nested_pp", "object_rc", "subject_rc")
"""Tags of the subject's postmodifier (see the module docstring)."""

OPENINGS: tuple[str, ...] = ("none", "adverbial", "pp", "subordinate", "complement")
"""Tags of the material before the subject."""

MAX_ATTRACTORS = 4
"""The largest number of attractors in a sentence."""

DEFAULT_MAX_LENGTH = 48
"""Default longest sentence, in tokens with ``[CLS]`` (longer draws are drawn again)."""

# -- the grammar's probabilities ---------------------------------------------------------------
_ATTRACTOR_WEIGHTS = tuple(0.5**k for k in range(MAX_ATTRACTORS + 1))
_SAME_NUMBER_WEIGHTS = tuple(0.5**e for e in range(4))
_OPENING_WEIGHTS = {
    "none": 0.50,
    "adverbial": 0.15,
    "pp": 0.10,
    "subordinate": 0.12,
    "complement": 0.13,
}
_POSTMODIFIER_WEIGHTS = {"pp": 0.5, "object_rc": 0.25, "subject_rc": 0.25}
_OBJECT_RC_PRONOUNS: dict[str | None, float] = {"that": 0.45, "which": 0.2, "who": 0.15, None: 0.2}
_SUBJECT_RC_PRONOUNS: dict[str, float] = {"that": 0.45, "which": 0.25, "who": 0.3}
_ADJECTIVE_COUNT_WEIGHTS = (0.7, 0.25, 0.05)
_SINGULAR_MODIFIERS: dict[str | None, float] = {"NNP": 0.35, "NN": 0.15, None: 0.5}
P_INTRANSITIVE_RC = 0.3  # subject without intervening nouns: "the men who smile"
P_INNER_INTRANSITIVE_RC = 0.05  # "the key to the man who smiles"
P_MODIFIER = 0.06  # a noun modifier before the head noun: "the NNP systems"
P_PLACEHOLDER = 0.08  # a rare noun, written as its tag NN / NNS
P_PROPER = 0.05  # a singular noun phrase that is just NNP
P_PRESENT = 0.75  # relative-clause verbs in the present tense (they agree)
P_OPENING_PRESENT = 0.6  # verbs of openings in the present tense
P_ADVERB = 0.1  # an adverb before a verb
P_PP_AFTER_RC_VERB = 0.5  # "the key that the men put on the tables"
P_UNKNOWN = 0.02  # other words replaced by [UNK]


# -- drawing ----------------------------------------------------------------------------------
class _Draws:
    """Uniform numbers from a NumPy generator, drawn in blocks (fast, reproducible)."""

    _BLOCK = 8192

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self._block: list[float] = []
        self._next = 0

    def uniform(self) -> float:
        if self._next == len(self._block):
            self._block = self._rng.random(self._BLOCK).tolist()
            self._next = 0
        value = self._block[self._next]
        self._next += 1
        return value

    def chance(self, probability: float) -> bool:
        return self.uniform() < probability

    def pick(self, options: Sequence[_T]) -> _T:
        return options[min(int(self.uniform() * len(options)), len(options) - 1)]

    def choose(self, weights: dict[_T, float]) -> _T:
        """Pick a key of `weights`, with probability proportional to its value."""
        keys = list(weights)
        return keys[self.index(list(weights.values()))]

    def index(self, weights: Sequence[float]) -> int:
        """Pick an index into `weights`, with probability proportional to its value."""
        cumulative = list(itertools.accumulate(weights))
        index = bisect.bisect_right(cumulative, self.uniform() * cumulative[-1])
        return min(index, len(weights) - 1)

    def sample(self, population: int, count: int) -> list[int]:
        """``count`` distinct indices below ``population`` (a partial Fisher-Yates shuffle)."""
        order = list(range(population))
        for i in range(count):
            j = i + min(int(self.uniform() * (population - i)), population - i - 1)
            order[i], order[j] = order[j], order[i]
        return order[:count]


# -- sentence skeletons -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Word:
    text: str


@dataclass(frozen=True)
class _NounPhrase:
    slot: int  # the head noun's number slot
    modifier: int  # the modifier noun's slot, or -1
    adjectives: int
    subject: bool = False


@dataclass(frozen=True)
class _Verb:
    slot: int  # the number slot it agrees with (in the present tense)
    forms: tuple[str, str, str]
    present: bool


_Piece = _Word | _NounPhrase | _Verb


class _Builder:
    """Grows a sentence skeleton; every noun gets a number slot, filled in afterwards."""

    def __init__(self, draws: _Draws) -> None:
        self.draws = draws
        self.slots = 0

    def slot(self) -> int:
        self.slots += 1
        return self.slots - 1

    def noun_phrase(self, *, modifier: bool, subject: bool = False) -> _NounPhrase:
        head = self.slot()
        modifier_slot = self.slot() if modifier else -1
        adjectives = self.draws.index(_ADJECTIVE_COUNT_WEIGHTS)
        return _NounPhrase(head, modifier_slot, adjectives, subject)

    def adverb(self) -> list[_Piece]:
        return [_Word(self.draws.pick(_ADVERBS))] if self.draws.chance(P_ADVERB) else []

    def verb(self, slot: int, verbs: Sequence[tuple[str, str, str]], present: float) -> _Verb:
        return _Verb(slot, self.draws.pick(verbs), self.draws.chance(present))

    def phrase(self, budget: int) -> tuple[list[_Piece], int, bool]:
        """Grow a noun phrase and its postmodifiers with exactly `budget` >= 1 nouns.

        Returns the pieces, the head's slot and whether the phrase has a postmodifier.
        """
        modifier = budget >= 2 and self.draws.chance(P_MODIFIER)
        head = self.noun_phrase(modifier=modifier)
        rest = budget - 1 - int(modifier)
        if rest > 0:
            post, _ = self.postmodifier(head.slot, rest)
            return [head, *post], head.slot, True
        if self.draws.chance(P_INNER_INTRANSITIVE_RC):
            return [head, *self.intransitive_rc(head.slot)], head.slot, True
        return [head], head.slot, False

    def intransitive_rc(self, head: int) -> list[_Piece]:
        pronoun = self.draws.choose(_SUBJECT_RC_PRONOUNS)
        verb = self.verb(head, _INTRANSITIVE, P_PRESENT)
        return [_Word(pronoun), *self.adverb(), verb]

    def postmodifier(self, head: int, budget: int) -> tuple[list[_Piece], str]:
        """Postmodifiers of the noun in `head` with exactly `budget` nouns, and their tag."""
        if budget == 0:
            if self.draws.chance(P_INTRANSITIVE_RC):
                return self.intransitive_rc(head), "subject_rc"
            return [], "simple"
        kind = self.draws.choose(_POSTMODIFIER_WEIGHTS)
        if kind == "pp":
            inner, _, nested = self.phrase(budget)
            preposition = _Word(self.draws.pick(_PREPOSITIONS))
            return [preposition, *inner], "nested_pp" if nested else "pp"
        if kind == "object_rc":
            relative = self.draws.choose(_OBJECT_RC_PRONOUNS)
            pieces: list[_Piece] = [] if relative is None else [_Word(relative)]
            after = 0
            if budget >= 2 and self.draws.chance(P_PP_AFTER_RC_VERB):
                after = 1 + int(self.draws.uniform() * (budget - 1))
            inner, inner_head, _ = self.phrase(budget - after)
            pieces += [*inner, *self.adverb(), self.verb(inner_head, _TRANSITIVE, P_PRESENT)]
            if after:
                tail, _, _ = self.phrase(after)
                pieces += [_Word(self.draws.pick(_PREPOSITIONS)), *tail]
            return pieces, "object_rc"
        pronoun = self.draws.choose(_SUBJECT_RC_PRONOUNS)
        verb = self.verb(head, _TRANSITIVE, P_PRESENT)
        inner, _, _ = self.phrase(budget)
        return [_Word(pronoun), *self.adverb(), verb, *inner], "subject_rc"

    def opening(self) -> tuple[list[_Piece], str]:
        """Material before the subject (its nouns are never attractors), and its tag."""
        kind = self.draws.choose(_OPENING_WEIGHTS)
        if kind == "adverbial":
            return [_Word(word) for word in self.draws.pick(_OPENING_ADVERBIALS)], kind
        if kind == "pp":
            phrase = self.noun_phrase(modifier=self.draws.chance(P_MODIFIER))
            return [_Word(self.draws.pick(_PREPOSITIONS)), phrase, _Word(",")], kind
        if kind == "subordinate":
            phrase = self.noun_phrase(modifier=self.draws.chance(P_MODIFIER))
            verb = self.verb(phrase.slot, _INTRANSITIVE, P_OPENING_PRESENT)
            return [_Word(self.draws.pick(_SUBORDINATORS)), phrase, verb, _Word(",")], kind
        if kind == "complement":
            phrase = self.noun_phrase(modifier=self.draws.chance(P_MODIFIER))
            verb = self.verb(phrase.slot, _COMPLEMENT_VERBS, P_OPENING_PRESENT)
            return [phrase, verb, _Word("that")], kind
        return [], kind


@dataclass(frozen=True)
class _Sentence:
    tokens: list[str]
    subject: int
    attractors: int
    intervening: int
    structure: str
    opening: str


def _noun(draws: _Draws, number: int, *, modifier: bool = False) -> str:
    """Pick a noun of the given number; modifiers are mostly proper nouns and rare words."""
    if modifier and number == 0:
        kind = draws.choose(_SINGULAR_MODIFIERS)
        return draws.pick(_SINGULAR_NOUNS) if kind is None else kind
    if modifier:
        return "NNS" if draws.chance(0.2) else draws.pick(_PLURAL_NOUNS)
    if draws.chance(P_PLACEHOLDER):
        return "NN" if number == 0 else "NNS"
    return draws.pick(_SINGULAR_NOUNS if number == 0 else _PLURAL_NOUNS)


def _render_noun_phrase(
    draws: _Draws, phrase: _NounPhrase, numbers: list[int], out: list[str]
) -> None:
    number = numbers[phrase.slot]
    if number == 0 and phrase.modifier < 0 and phrase.adjectives == 0 and draws.chance(P_PROPER):
        out.append("NNP")
        return
    determiner = draws.choose(_SINGULAR_DETERMINERS if number == 0 else _PLURAL_DETERMINERS)
    words: list[str] = []
    for _ in range(phrase.adjectives):
        adjective = draws.pick(_ADJECTIVES)
        if adjective in words:  # no "the big big key"
            adjective = _ADJECTIVES[(_ADJECTIVES.index(adjective) + 1) % len(_ADJECTIVES)]
        words.append(adjective)
    if phrase.modifier >= 0:
        words.append(_noun(draws, numbers[phrase.modifier], modifier=True))
    words.append(_noun(draws, number))
    if determiner is not None:
        out.append("an" if determiner == "a" and words[0][0] in "aeiou" else determiner)
    out.extend(words)


def _sentence(draws: _Draws, label: int) -> _Sentence:
    """Draw one sentence whose subject has number `label`."""
    attractors = draws.index(_ATTRACTOR_WEIGHTS)
    same = draws.index(_SAME_NUMBER_WEIGHTS)
    builder = _Builder(draws)
    opening, opening_tag = builder.opening()
    return _finish_sentence(
        draws, label, builder, opening, attractors=attractors, same=same, opening=opening_tag
    )


def _finish_sentence(
    draws: _Draws,
    label: int,
    builder: _Builder,
    before: list[_Piece],
    *,
    attractors: int,
    same: int,
    opening: str,
) -> _Sentence:
    """Draw the rest of a sentence after the material `before` the subject, and its words.

    The subject (number `label`), its postmodifier with ``attractors + same`` nouns and
    an adverb; the nouns' numbers, free before the subject and, after it, `attractors`
    drawn ones of the opposite number; then the words, some replaced by UNK. `opening`
    names the material before the subject.
    """
    subject = builder.noun_phrase(modifier=draws.chance(P_MODIFIER), subject=True)
    first = builder.slots  # the intervening nouns' slots start here
    post, structure = builder.postmodifier(subject.slot, attractors + same)
    if builder.slots - first != attractors + same:
        msg = "internal error: the postmodifier has the wrong number of nouns"
        raise AssertionError(msg)
    pieces: list[_Piece] = [*before, subject, *post, *builder.adverb()]

    numbers = [int(draws.chance(0.5)) for _ in range(builder.slots)]
    numbers[subject.slot] = label
    opposite = set(draws.sample(attractors + same, attractors))
    for offset in range(attractors + same):
        numbers[first + offset] = 1 - label if offset in opposite else label

    tokens = ["[CLS]"]
    position = -1
    for piece in pieces:
        if isinstance(piece, _Word):
            tokens.append(piece.text)
        elif isinstance(piece, _Verb):
            tokens.append(piece.forms[numbers[piece.slot]] if piece.present else piece.forms[2])
        else:
            _render_noun_phrase(draws, piece, numbers, tokens)
            if piece.subject:
                position = len(tokens) - 1
    for index in range(1, len(tokens)):
        word = tokens[index]
        if _LEXICON[word] not in ("noun", "punctuation") and draws.chance(P_UNKNOWN):
            tokens[index] = "[UNK]"
    return _Sentence(
        tokens=tokens,
        subject=position,
        attractors=attractors,
        intervening=attractors + same,
        structure=structure,
        opening=opening,
    )


# -- the data set -----------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class AgreementData:
    """Sentence prefixes for verb number prediction, padded into one batch.

    Position 0 of every row is ``[CLS]``; the verb is not part of the input. All arrays
    are read-only.

    Attributes
    ----------
    ids : ndarray of int64, shape (N, n)
        Token ids (indices into `vocabulary`), right-padded with ``PAD`` (0); ``n`` is
        the longest sentence of the set.
    mask : ndarray of bool, shape (N, n)
        True for real tokens, False for padding.
    labels : ndarray of int64, shape (N,)
        The number of the verb, i.e. of the head of its subject: 0 singular, 1 plural.
    subject : ndarray of int64, shape (N,)
        Position of the subject's head noun (``[CLS]`` is position 0).
    attractors : ndarray of int64, shape (N,)
        Number of nouns of the opposite number between the subject and the verb.
    intervening : ndarray of int64, shape (N,)
        Number of all nouns between the subject and the verb (attractors included).
    structure : ndarray of str, shape (N,)
        The subject's postmodifier, one of :data:`STRUCTURES`.
    opening : ndarray of str, shape (N,)
        The material before the subject, one of :data:`OPENINGS`.
    vocabulary : tuple of str
        The words; an id is an index (:data:`VOCABULARY`).
    replacement : int
        Id of ``[UNK]``, the blank-out replacement token.

    Examples
    --------
    >>> from attnflow_lab.agreement.agreement import agreement_data
    >>> data = agreement_data(4, seed=0)
    >>> len(data), data.ids.shape[0], data.vocabulary[data.replacement]
    (4, 4, '[UNK]')
    >>> data.words(0)[0]
    '[CLS]'
    """

    ids: NDArray[np.int64]
    mask: NDArray[np.bool_]
    labels: NDArray[np.int64]
    subject: NDArray[np.int64]
    attractors: NDArray[np.int64]
    intervening: NDArray[np.int64]
    structure: NDArray[np.str_]
    opening: NDArray[np.str_]
    vocabulary: tuple[str, ...] = VOCABULARY
    replacement: int = UNK

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def lengths(self) -> NDArray[np.int64]:
        """Number of real tokens of each sentence, ``[CLS]`` included."""
        lengths: NDArray[np.int64] = self.mask.sum(axis=1, dtype=np.int64)
        return lengths

    @property
    def noun_number(self) -> NDArray[np.int8]:
        """Number of each vocabulary word: 0 singular noun, 1 plural noun, -1 not a noun."""
        extra = len(self.vocabulary) - len(NOUN_NUMBER)
        if extra <= 0:
            return NOUN_NUMBER
        return np.concatenate([NOUN_NUMBER, np.full(extra, -1, dtype=np.int8)])

    def words(self, index: int, /) -> list[str]:
        """Return the tokens of sentence `index`, ``[CLS]`` first, without padding.

        Parameters
        ----------
        index : int
            The sentence.

        Returns
        -------
        list of str
            One word per position of the model's input.

        Examples
        --------
        >>> from attnflow_lab.agreement.agreement import agreement_data
        >>> data = agreement_data(2, seed=0)
        >>> len(data.words(1)) == int(data.mask[1].sum())
        True
        """
        row = self.ids[index][self.mask[index]]
        return [self.vocabulary[int(token)] for token in row]

    def text(self, index: int, /) -> str:
        """Sentence `index` as a string, without ``[CLS]``.

        Parameters
        ----------
        index : int
            The sentence.

        Returns
        -------
        str
            The words, separated by spaces.

        Examples
        --------
        >>> from attnflow_lab.agreement.agreement import agreement_data
        >>> agreement_data(1, seed=0).text(0).startswith("[CLS]")
        False
        """
        return " ".join(self.words(index)[1:])

    def take(self, indices: ArrayLike, /) -> AgreementData:
        """Select the sentences at `indices` (an index array or a boolean mask), re-padded.

        Parameters
        ----------
        indices : array_like of int or bool
            Which sentences, in which order.

        Returns
        -------
        AgreementData
            A new set; its width is the longest of the chosen sentences.

        Examples
        --------
        >>> from attnflow_lab.agreement.agreement import agreement_data
        >>> data = agreement_data(10, seed=0)
        >>> len(data.take(data.attractors == 0)) == int((data.attractors == 0).sum())
        True
        """
        index = np.asarray(indices)
        if index.dtype == np.bool_:
            index = np.flatnonzero(index)
        width = int(self.lengths[index].max(initial=1))
        return _frozen(
            ids=self.ids[index, :width],
            mask=self.mask[index, :width],
            labels=self.labels[index],
            subject=self.subject[index],
            attractors=self.attractors[index],
            intervening=self.intervening[index],
            structure=self.structure[index],
            opening=self.opening[index],
            vocabulary=self.vocabulary,
            replacement=self.replacement,
        )


def _frozen(
    *,
    vocabulary: tuple[str, ...] = VOCABULARY,
    replacement: int = UNK,
    **arrays: NDArray[np.generic],
) -> AgreementData:
    copies = {name: np.array(value) for name, value in arrays.items()}
    for value in copies.values():
        value.setflags(write=False)
    return AgreementData(**copies, vocabulary=vocabulary, replacement=replacement)


def with_end_token(data: AgreementData, /) -> AgreementData:
    """Write ``<eos>`` at the verb position of every sentence: the paper code's input.

    Abnar & Zuidema's code for Tables 1-2 (``samiraabnar/Reflect``, notebook
    ``attention_flow.ipynb``, on Linzen's ``word_sv_agreement_vp`` task) feeds the
    sentence up to the verb with ``<eos>`` written where the verb was, after a ``<bos>``
    token that serves as CLS. Here ``[CLS]`` (position 0, whose final state is
    classified) plays ``<bos>``'s role, and this function appends ``<eos>``
    (:data:`EOS`) after each sentence's last token. Blank-out in that code leaves
    ``<eos>`` out and scores it 0 (``blank_out(..., last_token="zero")``).

    Parameters
    ----------
    data : AgreementData
        Sentences without ``<eos>`` (vocabulary :data:`VOCABULARY`).

    Returns
    -------
    AgreementData
        The same sentences one token longer, with vocabulary :data:`EOS_VOCABULARY`;
        labels, subjects and the other annotations are unchanged.

    Raises
    ------
    ValueError
        If `data` already uses another vocabulary (e.g. it already ends with ``<eos>``).

    References
    ----------
    Abnar & Zuidema (2020), §2 and Tables 1-2; the code at ``samiraabnar/Reflect``
    commit ``d28ddd5``.

    Examples
    --------
    >>> from attnflow_lab.agreement.agreement import agreement_data, with_end_token
    >>> data = with_end_token(agreement_data(2, seed=0))
    >>> data.words(0)[0], data.words(0)[-1]
    ('[CLS]', '<eos>')
    """
    if data.vocabulary != VOCABULARY:
        msg = (
            "`data` must use the plain vocabulary VOCABULARY (sentences without <eos>); "
            f"got a vocabulary of {len(data.vocabulary)} words ending with "
            f"{data.vocabulary[-1]!r}. Pass the data as agreement_data() made it."
        )
        raise ValueError(msg)
    count, width = data.ids.shape
    lengths = data.lengths
    ids = np.zeros((count, width + 1), dtype=np.int64)
    ids[:, :width] = data.ids
    ids[np.arange(count), lengths] = EOS
    mask = np.zeros((count, width + 1), dtype=np.bool_)
    mask[:, :width] = data.mask
    mask[np.arange(count), lengths] = True
    return _frozen(
        ids=ids,
        mask=mask,
        labels=data.labels,
        subject=data.subject,
        attractors=data.attractors,
        intervening=data.intervening,
        structure=data.structure,
        opening=data.opening,
        vocabulary=EOS_VOCABULARY,
        replacement=data.replacement,
    )


def _generate(
    count: int,
    rng: np.random.Generator,
    *,
    max_length: int,
    exclude: frozenset[bytes],
    draws: _Draws | None = None,
    sentence_of: Callable[[_Draws, int], _Sentence] = _sentence,
) -> AgreementData:
    """Draw `count` distinct sentences of at most `max_length` tokens, none in `exclude`.

    `draws` (default: uniform word choices from `rng`) and `sentence_of` (default: this
    module's grammar) are the sentence generator's; `rng` also shuffles the classes.
    """
    draws = _Draws(rng) if draws is None else draws
    sentences: list[_Sentence] = []
    rows: list[NDArray[np.int64]] = []
    while len(sentences) < count:
        label = len(sentences) % 2  # balanced classes; the order is shuffled below
        sentence = sentence_of(draws, label)
        if len(sentence.tokens) > max_length:
            continue
        row = np.array([_ID[word] for word in sentence.tokens], dtype=np.int64)
        if row.tobytes() in exclude:
            continue
        sentences.append(sentence)
        rows.append(row)
    order = rng.permutation(count)
    width = max((len(row) for row in rows), default=1)
    ids = np.zeros((count, width), dtype=np.int64)
    mask = np.zeros((count, width), dtype=np.bool_)
    for target, source in enumerate(order.tolist()):
        ids[target, : len(rows[source])] = rows[source]
        mask[target, : len(rows[source])] = True
    chosen = [sentences[i] for i in order.tolist()]
    return _frozen(
        ids=ids,
        mask=mask,
        labels=np.array([i % 2 for i in order.tolist()], dtype=np.int64),
        subject=np.array([s.subject for s in chosen], dtype=np.int64),
        attractors=np.array([s.attractors for s in chosen], dtype=np.int64),
        intervening=np.array([s.intervening for s in chosen], dtype=np.int64),
        structure=np.array([s.structure for s in chosen], dtype=np.str_),
        opening=np.array([s.opening for s in chosen], dtype=np.str_),
    )


def _sentence_keys(data: AgreementData) -> frozenset[bytes]:
    return frozenset(
        row[: int(length)].tobytes()
        for row, length in zip(data.ids, data.lengths.tolist(), strict=True)
    )


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
        msg = f"`{name}` must be an int of at least {minimum}; got {value!r}."
        raise ValueError(msg)
    return int(value)


def agreement_data(
    n_sentences: int,
    /,
    *,
    seed: int | np.random.SeedSequence,
    max_length: int = DEFAULT_MAX_LENGTH,
    exclude: AgreementData | None = None,
) -> AgreementData:
    """Generate `n_sentences` subject-verb agreement prefixes.

    Parameters
    ----------
    n_sentences : int
        How many sentences. Half of them (rounded up) have a singular subject.
    seed : int or numpy.random.SeedSequence
        Seed of ``numpy.random.default_rng``; the same seed gives the same arrays.
    max_length : int, default DEFAULT_MAX_LENGTH
        Longest sentence in tokens, ``[CLS]`` included; longer draws are drawn again.
        At least 16.
    exclude : AgreementData, optional
        Sentences that must not occur: a draw equal to one of them is drawn again (so
        a test set never repeats a training sentence verbatim).

    Returns
    -------
    AgreementData
        The sentences in random order, with their labels and ground truth.

    Raises
    ------
    ValueError
        If `n_sentences` is negative or `max_length` is too small.

    See Also
    --------
    agreement_split : Disjoint training and test sets.

    References
    ----------
    Linzen, Dupoux & Goldberg (2016), TACL 4; Abnar & Zuidema (2020), §2.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow_lab.agreement.agreement import NOUN_NUMBER, agreement_data
    >>> data = agreement_data(100, seed=0)
    >>> int(data.labels.sum())  # balanced
    50
    >>> nouns = data.ids[np.arange(100), data.subject]
    >>> bool((NOUN_NUMBER[nouns] == data.labels).all())
    True
    >>> bool((agreement_data(100, seed=0).ids == data.ids).all())  # reproducible
    True
    """
    count = _check_int("n_sentences", n_sentences, 0)
    length = _check_int("max_length", max_length, 16)
    keys = frozenset() if exclude is None else _sentence_keys(exclude)
    return _generate(count, np.random.default_rng(seed), max_length=length, exclude=keys)


def agreement_split(
    n_train: int,
    n_test: int,
    /,
    *,
    seed: int,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> tuple[AgreementData, AgreementData]:
    """Generate a training set and a test set that shares no sentence with it.

    The training set is ``agreement_data(n_train, seed=seed)``; the test set is drawn
    from an independent stream (``numpy.random.SeedSequence(seed).spawn(1)``) with every
    training sentence excluded, so no test sentence occurs verbatim in training (short,
    common sentences are therefore slightly rarer in the test set).

    Parameters
    ----------
    n_train, n_test : int
        Sizes of the two sets.
    seed : int
        The seed of both.
    max_length : int, default DEFAULT_MAX_LENGTH
        Longest sentence in tokens, ``[CLS]`` included.

    Returns
    -------
    train, test : AgreementData
        The two sets.

    Raises
    ------
    ValueError
        On a negative size or a too small `max_length`.

    References
    ----------
    Abnar & Zuidema (2020), §2 (training and test sets of the agreement task).

    Examples
    --------
    >>> from attnflow_lab.agreement.agreement import agreement_split
    >>> train, test = agreement_split(200, 50, seed=0)
    >>> seen = {train.text(i) for i in range(len(train))}
    >>> any(test.text(i) in seen for i in range(len(test)))
    False
    """
    train = agreement_data(n_train, seed=seed, max_length=max_length)
    (test_seed,) = np.random.SeedSequence(seed).spawn(1)
    test = agreement_data(n_test, seed=test_seed, max_length=max_length, exclude=train)
    return train, test


def encode(words: str | Iterable[str], /) -> NDArray[np.int64]:
    """Turn words into the model's input ids, ``[CLS]`` first.

    Parameters
    ----------
    words : str or iterable of str
        A space-separated string or a sequence of words, without ``[CLS]``; words
        outside the vocabulary become ``[UNK]``.

    Returns
    -------
    ndarray of int64, shape (1 + len(words),)
        The ids.

    Examples
    --------
    >>> from attnflow_lab.agreement.agreement import decode, encode
    >>> ids = encode("the key to the cabinets")
    >>> decode(ids)
    ['[CLS]', 'the', 'key', 'to', 'the', 'cabinets']
    """
    tokens = words.split() if isinstance(words, str) else list(words)
    return np.array([CLS, *(_ID.get(word, UNK) for word in tokens)], dtype=np.int64)


def decode(ids: ArrayLike, /) -> list[str]:
    """Turn ids back into words, leaving out padding.

    Parameters
    ----------
    ids : array_like of int
        Token ids, e.g. a row of :attr:`AgreementData.ids`.

    Returns
    -------
    list of str
        The words (``[CLS]`` included when present).

    Examples
    --------
    >>> from attnflow_lab.agreement.agreement import decode
    >>> decode([1, 2, 0, 0])
    ['[CLS]', '[UNK]']
    """
    return [VOCABULARY[int(token)] for token in np.asarray(ids).ravel() if int(token) != PAD]
