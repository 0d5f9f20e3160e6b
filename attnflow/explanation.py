"""A labelled explanation of one input: tokens, scores per method and layer, the class.

:class:`Explanation` is what the adapters' one-call helpers return
(:func:`attnflow.adapters.torch.explain_text`): the tokens of one input, the scores of
each method at every layer for one output position, and the model's prediction. It shows
itself in a terminal (:meth:`Explanation.show`), in a notebook (``_repr_html_``), as a
standalone page (:meth:`Explanation.to_html`; with several methods or layers, picked in
the page by :class:`attnflow.html.InteractiveView`) and as a figure (:meth:`Explanation.plot`),
and it saves to one ``.npz`` file with its metadata as JSON inside (no pickle), read back
with :meth:`Explanation.load`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

__all__ = ["Explanation"]

_FORMAT = "attnflow.Explanation/1"


class Explanation:
    """Scores of several methods for one output position of one input, with its tokens.

    Parameters
    ----------
    tokens : sequence of str
        The ``n`` tokens of the input, special tokens included.
    scores : mapping of str to array
        Per method (``"raw"``, ``"rollout"``, ``"flow"``...), the scores of the explained
        row at every layer, ``(layers, n)`` (first layer first), or at one layer, ``(n,)``.
    row : int, default 0
        The output position explained (0: ``[CLS]`` for BERT-like models).
    special : sequence of bool, optional
        True for special tokens (``[CLS]``, ``[SEP]``, padding). They stay in the data;
        the views leave them out of the colour scale unless asked not to.
    target : int, optional
        The class explained (gradient-weighted methods), if any.
    predicted : int, optional
        The class the model predicts.
    probabilities : array of shape (classes,), optional
        The model's class probabilities.
    labels : sequence of str, optional
        The class names, indexed by class.
    text : str, optional
        The raw input.

    Attributes
    ----------
    tokens : tuple of str
    scores : dict of str to ndarray
        ``(layers, n)`` float64 per method.
    row, target, predicted : int or None
    special : ndarray of bool
    probabilities : ndarray or None
    labels : tuple of str or None
    text : str or None

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
    """

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Mapping[str, Any],
        *,
        row: int = 0,
        special: Sequence[bool] | None = None,
        target: int | None = None,
        predicted: int | None = None,
        probabilities: Any = None,
        labels: Sequence[str] | None = None,
        text: str | None = None,
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
        self.row = _optional_int(row, "row")
        self.special = np.zeros(n, dtype=bool) if special is None else np.asarray(special, bool)
        if self.special.shape != (n,):
            msg = f"`special` must hold one bool per token ({n}); got shape {self.special.shape}."
            raise ValueError(msg)
        self.target = _optional_int(target, "target")
        self.predicted = _optional_int(predicted, "predicted")
        self.probabilities = (
            None if probabilities is None else np.asarray(probabilities, dtype=np.float64)
        )
        self.labels = None if labels is None else tuple(str(label) for label in labels)
        self.text = text

    def __repr__(self) -> str:
        methods = ", ".join(self.scores)
        return (
            f"Explanation(tokens={len(self.tokens)}, methods=[{methods}], "
            f"layers={self.n_layers}, row={self.row}, predicted={self._class(self.predicted)})"
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
        if index is None:
            return "None"
        if self.labels is not None and 0 <= index < len(self.labels):
            return f"{index} ({self.labels[index]})"
        return str(index)

    def _heading(self, layer: int | None) -> str:
        token = self.tokens[self.row] if 0 <= self.row < len(self.tokens) else "?"
        parts = [f"row {self.row} ({token})"]
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

    def show(self, layer: int = -1, *, file: TextIO | None = None) -> None:
        """Print a table: one line per token, one column per method, at one layer."""
        out = sys.stdout if file is None else file
        values = self.at_layer(layer)
        width = max(8, *(len(t) for t in self.tokens))
        columns = [max(12, len(name) + 2) for name in values]
        print(self._heading(layer), file=out)
        header = "token".ljust(width) + "".join(
            name.rjust(size) for name, size in zip(values, columns, strict=True)
        )
        print(header, file=out)
        for i, token in enumerate(self.tokens):
            cells = "".join(
                f"{float(v[i]):{size}.4f}" for v, size in zip(values.values(), columns, strict=True)
            )
            print(token.ljust(width) + cells, file=out)

    def _excluded(self, scale_special: bool) -> list[int]:
        exclude = [] if scale_special else [int(i) for i in np.flatnonzero(self.special)]
        return [] if len(exclude) == len(self.tokens) else exclude  # none left to scale by

    def _view(self, layer: int, *, scale_special: bool) -> Any:
        from .html import TokenView

        return TokenView(
            self.at_layer(layer),
            self.tokens,
            title=self._heading(layer),
            scale_exclude=self._excluded(scale_special),
        )

    def _interactive(self, layer: int, *, scale_special: bool) -> Any:
        """Build an interactive view of every method and layer (None: one of each)."""
        from .html import InteractiveView

        if len(self.scores) == 1 and self.n_layers == 1:
            return None
        if not -self.n_layers <= layer < self.n_layers:
            msg = f"`layer` must index the {self.n_layers} layers; got {layer}."
            raise IndexError(msg)
        rows = [self.row] if self.row is not None and 0 <= self.row < len(self.tokens) else None
        return InteractiveView(
            self.scores,
            self.tokens,
            rows=rows,
            title=self._heading(None),
            scale_exclude=self._excluded(scale_special),
            layer=layer,
        )

    def _render(self, layer: int, *, scale_special: bool, page: bool) -> str:
        """Render the interactive view (given a choice) and the static table of `layer`.

        The static table of every method at `layer` is what readers without scripts see.
        """
        static = self._view(layer, scale_special=scale_special)
        interactive = self._interactive(layer, scale_special=scale_special)
        if interactive is None:
            return str(static.to_html() if page else static._repr_html_())
        from .html import _with_fallback

        return _with_fallback(interactive, static, page=page)

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
        scripts. The file is written atomically and never replaces an existing one unless
        `overwrite`.
        """
        from .html import _write_page

        text = self._render(layer, scale_special=scale_special, page=True)
        if path is not None:
            _write_page(lambda: text, path, overwrite=overwrite)
        return text

    def plot(self, *, methods: Sequence[str] | None = None, scale_special: bool = False) -> Any:
        """Draw a layer x token map per method (matplotlib; ``attnflow[plot]``).

        Special tokens are drawn with the others; with ``scale_special=False`` the colour
        scale of each map ends at the largest score of the other tokens.
        """
        from .plot import layer_token_map

        chosen = list(self.scores) if methods is None else list(methods)
        unknown = [m for m in chosen if m not in self.scores]
        if unknown:
            msg = f"`methods` must name scored methods {list(self.scores)}; got {unknown}."
            raise ValueError(msg)
        maps = {name: self.scores[name] for name in chosen}
        vmax = None
        if not scale_special and not self.special.all():
            vmax = max(float(m[:, ~self.special].max()) for m in maps.values())
        return layer_token_map(maps, tokens=list(self.tokens), title=self._heading(-1), vmax=vmax)

    # -- data ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Return everything as a JSON-serialisable dict (scores as nested lists)."""
        return {
            "format": _FORMAT,
            "tokens": list(self.tokens),
            "scores": {name: values.tolist() for name, values in self.scores.items()},
            "row": self.row,
            "special": self.special.tolist(),
            "target": self.target,
            "predicted": self.predicted,
            "probabilities": None if self.probabilities is None else self.probabilities.tolist(),
            "labels": None if self.labels is None else list(self.labels),
            "text": self.text,
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
            row=data["row"],
            special=data["special"],
            target=data["target"],
            predicted=data["predicted"],
            probabilities=data["probabilities"],
            labels=data["labels"],
            text=data["text"],
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
        arrays["meta"] = np.asarray(json.dumps(meta))
        if not overwrite and os.path.lexists(target):
            msg = f"{target} exists; pass overwrite=True to replace it."
            raise FileExistsError(msg)
        return write_npz(target, arrays, force=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Explanation:
        """Read an explanation written by :meth:`save`."""
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            meta["scores"] = {
                key.split("/", 1)[1]: data[key] for key in data.files if key.startswith("scores/")
            }
        return cls.from_dict(meta)


def _optional_int(value: object, name: str) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        msg = f"`{name}` must be an int or None; got {value!r}."
        raise TypeError(msg)
    return int(value)
