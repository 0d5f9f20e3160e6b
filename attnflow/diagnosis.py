r"""A model report for decoder LLMs: sinks, inactive heads, copying heads, which methods localise.

:func:`attnflow.adapters.torch.diagnose` (``attnflow diagnose --model FOLDER``) runs a
causal LM on a built-in probe, in-context copying items whose answer's source token is
known, and gathers the pieces; this module reduces them and draws the page:

* **sink mass** of each layer and head: the mean attention that a query row gives to the
  first position, :math:`\operatorname{mean}_{t \ge 1} A^{l,h}_{t0}` (an attention sink,
  Xiao et al. 2023, stores attention without moving information);
* **output share**: each head's share of the norms of its layer's head outputs at the
  explained rows, :math:`\lVert o^{l,h}_t\rVert / \sum_{h'} \lVert o^{l,h'}_t\rVert` with
  :math:`o^{l,h}_t = \sum_j A^{l,h}_{tj} f^{l,h}(x_j)`; a head far below its layer's mean
  (under a fifth of :math:`1/H`) is *inactive*: it attends, to a sink as a rule, but
  writes almost nothing (the value-norm criterion of "active-dormant" heads);
* **copying score**: each head's direct logit term at the source of the copied word,
  over the sum of the absolute terms of every head and token (:func:`direct_logit
  <attnflow.adapters.torch.explain>` with ``heads="each"``), averaged over the items the
  model answers: the heads that carry the answer;
* **rollout's depth bias**: the share of the last row's rollout at the first token, layer
  by layer (1 / its position count would be no bias);
* **hit@1** of each method on the probe: how often it ranks the source first among the
  context's tokens (the first token and the explained one excluded).
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._namespace import resolve_namespace
from ._typing import Namespace

__all__ = ["INACTIVE_SHARE", "ModelReport", "copying_scores", "output_shares", "sink_mass"]

#: A head is inactive when its output share is under this fraction of its layer's mean (1/H).
INACTIVE_SHARE = 0.2


def sink_mass(attentions: Any, /, *, xp: Namespace | None = None) -> Any:
    r"""Mean attention to the first position over the query rows after it.

    :math:`\operatorname{mean}_{t \ge 1} A_{t0}`: how much attention the first position
    stores (an attention sink, Xiao et al. 2023).

    Parameters
    ----------
    attentions : array ``(..., n, n)``
        Attention probabilities, rows = queries, ``n >= 2``.
    xp : namespace, optional
        The array namespace; inferred from `attentions` by default.

    Returns
    -------
    array ``(...)``
        E.g. ``(layers, heads)`` for one sequence's ``(layers, heads, n, n)``.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.diagnosis import sink_mass
    >>> A = np.array([[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.5, 0.25, 0.25]])
    >>> float(sink_mass(A))
    0.7
    """
    xp = resolve_namespace(attentions, xp=xp, names=("attentions",))
    return xp.mean(attentions[..., 1:, 0], axis=-1)


def output_shares(norms: Any, /, *, xp: Namespace | None = None) -> Any:
    r"""Each head's share of its layer's head-output norms, averaged over rows.

    :math:`\operatorname{mean}_t \lVert o^h_t\rVert / \sum_{h'} \lVert o^{h'}_t\rVert`
    (a row whose heads all write nothing counts as equal shares).

    Parameters
    ----------
    norms : array ``(..., heads, rows)``
        :math:`\lVert o^{h}_t\rVert`, the norm of each head's output at each row.
    xp : namespace, optional
        The array namespace; inferred from `norms` by default.

    Returns
    -------
    array ``(..., heads)``
        The shares; they sum to one over the heads.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.diagnosis import output_shares
    >>> norms = np.array([[3.0, 1.0], [1.0, 1.0]])  # 2 heads, 2 rows
    >>> output_shares(norms).tolist()
    [0.625, 0.375]
    """
    xp = resolve_namespace(norms, xp=xp, names=("norms",))
    total = xp.sum(norms, axis=-2, keepdims=True)
    heads = norms.shape[-2]
    shares = xp.where(total > 0, norms / xp.where(total > 0, total, 1.0), 1.0 / heads)
    return xp.mean(shares, axis=-1)


def copying_scores(terms: Any, source: int, /, *, xp: Namespace | None = None) -> Any:
    r"""Each head's direct logit term at the source over the sum of all absolute terms.

    :math:`D^{l,h}_s / \sum_{l,h,j} |D^{l,h}_j|`: signed, and the heads that carry the
    answer from the source get the largest values.

    Parameters
    ----------
    terms : array ``(layers, heads, n)``
        The direct logit terms of one explained row (``explain(...,
        method="direct_logit", heads="each", layers="all")``).
    source : int
        The source position.
    xp : namespace, optional
        The array namespace; inferred from `terms` by default.

    Returns
    -------
    array ``(layers, heads)``
        The share of each head at the source.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.diagnosis import copying_scores
    >>> terms = np.array([[[0.1, 0.6, -0.3]]])  # 1 layer, 1 head, 3 tokens
    >>> copying_scores(terms, 1).tolist()
    [[0.6]]
    """
    xp = resolve_namespace(terms, xp=xp, names=("terms",))
    total = xp.sum(xp.abs(terms))
    return terms[..., source] / xp.where(total > 0, total, 1.0)


@dataclass(frozen=True)
class ModelReport:
    """What :func:`attnflow.adapters.torch.diagnose` measured on one causal LM.

    Parameters
    ----------
    model : str
        The model's name (its class, or the folder it was loaded from).
    sink_mass : ndarray ``(layers, heads)``
        Mean attention to the first position, over query rows after it.
    output_share : ndarray ``(layers, heads)``
        Each head's share of its layer's head-output norms at the explained rows.
    copying_score : ndarray ``(layers, heads)``
        Each head's direct logit term at the copied word's source, over the sum of the
        absolute terms, mean over the correctly answered probe items.
    rollout_first : ndarray ``(layers,)``
        The share of the last row's rollout (every layer below included) at the first
        token.
    hit_rate : mapping of str to float
        The hit@1 of each method on the probe items the model answers.
    accuracy : float
        The share of probe items the model answers.
    items : int
        The number of probe items.
    seconds : float
        The wall time of the whole diagnosis.
    notes : tuple of str, default ()
        Lines added to the summary.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.diagnosis import ModelReport
    >>> report = ModelReport(
    ...     "toy", np.full((2, 2), 0.6), np.full((2, 2), 0.5), np.array([[0.1, 0.0], [0.4, -0.2]]),
    ...     np.array([0.2, 0.9]), {"rollout": 0.0, "direct_logit": 1.0}, 1.0, 4, 0.5,
    ... )
    >>> report.top_heads(1)
    [(1, 0, 0.4)]
    """

    model: str
    sink_mass: np.ndarray
    output_share: np.ndarray
    copying_score: np.ndarray
    rollout_first: np.ndarray
    hit_rate: Mapping[str, float]
    accuracy: float
    items: int
    seconds: float
    notes: tuple[str, ...] = field(default=())

    @property
    def inactive(self) -> np.ndarray:
        """``(layers, heads)`` bool: heads writing under a fifth of their layer's mean share.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.diagnosis import ModelReport
        >>> shares = np.array([[0.95, 0.05]])
        >>> z = np.zeros((1, 2))
        >>> ModelReport("toy", z, shares, z, np.zeros(1), {}, 1.0, 1, 0.0).inactive.tolist()
        [[False, True]]
        """
        heads = self.output_share.shape[-1]
        return np.asarray(self.output_share < INACTIVE_SHARE / heads)

    def top_heads(self, count: int = 5) -> list[tuple[int, int, float]]:
        """Return the heads with the largest copying score.

        Parameters
        ----------
        count : int, default 5
            How many heads.

        Returns
        -------
        list of (int, int, float)
            ``(layer, head, score)``, the largest score first.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.diagnosis import ModelReport
        >>> z = np.zeros((2, 2))
        >>> copying = np.array([[0.1, 0.0], [0.4, -0.2]])
        >>> ModelReport("toy", z, z + 0.5, copying, np.zeros(2), {}, 1.0, 1, 0.0).top_heads(2)
        [(1, 0, 0.4), (0, 0, 0.1)]
        """
        flat = np.argsort(self.copying_score, axis=None)[::-1][:count]
        layers, heads = np.unravel_index(flat, self.copying_score.shape)
        return [
            (int(layer), int(head), float(self.copying_score[layer, head]))
            for layer, head in zip(layers, heads, strict=True)
        ]

    def summary(self) -> str:
        """Return the report as text: sinks, inactive heads, copying heads, hit@1.

        Returns
        -------
        str
            One line per finding.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.diagnosis import ModelReport
        >>> z = np.zeros((2, 2))
        >>> r = ModelReport("toy", z, z + 0.5, z, np.zeros(2), {"direct_logit": 1.0}, 1.0, 3, 0.1)
        >>> r.summary().splitlines()[0]
        'toy: 2 layers x 2 heads, 3 copying items (answered 1.00), 0.1 s'
        """
        layers, heads = self.sink_mass.shape
        lines = [
            (
                f"{self.model}: {layers} layers x {heads} heads, {self.items} copying items "
                f"(answered {self.accuracy:.2f}), {self.seconds:.1f} s"
            ),
            (
                "sink mass (attention to the first token): median "
                f"{np.median(self.sink_mass):.2f}, {int((self.sink_mass > 0.5).sum())} heads "
                "above 0.5"
            ),
            (
                f"inactive heads (output share < {INACTIVE_SHARE:g} / {heads}): "
                f"{int(self.inactive.sum())} of {layers * heads}"
            ),
            "heads that carry the copied word (layer.head: share of the logit terms): "
            + ", ".join(f"{layer}.{head}: {score:.2f}" for layer, head, score in self.top_heads()),
            "rollout's share at the first token by depth: "
            + ", ".join(
                f"L{i}: {self.rollout_first[i]:.2f}"
                for i in sorted({0, layers // 4, layers // 2, 3 * layers // 4, layers - 1})
            ),
            "hit@1 on the probe (source ranked first): "
            + ", ".join(f"{name} {rate:.2f}" for name, rate in self.hit_rate.items()),
        ]
        return "\n".join([*lines, *self.notes])

    def show(self) -> None:
        """Print :meth:`summary`.

        Examples
        --------
        >>> import numpy as np
        >>> from attnflow.diagnosis import ModelReport
        >>> z = np.zeros((1, 1))
        >>> ModelReport("toy", z, z + 1, z, np.zeros(1), {}, 1.0, 1, 0.0).show()  # doctest: +ELLIPSIS
        toy: 1 layers x 1 heads, 1 copying items (answered 1.00), 0.0 s
        ...
        """
        print(self.summary())  # noqa: T201

    def to_html(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the report as one standalone HTML page with its figures; return the path.

        Parameters
        ----------
        path : str or path-like
            The page to write (written whole or not at all).
        overwrite : bool, default False
            Replace an existing file.

        Returns
        -------
        pathlib.Path
            The page written.

        Raises
        ------
        FileExistsError
            If `path` exists and `overwrite` is False.
        ModuleNotFoundError
            Without matplotlib (``pip install 'attnflow[plot]'``).

        Examples
        --------
        >>> import tempfile, pathlib, numpy as np
        >>> from attnflow.diagnosis import ModelReport
        >>> z = np.zeros((2, 2))
        >>> report = ModelReport("toy", z, z + 0.5, z, np.zeros(2), {}, 1.0, 1, 0.0)
        >>> page = report.to_html(pathlib.Path(tempfile.mkdtemp()) / "report.html")
        >>> page.read_text().count("data:image/png")
        4
        """
        from .html import _write_page

        return _write_page(self._page, path, overwrite=overwrite)

    def _page(self) -> str:
        from .html import _page

        figures = _figures(self)
        rows = "".join(
            f"<tr><td>{html.escape(name)}</td><td>{rate:.2f}</td></tr>"
            for name, rate in self.hit_rate.items()
        )
        heads = "".join(
            f"<tr><td>{layer}</td><td>{head}</td><td>{score:.3f}</td></tr>"
            for layer, head, score in self.top_heads(10)
        )
        body = (
            f"<h1>Model report: {html.escape(self.model)}</h1>"
            f"<pre>{html.escape(self.summary())}</pre>"
            "<h2>Which methods localise on this model</h2>"
            f"<p>hit@1 of the copied word's source on {self.items} in-context copying items "
            f"(the model answers {self.accuracy:.2f} of them).</p>"
            f"<table><tr><th>method</th><th>hit@1</th></tr>{rows}</table>"
            "<h2>Heads that carry the answer</h2>"
            f"<table><tr><th>layer</th><th>head</th><th>copying score</th></tr>{heads}</table>"
            + "".join(
                f'<h2>{html.escape(title)}</h2><p>{html.escape(caption)}</p><img src="{url}" '
                f'alt="{html.escape(title)}" style="max-width:100%">'
                for title, caption, url in figures
            )
        )
        css = "body{font-family:sans-serif;max-width:60em;margin:auto}td,th{padding:0 1em}"
        return _page(f"attnflow model report: {self.model}", css, body)


def _figures(report: ModelReport) -> list[tuple[str, str, str]]:
    """``(title, caption, PNG data URL)`` of each figure (matplotlib, Agg)."""
    import base64
    import io

    from .plot import _new_figure

    out = []
    maps = (
        (
            "Sink mass",
            "Mean attention to the first token, per layer (rows) and head (columns).",
            report.sink_mass,
            "viridis",
        ),
        (
            "Output share",
            (
                f"Each head's share of its layer's head-output norm; heads under "
                f"{INACTIVE_SHARE:g}/H are inactive (marked x)."
            ),
            report.output_share,
            "cividis",
        ),
        (
            "Copying score",
            "Each head's direct logit term at the copied word's source, over all terms.",
            report.copying_score,
            "magma",
        ),
    )
    for title, caption, values, colours in maps:
        figure = _new_figure(figsize=(6.5, 4.5))
        axes = figure.add_subplot()
        low, high, cmap = None, None, colours
        if title == "Copying score":  # signed: a diverging map centred on zero
            high = float(np.abs(values).max()) or 1.0
            low, cmap = -high, _diverging()
        image = axes.imshow(
            values, aspect="auto", cmap=cmap, interpolation="nearest", vmin=low, vmax=high
        )
        if title == "Output share":
            layers, heads = np.nonzero(report.inactive)
            axes.scatter(heads, layers, marker="x", color="white", s=12)
        axes.set_xlabel("head")
        axes.set_ylabel("layer")
        figure.colorbar(image, ax=axes)
        out.append((title, caption, _png_url(figure, base64, io)))
    figure = _new_figure(figsize=(6.5, 3.5))
    axes = figure.add_subplot()
    axes.plot(np.arange(len(report.rollout_first)), report.rollout_first, marker="o")
    axes.set_xlabel("layer")
    axes.set_ylabel("rollout share at the first token")
    axes.set_ylim(0, 1)
    out.append(
        (
            "Rollout's depth bias",
            (
                "The last row's rollout share at the first token, composing the layers up "
                "to each one: causal attention compounds toward the first tokens."
            ),
            _png_url(figure, base64, io),
        )
    )
    return out


def _diverging() -> str:
    """Return a perceptually uniform diverging map (matplotlib's "berlin"), else RdBu_r."""
    import matplotlib as mpl

    return "berlin" if "berlin" in list(mpl.colormaps) else "RdBu_r"


def _png_url(figure: Any, base64: Any, io: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    encoded: str = base64.b64encode(buffer.getvalue()).decode("ascii")
    return "data:image/png;base64," + encoded
