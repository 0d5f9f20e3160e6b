"""Text a model supplies (token strings, class names), made safe to put in a heading.

A model's vocabulary or label names are not the caller's text: a hostile or careless
checkpoint can name a class ``<img src=x onerror=...>`` or a token 5,000 characters long,
or hide right-to-left overrides in it. Escaping keeps such text from running in a page;
in a title or a heading it should also neither take over the line nor pass for the page's
own words. :func:`model_text` leaves ordinary labels as they are, and shortens and marks
any other: quoted (control and invisible characters escaped) after the words "model text".
"""

from __future__ import annotations

__all__ = ["MAX_LABEL", "model_text"]

MAX_LABEL = 32
"""The most characters of a model-supplied label shown in a heading."""
_MARKUP = frozenset('<>&"`')


def is_plain(text: str, *, limit: int = MAX_LABEL) -> bool:
    """Whether `text` is short, printable and free of markup characters."""
    return len(text) <= limit and text.isprintable() and not _MARKUP.intersection(text)


def model_text(text: str, *, limit: int = MAX_LABEL) -> str:
    r"""Return `text` for a heading: as it is if plain, else shortened and marked.

    Parameters
    ----------
    text : str
        A token's or a class's text, as the model supplies it.
    limit : int
        The most characters shown.

    Returns
    -------
    str
        `text` itself when it is at most `limit` printable characters without markup
        (``<>&"`````), else ``model text '...'``: its first characters, quoted, with
        control and invisible characters escaped.

    Examples
    --------
    >>> from attnflow._model_text import model_text
    >>> model_text("positive")
    'positive'
    >>> print(model_text("<img src=x onerror=alert(1)>" * 3))
    model text '<img src=x onerror=alert(1)><im…'
    >>> print(model_text("evil\u202egnp.exe"))
    model text 'evil\u202egnp.exe'
    """
    if is_plain(text, limit=limit):
        return text
    short = text if len(text) <= limit else text[: limit - 1] + "\u2026"
    return f"model text {short!r}"
