r"""Score attributions of a causal LM against a known source token (issue 21, item 7).

For prompts whose answer has a known source position (:mod:`._llm_tasks`), an attribution of
the answer (a score per prompt token for the last position) should rank that position
first. :func:`source_ranks` computes the rank; :func:`ground_truth` runs the whole protocol
(accuracy, hit@1 and mean rank per method and layer, ERASER comprehensiveness and
sufficiency of the answer's log-probability) over items, with the model and the methods
given as plain functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnflow._host import to_host
from attnflow._namespace import array_device, array_namespace, enter_boundary
from attnflow._typing import Array, Namespace
from attnflow._validation import describe

from ._erasure import ERASER_FRACTIONS, comprehensiveness, sufficiency
from ._llm_tasks import TaskTokens

__all__ = [
    "GroundTruthReport",
    "competing_positions",
    "ground_truth",
    "max_attention",
    "max_contribution",
    "source_ranks",
]

# Log-probabilities are mapped to two-class "probabilities" q = 1 + log p / _FLOOR for the
# erasure functions: differences of q times _FLOOR are differences of log p (exact above
# the floor, log p >= _FLOOR nats).
_FLOOR = 200.0


def competing_positions(
    n: int, /, *, explained: int = -1, context: tuple[int, int] | None = None
) -> np.ndarray:
    """Mark the prompt positions that compete for rank 1: all but the first and the explained.

    Position 0 is left out because a causal LM uses its first token as an attention sink
    (SmolLM2's tokenizer adds no BOS, so the first word plays that part), and a source is
    never there by construction; the explained position (the last, whose next token is
    the answer) is left out because attributions give it its own residual stream. With
    `context`, only the context's positions compete: the query after the context (the
    repeated words, the asked key, the question) says *which* context token to use and is
    not a candidate source, as in context attribution (ContextCite, Cohen-Wang et al.
    2024, arXiv 2409.00729).

    Parameters
    ----------
    n : int
        Number of prompt tokens (>= 3).
    explained : int, default -1
        The explained position (negative counts from the end).
    context : tuple of int, optional
        ``(start, stop)``: only positions ``start <= j < stop`` compete (``TaskTokens.context``).

    Returns
    -------
    ndarray of bool, shape (n,)
        True for the positions that compete for the first rank.

    Examples
    --------
    >>> from attnflow.evaluate import competing_positions
    >>> competing_positions(5)
    array([False,  True,  True,  True, False])
    >>> competing_positions(5, context=(0, 3))
    array([False,  True,  True, False, False])
    """
    size: object = n
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 3:
        msg = f"`n` must be an int >= 3 (a first token, a candidate and the explained one); got {n!r}."
        raise ValueError(msg)
    position: object = explained
    if isinstance(position, bool) or not isinstance(position, int | np.integer):
        msg = f"`explained` must be an int position; got {explained!r}."
        raise TypeError(msg)
    if not -n <= explained < n:
        msg = f"`explained` must be a position in [-{n}, {n}); got {explained}."
        raise IndexError(msg)
    competing = np.ones(n, dtype=bool)
    if context is not None:
        bounds = tuple(context)
        if len(bounds) != 2 or not all(isinstance(b, int | np.integer) for b in bounds):
            msg = f"`context` must be (start, stop) ints or None; got {context!r}."
            raise TypeError(msg)
        if not 0 <= bounds[0] < bounds[1] <= n:
            msg = f"`context` must satisfy 0 <= start < stop <= n = {n}; got {context!r}."
            raise ValueError(msg)
        competing[: bounds[0]] = False
        competing[bounds[1] :] = False
    competing[0] = False
    competing[explained % n] = False
    return competing


def source_ranks(
    scores: Array,
    sources: np.ndarray | Sequence[int],
    /,
    *,
    explained: int = -1,
    contexts: Sequence[tuple[int, int] | None] | None = None,
) -> Array:
    r"""Rank of each item's source position in its scores, among the competing positions.

    .. math::

        \operatorname{rank} = 1 + \#\{\, j \in C,\ j \ne s : x_j \ge x_s \,\},

    with :math:`x` the scores, :math:`s` the source and :math:`C` the competing positions
    (:func:`competing_positions`: all but the first and the explained). Ties count against
    the source, so a constant score never ranks it first. hit@1 is ``rank == 1``.

    Parameters
    ----------
    scores : array of shape (B, ..., n)
        Attributions, one per prompt token (e.g. one rollout row, or one per layer with
        ``(B, layers, n)``). Any array library; NaN is refused.
    sources : array or sequence of int, shape (B,)
        The source position of each item, a competing position.
    explained : int, default -1
        The explained position, left out of the competition.
    contexts : sequence of (start, stop) or None, optional
        Per item, the context positions that compete (``TaskTokens.context``); None (or a
        None entry): the whole prompt.

    Returns
    -------
    array of int64, shape (B, ...)
        Ranks from 1 (best) to ``n - 2``, in the namespace and on the device of `scores`.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate import source_ranks
    >>> scores = np.array([[0.9, 0.1, 0.5, 0.2, 0.8], [0.3, 0.3, 0.3, 0.1, 0.0]])
    >>> source_ranks(scores, [2, 1])
    array([1, 2])

    Only the context competes with ``contexts``: position 3 (a query token) outranks the
    source 2 over the whole prompt, not within the context ``(0, 3)``:

    >>> scores = np.array([[0.9, 0.1, 0.5, 0.7, 0.8]])
    >>> source_ranks(scores, [2]), source_ranks(scores, [2], contexts=[(0, 3)])
    (array([2]), array([1]))
    """
    (converted,), boundary = enter_boundary([scores], ["scores"])
    if getattr(converted, "shape", None) is None or len(converted.shape) < 2:
        msg = f"`scores` must be an array of shape (B, ..., n); got {describe(scores)}."
        raise ValueError(msg)
    host = to_host(converted, name="scores").astype(np.float64)
    if np.isnan(host).any():
        msg = "`scores` holds NaN; a rank is undefined."
        raise ValueError(msg)
    batch, n = host.shape[0], host.shape[-1]
    spans = [None] * batch if contexts is None else list(contexts)
    if len(spans) != batch:
        msg = (
            f"`contexts` must hold one (start, stop) or None per item ({batch}); got {len(spans)}."
        )
        raise ValueError(msg)
    competing = np.stack([competing_positions(n, explained=explained, context=c) for c in spans])
    positions = np.asarray(sources)
    if positions.shape != (batch,) or positions.dtype.kind not in "iu":
        msg = f"`sources` must hold one int position per item, shape ({batch},); got {describe(sources)}."
        raise ValueError(msg)
    clipped = np.clip(positions, 0, n - 1)
    if not competing[np.arange(batch), clipped].all() or (positions >= n).any():
        msg = (
            f"`sources` must be competing positions (1 .. n - 2 = {n - 2}, inside the context, "
            f"not the explained one); got {positions.tolist()}."
        )
        raise ValueError(msg)
    flat = host.reshape(batch, -1, n)
    own = np.take_along_axis(flat, positions[:, None, None], axis=-1)
    others = competing[:, None, :] & (np.arange(n) != positions[:, None, None])
    ranks = 1 + np.sum(others & (flat >= own), axis=-1)
    result = ranks.reshape(host.shape[:-1]).astype(np.int64)
    # Counted on the host; handed back in the caller's namespace and device, as int64.
    xp = array_namespace(converted)
    back = xp.asarray(result, device=array_device(converted))
    return boundary.restore(back)


def max_attention(attentions: Array, /, *, rows: int = -1, xp: Namespace | None = None) -> Array:
    r"""Return the largest attention any head of any layer gives each key from the explained row.

    .. math::

        m_j = \max_{l, h} W_{l,h}[i, j],

    for the explained position :math:`i`. A gradient-free attribution for decoders: where
    one head of one layer retrieves the source (an induction or retrieval head), its weight
    on the source stands out, whereas rollout and flow average it with every other head and
    smear it through the layers below (measured in docs/evaluation.md, "Ground truth on a
    causal LM"). Attention sinks (the first token) also get large maxima: leave them out of
    the comparison (:func:`competing_positions` does).

    Parameters
    ----------
    attentions : array of shape (\*batch, layers, heads, n, n)
        Attention probabilities, rows = queries (any array-API library).
    rows : int, default -1
        The explained position (negative counts from the end).
    xp : namespace, optional
        Inferred from `attentions` by default.

    Returns
    -------
    array of shape (\*batch, n)
        In the namespace, dtype and device of `attentions`.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate import max_attention
    >>> w = np.full((2, 2, 3, 3), 1 / 3)
    >>> w[1, 0, 2] = [0.1, 0.8, 0.1]
    >>> max_attention(w)
    array([0.33333333, 0.8       , 0.33333333])
    """
    namespace = array_namespace(attentions) if xp is None else xp
    shape = getattr(attentions, "shape", None)
    if shape is None or len(shape) < 4 or shape[-1] != shape[-2]:
        msg = (
            "`attentions` must be an array of shape (*batch, layers, heads, n, n); got "
            f"{describe(attentions)}. Stack a sequence of per-layer arrays first."
        )
        raise ValueError(msg)
    explained = attentions[..., _one_position(rows, shape[-1]), :]
    return namespace.max(namespace.max(explained, axis=-2), axis=-2)


def max_contribution(
    contributions: Array, /, *, rows: int = -1, xp: Namespace | None = None
) -> Array:
    r"""Return the largest contribution any layer makes to the explained row from each key.

    .. math::

        m_j = \max_l C_l[i, j], \qquad
        C_l[i, j] = \Big\lVert \sum_h \alpha^h_{l,ij} f^h_l(z_j) \Big\rVert_2 ,

    for the explained position :math:`i`, with :math:`C_l` a value-aware token-mixing
    matrix of layer :math:`l`: the norm-based contributions of Kobayashi et al. (2020),
    "Attention is Not Only a Weight" (``capture(model, contributions="norm")``, or
    :func:`attnflow.contributions` with ``method="norm"``), whose :math:`f^h_l(z_j)` is
    head :math:`h`'s transformed value of key :math:`j`. The value-aware twin of
    :func:`max_attention`: an attention sink takes much of a row's weight but, its values
    being small, little of its contribution, so it competes less with the token a
    retrieval head reads. Nothing is composed across layers (see docs/evaluation.md,
    "Ground truth on a causal LM", for why composing fails on a decoder).

    Parameters
    ----------
    contributions : array of shape (\*batch, layers, n, n)
        One token-mixing matrix per layer, rows = receiving tokens (any array-API
        library). Rows need not sum to one.
    rows : int, default -1
        The explained position (negative counts from the end).
    xp : namespace, optional
        Inferred from `contributions` by default.

    Returns
    -------
    array of shape (\*batch, n)
        In the namespace, dtype and device of `contributions`.

    See Also
    --------
    max_attention : The same maximum over attention weights (layers and heads).

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate import max_contribution
    >>> c = np.zeros((2, 3, 3))
    >>> c[0, 2] = [4.0, 1.0, 2.0]
    >>> c[1, 2] = [0.5, 3.0, 1.0]
    >>> max_contribution(c)
    array([4., 3., 2.])
    """
    namespace = array_namespace(contributions) if xp is None else xp
    shape = getattr(contributions, "shape", None)
    if shape is None or len(shape) < 3 or shape[-1] != shape[-2]:
        msg = (
            "`contributions` must be an array of shape (*batch, layers, n, n), one "
            f"token-mixing matrix per layer; got {describe(contributions)}. Use "
            "max_attention for per-head attention weights (*batch, layers, heads, n, n)."
        )
        raise ValueError(msg)
    return namespace.max(contributions[..., _one_position(rows, shape[-1]), :], axis=-2)


def _one_position(rows: object, n: int) -> int:
    """Check `rows`, one int position of `n` tokens; return it non-negative."""
    if isinstance(rows, bool) or not isinstance(rows, int | np.integer):
        msg = f"`rows` must be one int position; got {rows!r}."
        raise TypeError(msg)
    if not -n <= rows < n:
        msg = f"`rows` must be a position in [-{n}, {n}); got {rows}."
        raise IndexError(msg)
    return int(rows) % n


Method = Callable[[TaskTokens], Any]
LogProbabilities = Callable[[Any], Any]


@dataclass(frozen=True)
class GroundTruthReport:
    """What :func:`ground_truth` measured.

    Parameters
    ----------
    correct : ndarray of bool, shape (B,)
        Whether the model's top next token is the answer's first token.
    ranks : dict of str to ndarray of int64, shape (B, layers)
        Per method, the rank of the source among the context's positions at each reported
        layer (one column for methods without layers); for every item (correct or not).
    comprehensiveness, sufficiency : dict of str to ndarray, shape (B, K)
        Per method (its top layer), the drop of the answer's log-probability (nats) when
        the top-ranked `fractions` of the removable tokens are replaced (comprehensiveness),
        or when all but them are (sufficiency); NaN for the items answered wrongly.
    fractions : tuple of float
        The ERASER fractions.
    tasks : ndarray of str, shape (B,)
        The task of each item.
    prompt_ranks : dict of str to ndarray of int64, shape (B, layers)
        The same ranks among every prompt position (the query's tokens compete too);
        ``scope="prompt"`` in the accessors.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate import GroundTruthReport
    >>> report = GroundTruthReport(
    ...     correct=np.array([True, True, False]),
    ...     ranks={"gae": np.array([[3, 1], [2, 1], [5, 4]])},
    ... )
    >>> report.accuracy, report.hit_rate("gae"), report.mean_rank("gae", layer=0)
    (0.6666666666666666, 1.0, 2.5)
    >>> report.best_layer("gae")
    1
    """

    correct: np.ndarray
    ranks: dict[str, np.ndarray]
    comprehensiveness: dict[str, np.ndarray] = field(default_factory=dict)
    sufficiency: dict[str, np.ndarray] = field(default_factory=dict)
    fractions: tuple[float, ...] = ERASER_FRACTIONS
    tasks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=str))
    prompt_ranks: dict[str, np.ndarray] = field(default_factory=dict)

    def _ranks(self, method: str, scope: str) -> np.ndarray:
        if scope not in ("context", "prompt"):
            msg = f"`scope` must be 'context' or 'prompt'; got {scope!r}."
            raise ValueError(msg)
        table = self.ranks if scope == "context" else self.prompt_ranks
        if method not in table:
            msg = f"no {scope} ranks for method {method!r}; methods: {sorted(table)}."
            raise KeyError(msg)
        chosen: np.ndarray = table[method][self.correct]
        return chosen

    @property
    def accuracy(self) -> float:
        """The share of items the model answers correctly."""
        return float(self.correct.mean()) if self.correct.size else math.nan

    def hit_rate(self, method: str, *, layer: int = -1, scope: str = "context") -> float:
        """hit@1 of `method` at `layer` over the correctly answered items."""
        ranks = self._ranks(method, scope)[:, layer]
        return float(np.mean(ranks == 1)) if ranks.size else math.nan

    def mean_rank(self, method: str, *, layer: int = -1, scope: str = "context") -> float:
        """Mean rank of the source under `method` at `layer`, over the correct items."""
        ranks = self._ranks(method, scope)[:, layer]
        return float(np.mean(ranks)) if ranks.size else math.nan

    def best_layer(self, method: str, *, scope: str = "context") -> int:
        """Return the layer with the highest hit@1 (ties: the lowest mean rank, then the first)."""
        ranks = self._ranks(method, scope)
        if not ranks.size:
            return int(ranks.shape[1]) - 1
        keys = [(-np.mean(col == 1), np.mean(col)) for col in ranks.T]
        best: int = min(range(len(keys)), key=keys.__getitem__)
        return best

    def to_markdown(self) -> str:
        """Return a table: per method, hit@1 and mean rank (top and best layer), AOPCs."""
        header = (
            "| method | hit@1 | mean rank | best layer: hit@1 (mean rank) | "
            "whole prompt: hit@1 (mean rank) | "
            "comprehensiveness (AOPC, nats) | sufficiency (AOPC, nats) |"
        )
        lines = [header, "|---|---|---|---|---|---|---|"]
        for name, ranks in self.ranks.items():
            best = self.best_layer(name)
            layered = ranks.shape[1] > 1
            best_text = (
                f"{best}: {self.hit_rate(name, layer=best):.2f} "
                f"({self.mean_rank(name, layer=best):.1f})"
                if layered
                else "-"
            )
            comp = self._aopc(self.comprehensiveness.get(name))
            suff = self._aopc(self.sufficiency.get(name))
            if not self.correct.any():
                best_text = "-"
            whole = (
                f"{self.hit_rate(name, scope='prompt'):.2f} "
                f"({self.mean_rank(name, scope='prompt'):.1f})"
                if name in self.prompt_ranks
                else "-"
            )
            lines.append(
                f"| {name} | {self.hit_rate(name):.2f} | {self.mean_rank(name):.1f} | "
                f"{best_text} | {whole} | {comp} | {suff} |"
            )
        return "\n".join(lines)

    def _aopc(self, values: np.ndarray | None) -> str:
        if values is None:
            return "-"
        chosen = values[self.correct]
        return f"{float(np.nanmean(chosen)):.2f}" if chosen.size else "-"


def _check_items(items: object) -> list[TaskTokens]:
    if not isinstance(items, Sequence) or not all(isinstance(i, TaskTokens) for i in items):
        msg = (
            "`items` must be a sequence of TaskTokens (from locate_source); got "
            f"{type(items).__name__}."
        )
        raise TypeError(msg)
    return list(items)


def _check_methods(methods: object) -> dict[str, Method]:
    if (
        not isinstance(methods, Mapping)
        or not methods
        or not all(isinstance(k, str) and callable(v) for k, v in methods.items())
    ):
        msg = (
            "`methods` must be a non-empty mapping of names to callables "
            f"item -> scores (layers, n) or (n,); got {methods!r}."
        )
        raise TypeError(msg)
    return dict(methods)


def _scores_of(name: str, output: Any, n: int) -> np.ndarray:
    (converted,), _ = enter_boundary([output], [f"methods[{name!r}](item)"])
    host = to_host(converted, name=f"methods[{name!r}](item)").astype(np.float64)
    if host.ndim == 1:
        host = host[None]
    if host.ndim != 2 or host.shape[-1] != n:
        msg = (
            f"`methods[{name!r}]` must return scores of shape (layers, n) or (n,) with "
            f"n = {n} prompt tokens; got shape {host.shape}."
        )
        raise ValueError(msg)
    return host


def ground_truth(
    items: Sequence[TaskTokens],
    methods: Mapping[str, Method],
    log_probabilities: LogProbabilities,
    /,
    *,
    replacement: int | None = None,
    fractions: Sequence[float] = ERASER_FRACTIONS,
    erase: Sequence[str] | None = None,
) -> GroundTruthReport:
    r"""Score attribution methods of a causal LM against known source tokens.

    For each item (a prompt with a known source position ``s``, see
    :func:`locate_source`):

    - the model is correct if the top next token after the prompt is the answer's first
      token;
    - each method gives one score per prompt token, per layer, for the last position; the
      rank of ``s`` among the competing positions (:func:`competing_positions`: the
      context's tokens, ``item.context``, but the first token and the last) is
      :func:`source_ranks`; the rank among every prompt position is kept too
      (``prompt_ranks``);
    - with `replacement`, the top layer's scores go through ERASER comprehensiveness and
      sufficiency (:func:`comprehensiveness`, :func:`sufficiency`) of the answer's
      log-probability at the last position, removing only competing positions (the query,
      the first token and the explained one stay), replaced by the token `replacement`.

    hit@1 and mean ranks are read over the correctly answered items
    (:class:`GroundTruthReport`).

    Parameters
    ----------
    items : sequence of TaskTokens
        The tokenized items.
    methods : mapping of str to callable
        ``method(item) -> scores``, an array of shape ``(layers, n)`` (e.g. rollout with
        ``layers="all"``, the last row) or ``(n,)``, in any array library.
    log_probabilities : callable
        ``log_probabilities(ids) -> (B, vocab)``: the log-softmax of the next-token logits
        at the last position for a batch of token ids ``(B, n)`` (NumPy int64).
    replacement : int, optional
        The token id that replaces removed tokens in the erasure metrics; None skips them.
    fractions : sequence of float, default (0.01, 0.05, 0.1, 0.2, 0.5)
        The ERASER fractions of the removable tokens.
    erase : sequence of str, optional
        The methods whose erasure metrics are computed (each costs two batched model
        calls per correctly answered item; wrong items get NaN rows); None: all of them.

    Returns
    -------
    GroundTruthReport
        Accuracy, the source's rank per method and layer, and the erasure metrics.

    Examples
    --------
    A toy "model" that predicts the token after the previous occurrence of the last token,
    and its attention-like method that points at that token:

    >>> import numpy as np
    >>> from attnflow.evaluate import TaskTokens, TaskItem, ground_truth
    >>> def log_probabilities(ids):
    ...     out = np.full((len(ids), 10), -10.0)
    ...     for b, row in enumerate(ids):
    ...         earlier = np.flatnonzero(row[:-1] == row[-1])
    ...         out[b, row[earlier[-1] + 1] if earlier.size else 0] = 0.0
    ...     return out
    >>> def pointer(item):
    ...     ids = item.ids
    ...     scores = np.zeros(len(ids))
    ...     scores[np.flatnonzero(ids[:-1] == ids[-1])[-1] + 1] = 1.0
    ...     return scores
    >>> item = TaskItem("a b c d a", " b", (2, 3), "copying")
    >>> tokens = TaskTokens(np.array([9, 1, 2, 3, 9, 1, 2]), 3, 3, item)
    >>> report = ground_truth([tokens], {"pointer": pointer}, log_probabilities, replacement=0)
    >>> report.accuracy, report.hit_rate("pointer"), report.mean_rank("pointer")
    (1.0, 1.0, 1.0)
    >>> round(float(report.comprehensiveness["pointer"][0, 0]), 6)  # nats
    10.0
    """
    chosen = _check_items(items)
    named = _check_methods(methods)
    function: object = log_probabilities
    if not callable(function):
        msg = (
            "`log_probabilities` must be callable: ids (B, n) -> next-token log-probabilities "
            f"(B, vocab); got {type(log_probabilities).__name__}."
        )
        raise TypeError(msg)
    if replacement is not None and (
        isinstance(replacement, bool) or not isinstance(replacement, int | np.integer)
    ):
        msg = f"`replacement` must be a token id (int) or None; got {replacement!r}."
        raise TypeError(msg)
    bins = tuple(fractions)
    erased = set(named) if erase is None else set(erase)
    if isinstance(erase, str) or not erased <= set(named):
        msg = f"`erase` must be a sequence of names of `methods`; got {erase!r}."
        raise ValueError(msg)
    correct = np.zeros(len(chosen), dtype=bool)
    ranks: dict[str, list[np.ndarray]] = {name: [] for name in named}
    whole: dict[str, list[np.ndarray]] = {name: [] for name in named}
    comp: dict[str, list[np.ndarray]] = {name: [] for name in named}
    suff: dict[str, list[np.ndarray]] = {name: [] for name in named}
    for index, item in enumerate(chosen):
        ids = item.ids[None]
        n = ids.shape[1]
        base = _log_probabilities_of(log_probabilities, ids)
        correct[index] = int(np.argmax(base[0])) == item.answer_id
        where = competing_positions(n, context=item.context)[None]
        predict = _answer_predict(log_probabilities, item.answer_id)
        for name, method in named.items():
            scores = _scores_of(name, method(item), n)
            ranks[name].append(
                source_ranks(scores[None], [item.source], contexts=[item.context])[0]
            )
            whole[name].append(source_ranks(scores[None], [item.source])[0])
            if replacement is None or name not in erased:
                continue
            if not correct[index]:  # a wrong answer has no known source: not erased
                comp[name].append(np.full(len(bins), np.nan))
                suff[name].append(np.full(len(bins), np.nan))
                continue
            top = scores[-1][None]
            for kind, store in ((comprehensiveness, comp), (sufficiency, suff)):
                drop = kind(
                    predict,
                    ids,
                    top,
                    replacement=int(replacement),
                    target=0,
                    fractions=bins,
                    where=where,
                )
                store[name].append(np.asarray(drop)[0] * _FLOOR)
    widths = {name: max(r.shape[0] for r in values) for name, values in ranks.items()}
    return GroundTruthReport(
        correct=correct,
        ranks={name: np.stack(values) for name, values in ranks.items() if widths[name]},
        comprehensiveness={k: np.stack(v) for k, v in comp.items() if v},
        sufficiency={k: np.stack(v) for k, v in suff.items() if v},
        fractions=bins,
        tasks=np.array([item.item.task for item in chosen]),
        prompt_ranks={name: np.stack(values) for name, values in whole.items() if widths[name]},
    )


def _log_probabilities_of(log_probabilities: LogProbabilities, ids: np.ndarray) -> np.ndarray:
    output = log_probabilities(ids)
    (converted,), _ = enter_boundary([output], ["log_probabilities(ids)"])
    host = to_host(converted, name="log_probabilities(ids)").astype(np.float64)
    if host.ndim != 2 or host.shape[0] != ids.shape[0]:
        msg = (
            "`log_probabilities(ids)` must return next-token log-probabilities of shape "
            f"(B, vocab) = ({ids.shape[0]}, vocab); got shape {host.shape}."
        )
        raise ValueError(msg)
    return host


def _answer_predict(
    log_probabilities: LogProbabilities, answer_id: int
) -> Callable[[Any], np.ndarray]:
    """Two-class 'probabilities' ``(q, 1 - q)``, ``q = 1 + max(log p, -F) / F``, for erasure."""

    def predict(ids: Any) -> np.ndarray:
        values = _log_probabilities_of(log_probabilities, np.asarray(ids))[:, answer_id]
        q = 1.0 + np.maximum(values, -_FLOOR) / _FLOOR
        return np.stack([q, 1.0 - q], axis=1)

    return predict
