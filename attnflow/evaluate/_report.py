"""The result of a faithfulness evaluation: per-sample values and their summary tables."""

from __future__ import annotations

import html
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ._markdown import markdown_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["FaithfulnessReport"]

_REFERENCE_LABELS = {"blank_out": "blank-out", "input_gradients": "input gradients"}
_CORRELATION_LABELS = {
    "spearman": "Spearman",
    "kendall": "Kendall",
    "spearman_dense": "Spearman (dense ranks, no-ties formula)",
}
_OVER_LAYERS = ("each", "cumulative")
_METRIC_LABELS = {
    "comprehensiveness": "comprehensiveness AOPC (higher is more faithful)",
    "sufficiency": "sufficiency AOPC (lower is more faithful)",
}


def _summary(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean, population standard deviation and count over samples (axis 0), NaN left out."""
    finite = np.isfinite(values)
    count = finite.sum(axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns give NaN
        return np.nanmean(values, axis=0), np.nanstd(values, axis=0), count


def _cumulative_summary(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and population sd at layer l of the values of layers 0..l pooled: ``(N, L)``."""
    finite = np.isfinite(values)
    count = np.cumsum(finite.sum(axis=0))
    first = np.cumsum(np.where(finite, values, 0.0).sum(axis=0))
    second = np.cumsum(np.where(finite, values * values, 0.0).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = first / count
        variance = np.maximum(second / count - mean * mean, 0.0)
    return mean, np.sqrt(variance)


def _check_over_layers(over_layers: object) -> str:
    if over_layers not in _OVER_LAYERS:
        msg = (
            f"`over_layers` must be one of {_OVER_LAYERS} (each layer on its own, or the "
            f"values of layers 1..l pooled as the paper's log prints them); got {over_layers!r}."
        )
        raise ValueError(msg)
    return str(over_layers)


@dataclass(frozen=True)
class FaithfulnessReport:
    """What :func:`faithfulness` measured: per-sample values and their summaries.

    Parameters
    ----------
    samples : mapping of str to ndarray
        Per-sample arrays: ``index``, ``predicted``, ``target``, ``probability`` (of the
        target), ``label`` (with targets), ``scores.<method>`` ``(N, layers, n)``,
        ``reference.<reference>`` ``(N, n)``, ``correlation.<method>.<reference>``
        ``(N, layers)``, ``comprehensiveness.<method>`` and ``sufficiency.<method>``
        ``(N, layers, bins)``.
    methods, references : tuple of str
        What was compared with what.
    correlation : str
        ``"spearman"`` or ``"kendall"``.
    blank_out_score : str
        The blank-out score used.
    rows : int or str
        The explained output row, or ``"max"``/``"mean"`` over rows.
    fractions : tuple of float or None
        The erasure bins, or None when they were skipped.
    seconds : float
        Wall time of the evaluation (of this run, when resumed).
    blank_out_last_token : str, default "blank"
        How blank-out scored the last token of each sequence ("blank" or "zero").

    See Also
    --------
    faithfulness : Produces it.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate import FaithfulnessReport
    >>> samples = {"correlation.rollout.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]])}
    >>> report = FaithfulnessReport(samples, ("rollout",), ("blank_out",), "spearman", "drop", 0)
    >>> report.correlation_mean("rollout", "blank_out")
    array([0.4, 0.8])
    >>> report.n_layers
    2
    """

    samples: Mapping[str, np.ndarray]
    methods: tuple[str, ...]
    references: tuple[str, ...]
    correlation: str
    blank_out_score: str
    rows: int | str
    fractions: tuple[float, ...] | None = None
    seconds: float = field(default=0.0, compare=False)
    blank_out_last_token: str = "blank"

    # -- numbers ------------------------------------------------------------------------
    @property
    def n_samples(self) -> int:
        """The number of samples evaluated.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> report.n_samples
        2
        """
        return len(next(iter(self.samples.values())))

    @property
    def n_layers(self) -> int:
        """The number of layers of the model.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> report.n_layers
        2
        """
        method, reference = self.methods[0], self.references[0] if self.references else ""
        key = f"correlation.{method}.{reference}"
        if key in self.samples:
            return int(self.samples[key].shape[1])
        return int(self.samples[f"scores.{method}"].shape[1])

    @property
    def accuracy(self) -> float | None:
        """The share of samples whose predicted class is their label (None without labels).

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> report.accuracy
        0.5
        """
        if "label" not in self.samples:
            return None
        return float(np.mean(self.samples["predicted"] == self.samples["label"]))

    def _correlations(self, method: str, reference: str) -> np.ndarray:
        key = f"correlation.{method}.{reference}"
        if key not in self.samples:
            msg = (
                f"no correlation of {method!r} with {reference!r} in this report; it has "
                f"methods {list(self.methods)} and references {list(self.references)}."
            )
            raise KeyError(msg)
        return self.samples[key]

    def correlation_mean(
        self,
        method: str,
        reference: str,
        *,
        over_layers: Literal["each", "cumulative"] = "each",
    ) -> np.ndarray:
        r"""Return the mean correlation of `method` with `reference` at each layer.

        Parameters
        ----------
        method, reference : str
            A method and a reference score of the report.
        over_layers : {"each", "cumulative"}, default "each"
            ``"each"``: the mean over samples of layer :math:`l`'s correlations.
            ``"cumulative"``: the mean of the correlations of layers :math:`1..l` of all
            samples pooled, :math:`\bar\rho_{\le l} = \frac{1}{l} \sum_{k \le l}
            \bar\rho_k` (without NaN), which is what the log of Abnar & Zuidema's code
            for Tables 1-2 prints as "layer l" (its lists are never reset between
            layers); the paper's tables are the per-layer values,
            :math:`l \bar\rho_{\le l} - (l - 1) \bar\rho_{\le l-1}`.

        Returns
        -------
        ndarray of shape (layers,)
            The mean over samples (NaN, from ``nan="omit"``, left out).

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> report.correlation_mean("flow", "blank_out")
        array([0.4, 0.8])
        >>> report.correlation_mean("flow", "blank_out", over_layers="cumulative")
        array([0.4, 0.6])
        """
        values = self._correlations(method, reference)
        if _check_over_layers(over_layers) == "cumulative":
            return _cumulative_summary(values)[0]
        return _summary(values)[0]

    def correlation_std(
        self,
        method: str,
        reference: str,
        *,
        over_layers: Literal["each", "cumulative"] = "each",
    ) -> np.ndarray:
        """Return the standard deviation of the correlation over samples at each layer.

        Parameters
        ----------
        method, reference : str
            A method and a reference score of the report.
        over_layers : {"each", "cumulative"}, default "each"
            As for :meth:`correlation_mean`: ``"cumulative"`` pools the correlations of
            layers 1..l of all samples, as the paper code's log.

        Returns
        -------
        ndarray of shape (layers,)
            The population standard deviation (``ddof=0``, as the paper's code).

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> report.correlation_std("flow", "blank_out")
        array([0.1, 0.1])
        >>> report.correlation_std("flow", "blank_out", over_layers="cumulative").round(4)
        array([0.1   , 0.2236])
        """
        values = self._correlations(method, reference)
        if _check_over_layers(over_layers) == "cumulative":
            return _cumulative_summary(values)[1]
        return _summary(values)[1]

    def aopc(self, method: str, metric: str = "comprehensiveness") -> tuple[np.ndarray, np.ndarray]:
        """Return the mean and standard deviation over samples of the AOPC at each layer.

        Parameters
        ----------
        method : str
            A method of the report.
        metric : {"comprehensiveness", "sufficiency"}, default "comprehensiveness"
            The erasure metric; a sample's AOPC is its average over the fractions.

        Returns
        -------
        mean : ndarray of shape (layers,)
            The mean AOPC over samples.
        std : ndarray of shape (layers,)
            Its standard deviation over samples (``ddof=0``).

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> mean, std = report.aopc("flow")
        >>> mean
        array([0.2, 0.3])
        """
        key = f"{metric}.{method}"
        if key not in self.samples:
            msg = f"no {metric!r} for {method!r} in this report (were `fractions` None?)."
            raise KeyError(msg)
        values = self.samples[key]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            per_sample = np.nanmean(values, axis=-1)
        mean, std, _ = _summary(per_sample)
        return mean, std

    # -- tables ---------------------------------------------------------------------------
    def records(self) -> list[dict[str, Any]]:
        """Return the summary in long form: one dict per method, layer and measure.

        Returns
        -------
        list of dict
            Keys ``method``, ``layer`` (from 1), ``measure`` (``"spearman:blank_out"``,
            ``"aopc:comprehensiveness"``, ...), ``mean``, ``std`` and ``samples``.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> report.records()[0]
        {'method': 'flow', 'layer': 1, 'measure': 'spearman:blank_out', 'mean': 0.4, 'std': 0.1, 'samples': 2}
        """
        rows: list[dict[str, Any]] = []
        for method in self.methods:
            for reference in self.references:
                mean, std, count = _summary(self._correlations(method, reference))
                for layer in range(len(mean)):
                    rows.append(
                        {
                            "method": method,
                            "layer": layer + 1,
                            "measure": f"{self.correlation}:{reference}",
                            "mean": float(mean[layer]),
                            "std": float(std[layer]),
                            "samples": int(count[layer]),
                        }
                    )
            if self.fractions is None:
                continue
            for metric in ("comprehensiveness", "sufficiency"):
                values = self.samples[f"{metric}.{method}"]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    per_sample = np.nanmean(values, axis=-1)
                mean, std, count = _summary(per_sample)
                for layer in range(len(mean)):
                    rows.append(
                        {
                            "method": method,
                            "layer": layer + 1,
                            "measure": f"aopc:{metric}",
                            "mean": float(mean[layer]),
                            "std": float(std[layer]),
                            "samples": int(count[layer]),
                        }
                    )
        return rows

    def to_frame(self) -> Any:
        """Return the summary as a pandas DataFrame in long form (needs pandas).

        Returns
        -------
        pandas.DataFrame
            The rows of :meth:`records`.

        Raises
        ------
        ImportError
            Without pandas.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> report.to_frame().shape  # doctest: +SKIP
        (6, 6)
        """
        try:
            import pandas as pd
        except ImportError:
            msg = "to_frame() needs pandas (`pip install pandas`); records() gives the same rows."
            raise ImportError(msg) from None
        return pd.DataFrame.from_records(self.records())

    def _tables(self, *, aopc: bool) -> list[tuple[str, list[str], list[list[str]]]]:
        """(title, header, rows) of each table: one per reference, then the AOPCs."""
        layers = [f"L{layer + 1}" for layer in range(self.n_layers)]
        tables = []
        name = _CORRELATION_LABELS.get(self.correlation, self.correlation.capitalize())
        for reference in self.references:
            body = []
            for method in self.methods:
                mean = self.correlation_mean(method, reference)
                std = self.correlation_std(method, reference)
                body.append(
                    [method, *(f"{m:.2f} ± {s:.2f}" for m, s in zip(mean, std, strict=True))]
                )
            label = _REFERENCE_LABELS.get(reference, reference)
            title = f"{name} correlation with {label} (mean ± sd over {self.n_samples} samples)"
            tables.append((title, ["method", *layers], body))
        if aopc and self.fractions is not None:
            bins = ", ".join(f"{f:g}" for f in self.fractions)
            for metric in ("comprehensiveness", "sufficiency"):
                body = []
                for method in self.methods:
                    mean, std = self.aopc(method, metric)
                    body.append(
                        [method, *(f"{m:.3f} ± {s:.3f}" for m, s in zip(mean, std, strict=True))]
                    )
                title = f"ERASER {_METRIC_LABELS[metric]}, fractions {bins}"
                tables.append((title, ["method", *layers], body))
        return tables

    def to_markdown(self, *, aopc: bool = True) -> str:
        """Return the summary tables in Markdown, as in the paper's Tables 1 and 2.

        Parameters
        ----------
        aopc : bool, default True
            Add the comprehensiveness and sufficiency tables.

        Returns
        -------
        str
            One table per reference (methods x layers, mean ± sd), then the AOPCs.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> print(report.to_markdown(aopc=False))
        Spearman correlation with blank-out (mean ± sd over 2 samples)
        <BLANKLINE>
        | method | L1          | L2          |
        |--------|-------------|-------------|
        | flow   | 0.40 ± 0.10 | 0.80 ± 0.10 |
        """
        parts = []
        for title, header, body in self._tables(aopc=aopc):
            parts.append(f"{title}\n\n{markdown_table(header, body)}")
        return "\n\n".join(parts)

    def to_html(self) -> str:
        """Return the summary tables as an HTML fragment (no scripts, no external resources).

        Returns
        -------
        str
            The accuracy and one ``<table>`` per table of :meth:`to_markdown`.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> report.to_html().count("<table>")
        3
        """
        pieces = []
        for title, header, body in self._tables(aopc=True):
            head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
            rows = "".join(
                "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                for row in body
            )
            pieces.append(
                f"<table><caption>{html.escape(title)}</caption>"
                f"<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
            )
        accuracy = "" if self.accuracy is None else f"<p>Accuracy: {self.accuracy:.4f}</p>"
        return f'<div class="attnflow-faithfulness">{accuracy}{"".join(pieces)}</div>'

    def _repr_html_(self) -> str:
        return self.to_html()

    def to_dict(self) -> dict[str, Any]:
        """Return the settings and summaries as JSON-serialisable values.

        Returns
        -------
        dict
            The settings, ``samples``, ``layers``, ``accuracy`` and the ``summary``
            (:meth:`records`, with NaN as None).

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> report.to_dict()["accuracy"]
        0.5
        """
        return {
            "methods": list(self.methods),
            "references": list(self.references),
            "correlation": self.correlation,
            "blank_out_score": self.blank_out_score,
            "blank_out_last_token": self.blank_out_last_token,
            "rows": self.rows,
            "fractions": None if self.fractions is None else list(self.fractions),
            "samples": self.n_samples,
            "layers": self.n_layers,
            "accuracy": self.accuracy,
            "seconds": self.seconds,
            "summary": [
                {
                    k: (None if isinstance(v, float) and not np.isfinite(v) else v)
                    for k, v in r.items()
                }
                for r in self.records()
            ],
        }

    def to_json(self) -> str:
        """Return :meth:`to_dict` as JSON text.

        Returns
        -------
        str
            Indented JSON, ending with a newline.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> import json
        >>> json.loads(report.to_json())["layers"]
        2
        """
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def plot(self, **options: Any) -> Figure:
        """Draw correlations (and AOPC) by layer, one line per method.

        Parameters
        ----------
        **options
            Passed to :func:`attnflow.plot.faithfulness_by_layer`.

        Returns
        -------
        matplotlib.figure.Figure
            One panel per reference and erasure metric.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.evaluate import FaithfulnessReport
        >>> samples = {
        ...     "correlation.flow.blank_out": np.array([[0.5, 0.7], [0.3, 0.9]]),
        ...     "comprehensiveness.flow": np.array([[[0.2, 0.4], [0.1, 0.3]], [[0.0, 0.2], [0.3, 0.5]]]),
        ...     "sufficiency.flow": np.zeros((2, 2, 2)),
        ...     "predicted": np.array([1, 0]),
        ...     "label": np.array([1, 1]),
        ... }
        >>> report = FaithfulnessReport(
        ...     samples, ("flow",), ("blank_out",), "spearman", "drop", 0, fractions=(0.1, 0.5)
        ... )
        >>> len(report.plot().axes)
        3
        """
        from attnflow.plot import faithfulness_by_layer

        return faithfulness_by_layer(self, **options)
