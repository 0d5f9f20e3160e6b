"""Spans: scores summed over words, sentences or character ranges of a text.

A span is a set of token positions. :func:`token_spans` turns ``"words"``,
``"sentences"`` or character ranges of the text into spans through the tokenizer's
character offsets (a token belongs to every span its characters overlap), and
:func:`sum_spans` sums the scores of each span's tokens. Token ranges given directly need
no text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ._namespace import array_namespace

__all__ = ["Span", "check_token_spans", "sum_spans", "token_spans"]

#: A span: its label and its token positions.
Span = tuple[str, tuple[int, ...]]

#: A word: letters and digits (with inner apostrophes), or one other visible character.
_WORD = re.compile(r"\w+(?:['\u2019]\w+)*|[^\w\s]")
#: A sentence: up to and including its final ., ! or ? (and closing quotes), or the end.
_SENTENCE = re.compile(r"\S(?:.*?(?:[.!?]+['\"\u201d\u2019)]*(?=\s|$))|.+)", re.DOTALL)


def _character_ranges(text: str, spans: object) -> list[tuple[int, int]]:
    if spans == "words":
        return [m.span() for m in _WORD.finditer(text)]
    if spans == "sentences":
        return [(m.start(), m.start() + len(m.group().rstrip())) for m in _SENTENCE.finditer(text)]
    if isinstance(spans, str) or not isinstance(spans, Sequence) or not spans:
        msg = (
            '`spans` must be "words", "sentences" or a non-empty sequence of character '
            f"ranges (start, end) of the text; got {spans!r}."
        )
        raise ValueError(msg)
    ranges = []
    for span in spans:
        if (
            not isinstance(span, Sequence)
            or isinstance(span, str)
            or len(span) != 2
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in span)
        ):
            msg = f"`spans` must hold character ranges (start, end), pairs of int; got {span!r}."
            raise ValueError(msg)
        start, end = int(span[0]), int(span[1])
        if not 0 <= start < end <= len(text):
            msg = (
                f"`spans` must hold character ranges inside the text (0 <= start < end <= "
                f"{len(text)}); got ({start}, {end})."
            )
            raise ValueError(msg)
        ranges.append((start, end))
    return ranges


def token_spans(text: str, offsets: Sequence[tuple[int, int]], spans: object) -> list[Span]:
    """Resolve `spans` of `text` into token positions through the tokens' character offsets.

    Parameters
    ----------
    text : str
        The text the tokens were cut from.
    offsets : sequence of (int, int)
        Each token's character range ``[start, end)`` in `text` (a Hugging Face fast
        tokenizer's ``offset_mapping``); ``(0, 0)`` for a token with no characters (special
        tokens), which belongs to no span.
    spans : "words", "sentences" or sequence of (int, int)
        Words (runs of letters and digits, each other visible character alone),
        sentences (up to a final ``.``, ``!`` or ``?``), or character ranges ``[start,
        end)`` of the text.

    Returns
    -------
    list of (str, tuple of int)
        Each span's text and the tokens whose characters overlap it.

    Raises
    ------
    ValueError
        On a span outside the text, a span that covers no token, or a malformed `spans`.

    Examples
    --------
    >>> from attnflow._spans import token_spans
    >>> text = "Hello world. Bye"
    >>> offsets = [(0, 3), (3, 5), (5, 11), (11, 12), (12, 16)]  # "Hel" "lo" " world" "." " Bye"
    >>> token_spans(text, offsets, "words")
    [('Hello', (0, 1)), ('world', (2,)), ('.', (3,)), ('Bye', (4,))]
    >>> token_spans(text, offsets, "sentences")
    [('Hello world.', (0, 1, 2, 3)), ('Bye', (4,))]
    >>> token_spans(text, offsets, [(6, 16)])
    [('world. Bye', (2, 3, 4))]
    """
    out: list[Span] = []
    for start, end in _character_ranges(text, spans):
        tokens = tuple(i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > start)
        if not tokens:
            msg = (
                f"The span ({start}, {end}) {text[start:end]!r} covers no token of the text; "
                "give ranges that hold at least one token's characters."
            )
            raise ValueError(msg)
        out.append((text[start:end], tokens))
    return out


def check_token_spans(spans: object, n: int) -> list[Span]:
    """Check token spans: a sequence of token ranges ``(start, end)`` or of position lists.

    Examples
    --------
    >>> from attnflow._spans import check_token_spans
    >>> check_token_spans([(0, 2), [4]], 5)
    [('0:2', (0, 1)), ('4', (4,))]
    """
    if isinstance(spans, str) or not isinstance(spans, Sequence) or not spans:
        msg = (
            "`spans` must be a non-empty sequence of token ranges (start, end) or of lists of "
            f"token positions; got {spans!r}. Words and sentences need the text: use "
            "explain_text(...).aggregate('words')."
        )
        raise ValueError(msg)
    out: list[Span] = []
    for span in spans:
        items = list(span) if isinstance(span, Sequence) and not isinstance(span, str) else None
        if not items or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            msg = (
                f"`spans` must hold token ranges (start, end) or lists of positions; got {span!r}."
            )
            raise ValueError(msg)
        if isinstance(span, tuple) and len(items) == 2:
            start, end = items
            if not 0 <= start < end <= n:
                msg = f"`spans` token range must have 0 <= start < end <= {n}; got {span!r}."
                raise ValueError(msg)
            out.append((f"{start}:{end}", tuple(range(start, end))))
            continue
        if not all(0 <= i < n for i in items):
            msg = f"`spans` must hold positions of the {n} tokens (0 to {n - 1}); got {span!r}."
            raise ValueError(msg)
        out.append((",".join(map(str, items)), tuple(sorted(set(items)))))
    return out


def sum_spans(scores: Any, spans: Sequence[Span], /) -> Any:
    r"""Sum the scores over each span's tokens: ``(..., n)`` to ``(..., s)``.

    .. math:: S_{\ldots, j} = \sum_{i \in \text{span}_j} s_{\ldots, i}

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._spans import sum_spans
    >>> sum_spans(np.array([0.25, 0.25, 0.125, 0.375]), [("a", (0, 1)), ("b", (3,))]).tolist()
    [0.5, 0.375]
    """
    xp = array_namespace(scores)
    n = int(scores.shape[-1])
    columns = []
    positions = xp.arange(n, device=getattr(scores, "device", None))
    for _, tokens in spans:
        member = xp.zeros(n, dtype=xp.bool, device=getattr(scores, "device", None))
        for i in tokens:
            member = member | (positions == i)
        columns.append(xp.sum(xp.where(member, scores, xp.zeros_like(scores)), axis=-1))
    return xp.stack(columns, axis=-1)
