"""A labelled explanation of one input: tokens, scores per method and layer, the class.

:class:`Explanation` is what the adapters' one-call helpers return
(:func:`attnflow.adapters.torch.explain_text`): the tokens of one input, the scores of
each method at every layer for one output position, and the model's prediction. It shows
itself in a terminal (:meth:`Explanation.show`), in a notebook (``_repr_html_``), as a
standalone page (:meth:`Explanation.to_html`; with several methods or layers, picked in
the page by :class:`attnflow.html.InteractiveView`) and as a figure (:meth:`Explanation.plot`),
and it saves to one ``.npz`` file with its metadata as JSON inside (no pickle), read back
with :meth:`Explanation.load`.

An image explanation (:func:`attnflow.adapters.torch.explain_image`) has the same tokens
and scores, the tokens being the vision transformer's non-patch tokens (CLS, distillation,
registers) followed by its patches row by row, plus the patch ``grid`` and the image the
model saw; its figure draws the patch scores over that image, its HTML views (page and
notebook) draw the patches as a grid of coloured cells below the non-patch tokens (over
the image, when it is kept: each cell more opaque the higher its score), and its
terminal view is a summary (the non-patch tokens, the top patches, a character map of the
grid).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ._deprecation import MISSING, Missing, renamed_keyword, warn_renamed
from ._display import check_patch_grid

__all__ = ["Explanation"]

_FORMAT = "attnflow.Explanation/1"
#: Characters of the terminal patch maps, darkest (lowest score) first.
_RAMP = ".:-=+*#%@"


class Explanation:
    """Scores of several methods for one output position of one input, with its tokens.

    Parameters
    ----------
    tokens : sequence of str
        The ``n`` token labels of the input, special tokens included. The adapters give
        the tokenizer's pieces (``[CLS]``, ``walk``, ``##ing``), or for a byte-level BPE
        tokenizer (GPT-2, Llama 3, SmolLM2) the text each piece stands for (``" is"``
        for ``Ġis``; controls such as a newline, ``Ċ``, written as escapes).
    scores : mapping of str to array
        Per method (``"raw"``, ``"rollout"``, ``"flow"``...), the scores of the explained
        row at every layer, ``(layers, n)`` (first layer first), or at one layer, ``(n,)``.
    rows : int, default 0
        The output position explained (0: ``[CLS]`` for BERT-like models). One position:
        the name is the core's (``rollout(..., rows=...)``). ``row`` is its deprecated
        spelling.
    special : sequence of bool, optional
        True for special tokens (``[CLS]``, ``[SEP]``, padding). They stay in the data;
        the HTML views leave them out of the colour scale (drawn grey with a dashed
        outline, their values on hover) unless asked not to.
    target : int, optional
        The class explained (gradient-weighted methods), if any.
    predicted : int, optional
        The class the model predicts.
    probabilities : array of shape (classes,), optional
        The model's class probabilities.
    labels : sequence of str or mapping of int to str, optional
        The class names, indexed by class; or, for a language model whose classes are its
        vocabulary, the names of some token ids (``{id: text}``).
    text : str, optional
        The raw input.
    grid : tuple of int, optional
        For an image: the patch grid ``(rows, cols)``. The last ``rows * cols`` tokens are
        the patches, row by row; the ones before them (``extra_tokens``: CLS,
        distillation, register tokens) are not patches.
    image : array of shape (H, W) or (H, W, 3), optional
        For an image (with `grid`): the picture the patch scores are drawn over, uint8 or
        floats in [0, 1].
    notes : sequence of str, optional
        Sentences a reader needs to read the scores (e.g. what a method left out), shown
        above the HTML views and under the terminal table's heading.
    sinks : sequence of int, optional
        Attention sinks of a decoder (:func:`attnflow.adapters.torch.explain_text` finds
        them: the first position and any position whose mean attention share from later
        queries is at least 0.3). Their scores stay in the data; the views leave them out
        of the colour scale and of the strongest sources (:meth:`top`), and say so.
    offsets : sequence of (int, int), optional
        Each token's character range ``[start, end)`` in `text` (a fast tokenizer's
        ``offset_mapping``; ``(0, 0)`` for special tokens): :meth:`aggregate` needs them
        for words, sentences and character ranges.
    row : int, optional
        Deprecated spelling of `rows`, kept for one release (a DeprecationWarning).

    Attributes
    ----------
    tokens : tuple of str
    scores : dict of str to ndarray
        ``(layers, n)`` float64 per method.
    rows, target, predicted : int or None
    special : ndarray of bool
    probabilities : ndarray or None
    labels : tuple of str, dict of int to str, or None
    text : str or None
    grid : tuple of int or None
    image : ndarray or None
    notes : tuple of str
    sinks : tuple of int
    offsets : tuple of (int, int) or None
    extra_tokens : int
        The leading tokens that are not patches (0 without `grid`).

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.explanation import Explanation
    >>> scores = {"rollout": np.array([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]])}
    >>> e = Explanation(["[CLS]", "cat", "[SEP]"], scores, special=[True, False, True])
    >>> e.show()
    row 0 ([CLS]), layer 2 of 2
    token        rollout
    [CLS]         0.4000
    cat           0.4000
    [SEP]         0.2000
    >>> Explanation.from_dict(e.to_dict()).scores["rollout"].shape
    (2, 3)

    An image of 2 x 2 patches after a CLS token:

    >>> grid = Explanation(
    ...     ["[CLS]", "(0,0)", "(0,1)", "(1,0)", "(1,1)"],
    ...     {"rollout": [0.2, 0.1, 0.4, 0.2, 0.1]},
    ...     special=[True, False, False, False, False],
    ...     grid=(2, 2),
    ... )
    >>> grid.extra_tokens
    1
    >>> grid.show(top=2)
    row 0 ([CLS]), layer 1 of 1; 2 x 2 patches after 1 other token
    token        rollout
    [CLS]         0.2000
    (0,1)         0.4000
    (1,0)         0.2000
    patches (darkest . to brightest @, each map on its own scale):
    rollout
    .@
    =.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Mapping[str, Any],
        *,
        rows: int = 0,
        special: Sequence[bool] | None = None,
        target: int | None = None,
        predicted: int | None = None,
        probabilities: Any = None,
        labels: Sequence[str] | Mapping[int, str] | None = None,
        text: str | None = None,
        grid: tuple[int, int] | None = None,
        image: Any = None,
        notes: Sequence[str] = (),
        sinks: Sequence[int] = (),
        offsets: Sequence[tuple[int, int]] | None = None,
        row: int | Missing = MISSING,
    ) -> None:
        given: object = tokens  # checked at run time: callers may not be type-checked
        if not isinstance(given, Sequence) or isinstance(given, str):
            msg = f"`tokens` must be a sequence of str; got {type(given).__name__}."
            raise TypeError(msg)
        if not all(isinstance(t, str) for t in given):
            msg = f"`tokens` must be a sequence of str; got {type(tokens).__name__}."
            raise TypeError(msg)
        self.tokens = tuple(tokens)
        n = len(self.tokens)
        given_scores: object = scores
        if not isinstance(given_scores, Mapping) or not given_scores:
            msg = "`scores` must be a non-empty mapping method name -> scores (layers, n)."
            raise ValueError(msg)
        self.scores: dict[str, np.ndarray] = {}
        for name, value in scores.items():
            array = np.asarray(value, dtype=np.float64)
            array = array[None, :] if array.ndim == 1 else array
            if array.ndim != 2 or array.shape[1] != n:
                msg = (
                    f"`scores[{name!r}]` must have shape (layers, {n}) or ({n},) for the {n} "
                    f"tokens; got shape {np.shape(value)}."
                )
                raise ValueError(msg)
            self.scores[str(name)] = array
        chosen: object = renamed_keyword("row", "rows", row, rows, default=0)
        # The caller decided the position (an adapter, once, before the model ran): only
        # its kind is checked here; every view names the explained token, so not None.
        if isinstance(chosen, bool) or not isinstance(chosen, int | np.integer):
            msg = f"`rows` must be an int (the explained position); got {chosen!r}."
            raise TypeError(msg)
        self.rows: int = int(chosen)
        self.special = np.zeros(n, dtype=bool) if special is None else np.asarray(special, bool)
        if self.special.shape != (n,):
            msg = f"`special` must hold one bool per token ({n}); got shape {self.special.shape}."
            raise ValueError(msg)
        self.target = _optional_int(target, "target")
        self.predicted = _optional_int(predicted, "predicted")
        self.probabilities = (
            None if probabilities is None else np.asarray(probabilities, dtype=np.float64)
        )
        self.labels = _checked_labels(labels)
        self.text = text
        self.grid, self.image = _checked_grid(grid, image, n)
        given_notes: object = notes
        if isinstance(given_notes, str) or not all(isinstance(t, str) for t in notes):
            msg = f"`notes` must be a sequence of str; got {notes!r}."
            raise TypeError(msg)
        self.notes = tuple(notes)
        self.sinks = _checked_sinks(sinks, n)
        self.offsets = _checked_offsets(offsets, n, text)

    @property
    def row(self) -> int:
        """Return the explained position: the deprecated spelling of :attr:`rows`."""
        warn_renamed("Explanation.row", "Explanation.rows")
        return self.rows

    @property
    def extra_tokens(self) -> int:
        """The leading tokens that are not patches (CLS, registers...); 0 without a grid."""
        return 0 if self.grid is None else len(self.tokens) - self.grid[0] * self.grid[1]

    def __repr__(self) -> str:
        methods = ", ".join(self.scores)
        return (
            f"Explanation(tokens={len(self.tokens)}, methods=[{methods}], "
            f"layers={self.n_layers}, rows={self.rows}, predicted={self._class(self.predicted)})"
        )

    @property
    def n_layers(self) -> int:
        """The number of layers of the scores (the largest over methods)."""
        return max(int(values.shape[0]) for values in self.scores.values())

    def at_layer(self, layer: int = -1) -> dict[str, np.ndarray]:
        """Return each method's scores ``(n,)`` at one layer (the last by default).

        Methods scored at one layer only give that layer whatever `layer` says.
        """
        picked = {}
        for name, values in self.scores.items():
            if values.shape[0] == 1:
                picked[name] = values[0]
                continue
            if not -values.shape[0] <= layer < values.shape[0]:
                msg = f"`layer` must index the {values.shape[0]} layers; got {layer}."
                raise IndexError(msg)
            picked[name] = values[layer]
        return picked

    def _class(self, index: int | None) -> str:
        from ._model_text import is_plain, model_text

        if index is None:
            return "None"
        if isinstance(self.labels, dict) and index in self.labels:
            label = self.labels[index]
            return f"{index} ({label!r})" if is_plain(label) else f"{index} ({model_text(label)})"
        if isinstance(self.labels, tuple) and 0 <= index < len(self.labels):
            return f"{index} ({model_text(self.labels[index])})"
        return str(index)

    def _heading(self, layer: int | None) -> str:
        from ._model_text import is_plain, model_text

        token = self.tokens[self.rows] if 0 <= self.rows < len(self.tokens) else "?"
        # A label with a space at either end (a byte-level BPE token's text) is quoted;
        # one with markup, control characters or of more than 32 characters is shortened
        # and marked as the model's text.
        shown = repr(token) if token != token.strip() and is_plain(token) else model_text(token)
        parts = [f"row {self.rows} ({shown})"]
        if layer is not None:
            parts[0] += f", layer {layer % self.n_layers + 1} of {self.n_layers}"
        if self.predicted is not None:
            predicted = f"predicted {self._class(self.predicted)}"
            if self.probabilities is not None:
                predicted += f", p = {self.probabilities[self.predicted]:.3f}"
            parts.append(predicted)
        if self.target is not None:
            parts.append(f"target {self._class(self.target)}")
        return "; ".join(parts)

    # -- views ---------------------------------------------------------------------------

    def show(self, layer: int = -1, *, file: TextIO | None = None, top: int = 8) -> None:
        """Print a table: one line per token, one column per method, at one layer.

        With a patch `grid` (an image), a summary instead: the non-patch tokens and the
        `top` patches (by the first method), then a character map of each method's patch
        scores.
        """
        out = sys.stdout if file is None else file
        if self.grid is not None:
            self._show_grid(layer, out, top)
            return
        values = self.at_layer(layer)
        width = max(8, *(len(t) for t in self.tokens))
        columns = [max(12, len(name) + 2) for name in values]
        print(self._heading(layer), file=out)
        for note in self.notes:
            print(note, file=out)
        header = "token".ljust(width) + "".join(
            name.rjust(size) for name, size in zip(values, columns, strict=True)
        )
        print(header, file=out)
        for i, token in enumerate(self.tokens):
            cells = "".join(
                f"{float(v[i]):{size}.4f}" for v, size in zip(values.values(), columns, strict=True)
            )
            print(token.ljust(width) + cells, file=out)
        if self.sinks:  # a decoder: name the sources, sinks and the explained token aside
            sinks = ", ".join(repr(self.tokens[k]) for k in self.sinks)
            print(f"strongest sources (sinks {sinks} and the explained token left out):", file=out)
            for name in values:
                shown = ", ".join(
                    f"{self.tokens[i]!r} {float(values[name][i]):.4g}"
                    for i in self.top(3, method=name, layer=layer)
                )
                print(f"  {name}: {shown}", file=out)

    def _excluded(self, scale_special: bool) -> list[int]:
        """Positions left out of the colour scale: special tokens, sinks, the explained one.

        The explained position's own share (a token's share in itself) is large for every
        method and says nothing about the others, so it never sets the scale either; nor
        does a decoder's attention sink (:attr:`sinks`), where heads park attention.
        """
        if scale_special:
            return []
        out = self.special.copy()
        out[list(self.sinks)] = True
        if 0 <= self.rows < len(self.tokens):
            out[self.rows] = True
        exclude = [int(i) for i in np.flatnonzero(out)]
        return [] if len(exclude) == len(self.tokens) else exclude  # none left to scale by

    def top(self, count: int = 5, *, method: str | None = None, layer: int = -1) -> list[int]:
        """Return the `count` strongest sources of the explained position, by one method.

        Special tokens, the :attr:`sinks` and the explained position itself are left out
        (their scores stay in :attr:`scores`); ties keep the earlier position first.

        Parameters
        ----------
        count : int, default 5
            How many positions.
        method : str, optional
            The method ranked (default: the first of :attr:`scores`).
        layer : int, default -1
            The layer ranked.

        Returns
        -------
        list of int
            Token positions, strongest first.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.explanation import Explanation
        >>> e = Explanation(["The", " cat", " sat", " on"], {"rollout": [0.7, 0.2, 0.04, 0.06]},
        ...                 rows=3, sinks=[0])
        >>> e.top(2)
        [1, 2]
        """
        given: object = count
        if isinstance(given, bool) or not isinstance(given, int) or count < 0:
            msg = f"`count` must be an int >= 0 (positions listed); got {count!r}."
            raise ValueError(msg)
        name = next(iter(self.scores)) if method is None else method
        if name not in self.scores:
            msg = f"`method` must be one of {list(self.scores)}; got {method!r}."
            raise ValueError(msg)
        from ._sinks import top_sources

        values = self.at_layer(layer)[name]
        leave_out = [*np.flatnonzero(self.special).tolist(), *self.sinks, self.rows]
        return top_sources(values, count=count, leave_out=leave_out)

    def aggregate(self, spans: Any, *, count_all: bool = False) -> Explanation:
        """Sum the scores over spans of the text: words, sentences or character ranges.

        Each span's score is the sum of its tokens' scores, at every layer and for every
        method (:func:`attnflow._spans.sum_spans`); a token belongs to every span its
        characters overlap (:attr:`offsets`, from the tokenizer), and tokens with no
        characters (special tokens) to none. The sinks and the explained token are not
        counted unless `count_all` (a sentence holding the sink would otherwise rank first
        for the sink's mass). The result is an explanation over the spans: ``show``,
        ``to_html``, ``save`` work on it; its explained row is the span holding the
        explained token (-1 if none), its sinks the spans made of sinks only.

        Parameters
        ----------
        spans : "words", "sentences", or sequence of (int, int)
            Words (letters and digits, each other visible character alone), sentences (up
            to a final ``.``, ``!`` or ``?``), or character ranges ``[start, end)`` of
            :attr:`text`.
        count_all : bool, default False
            Count the sinks' and the explained token's scores in their spans' sums too.

        Returns
        -------
        Explanation
            One "token" per span, labelled with its text.

        Raises
        ------
        ValueError
            On a span outside the text or covering no token, or words and sentences
            without :attr:`text` and :attr:`offsets`.

        Examples
        --------
        >>> from attnflow.explanation import Explanation
        >>> e = Explanation(
        ...     ["Hel", "lo", " world", "."], {"rollout": [0.5, 0.25, 0.125, 0.125]},
        ...     rows=3, text="Hello world.", offsets=[(0, 3), (3, 5), (5, 11), (11, 12)],
        ... )
        >>> words = e.aggregate("words")  # the explained "." is not counted
        >>> words.tokens, words.scores["rollout"].tolist(), words.rows
        (('Hello', 'world', '.'), [[0.75, 0.125, 0.0]], 2)
        """
        from ._spans import sum_spans, token_spans

        if self.text is None or self.offsets is None:
            msg = (
                f"`spans={spans!r}` needs the text and the tokens' character offsets; this "
                "explanation has none (explain_text keeps them when the tokenizer is a fast "
                "one). Sum token positions with explain(..., spans=[(start, end), ...])."
            )
            raise ValueError(msg)
        resolved = token_spans(self.text, self.offsets, spans)
        left_out = set() if count_all else {*self.sinks, self.rows}
        counted = [
            (label, tuple(i for i in tokens if i not in left_out)) for label, tokens in resolved
        ]
        scores = {name: sum_spans(values, counted) for name, values in self.scores.items()}
        holding = [j for j, (_, tokens) in enumerate(resolved) if self.rows in tokens]
        if left_out and not count_all:
            named = ", ".join(
                repr(self.tokens[i]) for i in sorted(left_out) if i < len(self.tokens)
            )
            summed = f"Scores summed over spans of the text, without {named} (sinks, explained)."
        else:
            summed = "Scores summed over spans of the text (each span's tokens)."
        return Explanation(
            [label for label, _ in resolved],
            scores,
            rows=holding[-1] if holding else -1,
            target=self.target,
            predicted=self.predicted,
            probabilities=self.probabilities,
            labels=self.labels,
            text=self.text,
            notes=[*self.notes, summed],
            sinks=[j for j, (_, tokens) in enumerate(resolved) if set(tokens) <= set(self.sinks)],
        )

    def _scale_note(self, scale_special: bool) -> str:
        """Say on the page what the colour scale leaves out, and any note of the scores."""
        parts = list(self.notes)
        excluded = self._excluded(scale_special)
        if excluded:
            names = ", ".join(self.tokens[i] for i in excluded)
            parts.insert(
                0,
                f"Left out of the colour scale, their values written beside them: the "
                f"explained position, the special tokens and the attention sinks ({names}).",
            )
        if self.sinks and not scale_special:
            from ._sinks import sink_note

            parts.insert(1 if excluded else 0, sink_note(self.tokens, self.sinks))
        return " ".join(parts)

    def _view(self, layer: int, *, scale_special: bool) -> Any:
        from ._colours import is_signed
        from .html import TokenView

        return TokenView(
            self.at_layer(layer),
            self.tokens,
            title=self._heading(layer),
            scale_exclude=self._excluded(scale_special),
            grid=self.grid,
            image=self.image,
            # One scale for every method's row: diverging when one of them is signed.
            signed=any(is_signed(name) for name in self.scores),
        )

    def _interactive(self, layer: int, *, scale_special: bool) -> Any:
        """Build an interactive view of every method and layer (None: one of each)."""
        from ._colours import is_signed
        from .html import InteractiveView

        if len(self.scores) == 1 and self.n_layers == 1:
            return None
        if not -self.n_layers <= layer < self.n_layers:
            msg = f"`layer` must index the {self.n_layers} layers; got {layer}."
            raise IndexError(msg)
        rows = [self.rows] if 0 <= self.rows < len(self.tokens) else None
        return InteractiveView(
            self.scores,
            self.tokens,
            rows=rows,
            title=self._heading(None),
            scale_exclude=self._excluded(scale_special),
            layer=layer,
            grid=self.grid,
            image=self.image,
            signed=[name for name in self.scores if is_signed(name)],
        )

    def _render(self, layer: int, *, scale_special: bool, page: bool) -> str:
        """Render the interactive view (given a choice) and the static table of `layer`.

        The static table of every method at `layer` is what readers without scripts see.
        """
        import html

        static = self._view(layer, scale_special=scale_special)
        interactive = self._interactive(layer, scale_special=scale_special)
        if interactive is None:
            text = str(static.to_html() if page else static._repr_html_())
        else:
            from .html import _with_fallback

            text = _with_fallback(interactive, static, page=page)
        note = self._scale_note(scale_special)
        if not note:
            return text
        # Above the first view: what a reader must know to read the colours.
        paragraph = (
            '<p class="attnflow-note" style="font: 12px system-ui, -apple-system, sans-serif; '
            'color: #555; margin: 0.3em 0;">'
            f"{html.escape(note)}</p>\n"
        )
        at = text.find('<div class="attnflow-')
        return text if at < 0 else text[:at] + paragraph + text[at:]

    def _repr_html_(self) -> str:
        """HTML for notebooks: every method and layer, special tokens out of the scale."""
        return self._render(-1, scale_special=False, page=False)

    def to_html(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        layer: int = -1,
        scale_special: bool = False,
        overwrite: bool = False,
    ) -> str:
        """Return a standalone HTML page; with `path`, also write it there.

        With several methods or layers the page picks them interactively (starting at
        `layer`), above the static table of every method at `layer` for readers without
        scripts. With a patch `grid` (an image) the patches are drawn as a grid of
        coloured cells, the non-patch tokens (CLS, registers) as tokens above it; the
        `image`, when kept, lies under the grid and shows through its cells. The file
        is written atomically and never replaces an existing one unless `overwrite`.
        """
        from .html import _write_page

        text = self._render(layer, scale_special=scale_special, page=True)
        if path is not None:
            _write_page(lambda: text, path, overwrite=overwrite)
        return text

    def plot(
        self,
        *,
        methods: Sequence[str] | None = None,
        scale_special: bool = False,
        layer: int = -1,
    ) -> Any:
        """Draw a layer x token map per method (matplotlib; ``attnflow[plot]``).

        Special tokens are drawn with the others; with ``scale_special=False`` the colour
        scale of each map ends at the largest score of the other tokens (neither special
        nor the explained position). Signed methods (``direct_logit``, ``alti_logit``) are
        drawn on a diverging scale centred at 0 with symmetric limits, negative scores in
        blue (:data:`attnflow.plot.SIGNED_CMAP`).

        With a patch `grid` (an image): one panel per method, the patch scores at `layer`
        (the last by default) upsampled over the image
        (:func:`attnflow.plot.image_overlay`), each on the scale of its own patch scores;
        the non-patch tokens are left out of the picture.
        """
        chosen = list(self.scores) if methods is None else list(methods)
        unknown = [m for m in chosen if m not in self.scores]
        if unknown:
            msg = f"`methods` must name scored methods {list(self.scores)}; got {unknown}."
            raise ValueError(msg)
        if self.grid is not None:
            return self._plot_grid(chosen, layer)
        from ._colours import is_signed
        from .plot import layer_token_map

        maps = {name: self.scores[name] for name in chosen}
        # Signed methods (direct_logit, alti_logit): a diverging scale centred at 0.
        signed = [is_signed(name) for name in chosen]
        vmax = None
        excluded = self._excluded(scale_special)
        if excluded:
            kept = np.ones(len(self.tokens), dtype=bool)
            kept[excluded] = False
            vmax = max(
                float(np.abs(m[:, kept]).max() if flag else m[:, kept].max())
                for m, flag in zip(maps.values(), signed, strict=True)
            )
        return layer_token_map(
            maps, tokens=list(self.tokens), title=self._heading(-1), vmax=vmax, signed=signed
        )

    # -- image (patch grid) views --------------------------------------------------------

    def _show_grid(self, layer: int, out: TextIO, top: int) -> None:
        """show() of an image: the non-patch tokens, the top patches, character maps."""
        given: object = top
        if isinstance(given, bool) or not isinstance(given, int) or top < 0:
            msg = f"`top` must be an int >= 0 (patches listed); got {top!r}."
            raise ValueError(msg)
        assert self.grid is not None
        rows, cols = self.grid
        extra = self.extra_tokens
        values = self.at_layer(layer)
        first = next(iter(values.values()))
        patches = np.argsort(-first[extra:], kind="stable")[:top] + extra
        listed = [*range(extra), *(int(i) for i in patches)]
        others = "token" if extra == 1 else "tokens"
        print(
            f"{self._heading(layer)}; {rows} x {cols} patches after {extra} other {others}",
            file=out,
        )
        width = max(8, *(len(self.tokens[i]) for i in listed)) if listed else 8
        columns = [max(12, len(name) + 2) for name in values]
        header = "token".ljust(width) + "".join(
            name.rjust(size) for name, size in zip(values, columns, strict=True)
        )
        print(header, file=out)
        for i in listed:
            cells = "".join(
                f"{float(v[i]):{size}.4f}" for v, size in zip(values.values(), columns, strict=True)
            )
            print(self.tokens[i].ljust(width) + cells, file=out)
        print(
            f"patches (darkest {_RAMP[0]} to brightest {_RAMP[-1]}, each map on its own scale):",
            file=out,
        )
        spans = [max(cols, len(name)) + 2 for name in values]
        print(
            "".join(name.ljust(s) for name, s in zip(values, spans, strict=True)).rstrip(), file=out
        )
        maps = [_characters(v[extra:].reshape(rows, cols)) for v in values.values()]
        for r in range(rows):
            line = "".join(m[r].ljust(s) for m, s in zip(maps, spans, strict=True))
            print(line.rstrip(), file=out)

    def _plot_grid(self, chosen: Sequence[str], layer: int) -> Any:
        """plot() of an image: each method's patch scores over the image, side by side."""
        from .plot import _new_figure, image_overlay

        assert self.grid is not None
        rows, cols = self.grid
        values = self.at_layer(layer)
        image = self.image
        if image is None:  # no picture kept: the patch map alone, one block per patch
            image = np.full((rows, cols), 0.5)
        height, width = image.shape[:2]
        panel = 4.0 * min(2.0, max(0.5, width / height))
        figure = _new_figure((panel * len(chosen) + 1.0, 4.4))
        figure.suptitle(self._heading(layer))
        for index, name in enumerate(chosen):
            axes = figure.add_subplot(1, len(chosen), index + 1)
            image_overlay(
                values[name],
                image,
                grid=(rows, cols),
                extra_tokens=self.extra_tokens,
                ax=axes,
                title=name,
                alpha=0.5 if self.image is not None else 1.0,
                interpolation="bilinear" if self.image is not None else "nearest",
            )
        return figure

    # -- data ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Return everything as a JSON-serialisable dict (scores as nested lists)."""
        return {
            "format": _FORMAT,
            "tokens": list(self.tokens),
            "scores": {name: values.tolist() for name, values in self.scores.items()},
            "rows": self.rows,
            "special": self.special.tolist(),
            "target": self.target,
            "predicted": self.predicted,
            "probabilities": None if self.probabilities is None else self.probabilities.tolist(),
            "labels": _labels_as_json(self.labels),
            "text": self.text,
            "grid": None if self.grid is None else list(self.grid),
            "image": None if self.image is None else self.image.tolist(),
            "notes": list(self.notes),
            "sinks": list(self.sinks),
            "offsets": None if self.offsets is None else [list(o) for o in self.offsets],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Explanation:
        """Rebuild an explanation from :meth:`to_dict`'s output."""
        if data.get("format") != _FORMAT:
            msg = f"not an attnflow explanation (format {data.get('format')!r}, expected {_FORMAT!r})."
            raise ValueError(msg)
        return cls(
            data["tokens"],
            {name: np.asarray(values) for name, values in data["scores"].items()},
            rows=data["rows"] if "rows" in data else data["row"],  # "row" before 0.1
            special=data["special"],
            target=data["target"],
            predicted=data["predicted"],
            probabilities=data["probabilities"],
            labels=_labels_from_json(data["labels"]),
            text=data["text"],
            grid=None if data.get("grid") is None else tuple(data["grid"]),
            image=data.get("image"),
            notes=data.get("notes", ()),
            sinks=data.get("sinks", ()),
            offsets=None if data.get("offsets") is None else [tuple(o) for o in data["offsets"]],
        )

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write one ``.npz``: the scores as arrays, the rest as JSON (no pickle).

        Written atomically; an existing file is kept unless `overwrite`.
        """
        from ._arrayio import write_npz

        target = Path(path)
        if target.suffix != ".npz":
            msg = f"`path` must end in .npz; got {target.name!r}."
            raise ValueError(msg)
        meta = self.to_dict()
        del meta["scores"]
        arrays = {f"scores/{name}": values for name, values in self.scores.items()}
        if self.image is not None:
            meta["image"] = None
            arrays["image"] = self.image
        if self.probabilities is not None:  # a language model's vocabulary is large
            meta["probabilities"] = None
            arrays["probabilities"] = self.probabilities
        arrays["meta"] = np.asarray(json.dumps(meta))
        if not overwrite and os.path.lexists(target):
            msg = f"{target} exists; pass overwrite=True to replace it."
            raise FileExistsError(msg)
        return write_npz(target, arrays, force=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Explanation:
        """Read an explanation written by :meth:`save`.

        Every array's header is checked (shape, dtype, size, the scores' width against
        the tokens) before its data is read, so a damaged or hostile file (a small archive
        declaring gigabytes) is refused, never inflated, with one line naming the file.

        Raises
        ------
        ValueError
            On a file that is not an explanation written by :meth:`save`, damaged or
            truncated (an ``attnflow._arrayio.ArrayFileError``, a ValueError).
        """
        from ._array_headers import open_entries
        from ._arrayio import ArrayFileError, read_selected
        from ._header_checks import check_explanation

        file = Path(path)
        meta_array = read_selected(file, required=("meta",), check=check_explanation)["meta"]
        from ._json_limits import JSONLimitError, load_json

        try:
            meta = load_json(str(meta_array), file)
        except JSONLimitError as error:
            raise ArrayFileError(str(error)) from None
        try:
            n = len(meta["tokens"])
        except (KeyError, TypeError) as error:
            msg = f"{file}: its metadata is not an attnflow explanation's ({error!r})"
            raise ArrayFileError(msg) from None
        names = [name for name in open_entries(file) if name.startswith("scores/")]
        optional = ("image", "probabilities")
        data = read_selected(
            file, required=names, optional=optional, check=lambda h: check_explanation(h, n=n)
        )
        meta["scores"] = {name.split("/", 1)[1]: data[name] for name in names}
        for name in optional:
            if name in data:
                meta[name] = data[name]
        try:
            return cls.from_dict(meta)
        except (KeyError, TypeError, ValueError) as error:
            msg = f"{file}: not a valid attnflow explanation ({error})"
            raise ArrayFileError(msg) from None


def _checked_labels(labels: object) -> tuple[str, ...] | dict[int, str] | None:
    """Class names: one per class (a sequence), or some classes' names by index (a mapping).

    A mapping suits a language model, whose classes are a vocabulary: only the predicted
    and the explained token need a name.
    """
    if labels is None:
        return None
    if isinstance(labels, Mapping):
        bad = [k for k in labels if isinstance(k, bool) or not isinstance(k, int | np.integer)]
        if bad:
            msg = f"`labels` as a mapping must have int class indices as keys; got {bad[0]!r}."
            raise TypeError(msg)
        return {int(k): str(v) for k, v in labels.items()}
    if isinstance(labels, str) or not isinstance(labels, Sequence):
        msg = (
            "`labels` must be a sequence of class names or a mapping class index -> name; "
            f"got {type(labels).__name__}."
        )
        raise TypeError(msg)
    return tuple(str(label) for label in labels)


def _labels_as_json(labels: tuple[str, ...] | dict[int, str] | None) -> Any:
    # JSON objects have string keys: a mapping is kept as [index, name] pairs.
    if isinstance(labels, dict):
        return {"by_index": [[k, v] for k, v in labels.items()]}
    return None if labels is None else list(labels)


def _labels_from_json(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {int(k): str(v) for k, v in value["by_index"]}
    return value


def _optional_int(value: object, name: str) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        msg = f"`{name}` must be an int or None; got {value!r}."
        raise TypeError(msg)
    return int(value)


def _checked_offsets(
    offsets: object, n: int, text: str | None
) -> tuple[tuple[int, int], ...] | None:
    """Offsets: one (start, end) pair of ints per token, inside the text."""
    if offsets is None:
        return None
    pairs = list(offsets) if isinstance(offsets, Sequence | np.ndarray) else None
    if pairs is None or len(pairs) != n:
        msg = f"`offsets` must hold one (start, end) pair per token ({n}); got {offsets!r}."
        raise ValueError(msg)
    out = []
    for pair in pairs:
        start, end = (int(v) for v in pair)
        if not 0 <= start <= end or (text is not None and end > len(text)):
            msg = f"`offsets` must be character ranges of the text; got {tuple(pair)!r}."
            raise ValueError(msg)
        out.append((start, end))
    return tuple(out)


def _checked_sinks(sinks: object, n: int) -> tuple[int, ...]:
    """Sinks: distinct token positions in [0, n), kept in ascending order."""
    if isinstance(sinks, str) or not isinstance(sinks, Sequence | np.ndarray):
        msg = f"`sinks` must be a sequence of token positions; got {sinks!r}."
        raise TypeError(msg)
    out: list[int] = []
    for position in sinks:
        if isinstance(position, bool) or not isinstance(position, int | np.integer):
            msg = f"`sinks` must hold token positions (int); got {position!r}."
            raise TypeError(msg)
        if not 0 <= int(position) < n:
            msg = f"`sinks` must hold positions of the {n} tokens (0 to {n - 1}); got {position}."
            raise ValueError(msg)
        out.append(int(position))
    return tuple(sorted(set(out)))


def _checked_grid(grid: object, image: object, n: int) -> tuple[tuple[int, int] | None, Any]:
    """Validate Explanation's `grid` and `image`; return them as (rows, cols) and ndarray."""
    if grid is None:
        if image is not None:
            msg = "`image` needs `grid=(rows, cols)`, the patch grid its scores are laid on."
            raise ValueError(msg)
        return None, None
    rows, cols = check_patch_grid(grid)
    if rows * cols > n:
        msg = (
            f"`grid`=({rows}, {cols}) has {rows * cols} patches, more than the {n} tokens; "
            "the tokens must be the non-patch tokens followed by the patches, row by row."
        )
        raise ValueError(msg)
    if image is None:
        return (rows, cols), None
    pixels = np.asarray(image)
    if not (pixels.ndim == 2 or (pixels.ndim == 3 and pixels.shape[-1] in (3, 4))):
        msg = f"`image` must have shape (H, W), (H, W, 3) or (H, W, 4); got {pixels.shape}."
        raise ValueError(msg)
    if pixels.dtype.kind in "iu":
        if pixels.size and (pixels.min() < 0 or pixels.max() > 255):
            msg = "`image` of integers must hold 8-bit values, 0 to 255."
            raise ValueError(msg)
        return (rows, cols), pixels.astype(np.uint8)
    if pixels.dtype.kind not in "fb":
        msg = f"`image` must hold numbers; got dtype {pixels.dtype}."
        raise ValueError(msg)
    return (rows, cols), pixels.astype(np.float64)


def _characters(patches: np.ndarray) -> list[str]:
    """Draw a (rows, cols) map as lines of _RAMP characters, scaled to its own range."""
    low, high = float(patches.min()), float(patches.max())
    if high <= low:
        levels = np.zeros(patches.shape, dtype=int)
    else:
        scaled = (patches - low) / (high - low) * len(_RAMP)
        levels = np.minimum(scaled.astype(int), len(_RAMP) - 1)
    return ["".join(_RAMP[level] for level in line) for line in levels]
