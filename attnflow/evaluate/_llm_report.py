"""What the ground truth of a causal LM measured: :class:`GroundTruthReport`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ._erasure import ERASER_FRACTIONS

__all__ = ["GroundTruthReport"]


@dataclass(frozen=True)
class GroundTruthReport:
    """What :func:`attnflow.evaluate.ground_truth` measured.

    Parameters
    ----------
    correct : ndarray of bool, shape (B,)
        Whether the model answers each item: its top next token is the answer, or, for the
        tasks with a foil (agreement, IOI), the answer's logit is above the foil's.
    ranks : dict of str to ndarray of int64, shape (B, layers)
        Per method, the rank of the source among the context's positions at each reported
        layer (one column for methods without layers); for every item (correct or not).
    comprehensiveness, sufficiency : dict of str to ndarray, shape (B, K)
        Per method (its top layer), the drop of the answer's log-probability (nats) when
        the top-ranked `fractions` of the removable tokens are replaced (comprehensiveness),
        or when all but them are (sufficiency); NaN for the items answered wrongly. Empty
        without a `replacement`.
    fractions : tuple of float
        The ERASER fractions.
    tasks : ndarray of str, shape (B,)
        The task of each item.
    prompt_ranks : dict of str to ndarray of int64, shape (B, layers)
        The same ranks among every prompt position (the query's tokens compete too);
        ``scope="prompt"`` in the accessors.
    seconds : dict of str to float
        Per method, the wall-clock seconds it took over all items.

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
    >>> report.mrr("gae", layer=0), report.best_layer("gae")
    (0.41666666666666663, 1)
    """

    correct: np.ndarray
    ranks: dict[str, np.ndarray]
    comprehensiveness: dict[str, np.ndarray] = field(default_factory=dict)
    sufficiency: dict[str, np.ndarray] = field(default_factory=dict)
    fractions: tuple[float, ...] = ERASER_FRACTIONS
    tasks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=str))
    prompt_ranks: dict[str, np.ndarray] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

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

    def mrr(self, method: str, *, layer: int = -1, scope: str = "context") -> float:
        """Mean reciprocal rank of the source under `method` at `layer`, over the correct items."""
        ranks = self._ranks(method, scope)[:, layer]
        return float(np.mean(1.0 / ranks)) if ranks.size else math.nan

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
        """Return a table: per method, hit@1, MRR and mean rank (top and best layer), AOPCs, time."""
        header = (
            "| method | hit@1 | MRR | mean rank | best layer: hit@1 (mean rank) | "
            "whole prompt: hit@1 (mean rank) | "
            "comprehensiveness (AOPC, nats) | sufficiency (AOPC, nats) | s per item |"
        )
        lines = [header, "|---|---|---|---|---|---|---|---|---|"]
        for name, ranks in self.ranks.items():
            best = self.best_layer(name)
            layered = ranks.shape[1] > 1
            best_text = (
                f"{best}: {self.hit_rate(name, layer=best):.2f} "
                f"({self.mean_rank(name, layer=best):.1f})"
                if layered and self.correct.any()
                else "-"
            )
            comp = self._aopc(self.comprehensiveness.get(name))
            suff = self._aopc(self.sufficiency.get(name))
            whole = (
                f"{self.hit_rate(name, scope='prompt'):.2f} "
                f"({self.mean_rank(name, scope='prompt'):.1f})"
                if name in self.prompt_ranks
                else "-"
            )
            seconds = self.seconds.get(name)
            timed = f"{seconds / len(self.correct):.2f}" if seconds is not None else "-"
            lines.append(
                f"| {name} | {self.hit_rate(name):.2f} | {self.mrr(name):.2f} | "
                f"{self.mean_rank(name):.1f} | {best_text} | {whole} | {comp} | {suff} | "
                f"{timed} |"
            )
        return "\n".join(lines)

    def _aopc(self, values: np.ndarray | None) -> str:
        if values is None:
            return "-"
        chosen = values[self.correct]
        return f"{float(np.nanmean(chosen)):.2f}" if chosen.size else "-"
