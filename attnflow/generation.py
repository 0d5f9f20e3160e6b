"""The attribution of generated text: one row of scores per generated token.

:class:`GenerationExplanation` is what :func:`attnflow.adapters.torch.explain_generation`
returns: the tokens of a prompt and of the text a causal language model generated after
it, the generated token ids, and per method a ``(T, P + T - 1)`` array of scores for a
prompt of ``P`` tokens and ``T`` generated ones. Row ``t`` explains generated token ``t``
at the position that predicted it, the last one of its prefix (``P + t - 1``): its
scores cover the prompt and the ``t`` tokens generated before it, and are zero beyond.

It shows itself in a terminal (:meth:`GenerationExplanation.show`: the strongest sources
of each generated token, or the full table of one), in a notebook and as a standalone page
(:meth:`GenerationExplanation.to_html`: pick a generated token, by a click or the menu, and
see its attribution over the tokens before it, with the colours and controls of
:class:`attnflow.html.InteractiveView`), hands any one token's row on as an
:class:`attnflow.explanation.Explanation` (:meth:`GenerationExplanation.explanation`), and
saves to one ``.npz`` file with its metadata as JSON inside (no pickle), read back, with
every array's header checked first, by :meth:`GenerationExplanation.load`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ._display import check_finite
from ._sinks import top_sources
from .explanation import Explanation, _checked_sinks

__all__ = ["GenerationExplanation"]

_FORMAT = "attnflow.GenerationExplanation/1"
#: The arrays a saved file may hold besides ``scores/<method>``.
_ARRAYS = ("meta", "generated_ids", "prompt_ids", "special")


class GenerationExplanation:
    r"""Scores of several methods for every generated token, over the tokens before it.

    Parameters
    ----------
    tokens : sequence of str
        The ``P + T`` tokens: the prompt's ``P`` (special tokens included), then the
        ``T`` generated ones.
    generated_ids : sequence of int
        The ``T`` generated token ids (vocabulary indices), in order.
    scores : mapping of str to array
        Per method (``"rollout"``, ``"gradient_rollout"``, ``"raw"``...), an array of
        shape ``(T, P + T - 1)``: row ``t`` attributes generated token ``t`` to the
        tokens ``0 .. P + t - 1`` before it, read at the position that predicted it
        (``P + t - 1``), and is zero from column ``P + t`` on.
    prompt_length : int
        ``P``, at least 1.
    prompt_ids : sequence of int, optional
        The prompt's ``P`` token ids.
    special : sequence of bool, optional
        True for special tokens (BOS, chat-template markers), one per token. The HTML
        views leave them out of the colour scale unless asked not to.
    prompt, generated_text : str, optional
        The prompt and the generated text, decoded.
    sinks : sequence of int, optional
        The prompt's attention sinks (:func:`attnflow.adapters.torch.explain_generation`
        finds them: the first position, and any position whose mean attention share from
        the queries after it is at least 0.3). Their scores stay in the data; the views
        leave them out of the colour scale and of the strongest sources, and say so.
    self_excluded : bool, default False
        True when each row's score at its own (predicting) position was set to 0
        (``explain_generation``'s default); the page says so. Whatever it says, the
        predicting position is never listed among the strongest sources.

    Attributes
    ----------
    tokens : tuple of str
    generated_ids : ndarray of int64, shape (T,)
    prompt_ids : ndarray of int64, shape (P,), or None
    scores : dict of str to ndarray
        ``(T, P + T - 1)`` float64 per method.
    prompt_length : int
    special : ndarray of bool, shape (P + T,)
    prompt, generated_text : str or None
    sinks : tuple of int
    self_excluded : bool

    Raises
    ------
    ValueError
        If the shapes do not agree (``P + T`` tokens, ``T`` ids, ``(T, P + T - 1)``
        scores), a score is not finite, or a row has a score beyond its prefix.
    TypeError
        If `tokens` is not a sequence of str or an id is not an integer.

    See Also
    --------
    attnflow.adapters.torch.explain_generation : Builds it.
    attnflow.explanation.Explanation : One output position of one input.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.generation import GenerationExplanation
    >>> rollout = np.array([[0.3, 0.5, 0.2, 0.0], [0.2, 0.3, 0.1, 0.4]])  # T = 2, P = 3
    >>> g = GenerationExplanation(
    ...     ["<s>", "Hi", " you", " there", "!"], [7, 9], {"rollout": rollout},
    ...     prompt_length=3, special=[True, False, False, False, False],
    ... )
    >>> g
    GenerationExplanation(prompt=3 tokens, generated=2 tokens, methods=[rollout])
    >>> g.show()  # never the special token, nor the position that predicted the token
    2 tokens generated after a prompt of 3; the 3 strongest sources of each, by method
    Each generated token is attributed to the prompt and the text generated before it; the score of the position that predicted it is kept in the data but never listed among the sources.
    [3] ' there' (id 7), predicted at position 2
        rollout  [1] 'Hi' 0.5
    [4] '!' (id 9), predicted at position 3
        rollout  [1] 'Hi' 0.3  [2] ' you' 0.1
    >>> g.show(step=1)
    row 3 (' there'), layer 1 of 1; target 9
    token        rollout
    <s>           0.2000
    Hi            0.3000
     you          0.1000
     there        0.4000
    >>> GenerationExplanation.from_dict(g.to_dict()).scores["rollout"].shape
    (2, 4)
    """

    def __init__(
        self,
        tokens: Sequence[str],
        generated_ids: Sequence[int] | Any,
        scores: Mapping[str, Any],
        *,
        prompt_length: int,
        prompt_ids: Sequence[int] | Any | None = None,
        special: Sequence[bool] | Any | None = None,
        prompt: str | None = None,
        generated_text: str | None = None,
        sinks: Sequence[int] = (),
        self_excluded: bool = False,
    ) -> None:
        given: object = tokens  # checked at run time: callers may not be type-checked
        if (
            isinstance(given, str)
            or not isinstance(given, Sequence)
            or not all(isinstance(t, str) for t in given)
        ):
            msg = (
                "`tokens` must be a sequence of str (the prompt's tokens, then the generated "
                f"ones); got {type(given).__name__}."
            )
            raise TypeError(msg)
        self.tokens = tuple(tokens)
        length: object = prompt_length
        if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 1:
            msg = f"`prompt_length` must be an int >= 1 (the prompt's tokens); got {length!r}."
            raise ValueError(msg)
        self.prompt_length = int(length)
        n_generated = len(self.tokens) - self.prompt_length
        if n_generated < 1:
            msg = (
                f"`tokens` must hold the {self.prompt_length} prompt tokens and at least one "
                f"generated token; got {len(self.tokens)} tokens."
            )
            raise ValueError(msg)
        self.generated_ids = _ids(generated_ids, n_generated, "generated_ids")
        self.prompt_ids = (
            None if prompt_ids is None else _ids(prompt_ids, self.prompt_length, "prompt_ids")
        )
        given_scores: object = scores
        if not isinstance(given_scores, Mapping) or not given_scores:
            msg = "`scores` must be a non-empty mapping method name -> scores (T, P + T - 1)."
            raise ValueError(msg)
        width = len(self.tokens) - 1
        beyond = np.arange(width)[None, :] >= self.prompt_length + np.arange(n_generated)[:, None]
        self.scores: dict[str, np.ndarray] = {}
        for name, value in scores.items():
            array = np.asarray(value, dtype=np.float64)
            if array.shape != (n_generated, width):
                msg = (
                    f"`scores[{name!r}]` must have shape (T, P + T - 1) = ({n_generated}, "
                    f"{width}) for {self.prompt_length} prompt and {n_generated} generated "
                    f"tokens; got shape {np.shape(value)}."
                )
                raise ValueError(msg)
            check_finite(array, f"scores[{name!r}]")
            if array[beyond].any():
                step = int(np.flatnonzero((np.where(beyond, array, 0.0) != 0).any(axis=1))[0])
                msg = (
                    f"`scores[{name!r}]` must be zero beyond each row's prefix (row t covers "
                    f"the {self.prompt_length} + t tokens before generated token t); row "
                    f"{step} has a score at position {self.prompt_length + step} or later."
                )
                raise ValueError(msg)
            self.scores[str(name)] = array
        self.special = (
            np.zeros(len(self.tokens), dtype=bool)
            if special is None
            else np.asarray(special, dtype=bool)
        )
        if self.special.shape != (len(self.tokens),):
            msg = (
                f"`special` must hold one bool per token ({len(self.tokens)}); got shape "
                f"{self.special.shape}."
            )
            raise ValueError(msg)
        texts: tuple[tuple[str, object], ...] = (
            ("prompt", prompt),
            ("generated_text", generated_text),
        )
        for name, text in texts:
            if text is not None and not isinstance(text, str):
                msg = f"`{name}` must be a str or None; got {type(text).__name__}."
                raise TypeError(msg)
        self.prompt = prompt
        self.generated_text = generated_text
        self.sinks = _checked_sinks(sinks, len(self.tokens))
        flag: object = self_excluded  # checked at run time: callers may not be type-checked
        if not isinstance(flag, bool):
            msg = f"`self_excluded` must be a bool; got {self_excluded!r}."
            raise TypeError(msg)
        self.self_excluded = self_excluded

    # -- shape ---------------------------------------------------------------------------
    @property
    def n_generated(self) -> int:
        """``T``, the number of generated tokens."""
        return len(self.tokens) - self.prompt_length

    @property
    def generated_tokens(self) -> tuple[str, ...]:
        """The ``T`` generated tokens."""
        return self.tokens[self.prompt_length :]

    def __repr__(self) -> str:
        return (
            f"GenerationExplanation(prompt={self.prompt_length} tokens, "
            f"generated={self.n_generated} tokens, methods=[{', '.join(self.scores)}])"
        )

    def _step(self, step: object) -> int:
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            msg = f"`step` must be an int (a generated token's index); got {step!r}."
            raise TypeError(msg)
        if not -self.n_generated <= step < self.n_generated:
            msg = (
                f"`step` must index the {self.n_generated} generated tokens (0 to "
                f"{self.n_generated - 1}, or negative from the end); got {step}."
            )
            raise IndexError(msg)
        return int(step) % self.n_generated

    def explanation(self, step: int) -> Explanation:
        """Return generated token `step`'s scores as an :class:`~attnflow.explanation.Explanation`.

        Its tokens are the ``P + step`` tokens before that token, its row the position that
        predicted it (``P + step - 1``) and its target the generated id; ``show``, ``plot``
        and ``to_html`` are the ones of one input.
        """
        index = self._step(step)
        end = self.prompt_length + index
        return Explanation(
            list(self.tokens[:end]),
            {name: values[index, :end] for name, values in self.scores.items()},
            rows=end - 1,
            special=self.special[:end].tolist(),
            sinks=[k for k in self.sinks if k < end],
            target=int(self.generated_ids[index]),
            text=self.prompt,
        )

    # -- views ---------------------------------------------------------------------------
    def show(self, step: int | None = None, *, top: int = 3, file: TextIO | None = None) -> None:
        """Print the `top` strongest sources of every generated token, by method.

        With `step`, the full table of that generated token instead: one line per token
        before it, one column per method (:meth:`Explanation.show`).
        """
        out = sys.stdout if file is None else file
        if step is not None:
            self.explanation(step).show(file=out)
            return
        given: object = top
        if isinstance(given, bool) or not isinstance(given, int) or top < 1:
            msg = f"`top` must be an int >= 1 (sources listed per token); got {top!r}."
            raise ValueError(msg)
        print(
            f"{self.n_generated} tokens generated after a prompt of {self.prompt_length}; "
            f"the {top} strongest sources of each, by method",
            file=out,
        )
        for note in self._notes():
            print(note, file=out)
        width = max(len(name) for name in self.scores) + 2
        for index, token in enumerate(self.generated_tokens):
            position = self.prompt_length + index
            print(
                f"[{position}] {token!r} (id {int(self.generated_ids[index])}), predicted at "
                f"position {position - 1}",
                file=out,
            )
            # Never the predicting position itself, nor a sink or a special token.
            leave_out = [*np.flatnonzero(self.special).tolist(), *self.sinks, position - 1]
            for name, values in self.scores.items():
                row = values[index, :position]
                order = top_sources(row, count=top, leave_out=leave_out)
                cells = "  ".join(f"[{j}] {self.tokens[j]!r} {row[j]:.4g}" for j in order)
                print(f"    {name.ljust(width)}{cells}", file=out)

    def _title(self) -> str:
        return (
            f"{self.n_generated} generated tokens after a prompt of {self.prompt_length}: "
            "pick a generated token (click it, or the row menu) to see its attribution over "
            "the tokens before it"
        )

    def _notes(self) -> list[str]:
        """Return what a reader must know: the sinks left aside, the predicting position's score."""
        from ._sinks import sink_note

        notes = [sink_note(self.tokens, self.sinks)] if self.sinks else []
        own = (
            "set to 0 (exclude_self)"
            if self.self_excluded
            else "kept in the data but never listed among the sources"
        )
        notes.append(
            "Each generated token is attributed to the prompt and the text generated before "
            f"it; the score of the position that predicted it is {own}."
        )
        return notes

    def _render(self, *, scale_special: bool, page: bool) -> str:
        """Render the interactive view of every generated token, static rows as fallback."""
        import html

        from ._colours import is_signed
        from .html import InteractiveView, TokenView, _with_fallback

        n = len(self.tokens)
        padded = {
            name: np.concatenate([values, np.zeros((self.n_generated, 1))], axis=1)[None]
            for name, values in self.scores.items()
        }
        excluded = (
            [] if scale_special else sorted({*np.flatnonzero(self.special).tolist(), *self.sinks})
        )
        if len(excluded) == n:
            excluded = []
        positions = list(range(self.prompt_length, n))
        view = InteractiveView(
            padded,
            self.tokens,
            rows=positions,
            title=self._title(),
            scale_exclude=excluded,
            row=positions[0],
            signed=[name for name in padded if is_signed(name)],
        )
        first = next(iter(padded))
        static = TokenView(
            {
                f"{p}: {self.tokens[p]} ({first}; predicted at {p - 1})": padded[first][0, index]
                for index, p in enumerate(positions)
            },
            self.tokens,
            title=self._title(),
            scale_exclude=excluded,
            signed=is_signed(first),
        )
        text = _with_fallback(view, static, page=page)
        notes = self._notes() if not scale_special else self._notes()[-1:]
        paragraph = (
            '<p class="attnflow-note" style="font: 12px system-ui, -apple-system, sans-serif; '
            'color: #555; margin: 0.3em 0;">'
            f"{html.escape(' '.join(notes))}</p>\n"
        )
        at = text.find('<div class="attnflow-')
        return text if at < 0 else text[:at] + paragraph + text[at:]

    def _repr_html_(self) -> str:
        """HTML for notebooks: every method and generated token, specials out of the scale."""
        return self._render(scale_special=False, page=False)

    def to_html(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        scale_special: bool = False,
        overwrite: bool = False,
    ) -> str:
        """Return a standalone HTML page; with `path`, also write it there.

        The page holds every method's rows (:class:`attnflow.html.InteractiveView`): a
        menu picks the method, a click on a generated token (or the row menu, or Enter on
        a focused token) picks the token explained, and the tokens before it are coloured
        by their scores, white (0) to red (the largest shown), values on hover; the token
        explained is outlined and the tokens after it score 0. Special tokens are left out
        of the colour scale unless `scale_special`. Readers without scripts get the first
        method's rows, one line per generated token. Written atomically; an existing file
        is kept unless `overwrite`.
        """
        from .html import _write_page

        text = self._render(scale_special=scale_special, page=True)
        if path is not None:
            _write_page(lambda: text, path, overwrite=overwrite)
        return text

    # -- data ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Return everything as a JSON-serialisable dict (arrays as nested lists)."""
        return {
            "format": _FORMAT,
            "tokens": list(self.tokens),
            "prompt_length": self.prompt_length,
            "generated_ids": self.generated_ids.tolist(),
            "prompt_ids": None if self.prompt_ids is None else self.prompt_ids.tolist(),
            "scores": {name: values.tolist() for name, values in self.scores.items()},
            "special": self.special.tolist(),
            "prompt": self.prompt,
            "generated_text": self.generated_text,
            "sinks": list(self.sinks),
            "self_excluded": self.self_excluded,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationExplanation:
        """Rebuild a generation explanation from :meth:`to_dict`'s output."""
        given: object = data
        if not isinstance(given, Mapping) or given.get("format") != _FORMAT:
            found = given.get("format") if isinstance(given, Mapping) else type(given).__name__
            msg = (
                f"not an attnflow generation explanation (format {found!r}, expected {_FORMAT!r})."
            )
            raise ValueError(msg)
        missing = [
            key for key in ("tokens", "prompt_length", "generated_ids", "scores") if key not in data
        ]
        if missing:
            msg = f"an attnflow generation explanation needs {missing}; they are missing."
            raise ValueError(msg)
        return cls(
            data["tokens"],
            data["generated_ids"],
            {name: np.asarray(values) for name, values in data["scores"].items()},
            prompt_length=data["prompt_length"],
            prompt_ids=data.get("prompt_ids"),
            special=data.get("special"),
            prompt=data.get("prompt"),
            generated_text=data.get("generated_text"),
            sinks=data.get("sinks", ()),
            self_excluded=data.get("self_excluded", False),
        )

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write one ``.npz``: the scores and ids as arrays, the rest as JSON (no pickle).

        Written atomically; an existing file is kept unless `overwrite`.

        Raises
        ------
        ValueError
            If `path` does not end in ``.npz``.
        FileExistsError
            If `path` exists and `overwrite` is False.
        """
        from ._arrayio import write_npz

        target = Path(path)
        if target.suffix != ".npz":
            msg = f"`path` must end in .npz; got {target.name!r}."
            raise ValueError(msg)
        meta = self.to_dict()
        for key in ("scores", "generated_ids", "prompt_ids", "special"):
            del meta[key]
        arrays: dict[str, np.ndarray] = {
            f"scores/{name}": values for name, values in self.scores.items()
        }
        arrays["generated_ids"] = self.generated_ids
        if self.prompt_ids is not None:
            arrays["prompt_ids"] = self.prompt_ids
        arrays["special"] = self.special
        arrays["meta"] = np.asarray(json.dumps(meta))
        if not overwrite and os.path.lexists(target):
            msg = f"{target} exists; pass overwrite=True to replace it."
            raise FileExistsError(msg)
        return write_npz(target, arrays, force=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> GenerationExplanation:
        """Read a generation explanation written by :meth:`save`.

        Every array's header (name, shape, dtype) is checked before its data is read, and
        nothing is unpickled.

        Raises
        ------
        ValueError
            With one line naming the file, if it is missing, damaged, truncated, holds
            pickled data, or is not a generation explanation.
        """
        from ._arrayio import ArrayFileError, read_arrays

        file = Path(path)
        try:
            arrays = read_arrays(file, accept=_accept)
        except ArrayFileError as error:
            raise ValueError(str(error)) from None
        if "meta" not in arrays:
            msg = f"{file}: not an attnflow generation explanation (no 'meta' array)"
            raise ValueError(msg)
        from ._json_limits import load_json

        meta = load_json(str(arrays["meta"]), file, "'meta' array")
        if not isinstance(meta, dict):
            msg = f"{file}: its 'meta' array is not a JSON object"
            raise ValueError(msg)  # noqa: TRY004 - a damaged file, as every load error
        if meta.get("format") != _FORMAT:
            msg = (
                f"{file}: not an attnflow generation explanation (format "
                f"{meta.get('format')!r}, expected {_FORMAT!r})"
            )
            raise ValueError(msg)
        meta["scores"] = {
            key.split("/", 1)[1]: values
            for key, values in arrays.items()
            if key.startswith("scores/")
        }
        for key in ("generated_ids", "prompt_ids", "special"):
            meta[key] = arrays.get(key)
        try:
            return cls.from_dict(meta)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            text = str(error).splitlines()[0] if str(error) else type(error).__name__
            msg = f"{file}: not a valid attnflow generation explanation: {text}"
            raise ValueError(msg) from None


def _accept(header: Any) -> None:
    """Refuse, from its header alone, an array a saved generation explanation never holds."""
    name, shape, kind = header.name, header.shape, header.dtype.kind
    if name.startswith("scores/"):
        if kind != "f" or len(shape) != 2:
            msg = "scores must be a 2-d float array (T, P + T - 1)"
            raise ValueError(msg)
    elif name == "meta":
        if kind != "U" or shape != ():
            msg = "meta must be one JSON string"
            raise ValueError(msg)
        from ._json_limits import MAX_JSON_CHARS

        if header.nbytes > 4 * MAX_JSON_CHARS:  # 4 bytes a character
            msg = (
                f"meta declares {header.nbytes // 4:,} characters of JSON, more than the "
                f"{MAX_JSON_CHARS:,} attnflow reads"
            )
            raise ValueError(msg)
    elif name in ("generated_ids", "prompt_ids"):
        if kind not in "iu" or len(shape) != 1:
            msg = "token ids must be a 1-d integer array"
            raise ValueError(msg)
    elif name == "special":
        if kind != "b" or len(shape) != 1:
            msg = "special must be a 1-d bool array"
            raise ValueError(msg)
    else:
        msg = f"not part of a generation explanation (expected scores/<method> or {_ARRAYS})"
        raise ValueError(msg)


def _ids(values: object, count: int, name: str) -> np.ndarray:
    """`values` as ``count`` token ids, int64."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu" or array.shape != (count,):
        msg = (
            f"`{name}` must hold {count} integer token ids; got {array.dtype} values of "
            f"shape {array.shape}."
        )
        raise (TypeError if array.dtype.kind not in "iu" else ValueError)(msg)
    return array.astype(np.int64)
