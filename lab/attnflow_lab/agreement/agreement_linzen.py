"""Agreement prefixes matched to the published statistics of Linzen et al.'s data.

Abnar & Zuidema (2020) trained and evaluated on Linzen, Dupoux & Goldberg's (2016)
``word_sv_agreement_vp`` data (the ``agr_50_mostcommon_10K.tsv`` release: Wikipedia
sentences of at most 50 words, the 10,000 most common words kept and rarer ones written
as their part-of-speech tag). No package of PyPI, npm or Debian ships that file (see
``docs/reproduction.md``, *What is not measured*), so this module generates a set from
the grammar of :mod:`attnflow_lab.agreement.agreement` whose *data-shaped* statistics
follow the published ones instead of the grammar's defaults:

* **Attractors.** The number of attractors (nouns of the other number between subject
  and verb) is drawn with the frequencies of Linzen's test set as Kuncoro et al. (2018,
  Table 1) count them: 1,146,330 sentences with none, 52,599 with one, 9,380 with two,
  2,051 with three, 561 with four and 159 with five (of 1,211,080, the 90 % test split of
  Linzen's 1.35 million; the grammar caps at four, so four here is "four or more").
  That is 94.7 % without an attractor, where :func:`~attnflow_lab.agreement.agreement.
  agreement_data` draws 52 %.
* **Length.** Wikipedia prefixes are longer and more varied than the grammar's (mean 11.6
  tokens with ``[CLS]``): here 0 to 5 opening clauses are chained before the subject
  (their number drawn with weights ``LONG_OPENING_WEIGHTS``) and the subject carries 0 to
  6 same-number intervening nouns (``LONG_SAME_NUMBER_WEIGHTS``), up to Linzen's cap of 50
  words (``LINZEN_MAX_LENGTH`` tokens with ``[CLS]``). Linzen et al. publish no
  histogram of prefix lengths that could be read here; the weights were set, before any
  model was trained, for a mean of about 17 tokens with ``[CLS]`` and ``<eos>`` (17.8 on
  40,000 sentences), the length (with ``<bos>`` and ``<eos>``) of the one validation
  sentence whose shape the authors' log prints.
* **Word frequencies.** Within each word class, words are drawn with Zipf's law
  (probability proportional to ``1 / rank``, the rank being the word's place in the
  grammar's list) instead of uniformly: a Zipf-shaped profile within each class, not a
  real vocabulary's (the 10 most frequent tokens are 40 % of all tokens, 37 % in the
  grammar). The vocabulary itself is the grammar's (280 words), so models and the
  ``<eos>`` input (:func:`~attnflow_lab.agreement.agreement.with_end_token`) work
  unchanged.

The sentences are :class:`~attnflow_lab.agreement.agreement.AgreementData`, with the
same annotations (subject position, attractors, intervening nouns, structure, opening:
the first opening clause's tag).

References
----------
Linzen, T., Dupoux, E. & Goldberg, Y. (2016). Assessing the ability of LSTMs to learn
syntax-sensitive dependencies. TACL 4, 521-535.

Kuncoro, A., Dyer, C., Hale, J., Yogatama, D., Clark, S. & Blunsom, P. (2018). LSTMs can
learn syntax-sensitive dependencies well, but modeling structure makes them better.
ACL 2018, 1426-1436.

Abnar, S. & Zuidema, W. (2020). Quantifying attention flow in transformers. ACL 2020.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from attnflow_lab.agreement import agreement as _agreement
from attnflow_lab.agreement.agreement import AgreementData

__all__ = [
    "LINZEN_ATTRACTOR_COUNTS",
    "LINZEN_MAX_LENGTH",
    "LONG_OPENING_WEIGHTS",
    "LONG_SAME_NUMBER_WEIGHTS",
    "linzen_matched_data",
]

_T = TypeVar("_T")

LINZEN_ATTRACTOR_COUNTS: tuple[int, ...] = (1_146_330, 52_599, 9_380, 2_051, 561 + 159)
"""Sentences of Linzen's test set with 0, 1, 2, 3 and 4 or more attractors (Kuncoro et
al. 2018, Table 1)."""

LINZEN_MAX_LENGTH = 51
"""Longest prefix in tokens with ``[CLS]``: Linzen et al. keep sentences of at most 50
words."""

LONG_OPENING_WEIGHTS: tuple[float, ...] = (0.25, 0.25, 0.20, 0.12, 0.10, 0.08)
"""Weights of 0 to 5 chained opening clauses before the subject."""

LONG_SAME_NUMBER_WEIGHTS: tuple[float, ...] = (0.35, 0.25, 0.15, 0.10, 0.07, 0.05, 0.03)
"""Weights of 0 to 6 intervening nouns of the subject's own number."""


class _ZipfDraws(_agreement._Draws):
    """The grammar's draws, with `pick` following Zipf's law over the options' order."""

    def __init__(self, rng: np.random.Generator) -> None:
        super().__init__(rng)
        self._cumulative: dict[int, list[float]] = {}

    def pick(self, options: Sequence[_T]) -> _T:
        size = len(options)
        cumulative = self._cumulative.get(size)
        if cumulative is None:
            cumulative = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(size)))
            self._cumulative[size] = cumulative
        index = bisect.bisect_right(cumulative, self.uniform() * cumulative[-1])
        return options[min(index, size - 1)]


def _long_sentence(draws: _agreement._Draws, label: int) -> _agreement._Sentence:
    """One sentence whose subject has number `label`, with Linzen's attractor profile."""
    attractors = draws.index([float(c) for c in LINZEN_ATTRACTOR_COUNTS])
    same = draws.index(LONG_SAME_NUMBER_WEIGHTS)
    openings = draws.index(LONG_OPENING_WEIGHTS)
    builder = _agreement._Builder(draws)
    opening: list[_agreement._Piece] = []
    tags: list[str] = []
    while len(tags) < openings:
        pieces, tag = builder.opening()
        if tag != "none":
            opening += pieces
            tags.append(tag)
    return _agreement._finish_sentence(
        draws,
        label,
        builder,
        opening,
        attractors=attractors,
        same=same,
        opening=tags[0] if tags else "none",
    )


def linzen_matched_data(
    n_sentences: int,
    /,
    *,
    seed: int | np.random.SeedSequence,
    exclude: AgreementData | None = None,
) -> AgreementData:
    r"""Generate `n_sentences` agreement prefixes with Linzen's attractor and length profile.

    The attractor count of each sentence is drawn from the frequencies of Linzen et al.'s
    test set (:data:`LINZEN_ATTRACTOR_COUNTS`, 94.7 % with none), sentences are
    lengthened by chained opening clauses and same-number intervening nouns up to 50
    words (:data:`LINZEN_MAX_LENGTH` tokens with ``[CLS]``), and words are drawn with
    Zipf's law within each class, :math:`P(\text{rank } r) \propto 1 / r`. Everything
    else is :func:`~attnflow_lab.agreement.agreement.agreement_data`'s grammar.

    Parameters
    ----------
    n_sentences : int
        How many sentences; the classes alternate, so they are balanced.
    seed : int or numpy.random.SeedSequence
        Seed of ``numpy.random.default_rng``; the same seed gives the same arrays.
    exclude : AgreementData, optional
        Sentences that must not occur (a test set's, when drawing training sentences).

    Returns
    -------
    AgreementData
        The sentences in random order with their labels and ground truth, in the
        grammar's vocabulary (:data:`~attnflow_lab.agreement.agreement.VOCABULARY`).

    Raises
    ------
    ValueError
        If `n_sentences` is not an int of at least 0.

    References
    ----------
    Linzen, Dupoux & Goldberg (2016), TACL 4; Kuncoro et al. (2018), ACL, Table 1.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow_lab.agreement.agreement import NOUN_NUMBER
    >>> from attnflow_lab.agreement.agreement_linzen import linzen_matched_data
    >>> data = linzen_matched_data(200, seed=0)
    >>> int(data.labels.sum()), bool((data.lengths <= 51).all())
    (100, True)
    >>> nouns = data.ids[np.arange(200), data.subject]
    >>> bool((NOUN_NUMBER[nouns] == data.labels).all())
    True
    """
    count = _agreement._check_int("n_sentences", n_sentences, 0)
    keys = frozenset() if exclude is None else _agreement._sentence_keys(exclude)
    rng = np.random.default_rng(seed)
    return _agreement._generate(
        count,
        rng,
        max_length=LINZEN_MAX_LENGTH,
        exclude=keys,
        draws=_ZipfDraws(rng),
        sentence_of=_long_sentence,
    )
