"""Pictures of token attributions: the figures of Abnar & Zuidema (2020) and image overlays.

Every function returns a :class:`matplotlib.figure.Figure` built with the object-oriented
API: nothing is shown, no pyplot state is touched and no backend is needed. Save a figure
with ``fig.savefig("map.png")`` or let a notebook display it.

Scores may come from any array library attnflow supports (NumPy, PyTorch on any device,
JAX, Dask, array-api-strict, TensorFlow); they are copied to the host as NumPy.

matplotlib is an optional dependency (``pip install "attnflow[plot]"``); it is imported
when a function is called, never when this module is imported.

- :func:`token_heatmap`: one row of scores over the tokens of a sentence.
- :func:`layer_token_map`: layer x input-token maps, the paper's Figures 2 and 3 (raw
  attention, rollout and flow side by side for one output position).
- :func:`image_overlay`: a vision transformer's patch scores upsampled onto its image.
- :func:`attention_graph`: the layered attention graph, the paper's Figure 1.
- :func:`faithfulness_by_layer`: an evaluation's correlations and AOPC by layer, one line
  per method (the paper's Tables 1 and 2 as a figure).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import NDArray

from ._display import FloatArray, as_numpy, check_finite, check_patch_grid, check_tokens

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.image import AxesImage

__all__ = [
    "attention_graph",
    "faithfulness_by_layer",
    "image_overlay",
    "layer_token_map",
    "token_heatmap",
]

DEFAULT_CMAP = "magma_r"
"""Scores on white: a perceptually uniform map (lightness rises steadily with the value,
so equal steps look equal, also in grey print), reversed so that 0 is near white."""

SIGNED_CMAP = "attnflow_signed"
"""Signed scores (``direct_logit``, ``alti_logit``: a token can push the target down): a
diverging map, perceptually uniform in CIELAB (constant colour difference per step, the
lightness falling with the size of the score), blue below 0, near white at 0, red above,
drawn with symmetric limits ``[-m, m]``. Built by attnflow (``attnflow._colours``), not a
matplotlib name; matplotlib's uniform diverging maps ("berlin", "vanimo") are dark at 0."""

OVERLAY_CMAP = "inferno"
"""Scores over a grey image: perceptually uniform, dark to bright (never a rainbow such as
jet or turbo, whose bands invent edges)."""

_ANNOTATE_UP_TO = 24
"""`token_heatmap` writes the values into the cells for at most this many tokens."""


# -- input handling ------------------------------------------------------------------------


def _limits(values: FloatArray, vmin: float | None, vmax: float | None) -> tuple[float, float]:
    """Colour limits: zero to the largest value for non-negative scores, unless given."""
    if values.size == 0:
        return (0.0 if vmin is None else vmin, 1.0 if vmax is None else vmax)
    low = min(0.0, float(values.min())) if vmin is None else float(vmin)
    high = float(values.max()) if vmax is None else float(vmax)
    if high <= low:  # constant scores: any positive span shows them
        high = low + 1.0
    return low, high


def _signed_limits(
    values: FloatArray, vmin: float | None, vmax: float | None
) -> tuple[float, float]:
    """Symmetric colour limits ``(-m, m)``: m the largest absolute score, or of vmin/vmax."""
    given = [abs(float(v)) for v in (vmin, vmax) if v is not None]
    largest = float(np.abs(values).max()) if values.size else 0.0
    top = max(given) if given else largest
    top = top if top > 0 else 1.0  # all zero: any span shows them at the centre
    return -top, top


def _colour_map(cmap: str, signed: bool) -> Any:
    """Return the colour map to draw with: attnflow's diverging one for signed scales."""
    name = SIGNED_CMAP if signed and cmap == DEFAULT_CMAP else cmap
    if name != SIGNED_CMAP:
        return name
    from matplotlib.colors import ListedColormap

    from ._colours import signed_palette

    return ListedColormap(signed_palette(256), name=SIGNED_CMAP)


def _new_figure(figsize: tuple[float, float]) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, layout="constrained")


def _figure_and_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    """Make a figure with one axes, or find the figure that holds `ax`."""
    if ax is None:
        figure = _new_figure(figsize)
        return figure, figure.add_subplot()
    from matplotlib.axes import Axes

    given: object = ax
    if not isinstance(given, Axes):
        msg = f"`ax` must be a matplotlib Axes or None; got {type(given).__name__}."
        raise TypeError(msg)
    return ax.figure.figure, ax  # the root figure, also for an axes in a subfigure


def _label_tokens(ax: Axes, tokens: Sequence[str], room: float | None = None) -> None:
    """Token names on the x axis, rotated when they would collide.

    `room`: inches per token, when known (about 0.09 inch per character of 10 pt text).
    """
    ax.set_xticks(range(len(tokens)))
    longest = max((len(token) for token in tokens), default=0)
    crowded = longest * 0.09 > room if room is not None else longest * len(tokens) > 40
    if len(tokens) > 8 or crowded:
        ax.set_xticklabels(tokens, rotation=45, ha="right", rotation_mode="anchor")
    else:
        ax.set_xticklabels(tokens)


def _token_axis_width(n: int) -> float:
    return max(3.0, 0.5 * n + 1.0)


#: The widest figure (inches) that multi-panel functions aim for: shown at a page's content
#: width (about 800 px), default 10 pt tick labels stay 9 px or more.
_MAX_WIDTH = 12.0
#: Inches per token on a token axis: the preferred width, and the least before wrapping
#: panels onto more rows (45-degree labels of 10 pt text still clear each other).
_TOKEN_WIDTH, _TOKEN_WIDTH_MIN = 0.34, 0.25
#: Inches around the panels: the layer axis (label and ticks), the room between panels,
#: and a colour bar with its ticks.
_LAYER_AXIS, _PANEL_GAP, _COLOUR_BAR = 0.8, 0.35, 0.75


def _panel_layout(
    n_panels: int, n: int, *, least: float, per_panel_bar: bool, columns: int | None
) -> tuple[int, float]:
    """Choose the columns of a panel grid and the width (inches) of each panel's axes.

    The most columns (up to `n_panels`) whose row fits `_MAX_WIDTH` with at least
    `_TOKEN_WIDTH_MIN` inches per token (and `least` inches per axes, for its title); one
    column when even that does not fit.
    """

    def room(c: int) -> float:
        bars = c if per_panel_bar else 1
        return (_MAX_WIDTH - _LAYER_AXIS - c * _PANEL_GAP - bars * _COLOUR_BAR) / c

    chosen = columns if columns is not None else 1
    if columns is None:
        for c in range(n_panels, 0, -1):
            if room(c) >= max(least, _TOKEN_WIDTH_MIN * n):
                chosen = c
                break
    width = max(least, min(_TOKEN_WIDTH * n, room(chosen)), _TOKEN_WIDTH_MIN * n)
    return chosen, width


# -- token_heatmap -------------------------------------------------------------------------


def token_heatmap(
    scores: Any,
    /,
    *,
    tokens: Sequence[str],
    ax: Axes | None = None,
    title: str | None = None,
    cmap: str = DEFAULT_CMAP,
    vmin: float | None = None,
    vmax: float | None = None,
    annotate: bool | None = None,
    signed: bool = False,
) -> Figure:
    """Draw one row of scores over the tokens of a sentence as a coloured strip.

    Parameters
    ----------
    scores : array of shape (n,)
        One score per token, e.g. ``attnflow.rollout(attentions, rows=0)`` for the
        ``[CLS]`` position of one sentence. Any supported array library.
    tokens : sequence of str
        The ``n`` token labels, shown (rotated when long or many) under the strip.
    ax : matplotlib.axes.Axes, optional
        Draw into this axes (its figure gets the colour bar). By default a new figure.
    title : str, optional
        Title of the axes.
    cmap : str, default "magma_r"
        A matplotlib colour map name; the default is perceptually uniform
        (`DEFAULT_CMAP`).
    vmin, vmax : float, optional
        Colour limits. By default ``0`` (or the smallest score, if negative) and the
        largest score.
    annotate : bool, optional
        Write each value into its cell. By default only for at most 24 tokens.
    signed : bool, default False
        Signed scores (a method whose ``MethodSpec.signed`` is true, such as
        ``direct_logit``): a diverging scale centred at 0 (`SIGNED_CMAP` unless `cmap` is
        given) with symmetric limits ``[-m, m]``, m the largest absolute value (or of
        `vmin`/`vmax`), so negative scores show in blue, positive ones in red.

    Returns
    -------
    matplotlib.figure.Figure
        The figure holding the strip and its colour bar; ``fig.axes[0].images[0]``
        holds the ``(1, n)`` image of the scores.

    Raises
    ------
    ValueError
        If `scores` is not one-dimensional or not finite, or `tokens` does not have one
        label per score.
    TypeError
        If `tokens` is not a sequence of strings or `ax` not an Axes.

    See Also
    --------
    layer_token_map : The same scores for every layer, for several methods.
    attnflow.html.TokenView : The same strip as dependency-free HTML.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.plot import token_heatmap
    >>> fig = token_heatmap(np.array([0.1, 0.6, 0.3]), tokens=["[CLS]", "cats", "sleep"])
    >>> [label.get_text() for label in fig.axes[0].get_xticklabels()]
    ['[CLS]', 'cats', 'sleep']
    >>> fig.savefig("heatmap.png")  # doctest: +SKIP
    """
    values = as_numpy(scores, "scores")
    if values.ndim != 1:
        msg = (
            f"`scores` must be one row of scores, shape (n,); got shape {values.shape}. "
            "Select one output position first, e.g. `attnflow.rollout(w, rows=0)`."
        )
        raise ValueError(msg)
    n = values.shape[0]
    labels = check_tokens(tokens, n, "scores")
    check_finite(values, "scores")
    low, high = (_signed_limits if signed else _limits)(values, vmin, vmax)

    figure, axes = _figure_and_axes(ax, (max(4.0, 0.55 * n + 2.0), 2.2))
    image = axes.imshow(
        values[np.newaxis, :],
        cmap=_colour_map(cmap, signed),
        vmin=low,
        vmax=high,
        aspect="auto",
        interpolation="nearest",
    )
    _label_tokens(axes, labels)
    axes.set_yticks([])
    if title is not None:
        axes.set_title(title)
    figure.colorbar(image, ax=axes, fraction=0.05, pad=0.02)
    if annotate if annotate is not None else n <= _ANNOTATE_UP_TO:
        _annotate(axes, image, values)
    return figure


def _annotate(ax: Axes, image: AxesImage, values: FloatArray) -> None:
    """Write each value into its cell, white on dark cells and black on light ones."""
    colours = np.asarray(image.to_rgba(values), dtype=np.float64)
    for column, value in enumerate(values):
        red, green, blue = colours[column, :3]
        dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
        ax.text(
            column,
            0,
            f"{value:.2f}",
            ha="center",
            va="center",
            fontsize=8,
            color="white" if dark else "black",
        )


# -- layer_token_map -----------------------------------------------------------------------


def _named_maps(maps: Any, titles: Sequence[str] | None) -> list[tuple[str | None, FloatArray]]:
    """Split `maps` into the panels of `layer_token_map`: (title, (layers, n) map) pairs."""
    if isinstance(maps, Mapping):
        if not maps:
            msg = "`maps` is an empty mapping; pass at least one (layers, n) map."
            raise ValueError(msg)
        named: list[tuple[str | None, Any]] = [(str(key), value) for key, value in maps.items()]
    elif isinstance(maps, list | tuple):
        if not maps:
            msg = "`maps` is an empty sequence; pass at least one (layers, n) map."
            raise ValueError(msg)
        named = [(None, value) for value in maps]
    else:
        stacked = as_numpy(maps, "maps")
        if stacked.ndim == 2:
            named = [(None, stacked)]
        elif stacked.ndim == 3:
            named = [(None, panel) for panel in stacked]
        else:
            msg = (
                "`maps` must be one (layers, n) map, a stack (k, layers, n), or a mapping or "
                f"sequence of (layers, n) maps; got an array of shape {stacked.shape}."
            )
            raise ValueError(msg)
    if titles is not None:
        if isinstance(titles, str) or len(titles) != len(named):
            msg = (
                f"`titles` must be a sequence of {len(named)} strings, one per map; got {titles!r}."
            )
            raise ValueError(msg)
        named = [(str(title), value) for title, (_, value) in zip(titles, named, strict=True)]
    panels: list[tuple[str | None, FloatArray]] = []
    for index, (title, value) in enumerate(named):
        name = f"maps[{title!r}]" if isinstance(maps, Mapping) else f"maps[{index}]"
        array = as_numpy(value, name)
        if array.ndim != 2:
            msg = (
                f"`{name}` must be a (layers, n) map, one row per layer; got shape "
                f"{array.shape}. Use `layers='all'` with an int `rows`, e.g. "
                "`attnflow.rollout(w, rows=0, layers='all')`."
            )
            raise ValueError(msg)
        check_finite(array, name)
        panels.append((title, array))
    return panels


def _signed_flags(signed: object, count: int) -> list[bool]:
    """One flag per panel from `signed`: a bool for all, or one bool per panel."""
    if isinstance(signed, bool | np.bool_):
        return [bool(signed)] * count
    if (
        isinstance(signed, Sequence)
        and not isinstance(signed, str)
        and len(signed) == count
        and all(isinstance(flag, bool | np.bool_) for flag in signed)
    ):
        return [bool(flag) for flag in signed]
    msg = f"`signed` must be a bool or a sequence of {count} bools, one per map; got {signed!r}."
    raise ValueError(msg)


def layer_token_map(
    maps: Any,
    /,
    *,
    tokens: Sequence[str],
    titles: Sequence[str] | None = None,
    shared_scale: bool = True,
    cmap: str = DEFAULT_CMAP,
    vmin: float | None = None,
    vmax: float | None = None,
    title: str | None = None,
    figsize: tuple[float, float] | None = None,
    ylabel: str = "layer",
    columns: int | None = None,
    signed: bool | Sequence[bool] = False,
) -> Figure:
    """Draw layer x input-token maps side by side (Abnar & Zuidema 2020, Figures 2-3).

    Each panel shows, for one output position, the attention to every input token
    (x axis) at every layer (y axis, layer 1 at the bottom as in the paper). Pass raw
    attention, rollout and flow together to compare them. Panels that would make the
    figure wider than about 12 inches wrap onto more rows, so that the tick labels stay
    legible when the figure is shown at a page's width.

    Parameters
    ----------
    maps : array of shape (layers, n), or a mapping or sequence of them
        One map, a stack ``(k, layers, n)``, a sequence of maps, or a mapping from panel
        title to map, e.g. ``{"raw": ..., "rollout": ..., "flow": ...}`` with each from
        ``attnflow.<method>(w, rows=0, layers="all")``. Any supported array library.
    tokens : sequence of str
        The ``n`` input token labels.
    titles : sequence of str, optional
        Panel titles; by default the mapping's keys (no titles for arrays).
    shared_scale : bool, default True
        One colour scale (and one colour bar) for all panels, so that equal colours mean
        equal values across methods. This is honest when all maps are distributions over
        the same tokens, each row summing to 1: raw attention rows, rollout and
        (normalised) flow are. Turn it off for maps on different scales, such as
        ``attnflow.flow(..., normalize_result=False)`` next to rollout; each panel then gets its
        own colour bar.
    cmap : str, default "magma_r"
        A matplotlib colour map name; the default is perceptually uniform
        (`DEFAULT_CMAP`).
    vmin, vmax : float, optional
        Colour limits for every panel. By default ``0`` (or the smallest value, if
        negative) and the largest value: over all panels when `shared_scale`, per panel
        otherwise.
    title : str, optional
        Title above all panels.
    figsize : tuple of float, optional
        Figure size in inches; by default it grows with the number of tokens and layers,
        up to about 12 inches wide (more only when one panel needs it).
    ylabel : str, default "layer"
        What the rows are: ``"head"`` for the maps of ``heads="each"`` at one layer.
    columns : int, optional
        Panels per row. By default as many as fit in about 12 inches at 0.25 to 0.34
        inches per token (all of them for short sentences); the others wrap onto
        further rows.
    signed : bool or sequence of bool, default False
        Signed scores (a method whose ``MethodSpec.signed`` is true, such as
        ``direct_logit``; one flag per map, or one for all): drawn on a diverging scale
        centred at 0 (`SIGNED_CMAP` unless `cmap` is given) with symmetric limits
        ``[-m, m]``, m the largest absolute value (or of `vmin`/`vmax`), so negative
        scores show in blue. With `shared_scale`, one signed map makes the whole scale
        diverging.

    Returns
    -------
    matplotlib.figure.Figure
        One axes per map, in order (then the colour bar axes); ``fig.axes[i].images[0]``
        holds map ``i`` as drawn, row 0 = layer 1.

    Raises
    ------
    ValueError
        If a map is not two-dimensional or not finite, `tokens` or `titles` has the wrong
        length, `maps` is empty, or `columns` is not a positive int.
    TypeError
        If `tokens` is not a sequence of strings.

    See Also
    --------
    token_heatmap : One row of scores.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> from attnflow.plot import layer_token_map
    >>> rng = np.random.default_rng(0)
    >>> w = rng.dirichlet(np.ones(4), size=(3, 2, 4))  # (layers, heads, n, n)
    >>> maps = {
    ...     "raw": attnflow.raw(w, rows=0, layers="all"),
    ...     "rollout": attnflow.rollout(w, rows=0, layers="all"),
    ...     "flow": attnflow.flow(w, rows=0, layers="all"),
    ... }
    >>> fig = layer_token_map(maps, tokens=["[CLS]", "the", "key", "[SEP]"])
    >>> [ax.get_title() for ax in fig.axes[:3]]
    ['raw', 'rollout', 'flow']
    """
    panels = _named_maps(maps, titles)
    n = panels[0][1].shape[1]
    for index, (_, array) in enumerate(panels[1:], start=1):
        if array.shape[1] != n:
            msg = (
                f"every map must cover the same {n} tokens; map {index} has shape "
                f"{array.shape}, map 0 has {panels[0][1].shape}."
            )
            raise ValueError(msg)
    labels = check_tokens(tokens, n, "maps")
    flags = _signed_flags(signed, len(panels))
    given: object = columns
    if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
        msg = f"`columns` must be a positive int (panels per row) or None; got {columns!r}."
        raise ValueError(msg)
    # Room for each panel's title (about 0.1 inch per character at the default 12 pt).
    least = max([1.2] + [0.1 * len(name) for name, _ in panels if name is not None])
    n_columns, axis_width = _panel_layout(
        len(panels), n, least=least, per_panel_bar=not shared_scale, columns=columns
    )
    n_rows = -(-len(panels) // min(n_columns, len(panels)))
    if columns is None:  # balanced rows: four panels as 2 x 2, not 3 + 1
        n_columns = -(-len(panels) // n_rows)
        axis_width = _panel_layout(
            n_columns, n, least=least, per_panel_bar=not shared_scale, columns=n_columns
        )[1]
    n_columns = min(n_columns, len(panels))
    n_layers = max(array.shape[0] for _, array in panels)
    if figsize is None:
        bars = n_columns if not shared_scale else 1
        width = _LAYER_AXIS + n_columns * (axis_width + _PANEL_GAP) + bars * _COLOUR_BAR
        longest = max((len(label) for label in labels), default=0)
        labels_height = 0.25 + 0.07 * min(longest, 14)  # 45-degree token labels
        row_height = max(2.2, 0.3 * n_layers + 0.7 + labels_height)
        height = n_rows * row_height + (0.35 if title is not None else 0.0)
        figsize = (width, height)

    from matplotlib.colors import Normalize

    figure = _new_figure(figsize)
    axes_grid = figure.subplots(n_rows, n_columns, squeeze=False)
    every_axes = [ax for line in axes_grid for ax in line]
    axes = every_axes[: len(panels)]
    for unused in every_axes[len(panels) :]:
        figure.delaxes(unused)
    same_rows = len({array.shape[0] for _, array in panels}) == 1
    shared = None
    if shared_scale:  # one scale: diverging for all panels when any is signed
        every = np.concatenate([array.ravel() for _, array in panels])
        flags = [any(flags)] * len(panels)
        shared = Normalize(*(_signed_limits if flags[0] else _limits)(every, vmin, vmax))
    images = []
    for index, (ax, (panel_title, array)) in enumerate(zip(axes, panels, strict=True)):
        limits = _signed_limits if flags[index] else _limits
        norm = shared if shared is not None else Normalize(*limits(array, vmin, vmax))
        image = ax.imshow(
            array,
            cmap=_colour_map(cmap, flags[index]),
            norm=norm,
            origin="lower",
            aspect="auto",
            interpolation="nearest",
        )
        images.append(image)
        layers = array.shape[0]
        ax.set_yticks(range(layers))
        ax.set_yticklabels([str(layer + 1) for layer in range(layers)])
        if index % n_columns == 0:
            ax.set_ylabel(ylabel)
        elif same_rows:  # the row labels of the panel on the left hold for this one
            ax.tick_params(axis="y", labelleft=False)
        _label_tokens(ax, labels, room=axis_width / max(n, 1))
        if panel_title is not None:
            ax.set_title(panel_title)
        if shared is None:
            figure.colorbar(image, ax=ax, fraction=0.08, pad=0.02)
    if shared is not None:
        figure.colorbar(
            images[0], ax=axes, fraction=0.04 if n_rows == 1 else 0.03, pad=0.02, aspect=25
        )
    if title is not None:
        figure.suptitle(title)
    return figure


# -- image_overlay -------------------------------------------------------------------------


def _patch_grid(n_patches: int, grid: tuple[int, int] | None, extra_tokens: int) -> tuple[int, int]:
    if grid is None:
        side = math.isqrt(n_patches)
        if side * side != n_patches:
            msg = (
                f"`scores` has {n_patches} patch scores after dropping `extra_tokens`="
                f"{extra_tokens} leading token(s), which is not a square number; pass "
                "`grid=(rows, cols)` for a non-square patch grid, or set `extra_tokens` to "
                "the number of CLS, distillation and register tokens."
            )
            raise ValueError(msg)
        return side, side
    rows, cols = check_patch_grid(grid)
    if rows * cols != n_patches:
        msg = (
            f"`grid`={grid!r} has {rows * cols} patches but `scores` has {n_patches} patch "
            f"scores after dropping `extra_tokens`={extra_tokens} leading token(s)."
        )
        raise ValueError(msg)
    return rows, cols


def _as_image(image: Any) -> FloatArray:
    """`image` as float (H, W) or (H, W, 3|4) with values in [0, 1]."""
    pixels = as_numpy(image, "image")
    if pixels.ndim == 3 and pixels.shape[-1] not in (1, 3, 4) and pixels.shape[0] in (1, 3, 4):
        pixels = np.moveaxis(pixels, 0, -1)  # channel-first (PyTorch) to channel-last
    if pixels.ndim == 3 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    if not (pixels.ndim == 2 or (pixels.ndim == 3 and pixels.shape[-1] in (3, 4))):
        msg = (
            "`image` must have shape (H, W), (H, W, 3) or (H, W, 4) (or channel-first "
            f"(3, H, W)); got shape {pixels.shape}."
        )
        raise ValueError(msg)
    if pixels.shape[0] == 0 or pixels.shape[1] == 0:
        msg = f"`image` is empty: shape {pixels.shape}."
        raise ValueError(msg)
    check_finite(pixels, "image")
    low, high = float(pixels.min()), float(pixels.max())
    if low >= 0.0 and 1.0 < high <= 255.0:  # 8-bit values
        return pixels / 255.0
    if low < 0.0 or high > 1.0:  # e.g. a mean/std-normalised input
        return (pixels - low) / (high - low)
    return pixels


def _upsample(
    patch_map: FloatArray, shape: tuple[int, int], method: Literal["nearest", "bilinear"]
) -> FloatArray:
    """Resize a (rows, cols) map to `shape` (half-pixel centres, as image resizers do)."""
    rows, cols = patch_map.shape
    height, width = shape
    if method == "nearest":
        row_index = (np.arange(height) * rows) // height
        col_index = (np.arange(width) * cols) // width
        return patch_map[np.ix_(row_index, col_index)]

    def weights(out: int, size: int) -> tuple[NDArray[np.intp], NDArray[np.intp], FloatArray]:
        position = np.clip((np.arange(out) + 0.5) * size / out - 0.5, 0.0, size - 1.0)
        low = np.floor(position).astype(np.intp)
        high = np.minimum(low + 1, size - 1)
        return low, high, position - low

    r0, r1, wr = weights(height, rows)
    c0, c1, wc = weights(width, cols)
    along_rows = patch_map[r0, :] * (1.0 - wr)[:, None] + patch_map[r1, :] * wr[:, None]
    return along_rows[:, c0] * (1.0 - wc)[None, :] + along_rows[:, c1] * wc[None, :]


def image_overlay(
    scores: Any,
    image: Any,
    /,
    *,
    grid: tuple[int, int] | None = None,
    extra_tokens: int = 1,
    alpha: float = 0.5,
    cmap: str = OVERLAY_CMAP,
    interpolation: Literal["nearest", "bilinear"] = "bilinear",
    ax: Axes | None = None,
    title: str | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
) -> Figure:
    """Overlay a vision transformer's patch scores on its input image.

    The first `extra_tokens` scores (CLS, distillation, register tokens) are dropped, the
    rest are laid out row by row on the patch grid, upsampled to the image's size and
    drawn over the image.

    Parameters
    ----------
    scores : array of shape (extra_tokens + rows * cols,)
        One score per token of one output position, e.g. the ``[CLS]`` row
        ``attnflow.rollout(attentions, rows=0)``. Any supported array library.
    image : array of shape (H, W), (H, W, 3) or (H, W, 4)
        The input image; channel-first ``(3, H, W)`` arrays (PyTorch's layout) are
        accepted too. Values in [0, 1] are used as they are; other values (such
        as mean/std-normalised inputs) are rescaled to [0, 1] by their minimum and maximum.
        Values in [0, 255] with a maximum above 1 are read as 8-bit (divided by 255).
    grid : tuple of int, optional
        The patch grid ``(rows, cols)``. By default a square grid of side the square root
        of the number of patches.
    extra_tokens : int, default 1
        How many leading tokens are not patches: 1 for a CLS token, 2 with a distillation
        token (DeiT), ``1 + r`` with ``r`` registers, 0 for none.
    alpha : float, default 0.5
        Opacity of the score map over the image, in [0, 1].
    cmap : str, default "inferno"
        A matplotlib colour map name for the scores; the default is perceptually uniform
        (`OVERLAY_CMAP`).
    interpolation : {"bilinear", "nearest"}, default "bilinear"
        How the patch map is upsampled: smoothly, or as blocks with one colour per patch.
    ax : matplotlib.axes.Axes, optional
        Draw into this axes. By default a new figure.
    title : str, optional
        Title of the axes.
    vmin, vmax : float, optional
        Colour limits; by default the smallest and largest patch score.

    Returns
    -------
    matplotlib.figure.Figure
        The figure; in its first axes ``images[0]`` is the image and ``images[1]`` the
        upsampled ``(H, W)`` score map.

    Raises
    ------
    ValueError
        If the number of patch scores does not fit `grid` (or is not square without it),
        `extra_tokens` or `alpha` is out of range, or `image` has an unsupported shape.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.plot import image_overlay
    >>> scores = np.r_[0.5, np.arange(6.0)]  # CLS, then a 2 x 3 patch grid
    >>> image = np.zeros((40, 60, 3))
    >>> fig = image_overlay(scores, image, grid=(2, 3))
    >>> fig.axes[0].images[1].get_array().shape
    (40, 60)
    """
    values = as_numpy(scores, "scores")
    if values.ndim != 1:
        msg = (
            f"`scores` must be one row of token scores, shape (n,); got shape "
            f"{values.shape}. Select one output position, e.g. `attnflow.rollout(w, rows=0)`."
        )
        raise ValueError(msg)
    leading: object = extra_tokens
    if (
        isinstance(leading, bool)
        or not isinstance(leading, int | np.integer)
        or not 0 <= leading < values.shape[0]
    ):
        msg = (
            f"`extra_tokens` must be an int in [0, {values.shape[0]}) (the leading tokens "
            f"that are not patches); got {extra_tokens!r}."
        )
        raise ValueError(msg)
    if not 0.0 <= alpha <= 1.0:
        msg = f"`alpha` must be in [0, 1]; got {alpha!r}."
        raise ValueError(msg)
    if interpolation not in ("nearest", "bilinear"):
        msg = f"`interpolation` must be 'nearest' or 'bilinear'; got {interpolation!r}."
        raise ValueError(msg)
    check_finite(values, "scores")
    patches = values[int(extra_tokens) :]
    rows, cols = _patch_grid(patches.shape[0], grid, int(extra_tokens))
    pixels = _as_image(image)
    height, width = pixels.shape[:2]
    heat = _upsample(patches.reshape(rows, cols), (height, width), interpolation)
    low = float(patches.min()) if vmin is None else float(vmin)
    high = float(patches.max()) if vmax is None else float(vmax)
    if high <= low:
        high = low + 1.0

    figure, axes = _figure_and_axes(ax, (5.0 * min(2.0, max(0.5, width / height)) + 1.0, 5.0))
    if pixels.ndim == 2:
        axes.imshow(pixels, cmap="gray", vmin=0.0, vmax=1.0, interpolation="antialiased")
    else:
        axes.imshow(pixels, interpolation="antialiased")
    overlay = axes.imshow(
        heat, cmap=cmap, alpha=alpha, vmin=low, vmax=high, interpolation="nearest"
    )
    axes.set_axis_off()
    if title is not None:
        axes.set_title(title)
    colorbar = figure.colorbar(overlay, ax=axes, fraction=0.046, pad=0.02)
    if colorbar.solids is not None:
        colorbar.solids.set_alpha(1.0)  # the bar shows the colours, not the blend
    return figure


# -- attention_graph -----------------------------------------------------------------------


def attention_graph(
    attentions_fused: Any,
    /,
    *,
    tokens: Sequence[str],
    max_tokens: int = 12,
    min_weight: float = 0.0,
    ax: Axes | None = None,
    title: str | None = None,
    color: str = "tab:blue",
    max_linewidth: float = 5.0,
    row: int | None = None,
    residual: bool | None = None,
    legend: bool = True,
) -> Figure:
    """Draw the layered attention graph (Abnar & Zuidema 2020, Figure 1).

    Nodes are the tokens at each layer, inputs (layer 0) at the bottom. An edge joins
    node ``k`` of layer ``l`` (a query) to node ``m`` of layer ``l - 1`` (a key); its line
    width and opacity are proportional to the attention weight ``A_l[k, m]``, relative to
    the largest weight in the graph. Readable for short sequences only.

    Parameters
    ----------
    attentions_fused : array of shape (layers, n, n)
        Head-fused attention of one example (rows = queries at layer ``l``, columns = keys
        at layer ``l - 1``), e.g. ``attnflow.fuse_heads(w[0])``; add the residual with
        ``attnflow.add_residual`` to draw the graph that rollout and flow use. Any
        supported array library.
    tokens : sequence of str
        The ``n`` token labels, written under the input layer.
    max_tokens : int, default 12
        The longest sequence drawn; beyond it the picture is unreadable.
    min_weight : float, default 0.0
        Edges with weight at or below it are not drawn.
    ax : matplotlib.axes.Axes, optional
        Draw into this axes. By default a new figure.
    title : str, optional
        Title of the axes.
    color : str, default "tab:blue"
        Colour of the edges.
    max_linewidth : float, default 5.0
        Line width (points) of the heaviest edge.
    row : int, optional
        The output position explained: its node at the top layer is filled and labelled.
    residual : bool, optional
        Whether the weights include the residual (``attnflow.add_residual``), stated in the
        legend's title; None says nothing.
    legend : bool, default True
        A legend of edge widths: the heaviest weight, half and a quarter of it.

    Returns
    -------
    matplotlib.figure.Figure
        The figure; its first axes holds the edges as one
        :class:`~matplotlib.collections.LineCollection` (lightest first) and the nodes.

    Raises
    ------
    ValueError
        If the input is not ``(layers, n, n)``, is negative or not finite, has more than
        `max_tokens` tokens, or `tokens` does not have ``n`` labels.

    Examples
    --------
    >>> import numpy as np
    >>> import attnflow
    >>> from attnflow.plot import attention_graph
    >>> rng = np.random.default_rng(0)
    >>> w = rng.dirichlet(np.ones(4), size=(3, 2, 4))  # (layers, heads, n, n)
    >>> fig = attention_graph(attnflow.fuse_heads(w), tokens=["[CLS]", "a", "cat", "[SEP]"])
    >>> len(fig.axes[0].collections[0].get_segments())  # 3 layers of 4 x 4 edges
    48
    """
    weights = as_numpy(attentions_fused, "attentions_fused")
    if weights.ndim != 3 or weights.shape[1] != weights.shape[2] or weights.shape[0] == 0:
        msg = (
            "`attentions_fused` must be head-fused attention of one example, shape "
            f"(layers, n, n); got shape {weights.shape}. Fuse heads first with "
            "`attnflow.fuse_heads` and select one example."
        )
        raise ValueError(msg)
    n_layers, n = weights.shape[0], weights.shape[2]
    if n > max_tokens:
        msg = (
            f"`attentions_fused` has {n} tokens, more than `max_tokens`={max_tokens}; the "
            "graph would be unreadable. Raise `max_tokens` or slice the tokens of interest."
        )
        raise ValueError(msg)
    labels = check_tokens(tokens, n, "attentions_fused")
    check_finite(weights, "attentions_fused")
    if (weights < 0).any():
        msg = f"`attentions_fused` must be non-negative; its minimum is {weights.min():.4g}."
        raise ValueError(msg)

    from matplotlib.collections import LineCollection
    from matplotlib.colors import to_rgba

    figure, axes = _figure_and_axes(
        ax, (max(4.0, 0.85 * n + 1.5), max(3.0, 0.9 * (n_layers + 1) + 1.0))
    )
    layer, query, key = np.nonzero(weights > min_weight)
    strength = weights[layer, query, key]
    order = np.argsort(strength, kind="stable")  # heaviest drawn last, on top
    layer, query, key, strength = layer[order], query[order], key[order], strength[order]
    heaviest = float(strength.max()) if strength.size else 1.0
    relative = strength / heaviest
    # Query k of layer l + 1 (its attention is weights[l]) to key m of layer l.
    segments = np.stack(
        [np.stack([query, layer + 1], axis=-1), np.stack([key, layer], axis=-1)], axis=1
    ).astype(np.float64)
    colours = np.tile(np.asarray(to_rgba(color)), (relative.size, 1))
    colours[:, 3] = relative
    edges = LineCollection(
        list(segments),
        linewidths=max_linewidth * relative,
        colors=colours,
        capstyle="round",
        zorder=1,
    )
    edges.set_gid("attention-edges")
    axes.add_collection(edges)
    grid_x, grid_y = np.meshgrid(np.arange(n), np.arange(n_layers + 1))
    axes.scatter(
        grid_x.ravel(),
        grid_y.ravel(),
        s=60,
        facecolors="white",
        edgecolors="0.25",
        linewidths=1.0,
        zorder=2,
    )
    axes.set_xlim(-0.5, n - 0.5)
    axes.set_ylim(-0.4, n_layers + 0.4)
    _label_tokens(axes, labels)
    axes.set_yticks(range(n_layers + 1))
    axes.set_yticklabels(["input"] + [f"layer {layer + 1}" for layer in range(n_layers)])
    axes.tick_params(length=0)
    for spine in axes.spines.values():
        spine.set_visible(False)
    if row is not None:
        given: object = row  # checked at run time: callers may not be type-checked
        if isinstance(given, bool) or not isinstance(given, int | np.integer) or not -n <= row < n:
            msg = f"`row` must index the {n} tokens; got {row!r}."
            raise ValueError(msg)
        axes.scatter(
            [int(row) % n], [n_layers], s=110, facecolors=color, edgecolors="0.1", zorder=3
        )
        axes.annotate(
            f"explained: {labels[int(row) % n]}",
            (int(row) % n, n_layers),
            xytext=(0, 9),
            textcoords="offset points",
            ha="center",
            fontsize=9,
        )
    if legend and strength.size:
        from matplotlib.lines import Line2D

        shares = (1.0, 0.5, 0.25)
        handles = [
            Line2D([], [], color=color, alpha=share, linewidth=max_linewidth * share)
            for share in shares
        ]
        what = {None: "", True: " (residual included)", False: " (no residual)"}[residual]
        axes.legend(
            handles,
            [f"{heaviest * share:.3g}" for share in shares],
            title=f"edge weight{what}",
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            frameon=False,
            fontsize=8,
            title_fontsize=8,
        )
    if title is not None:
        axes.set_title(title, pad=18 if row is not None else 6)
    return figure


# -- faithfulness_by_layer -----------------------------------------------------------------

#: Okabe-Ito colours (distinguishable with colour-vision deficiencies) for method lines.
_METHOD_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9")
_METHOD_STYLES = {"raw": ("#000000", "--")}


def faithfulness_by_layer(
    report: Any,
    /,
    *,
    references: Sequence[str] | None = None,
    aopc: bool = True,
    band: Literal["sem", "sd", "none"] = "sem",
    paper: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
    figsize: tuple[float, float] | None = None,
    title: str | None = None,
) -> Figure:
    """Draw faithfulness by layer, one line per method (the paper's Tables 1-2 as a figure).

    One panel per reference score (the mean rank correlation of each method's explanation
    with blank-out, with input gradients) and, when the report has them, one per ERASER
    metric (AOPC of comprehensiveness and sufficiency), with layers on the x axis.

    Parameters
    ----------
    report : FaithfulnessReport
        From :func:`attnflow.evaluate.faithfulness`.
    references : sequence of str, optional
        The reference panels to draw; by default all of the report's.
    aopc : bool, default True
        Add the comprehensiveness and sufficiency panels (when the report has them).
    band : {"sem", "sd", "none"}, default "sem"
        The shaded band: ± the standard error of the mean, ± one standard deviation
        over samples, or none.
    paper : mapping, optional
        Published numbers drawn as dotted lines for comparison:
        ``{reference: {method: per-layer means}}``, e.g. the paper's Table 1 as
        ``{"blank_out": {"rollout": [0.32, 0.38, ...]}}``.
    figsize : (float, float), optional
        Figure size in inches; by default 3.2 inches per panel by 3.4 inches.
    title : str, optional
        A title over the panels.

    Returns
    -------
    matplotlib.figure.Figure
        One axes per panel; each method's mean is one line (``Line2D`` labelled with the
        method's name), in the same colour in every panel.

    Raises
    ------
    ValueError
        On an unknown reference or band.

    See Also
    --------
    attnflow.evaluate.faithfulness : Produces the report.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate import FaithfulnessReport
    >>> from attnflow.plot import faithfulness_by_layer
    >>> rng = np.random.default_rng(0)
    >>> samples = {
    ...     f"correlation.{m}.blank_out": rng.normal(shift, 0.2, (50, 6))
    ...     for m, shift in (("raw", 0.1), ("rollout", 0.5), ("flow", 0.6))
    ... }
    >>> report = FaithfulnessReport(
    ...     samples, ("raw", "rollout", "flow"), ("blank_out",), "spearman", "drop", 0
    ... )
    >>> figure = faithfulness_by_layer(report)
    >>> [line.get_label() for line in figure.axes[0].get_lines()][:3]
    ['raw', 'rollout', 'flow']
    """
    chosen = list(report.references if references is None else references)
    unknown = [r for r in chosen if r not in report.references]
    if unknown or not chosen:
        msg = f"`references` must be drawn from {list(report.references)}; got {chosen}."
        raise ValueError(msg)
    if band not in ("sem", "sd", "none"):
        msg = f'`band` must be "sem", "sd" or "none"; got {band!r}.'
        raise ValueError(msg)
    metrics = ["comprehensiveness", "sufficiency"] if aopc and report.fractions else []
    panels = [("correlation", r) for r in chosen] + [("aopc", m) for m in metrics]
    width = 3.2 * len(panels)
    figure = _new_figure(figsize or (width, 3.4))
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    layers = np.arange(1, report.n_layers + 1)
    # Published tables may have more layers than the model evaluated (the paper's six
    # beside a smaller model): each line is drawn over its own layers.
    longest = max(
        [report.n_layers]
        + [len(values) for lines in (paper or {}).values() for values in lines.values()]
    )
    name = report.correlation.capitalize()
    for ax, (kind, which) in zip(axes, panels, strict=True):
        for index, method in enumerate(report.methods):
            colour, style = _METHOD_STYLES.get(
                method, (_METHOD_COLOURS[index % len(_METHOD_COLOURS)], "-")
            )
            if kind == "correlation":
                values = report.samples[f"correlation.{method}.{which}"]
            else:
                values = np.nanmean(report.samples[f"{which}.{method}"], axis=-1)
            count = np.isfinite(values).sum(axis=0)
            mean = np.nanmean(values, axis=0)
            spread = np.nanstd(values, axis=0)
            if band == "sem":
                spread = spread / np.sqrt(np.maximum(count, 1))
            ax.plot(layers, mean, style, color=colour, marker="o", markersize=3.5, label=method)
            if band != "none":
                ax.fill_between(
                    layers, mean - spread, mean + spread, color=colour, alpha=0.15, lw=0
                )
            published = (paper or {}).get(which, {}).get(method)
            if published is not None:
                # Published tables may skip layers (NaN): join the reported ones.
                shown = np.asarray(published, dtype=float).reshape(-1)
                reported = np.isfinite(shown)
                ax.plot(
                    np.arange(1, shown.size + 1)[reported],
                    shown[reported],
                    ":",
                    color=colour,
                    linewidth=1.2,
                    label=f"{method} (paper)",
                )
        if kind == "correlation":
            label = {"blank_out": "blank-out", "input_gradients": "input gradients"}.get(
                which, which
            )
            ax.set_title(f"vs {label}")
            ax.set_ylabel(f"{name} ρ (mean)")
            ax.axhline(0.0, color="0.7", linewidth=0.8, zorder=0)
        else:
            arrow = "↑" if which == "comprehensiveness" else "↓"
            ax.set_title(f"{which} AOPC {arrow}")
            ax.set_ylabel("AOPC (mean)")
        ax.set_xlabel("layer")
        ax.set_xticks(np.arange(1, longest + 1))
        ax.grid(axis="y", color="0.9", linewidth=0.6)
    # One legend for all panels, below them, so that it never hides a line.
    # Each label once, from whichever panel has it (the paper's lines may be on some only).
    entries: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    handles, labels = list(entries.values()), list(entries)
    figure.legend(
        handles,
        labels,
        loc="outside lower center",
        ncols=_legend_columns(labels, figure.get_figwidth()),
        frameon=False,
    )
    if title is not None:
        figure.suptitle(_wrapped(title, figure.get_figwidth()))
    return figure


def _text_width(text: str, size: Any) -> float:
    """Return the width (points) of `text` in the default font at `size`."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    width, _, _ = TextToPath().get_text_width_height_descent(
        text, FontProperties(size=size), ismath=False
    )
    return float(width)


def _legend_columns(labels: Sequence[str], width_inches: float) -> int:
    """Return the most legend columns (up to 6) whose widest entries fit the figure."""
    from matplotlib import rcParams

    size = rcParams["legend.fontsize"]
    em = _text_width("M", size) / 0.8  # about one font size, in points
    entry = (
        max(_text_width(label, size) for label in labels)
        + (
            rcParams["legend.handlelength"]
            + rcParams["legend.handletextpad"]
            + rcParams["legend.columnspacing"]
        )
        * em
    )
    fitting = int(0.95 * width_inches * 72.0 // entry)
    return max(1, min(len(labels), 6, fitting))


def _wrapped(title: str, width_inches: float) -> str:
    """Break `title` at spaces into lines that fit the figure's width as a suptitle."""
    from matplotlib import rcParams

    size = rcParams["figure.titlesize"]
    room = 0.95 * width_inches * 72.0
    lines: list[str] = []
    for paragraph in title.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            longer = f"{line} {word}" if line else word
            if line and _text_width(longer, size) > room:
                lines.append(line)
                line = word
            else:
                line = longer
        lines.append(line)
    return "\n".join(lines)
