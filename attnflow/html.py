"""Token attributions as self-contained HTML: no plotting library, no CDN, no download.

:class:`TokenView` colours each token of a sentence by its score (white to one hue, by
value / largest value) and shows the value when the pointer rests on a token. Several
rows (raw attention, rollout, flow) share one colour scale; the page has no script.
:class:`InteractiveView` holds every method, layer, output row and head, with an inline
script and controls to pick which one colours the tokens. Both display themselves in
Jupyter-style notebooks (``_repr_html_``) and write a standalone page with ``save``.
In both, tokens left out of the scale (``scale_exclude``: ``[CLS]``, ``[SEP]``...) get
no colour of it, so that none reads as the strongest: they are drawn light grey with a
dashed outline (the ``attnflow-unscaled`` class), their value written beside the label,
and the scale's legend counts them.
With ``grid=(rows, cols)`` (an image: the last ``rows * cols`` tokens are its patches, row
by row) both draw the patches as a grid of square cells, the tokens before them (CLS,
registers) as spans above it; with ``image=`` the picture lies under the grid (embedded as
a PNG ``data:`` URL) and each cell is the colour at an opacity that grows with its score.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._atomic import write_atomically
from ._colours import SIGNED_STOPS, signed_rgb
from ._display import FloatArray, as_numpy, check_finite, check_patch_grid, check_tokens
from ._html_script import INTERACTIVE_CSS, INTERACTIVE_JS
from ._model_text import model_text

__all__ = ["InteractiveView", "TokenView"]

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
.attnflow-view .attnflow-grids { display: flex; flex-wrap: wrap; gap: 0.6em 2em;
  align-items: flex-start; }
.attnflow-view .attnflow-grid-row { display: flex; flex-direction: column; }
.attnflow-view .attnflow-grid-row .attnflow-label { min-width: 0; text-align: left; }
.attnflow-view .attnflow-grid { display: grid; gap: 2px; width: max-content;
  margin: 0.2em 0; }
.attnflow-view .attnflow-cell { position: relative; box-sizing: border-box;
  display: flex; align-items: center; justify-content: center; text-align: center;
  border: 1px solid #e4e4e4; border-radius: 2px; font-size: 10px; line-height: 1.1; }
.attnflow-view .attnflow-cell-text { overflow: hidden; max-width: 100%; max-height: 100%;
  overflow-wrap: anywhere; }
.attnflow-view .attnflow-grid-small .attnflow-cell-text { position: absolute; width: 1px;
  height: 1px; overflow: hidden; clip: rect(0 0 0 0); white-space: nowrap; }
.attnflow-view .attnflow-grid-image { background-image: var(--attnflow-image);
  background-size: 100% 100%; background-repeat: no-repeat; }
.attnflow-view .attnflow-grid-image .attnflow-cell { border-color: rgba(255, 255, 255, 0.3); }
.attnflow-view .attnflow-grid-image .attnflow-unscaled.attnflow-cell {
  background-color: rgba(238, 238, 238, 0.55); border-color: #8c8c8c; }
.attnflow-view .attnflow-grid-image .attnflow-cell-text { color: #222;
  background: rgba(255, 255, 255, 0.8); border-radius: 2px; padding: 0 2px; }
.attnflow-view .attnflow-cell:hover { outline: 1px solid #333; z-index: 5; }
.attnflow-view .attnflow-cell:hover::after { content: attr(title);
  position: absolute; left: 50%; bottom: 110%; transform: translateX(-50%);
  background: #222; color: #fff; font-size: 11px; line-height: 1.5; padding: 0 0.4em;
  border-radius: 3px; white-space: pre; pointer-events: none; z-index: 10; }
.attnflow-view .attnflow-unscaled { background-color: #eeeeee; color: #6b6b6b;
  border: 1px dashed #8c8c8c; }
.attnflow-view .attnflow-tok.attnflow-unscaled::after { content: attr(data-value);
  margin-left: 0.3em; font-size: 0.8em; }
.attnflow-view .attnflow-tok:hover { outline: 1px solid #333; }
.attnflow-view .attnflow-tok:hover::after { content: attr(data-value);
  position: absolute; left: 50%; bottom: 110%; transform: translateX(-50%);
  background: #222; color: #fff; font-size: 11px; padding: 0 0.4em;
  border-radius: 3px; white-space: nowrap; pointer-events: none; z-index: 10; }
.attnflow-view .attnflow-scale { font-size: 11px; color: #555; margin-top: 0.3em; }
.attnflow-view .attnflow-bar { display: inline-block; width: 8em; height: 0.8em;
  vertical-align: middle; margin: 0 0.4em; border: 1px solid #ccc; }
.attnflow-view .attnflow-key { display: inline-block; width: 1.6em; height: 0.8em;
  vertical-align: middle; margin: 0 0.4em 0 0.1em; border-radius: 3px; }
"""

#: The look of tokens left out of the colour scale (no colour of the scale; see _CSS).
_UNSCALED = "attnflow-unscaled"

#: About how wide (px) a grid of patches is drawn: a 14 x 14 grid has 33 px cells.
_GRID_WIDTH = 500
#: The gap between cells (px), as in _CSS.
_GRID_GAP = 2
#: The smallest and largest cells (px), and the smallest whose label is drawn in it.
_CELL_MIN, _CELL_MAX, _CELL_LABELLED = 6, 64, 48
#: Over an image, a cell is the colour at this opacity times its share of the scale's
#: maximum: clear where the score is 0, so the picture shows through.
_CELL_OPACITY = 0.75


def _parse_colour(colour: str) -> tuple[int, int, int]:
    given: object = colour
    if not isinstance(given, str) or not _HEX_COLOUR.match(given):
        msg = f"`color` must be a hex colour '#rrggbb'; got {colour!r}."
        raise ValueError(msg)
    return int(given[1:3], 16), int(given[3:5], 16), int(given[5:7], 16)


class TokenView:
    """Tokens coloured by their scores, as HTML (one or several rows, one colour scale).

    Each token's background goes from white (score 0) to `color` (the largest score of
    all rows); negative scores are shown white, unless `signed`: then a diverging scale
    centred at 0 colours them (blue below 0, red above, symmetric limits). Tokens left out of the scale
    (`scale_exclude`) are not coloured by it: they are drawn light grey with a dashed
    outline and a grey label followed by their value, and the legend under the tokens
    counts them. The exact
    value appears in a tooltip when the pointer rests on a token (and in its ``title``
    attribute). Tokens are HTML-escaped; the output has no scripts and loads nothing.

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
        but the scale's maximum is taken over the other tokens, and they get no colour of
        the scale (whatever their value) but a neutral look: light grey, dashed outline.
    grid : tuple of (int, int), optional
        Draw an image's patches as a grid: ``(rows, cols)`` says the last ``rows * cols``
        tokens are patches, row by row, drawn as ``rows`` x ``cols`` square cells coloured
        as the tokens would be (label and value in the tooltip, the label inside the cell
        when cells are large enough); the tokens before them (CLS, distillation, register
        tokens) are drawn as token spans above the grid. Several rows of scores are drawn
        as grids side by side. None (the default): all tokens in one line.
    image : array of shape (H, W), (H, W, 3) or (H, W, 4), optional
        With `grid`: the picture the patches cut (e.g. the image the model saw), drawn
        under each grid, stretched to it. Each cell is then `color` at an opacity from 0
        (score 0: the picture shows) to 0.75 (the scale's maximum). uint8, or floats in
        ``[0, 1]`` (other floats are stretched from their minimum to their maximum). It is
        embedded in the page as a PNG (``data:`` URL), shrunk if longer than 1024 px.
    signed : bool, default False
        The scores are signed (a method whose ``MethodSpec.signed`` is true, such as
        ``direct_logit``: a token can push the target down). The scale is then diverging
        and centred at 0, from ``-m`` (blue) through near white (0) to ``m`` (red), m the
        largest absolute score in the scale, perceptually uniform (CIELAB, see
        :data:`attnflow.plot.SIGNED_CMAP`); `color` is not used. Over an image a cell is
        its sign's end colour at an opacity that grows with its absolute score.

    Attributes
    ----------
    rows : dict of str or None to ndarray
        The scores as float64 NumPy arrays, by row name (``None`` for a single row).
    tokens : tuple of str
        The token labels.
    title : str or None
        The heading.
    grid : tuple of (int, int) or None
        The patch grid ``(rows, cols)``, None for one line of tokens.

    Raises
    ------
    ValueError
        If a row is not one-dimensional or not finite, does not have one score per token,
        `scores` is an empty mapping, `color` is not ``'#rrggbb'``, `grid` is not a
        pair of positive ints or has more cells than there are tokens, or `image` is given
        without `grid` or is not a picture.
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

    A [CLS] token, then 2 x 2 patches drawn as a grid:

    >>> patches = TokenView(
    ...     np.array([0.4, 0.1, 0.3, 0.2, 0.0]),
    ...     ["[CLS]", "(0,0)", "(0,1)", "(1,0)", "(1,1)"],
    ...     grid=(2, 2),
    ... )
    >>> patches.to_html().count('class="attnflow-cell"')
    4

    The same over a 32 x 32 picture (cells semi-transparent, the picture under them):

    >>> picture = np.linspace(0, 1, 32 * 32).reshape(32, 32)
    >>> page = TokenView(
    ...     np.array([0.4, 0.1, 0.3, 0.2, 0.0]),
    ...     ["[CLS]", "(0,0)", "(0,1)", "(1,0)", "(1,1)"],
    ...     grid=(2, 2),
    ...     scale_exclude=[0],
    ...     image=picture,
    ... ).to_html()
    >>> "data:image/png;base64," in page and "rgba(192, 57, 43, 0.75)" in page
    True
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
        grid: tuple[int, int] | None = None,
        image: Any = None,
        signed: bool = False,
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
            row = as_numpy(value, name)
            if row.ndim != 1:
                msg = (
                    f"`{name}` must be one row of scores, shape (n,); got shape {row.shape}. "
                    "Pass several rows as a mapping name -> scores."
                )
                raise ValueError(msg)
            check_finite(row, name)
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
        self.tokens = tuple(check_tokens(tokens, n, "scores"))
        self.grid = _checked_grid(grid, n)
        self._image = _image_url(image, self.grid)
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
        self._signed = _checked_signed(signed)

    def __repr__(self) -> str:
        names = [key for key in self.rows if key is not None]
        described = f"rows={names!r}, " if names else ""
        return f"{type(self).__name__}({described}tokens={len(self.tokens)})"

    # -- rendering -------------------------------------------------------------------------

    @property
    def scale_max(self) -> float:
        """The score shown in full colour: the largest (absolute, if signed) score in the scale."""
        return max(
            0.0,
            *(
                float((np.abs(row) if self._signed else row)[self._in_scale].max(initial=0.0))
                for row in self.rows.values()
            ),
        )

    def _format(self, value: float) -> str:
        return f"{value:.{self._precision}g}"

    def _background(self, value: float) -> tuple[str, str]:
        """CSS background and text colours of a token in the scale with score `value`."""
        top = self.scale_max
        if self._signed:
            return _signed_token_style(value, top)
        strength = min(1.0, max(0.0, value / top)) if top > 0 else 0.0
        red, green, blue = (round(255 + (c - 255) * strength) for c in self._rgb)
        dark = 0.299 * red + 0.587 * green + 0.114 * blue < 140
        return f"rgb({red}, {green}, {blue})", "#fff" if dark else "#222"

    def _body(self) -> str:
        """Render the view's markup, without its style sheet."""
        lines = [f'<div class="attnflow-view"{_image_style(self._image)}>']
        if self.title is not None:
            lines.append(f'<div class="attnflow-title">{html.escape(self.title)}</div>')
        first_cell = len(self.tokens) - _cells(self.grid)
        if self.grid is not None:
            lines.append('<div class="attnflow-grids">')
        for key, row in self.rows.items():
            spans = []
            for i, (token, value, in_scale) in enumerate(
                zip(self.tokens, row, self._in_scale, strict=True)
            ):
                shown = self._format(float(value))
                escaped = html.escape(token, quote=True)
                kind = "attnflow-cell" if i >= first_cell else "attnflow-tok"
                if in_scale:
                    if kind == "attnflow-cell" and self._image is not None:
                        background, text = _cell_style(
                            float(value), self.scale_max, self._rgb, signed=self._signed
                        )
                    else:
                        background, text = self._background(float(value))
                    look = f'class="{kind}" style="background-color: {background}; color: {text}"'
                else:  # no colour of the scale, whatever the value: the neutral look
                    look = f'class="{kind} {_UNSCALED}"'
                spans.append(
                    f'<span {look} title="{escaped}: {shown}" data-value="{shown}">'
                    f"{_content(escaped, i >= first_cell)}</span>"
                )
            label = "" if key is None else html.escape(key)
            if self.grid is None:
                lines.append(
                    f'<div class="attnflow-row"><span class="attnflow-label">{label}</span>'
                    f"<span>{''.join(spans)}</span></div>"
                )
            else:
                named = "" if key is None else f'<div class="attnflow-label">{label}</div>'
                grid = _arranged(spans, self.grid, over_image=self._image is not None)
                lines.append(f'<div class="attnflow-grid-row">{named}{grid}</div>')
        if self.grid is not None:
            lines.append("</div>")
        top, _ = self._background(self.scale_max)
        low = self._format(-self.scale_max) if self._signed and self.scale_max > 0 else "0"
        lines.append(
            f'<div class="attnflow-scale">{low}<span class="attnflow-bar" style="background: '
            f'{_bar(top, self._signed)}"></span>'
            f"{self._format(self.scale_max)}{_unscaled_note(self._in_scale)}</div>"
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
        title = self.title if self.title is not None else "attnflow tokens"
        return _views_page(title, [self])

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
        return _write_page(self.to_html, path, overwrite=overwrite)


class InteractiveView:
    """Tokens coloured by one choice of method, layer, output row and head, picked in the page.

    The page holds every score (as JSON) and a small inline script: a menu picks the
    method, a slider the layer, a menu (or a click, or Enter on a focused token) the output
    row explained, and a slider the attention head for per-head scores. The tokens are then
    coloured as in :class:`TokenView`: white (0) to `color` (the largest score shown,
    stated under the tokens), or for a signed method on a diverging scale from ``-m``
    (blue) to ``m`` (red), the exact value in a tooltip and in each token's ``title``.
    The page loads nothing and works offline; without a script it shows the initial choice.

    Parameters
    ----------
    scores : mapping of str to array, or array
        Per method, the scores of one or several output rows at every layer:
        ``(layers, rows, n)`` (e.g. ``attnflow.rollout(w, layers="all")`` for full maps),
        ``(layers, n)`` (one row), ``(n,)`` (one row, one layer), or per head
        ``(layers, heads, rows, n)``. Methods may have different numbers of layers or heads
        (the slider is clamped to each), but share the rows. An array alone is one method,
        ``"scores"``. Any supported array library.
    tokens : sequence of str
        The ``n`` token labels.
    rows : int or sequence of int, optional
        The token positions of the rows axis. By default ``0, ..., n - 1`` when the axis
        has ``n`` rows, and none (an unnamed row) when it has one.
    title : str, optional
        A heading above the controls (and the page title of :meth:`to_html`).
    color : str, default "#c0392b"
        The hue of the largest score, as ``'#rrggbb'``.
    precision : int, default 4
        Significant digits of the values shown (1 to 17).
    scale_exclude : sequence of int, optional
        Token positions left out of the colour scale, as in :class:`TokenView` (special
        tokens such as ``[CLS]`` and ``[SEP]``): the maximum is taken over the other
        tokens, and these are drawn light grey with a dashed outline whatever their value.
    method : str, optional
        The method shown first (default: the first).
    layer : int, default -1
        The layer shown first (default: the last; clamped to each method's layers).
    row : int, optional
        The token position of the row shown first (default: the first of `rows`).
    head : int, default 0
        The head shown first, for per-head scores.
    grid : tuple of (int, int), optional
        Draw an image's patches as a grid, as :class:`TokenView` does: ``(rows, cols)``
        says the last ``rows * cols`` tokens are patches, row by row, drawn as ``rows`` x
        ``cols`` square cells that the controls colour as they colour the tokens (value in
        the tooltip; a click, or Enter on a focused cell, picks the cell's output row); the
        tokens before them (CLS, registers) are drawn as token spans above the grid.
        None (the default): all tokens in one line.
    image : array of shape (H, W), (H, W, 3) or (H, W, 4), optional
        With `grid`: the picture drawn under the grid, as in :class:`TokenView`; the
        script then colours the cells at an opacity that grows with their score.
    signed : bool or sequence of str, default False
        The methods whose scores are signed (``MethodSpec.signed``, such as
        ``direct_logit``), or True for all: each is drawn on the diverging scale of
        :class:`TokenView` ``signed=True``, centred at 0 with symmetric limits, when it
        is picked.

    Attributes
    ----------
    scores : dict of str to ndarray
        The scores as float64 NumPy arrays ``(layers, heads, rows, n)`` (one head for
        scores not given per head).
    heads : dict of str to int or None
        The number of heads of each method, None where the scores are not per head.
    rows : tuple of int or None
        The token positions of the rows axis, None for one unnamed row.
    tokens : tuple of str
        The token labels.
    title : str or None
        The heading.
    grid : tuple of (int, int) or None
        The patch grid ``(rows, cols)``, None for one line of tokens.

    Raises
    ------
    ValueError
        If scores are not finite, have the wrong number of dimensions or of tokens, the
        methods do not share their rows, `rows` does not match them, an initial choice is
        out of range, `color` or `precision` is invalid, `grid` is not a pair of
        positive ints or has more cells than there are tokens, or `image` is given
        without `grid` or is not a picture.
    TypeError
        If `tokens` is not a sequence of strings, or a position is not an int.

    See Also
    --------
    TokenView : One static strip per row, no script.

    Notes
    -----
    Every score is embedded in the page, ``layers x heads x rows x n`` numbers per method:
    a 12-layer, 12-head model on 128 tokens makes a page of tens of megabytes. Pass the rows
    of interest (``attnflow.rollout(w, rows=[0, 5], layers="all")`` with ``rows=[0, 5]``)
    or fuse the heads for long inputs.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> from attnflow.html import InteractiveView
    >>> rng = np.random.default_rng(0)
    >>> w = rng.random((4, 2, 5, 5))
    >>> w /= w.sum(-1, keepdims=True)  # (layers, heads, n, n)
    >>> tokens = ["[CLS]", "the", "<cat>", "sat", "[SEP]"]
    >>> view = InteractiveView(
    ...     {"rollout": attnflow.rollout(w, layers="all"), "raw": w},
    ...     tokens,
    ...     scale_exclude=[0, 4],
    ... )
    >>> view
    InteractiveView(methods=['rollout', 'raw'], layers=4, heads=2, rows=5, tokens=5)
    >>> page = view.to_html()
    >>> "&lt;cat&gt;" in page and "<cat>" not in page
    True
    >>> path = view.save("explore.html")  # doctest: +SKIP
    """

    def __init__(
        self,
        scores: Any,
        tokens: Sequence[str],
        *,
        rows: int | Sequence[int] | None = None,
        title: str | None = None,
        color: str = "#c0392b",
        precision: int = 4,
        scale_exclude: Sequence[int] = (),
        method: str | None = None,
        layer: int = -1,
        row: int | None = None,
        head: int = 0,
        grid: tuple[int, int] | None = None,
        image: Any = None,
        signed: bool | Sequence[str] = False,
    ) -> None:
        named = (
            [(str(key), value) for key, value in scores.items()]
            if isinstance(scores, Mapping)
            else [("scores", scores)]
        )
        if not named:
            msg = "`scores` is an empty mapping; pass at least one method's scores."
            raise ValueError(msg)
        self.scores: dict[str, FloatArray] = {}
        self.heads: dict[str, int | None] = {}
        for key, value in named:
            name = "scores" if not isinstance(scores, Mapping) else f"scores[{key!r}]"
            array = as_numpy(value, name)
            if not 1 <= array.ndim <= 4 or 0 in array.shape:
                msg = (
                    f"`{name}` must have shape (n,), (layers, n), (layers, rows, n) or "
                    f"(layers, heads, rows, n); got shape {array.shape}."
                )
                raise ValueError(msg)
            check_finite(array, name)
            self.heads[key] = int(array.shape[1]) if array.ndim == 4 else None
            while array.ndim < 3:
                array = array[None] if array.ndim == 1 else array[:, None]
            self.scores[key] = array[:, None] if array.ndim == 3 else array
        first = next(iter(self.scores.values()))
        n, n_rows = int(first.shape[-1]), int(first.shape[-2])
        for key, array in self.scores.items():
            if array.shape[-2:] != (n_rows, n):
                msg = (
                    f"every method must score the same {n_rows} row(s) of {n} tokens; "
                    f"{key!r} has {array.shape[-2]} row(s) of {array.shape[-1]}."
                )
                raise ValueError(msg)
        self.tokens = tuple(check_tokens(tokens, n, "scores"))
        self.grid = _checked_grid(grid, n)
        self._image = _image_url(image, self.grid)
        self.rows = _row_positions(rows, n_rows, n)
        self.title = title
        self._rgb = _parse_colour(color)
        digits: object = precision
        if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 17:
            msg = f"`precision` must be an int from 1 to 17; got {precision!r}."
            raise ValueError(msg)
        self._precision = precision
        self._in_scale = np.ones(n, dtype=bool)
        self._in_scale[_positions(scale_exclude, n, "scale_exclude")] = False
        self._signed = _signed_methods(signed, list(self.scores))
        self._initial = self._initial_choice(method, layer, row, head)

    def _initial_choice(
        self, method: str | None, layer: int, row: int | None, head: int
    ) -> dict[str, int]:
        names = list(self.scores)
        if method is None:
            method = names[0]
        if method not in self.scores:
            msg = f"`method` must be one of {names}; got {method!r}."
            raise ValueError(msg)
        layers = max(int(array.shape[0]) for array in self.scores.values())
        heads = max(int(array.shape[1]) for array in self.scores.values())
        checked = {}
        for name, value, size in (("layer", layer, layers), ("head", head, heads)):
            given: object = value
            if isinstance(given, bool) or not isinstance(given, int | np.integer):
                msg = f"`{name}` must be an int; got {value!r}."
                raise TypeError(msg)
            if not -size <= int(given) < size:
                msg = f"`{name}` must index the {size} {name}s; got {int(given)}."
                raise ValueError(msg)
            checked[name] = int(given) % size
        index = 0
        if row is not None:
            if self.rows is None or row not in self.rows:
                msg = f"`row` must be one of the rows' positions {self.rows}; got {row!r}."
                raise ValueError(msg)
            index = self.rows.index(row)
        return {"method": names.index(method), "row": index, **checked}

    def __repr__(self) -> str:
        layers = max(int(array.shape[0]) for array in self.scores.values())
        heads = [count for count in self.heads.values() if count is not None]
        described = f", heads={max(heads)}" if heads else ""
        n_rows = next(iter(self.scores.values())).shape[-2]
        return (
            f"{type(self).__name__}(methods={list(self.scores)!r}, layers={layers}"
            f"{described}, rows={n_rows}, tokens={len(self.tokens)})"
        )

    # -- rendering -------------------------------------------------------------------------

    def _data(self) -> dict[str, Any]:
        """Everything the script needs, as JSON-serialisable values."""
        return {
            "tokens": list(self.tokens),
            # The status line's token: shortened and marked where it is not plain text.
            "headings": [model_text(token) for token in self.tokens],
            "rows": None if self.rows is None else list(self.rows),
            "inScale": self._in_scale.tolist(),
            "rgb": list(self._rgb),
            "precision": self._precision,
            "initial": self._initial,
            "overImage": self._image is not None,
            "cellOpacity": _CELL_OPACITY,
            "stops": [list(stop) for stop in SIGNED_STOPS] if self._signed else [],
            "methods": [
                {
                    "name": name,
                    "layers": int(array.shape[0]),
                    "heads": self.heads[name] or 0,
                    "signed": name in self._signed,
                    "values": array.tolist(),
                }
                for name, array in self.scores.items()
            ],
        }

    def _body(self, uid: str) -> str:
        """Render the view's markup in its initial state, its data and its script."""
        choice = self._initial
        name = list(self.scores)[choice["method"]]
        array = self.scores[name]
        layers, heads = int(array.shape[0]), self.heads[name]
        layer = min(choice["layer"], layers - 1)
        head = min(choice["head"], heads - 1) if heads else 0
        values = array[layer, head, choice["row"]]
        signed = name in self._signed
        shown_values = np.abs(values) if signed else values
        top = max(0.0, float(shown_values[self._in_scale].max(initial=0.0)))
        position = -1 if self.rows is None else self.rows[choice["row"]]
        rows_at = {} if self.rows is None else {p: i for i, p in enumerate(self.rows)}

        def option(value: int, label: str, chosen: bool) -> str:
            selected = " selected" if chosen else ""
            return f'<option value="{value}"{selected}>{html.escape(label)}</option>'

        methods = "".join(
            option(i, key, i == choice["method"]) for i, key in enumerate(self.scores)
        )
        row_options = "".join(
            option(i, f"{p}: {model_text(self.tokens[p])}", i == choice["row"])
            for i, p in enumerate(self.rows or ())
        )
        hide_method = " hidden" if len(self.scores) == 1 else ""
        hide_row = " hidden" if self.rows is None or len(self.rows) == 1 else ""
        hide_head = "" if heads else " hidden"
        max_heads = max(count or 1 for count in self.heads.values())
        layer_text = f"{layer + 1} of {layers}"
        head_text = f"{head + 1} of {heads}" if heads else ""
        disabled = " disabled" if layers == 1 else ""
        picture = _image_style(self._image)
        lines = [f'<div class="attnflow-view attnflow-interactive" id="{uid}"{picture}>']
        if self.title is not None:
            lines.append(f'<div class="attnflow-title">{html.escape(self.title)}</div>')
        lines += [
            '<div class="attnflow-controls">',
            (
                f'<label{hide_method}>method <select data-control="method">{methods}</select>'
                "</label>"
            ),
            (
                f'<label>layer <input type="range" data-control="layer" min="1" max="{layers}" '
                f'step="1" value="{layer + 1}" aria-valuetext="layer {layer_text}"{disabled}>'
                f'<output data-output="layer">{layer_text}</output></label>'
            ),
            f'<label{hide_row}>row <select data-control="row">{row_options}</select></label>',
            (
                f'<label data-control="head-label"{hide_head}>head <input type="range" '
                f'data-control="head" min="1" max="{heads or max_heads}" step="1" '
                f'value="{head + 1}" aria-valuetext="head {head_text}">'
                f'<output data-output="head">{head_text}</output></label>'
            ),
            "</div>",
        ]
        spans = []
        first_cell = len(self.tokens) - _cells(self.grid)
        for i, (token, value) in enumerate(zip(self.tokens, values, strict=True)):
            shown = f"{float(value):.{self._precision}g}"
            escaped = html.escape(token, quote=True)
            extra = ""
            if i in rows_at and self.rows is not None and len(self.rows) > 1:
                extra = f' data-row="{rows_at[i]}" tabindex="0" role="button"'
            if i == position:
                extra += ' aria-current="true"'
            current = " attnflow-current" if i == position else ""
            kind = "attnflow-cell" if i >= first_cell else "attnflow-tok"
            if self._in_scale[i]:
                if kind == "attnflow-cell" and self._image is not None:
                    background, text = _cell_style(float(value), top, self._rgb, signed=signed)
                elif signed:
                    background, text = _signed_token_style(float(value), top)
                else:
                    background, text = _token_style(float(value), top, self._rgb)
                look = (
                    f'class="{kind}{current}" style="background-color: {background}; color: {text}"'
                )
            else:  # no colour of the scale, as the script draws it
                look = f'class="{kind}{current} {_UNSCALED}"'
            spans.append(
                f'<span {look} title="{escaped}: {shown}" data-value="{shown}"{extra}>'
                f"{_content(escaped, i >= first_cell)}</span>"
            )
        if self.grid is None:
            lines.append(f'<div class="attnflow-row"><span>{"".join(spans)}</span></div>')
        else:
            lines.append(_arranged(spans, self.grid, over_image=self._image is not None))
        full, _ = _token_style(top, top, self._rgb)
        low = f"{-top:.{self._precision}g}" if signed and top > 0 else "0"
        status = [name, f"layer {layer_text}"]
        if position >= 0:
            status.append(f"row {position} ({model_text(self.tokens[position])})")
        if heads:
            status.append(f"head {head_text}")
        lines += [
            (
                f'<div class="attnflow-scale"><span data-output="min">{low}</span>'
                '<span class="attnflow-bar" data-output="bar" '
                f'style="background: {_bar(full, signed)}">'
                f'</span><span data-output="max">{top:.{self._precision}g}</span>'
                f"{_unscaled_note(self._in_scale)}</div>"
            ),
            (
                '<div class="attnflow-status" aria-live="polite" data-output="status">'
                f"{html.escape(', '.join(status))}</div>"
            ),
            "</div>",
            (
                f'<script type="application/json" id="{uid}-data">{_script_json(self._data())}'
                "</script>"
            ),
            f'<script>\n{INTERACTIVE_JS}("{uid}");\n</script>',
        ]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """HTML fragment for notebooks, with element ids unique to this rendering."""
        return f"<style>\n{_CSS}{INTERACTIVE_CSS}</style>\n{self._body(_unique_id())}"

    def to_html(self) -> str:
        """Return a standalone HTML document of the view (inline style and script).

        Returns
        -------
        str
            A complete UTF-8 HTML page with no external resources.
        """
        return _page(
            self.title if self.title is not None else "attnflow tokens",
            _CSS + INTERACTIVE_CSS,
            self._body(_unique_id()),
        )

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write :meth:`to_html` to `path` atomically, as :meth:`TokenView.save` does.

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
        return _write_page(self.to_html, path, overwrite=overwrite)


def _with_fallback(view: InteractiveView, fallback: TokenView, *, page: bool) -> str:
    """Render `view`, then `fallback` for readers without scripts (``<noscript>``)."""
    body = f"{view._body(_unique_id())}\n<noscript>\n{fallback._body()}\n</noscript>"
    css = _CSS + INTERACTIVE_CSS
    if page:
        return _page(view.title if view.title is not None else "attnflow tokens", css, body)
    return f"<style>\n{css}</style>\n{body}"


def _unique_id() -> str:
    """Return an element id that no other rendering on a page shares."""
    return f"attnflow-{uuid.uuid4().hex[:12]}"


def _script_json(data: Any) -> str:
    """Encode `data` as JSON safe inside ``<script>`` (no ``<``, ``>`` or ``&`` left)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for character, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(character, escaped)
    return text


def _unscaled_note(in_scale: np.ndarray) -> str:
    """Return the legend of the tokens left out of the scale: a key of their look, a count."""
    excluded = int((~in_scale).sum())
    if not excluded:
        return ""
    return (
        f' (<span class="{_UNSCALED} attnflow-key" aria-hidden="true"></span>'
        f"{excluded} token{'s' if excluded > 1 else ''} left out of the scale)"
    )


def _checked_signed(signed: object) -> bool:
    if not isinstance(signed, bool | np.bool_):
        msg = f"`signed` must be a bool (whether the scores are signed); got {signed!r}."
        raise TypeError(msg)
    return bool(signed)


def _signed_methods(signed: object, names: list[str]) -> set[str]:
    """Return the names of the signed methods: all (True), none (False) or those listed."""
    if isinstance(signed, bool | np.bool_):
        return set(names) if signed else set()
    if isinstance(signed, str | bytes) or not isinstance(signed, Sequence):
        msg = f"`signed` must be a bool or a sequence of method names; got {signed!r}."
        raise TypeError(msg)
    unknown = [name for name in signed if name not in names]
    if unknown:
        msg = f"`signed` must name methods of the scores {names}; got {unknown!r}."
        raise ValueError(msg)
    return set(signed)


def _bar(top: str, signed: bool) -> str:
    """Return the legend bar's CSS background: white to `top`, or the diverging stops."""
    if not signed:
        return f"linear-gradient(to right, rgb(255, 255, 255), {top})"
    stops = ", ".join(f"rgb({r}, {g}, {b})" for r, g, b in SIGNED_STOPS)
    return f"linear-gradient(to right, {stops})"


def _signed_token_style(value: float, top: float) -> tuple[str, str]:
    """CSS background and text colours of a signed score on the diverging scale ``±top``."""
    red, green, blue = signed_rgb(value, top)
    dark = 0.299 * red + 0.587 * green + 0.114 * blue < 140
    return f"rgb({red}, {green}, {blue})", "#fff" if dark else "#222"


def _token_style(value: float, top: float, rgb: tuple[int, int, int]) -> tuple[str, str]:
    """CSS background and text colours of a score, as the page's script computes them."""
    strength = min(1.0, max(0.0, value / top)) if top > 0 else 0.0
    red, green, blue = (math.floor(255 + (c - 255) * strength + 0.5) for c in rgb)
    dark = 0.299 * red + 0.587 * green + 0.114 * blue < 140
    return f"rgb({red}, {green}, {blue})", "#fff" if dark else "#222"


def _cell_style(
    value: float, top: float, rgb: tuple[int, int, int], *, signed: bool = False
) -> tuple[str, str]:
    """CSS colours of a grid cell over an image, as the page's script computes them.

    The view's colour at an opacity of `_CELL_OPACITY` times the score's share of `top`
    (in thousandths): the picture under a cell of score 0 shows unchanged. Signed: the
    end colour of the score's sign, at its absolute share.
    """
    if signed:
        rgb = SIGNED_STOPS[0] if value < 0 else SIGNED_STOPS[-1]
        value = abs(value)
    strength = min(1.0, max(0.0, value / top)) if top > 0 else 0.0
    thousandths = math.floor(1000 * _CELL_OPACITY * strength + 0.5)
    red, green, blue = rgb
    return f"rgba({red}, {green}, {blue}, {thousandths / 1000:g})", "#222"


def _image_url(image: Any, grid: tuple[int, int] | None) -> str | None:
    """Validate a view's `image` (it needs a `grid`); return it as a PNG data: URL."""
    if image is None:
        return None
    if grid is None:
        msg = (
            "`image` needs `grid=(rows, cols)`: the picture is drawn under the patch grid; "
            "pass the grid or leave `image` out."
        )
        raise ValueError(msg)
    from ._png import png_data_url

    shape = np.shape(image)
    if not (len(shape) == 2 or (len(shape) == 3 and shape[-1] in (3, 4))) or 0 in shape:
        msg = (
            f"`image` must be a picture of shape (H, W), (H, W, 3) or (H, W, 4); got shape "
            f"{shape}. Move a channel-first (3, H, W) array's channels last."
        )
        raise ValueError(msg)
    return png_data_url(image)


def _image_style(url: str | None) -> str:
    """Return the view's style attribute that puts `url` under its grids ('' for none)."""
    return "" if url is None else f" style=\"--attnflow-image: url('{url}')\""


def _checked_grid(grid: object, n: int) -> tuple[int, int] | None:
    """Validate a view's `grid` against its `n` tokens: None or (rows, cols) as ints."""
    if grid is None:
        return None
    rows, cols = check_patch_grid(grid)
    if rows * cols > n:
        msg = (
            f"`grid` must have at most as many cells (rows * cols) as there are tokens ({n}), "
            f"the patches being the last rows * cols tokens; got {(rows, cols)!r}, "
            f"{rows * cols} cells: pass the patch grid (image height / patch size, image "
            "width / patch size), e.g. grid=(14, 14) for a ViT-B/16 at 224 px, or leave "
            "`grid` out (None) for a line of tokens."
        )
        raise ValueError(msg)
    return rows, cols


def _cells(grid: tuple[int, int] | None) -> int:
    """Return the number of tokens drawn as grid cells (0 without a grid)."""
    return 0 if grid is None else grid[0] * grid[1]


def _cell_size(grid: tuple[int, int]) -> int:
    """Return the side (px) of a grid's square cells: its longer side about _GRID_WIDTH."""
    side = max(grid)
    fitting = (_GRID_WIDTH - _GRID_GAP * (side - 1)) // side
    return min(_CELL_MAX, max(_CELL_MIN, fitting))


def _content(escaped: str, cell: bool) -> str:
    """Return a token element's content: its label, wrapped (to be clipped) in a cell."""
    return f'<span class="attnflow-cell-text">{escaped}</span>' if cell else escaped


def _arranged(elements: Sequence[str], grid: tuple[int, int], *, over_image: bool = False) -> str:
    """Lay out the tokens' elements: the leading spans on a line, then the grid of cells.

    With `over_image` the grid draws the view's picture under its cells.
    """
    rows, cols = grid
    first_cell = len(elements) - rows * cols
    size = _cell_size(grid)
    small = "" if size >= _CELL_LABELLED else " attnflow-grid-small"
    small += " attnflow-grid-image" if over_image else ""
    parts = ['<div class="attnflow-patches">']
    if first_cell:
        parts.append(f'<div class="attnflow-extra">{"".join(elements[:first_cell])}</div>')
    parts.append(
        f'<div class="attnflow-grid{small}" data-rows="{rows}" data-cols="{cols}" '
        f'style="grid-template-columns: repeat({cols}, {size}px); '
        f'grid-auto-rows: {size}px">{"".join(elements[first_cell:])}</div>'
    )
    parts.append("</div>")
    return "".join(parts)


def _positions(given: object, n: int, name: str) -> list[int]:
    """Token positions in ``[-n, n)`` as non-negative ints."""
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        msg = f"`{name}` must be a sequence of token positions; got {given!r}."
        raise TypeError(msg)
    positions = []
    for position in given:
        if isinstance(position, bool) or not isinstance(position, int | np.integer):
            msg = f"`{name}` must hold token positions (int); got {position!r}."
            raise TypeError(msg)
        if not -n <= int(position) < n:
            msg = f"`{name}` must index the {n} tokens; got {int(position)}."
            raise IndexError(msg)
        positions.append(int(position) % n)
    return positions


def _row_positions(rows: object, n_rows: int, n: int) -> tuple[int, ...] | None:
    """Return the token positions of the rows axis (None: one unnamed row)."""
    if rows is None:
        if n_rows == n:
            return tuple(range(n))
        if n_rows == 1:
            return None
        msg = (
            f"the scores have {n_rows} rows of {n} tokens; pass `rows`, the token position "
            "of each row."
        )
        raise ValueError(msg)
    listed = [rows] if isinstance(rows, int | np.integer) else rows
    positions = _positions(listed, n, "rows")
    if len(positions) != n_rows:
        msg = f"`rows` must give one position per row of the scores ({n_rows}); got {rows!r}."
        raise ValueError(msg)
    return tuple(positions)


def _page(title: str, css: str, body: str) -> str:
    """Return a standalone HTML document around `body`."""
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n'
        "<head>\n"
        '<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n"
        + (f"<style>\n{css}</style>\n" if css else "")
        + "</head>\n"
        "<body>\n"
        f"{body}\n"
        "</body>\n"
        "</html>\n"
    )


def _views_page(title: str, parts: Sequence[str | TokenView], *, css: str = "") -> str:
    """Return a standalone page of `parts` in order: markup as given, views as markup.

    The views' style sheet is in the page's head once (with `css` after it), not repeated
    before each view as in their notebook output.
    """
    body = "\n".join(part if isinstance(part, str) else part._body() for part in parts)
    return _page(title, _CSS + css, body)


def _write_page(
    render: Callable[[], str], path: str | os.PathLike[str], *, overwrite: bool
) -> Path:
    """Write ``render()`` to `path` atomically (mode 0o644), refusing an existing file."""

    def exists(target: Path) -> FileExistsError:
        return FileExistsError(f"{str(target)!r} exists; pass `overwrite=True` to replace it.")

    return write_atomically(
        path, lambda file: file.write(render().encode("utf-8")), replace=overwrite, exists=exists
    )
