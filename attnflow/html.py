"""Token attributions as self-contained HTML: no plotting library, no script, no CDN.

:class:`TokenView` colours each token of a sentence by its score (white to one hue, by
value / largest value) and shows the value when the pointer rests on a token. Several
rows (raw attention, rollout, flow) share one colour scale. A view displays itself in
Jupyter-style notebooks (``_repr_html_``) and writes a standalone page with
:meth:`TokenView.save`.
"""

from __future__ import annotations

import html
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .plot import FloatArray, _as_numpy, _check_finite, _check_tokens

__all__ = ["TokenView"]

_HEX_COLOUR = re.compile(r"^#[0-9a-fA-F]{6}$")

_CSS = """\
.attnflow-view { font-family: system-ui, -apple-system, "Segoe UI", sans-serif;
  font-size: 14px; line-height: 2.1; color: #222; }
.attnflow-view .attnflow-title { font-weight: 600; margin-bottom: 0.3em; }
.attnflow-view .attnflow-row { display: flex; align-items: baseline; gap: 0.6em; }
.attnflow-view .attnflow-label { min-width: 5em; color: #555; font-size: 12px;
  text-align: right; }
.attnflow-view .attnflow-tok { position: relative; display: inline-block;
  padding: 0 0.25em; margin: 0 1px; border-radius: 3px; white-space: pre;
  border: 1px solid #e4e4e4; line-height: 1.5; }
.attnflow-view .attnflow-tok:hover { outline: 1px solid #333; }
.attnflow-view .attnflow-tok:hover::after { content: attr(data-value);
  position: absolute; left: 50%; bottom: 110%; transform: translateX(-50%);
  background: #222; color: #fff; font-size: 11px; padding: 0 0.4em;
  border-radius: 3px; white-space: nowrap; pointer-events: none; z-index: 10; }
.attnflow-view .attnflow-scale { font-size: 11px; color: #555; margin-top: 0.3em; }
.attnflow-view .attnflow-bar { display: inline-block; width: 8em; height: 0.8em;
  vertical-align: middle; margin: 0 0.4em; border: 1px solid #ccc; }
"""


def _parse_colour(colour: str) -> tuple[int, int, int]:
    given: object = colour
    if not isinstance(given, str) or not _HEX_COLOUR.match(given):
        msg = f"`color` must be a hex colour '#rrggbb'; got {colour!r}."
        raise ValueError(msg)
    return int(given[1:3], 16), int(given[3:5], 16), int(given[5:7], 16)


class TokenView:
    """Tokens coloured by their scores, as HTML (one or several rows, one colour scale).

    Each token's background goes from white (score 0) to `color` (the largest score of
    all rows); negative scores are shown white. The exact value appears in a tooltip when
    the pointer rests on a token (and in its ``title`` attribute). Tokens are
    HTML-escaped; the output has no scripts and loads nothing.

    Parameters
    ----------
    scores : array of shape (n,), or mapping of str to arrays of shape (n,)
        One score per token, e.g. ``attnflow.rollout(attentions, rows=0)``, or several
        named rows shown one per line with one shared scale, e.g.
        ``{"raw": ..., "rollout": ..., "flow": ...}``. Any supported array library.
    tokens : sequence of str
        The ``n`` token labels.
    title : str, optional
        A heading above the tokens (and the page title of :meth:`to_html`).
    color : str, default "#c0392b"
        The hue of the largest score, as ``'#rrggbb'``.
    precision : int, default 4
        Significant digits of the values shown.
    scale_exclude : sequence of int, optional
        Token positions left out of the colour scale (special tokens such as ``[CLS]`` and
        ``[SEP]``, which often take most of the mass): they are shown, with their values,
        but the scale's maximum is taken over the other tokens, and they are drawn at most
        in full colour.

    Attributes
    ----------
    rows : dict of str or None to ndarray
        The scores as float64 NumPy arrays, by row name (``None`` for a single row).
    tokens : tuple of str
        The token labels.
    title : str or None
        The heading.

    Raises
    ------
    ValueError
        If a row is not one-dimensional or not finite, does not have one score per token,
        `scores` is an empty mapping, or `color` is not ``'#rrggbb'``.
    TypeError
        If `tokens` is not a sequence of strings.

    See Also
    --------
    attnflow.plot.token_heatmap : The same strip as a matplotlib figure.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.html import TokenView
    >>> view = TokenView(np.array([0.2, 0.5, 0.3]), ["[CLS]", "<b>", "cat"], title="rollout")
    >>> "&lt;b&gt;" in view.to_html() and "<b>" not in view.to_html()
    True
    >>> rows = {"raw": np.array([0.6, 0.2, 0.2]), "rollout": np.array([0.4, 0.4, 0.2])}
    >>> TokenView(rows, ["[CLS]", "a", "cat"])
    TokenView(rows=['raw', 'rollout'], tokens=3)
    >>> path = TokenView(rows, ["[CLS]", "a", "cat"]).save("tokens.html")  # doctest: +SKIP
    """

    def __init__(
        self,
        scores: Any,
        tokens: Sequence[str],
        *,
        title: str | None = None,
        color: str = "#c0392b",
        precision: int = 4,
        scale_exclude: Sequence[int] = (),
    ) -> None:
        named: list[tuple[str | None, Any]]
        if isinstance(scores, Mapping):
            if not scores:
                msg = "`scores` is an empty mapping; pass at least one row of scores."
                raise ValueError(msg)
            named = [(str(key), value) for key, value in scores.items()]
        else:
            named = [(None, scores)]
        rows: dict[str | None, FloatArray] = {}
        for key, value in named:
            name = "scores" if key is None else f"scores[{key!r}]"
            row = _as_numpy(value, name)
            if row.ndim != 1:
                msg = (
                    f"`{name}` must be one row of scores, shape (n,); got shape {row.shape}. "
                    "Pass several rows as a mapping name -> scores."
                )
                raise ValueError(msg)
            _check_finite(row, name)
            rows[key] = row
        n = next(iter(rows.values())).shape[0]
        for key, row in rows.items():
            if row.shape[0] != n:
                msg = (
                    f"every row must score the same {n} tokens; row {key!r} has "
                    f"{row.shape[0]} scores."
                )
                raise ValueError(msg)
        self.rows = rows
        self.tokens = tuple(_check_tokens(tokens, n, "scores"))
        self.title = title
        self._rgb = _parse_colour(color)
        digits: object = precision
        if isinstance(digits, bool) or not isinstance(digits, int) or digits < 1:
            msg = f"`precision` must be a positive int; got {precision!r}."
            raise ValueError(msg)
        self._precision = precision
        excluded: object = scale_exclude
        if isinstance(excluded, str | bytes) or not isinstance(excluded, Sequence):
            msg = f"`scale_exclude` must be a sequence of token positions; got {scale_exclude!r}."
            raise TypeError(msg)
        positions = []
        for position in excluded:
            if isinstance(position, bool) or not isinstance(position, int | np.integer):
                msg = f"`scale_exclude` must hold token positions (int); got {position!r}."
                raise TypeError(msg)
            if not -n <= int(position) < n:
                msg = f"`scale_exclude` must index the {n} tokens; got {int(position)}."
                raise IndexError(msg)
            positions.append(int(position) % n)
        self._in_scale = np.ones(n, dtype=bool)
        self._in_scale[positions] = False

    def __repr__(self) -> str:
        names = [key for key in self.rows if key is not None]
        described = f"rows={names!r}, " if names else ""
        return f"{type(self).__name__}({described}tokens={len(self.tokens)})"

    # -- rendering -------------------------------------------------------------------------

    @property
    def scale_max(self) -> float:
        """The score shown in full colour: the largest score in the scale (0 if none)."""
        return max(
            0.0, *(float(row[self._in_scale].max(initial=0.0)) for row in self.rows.values())
        )

    def _format(self, value: float) -> str:
        return f"{value:.{self._precision}g}"

    def _background(self, value: float) -> tuple[str, str]:
        """CSS background and text colours of a token with score `value`."""
        top = self.scale_max
        strength = min(1.0, max(0.0, value / top)) if top > 0 else 0.0
        red, green, blue = (round(255 + (c - 255) * strength) for c in self._rgb)
        dark = 0.299 * red + 0.587 * green + 0.114 * blue < 140
        return f"rgb({red}, {green}, {blue})", "#fff" if dark else "#222"

    def _body(self) -> str:
        """Render the view's markup, without its style sheet."""
        lines = ['<div class="attnflow-view">']
        if self.title is not None:
            lines.append(f'<div class="attnflow-title">{html.escape(self.title)}</div>')
        for key, row in self.rows.items():
            spans = []
            for token, value in zip(self.tokens, row, strict=True):
                shown = self._format(float(value))
                background, text = self._background(float(value))
                escaped = html.escape(token, quote=True)
                spans.append(
                    f'<span class="attnflow-tok" style="background-color: {background}; '
                    f'color: {text}" title="{escaped}: {shown}" data-value="{shown}">'
                    f"{escaped}</span>"
                )
            label = "" if key is None else html.escape(key)
            lines.append(
                f'<div class="attnflow-row"><span class="attnflow-label">{label}</span>'
                f"<span>{''.join(spans)}</span></div>"
            )
        top, _ = self._background(self.scale_max)
        lines.append(
            '<div class="attnflow-scale">0<span class="attnflow-bar" style="background: '
            f'linear-gradient(to right, rgb(255, 255, 255), {top})"></span>'
            f"{self._format(self.scale_max)}</div>"
        )
        lines.append("</div>")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """HTML fragment for notebooks (its style sheet is scoped to the view)."""
        return f"<style>\n{_CSS}</style>\n{self._body()}"

    def to_html(self) -> str:
        """Return a standalone HTML document of the view.

        Returns
        -------
        str
            A complete UTF-8 HTML page with an inline style sheet and no external
            resources.
        """
        page_title = html.escape(self.title if self.title is not None else "attnflow tokens")
        return (
            "<!DOCTYPE html>\n"
            '<html lang="en">\n'
            "<head>\n"
            '<meta charset="utf-8">\n'
            f"<title>{page_title}</title>\n"
            f"<style>\n{_CSS}</style>\n"
            "</head>\n"
            "<body>\n"
            f"{self._body()}\n"
            "</body>\n"
            "</html>\n"
        )

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write :meth:`to_html` to `path` atomically.

        The page is written to a temporary file in the same folder, then moved into place,
        so `path` never holds a partial page. The file is readable by everyone (mode
        0o644), as a web page is meant to be.

        Parameters
        ----------
        path : str or os.PathLike
            Where to write the page (conventionally ``*.html``).
        overwrite : bool, default False
            Replace an existing file. Without it an existing `path` is left untouched.

        Returns
        -------
        pathlib.Path
            The path written.

        Raises
        ------
        FileExistsError
            If `path` exists and `overwrite` is False.
        """
        target = Path(path)
        if not overwrite and target.exists():
            msg = f"{str(target)!r} exists; pass `overwrite=True` to replace it."
            raise FileExistsError(msg)
        descriptor, temporary = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
        )
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8", newline="\n") as stream:
                stream.write(self.to_html())
                stream.flush()
                os.fsync(stream.fileno())
            Path(temporary).chmod(0o644)  # mkstemp makes it private; a page is for reading
            if overwrite:
                Path(temporary).replace(target)
            else:
                _move_without_overwrite(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return target


def _move_without_overwrite(source: str, target: Path) -> None:
    """Move `source` to `target`, failing if `target` appeared in the meantime."""
    try:
        os.link(source, target)  # atomic, and refuses an existing target
    except FileExistsError:
        msg = f"{str(target)!r} exists; pass `overwrite=True` to replace it."
        raise FileExistsError(msg) from None
    except OSError:  # no hard links on this file system: check, then move
        if target.exists():
            msg = f"{str(target)!r} exists; pass `overwrite=True` to replace it."
            raise FileExistsError(msg) from None
        Path(source).replace(target)
        return
    Path(source).unlink()
