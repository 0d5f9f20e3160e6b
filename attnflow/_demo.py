"""What ``attnflow demo`` shows: the table, the HTML page and the figures.

The argument parsing of ``attnflow demo`` is in :mod:`attnflow._cli`, which imports this
module only when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from ._cli_common import PAPER, PROG, UsageError, bar, can_encode, has_module

if TYPE_CHECKING:
    from .html import TokenView

__all__ = ["render_demo", "run_demo"]

_WIDTH = 88
_LAYOUT_CSS = "body { font-family: sans-serif; max-width: 1100px; margin: auto; }\n"


def _explained_row(tokens: Sequence[str]) -> int:
    """Choose the row the figures explain: the masked word (paper's Figure 4), else [CLS]."""
    return list(tokens).index("[MASK]") if "[MASK]" in tokens else 0


def _demo_page(sample: Any, sections: Sequence[str | TokenView], *, plotting: bool) -> str:
    """Assemble the demo's standalone HTML page from its per-sentence sections."""
    import html

    from .html import _views_page

    note = (
        ""
        if plotting
        else "<p>Install matplotlib (<code>pip install 'attnflow[plot]'</code>) for the "
        "figures.</p>"
    )
    header = (
        "<h1>attnflow demo</h1>\n"
        "<p>Raw attention, attention rollout and attention flow of a real model: "
        f"{html.escape(sample.source)}. Each sentence explains its [MASK] token (the "
        f"paper's Figure 4) or, without one, its [CLS] token. {html.escape(PAPER)}</p>\n"
        f"{note}"
    )
    return _views_page("attnflow demo", [header, *sections], css=_LAYOUT_CSS)


def _demo_file_names(sample: Any, folder: str, *, force: bool) -> list[str]:
    """List the demo's files; refuse (before anything is printed) to replace any."""
    from pathlib import Path

    target = Path(folder)
    names = ["index.html"]
    if has_module("matplotlib"):
        names += [
            f"sentence-{b + 1}-{kind}.png"
            for b in range(len(sample.sentences))
            for kind in ("layers", "graph")
        ]
        names.append("digits.png")
    existing = [name for name in names if os.path.lexists(target / name)]  # links count
    if existing and not force:
        msg = f"{target} already holds {', '.join(existing)}; pass --force to replace them"
        raise UsageError(msg)
    return names


def _write_demo_files(sample: Any, folder: str, *, force: bool) -> list[str]:
    """Write the demo's HTML page and (with matplotlib) its figures; list the files."""
    from pathlib import Path

    from ._staged import Staged

    target = Path(folder)
    names = _demo_file_names(sample, folder, force=force)
    plotting = len(names) > 1

    def exists(path: Path) -> Exception:
        return UsageError(f"{path} exists; pass --force to replace it")

    # Every file is staged, then all are published together: a failed or interrupted demo
    # leaves no partial folder (a folder it made is removed again).
    with Staged(force=force, exists=exists) as staged:
        try:
            staged.folder(target)
        except OSError as error:
            msg = f"cannot create {target}: {error}"
            raise UsageError(msg) from None
        _stage_demo_files(sample, target, staged, plotting=plotting)
        written = staged.publish()
    page = target / "index.html"  # first: the file to open
    return [str(page), *(str(path) for path in written if path != page)]


def _stage_demo_files(sample: Any, target: Any, staged: Any, *, plotting: bool) -> None:
    """Stage the demo's figures (with matplotlib) and its page, the page last."""
    import html

    import attnflow
    from attnflow.html import TokenView

    from ._sample import load_image_sample

    def save(name: str, write: Callable[[Any], object]) -> None:
        staged.write(target / name, write)

    sections: list[str | TokenView] = []
    for b, sentence in enumerate(sample.sentences):
        real = np.flatnonzero(sample.mask[b])
        tokens = [sample.tokens[b][i] for i in real]
        row = _explained_row(tokens)
        one = sample.attentions[b : b + 1][..., real, :][..., real]
        maps = {
            "raw": np.asarray(attnflow.raw(one, rows=row, layers="all"))[0],
            "rollout": np.asarray(attnflow.rollout(one, rows=row, layers="all"))[0],
            "flow": np.asarray(attnflow.flow(one, rows=row, layers="all"))[0],
        }
        special = [i for i, t in enumerate(tokens) if t in ("[CLS]", "[SEP]") and i != row]
        view = TokenView(
            {name: values[-1] for name, values in maps.items()},
            tokens,
            title=f"{tokens[row]} at the last layer (colour scale without [CLS] and [SEP])",
            scale_exclude=special,  # the sinks would wash out every other token
        )
        images = ""
        if plotting:
            import attnflow.plot

            figures = {
                "layers": attnflow.plot.layer_token_map(
                    maps,
                    tokens=tokens,
                    title=f"{sentence}: {tokens[row]} (row {row})",
                    # Shown at page width (about 1,100 px): a compact figure keeps its
                    # tick labels legible there.
                    figsize=(10.5, 3.4),
                ),
                "graph": attnflow.plot.attention_graph(
                    np.asarray(attnflow.fuse_heads(one))[0],
                    tokens=tokens,
                    title=sentence,
                    row=row,
                    residual=False,
                ),
            }
            for kind, figure in figures.items():
                name = f"sentence-{b + 1}-{kind}.png"

                def draw(file: Any, figure: Any = figure) -> None:
                    figure.savefig(file, format="png", dpi=110)

                save(name, draw)
                images += (
                    f'<p><img src="{name}" alt="{kind} of sentence {b + 1}" '
                    'style="max-width: 100%"></p>\n'
                )
        sections += [f"<h2>{b + 1}. {html.escape(sentence)}</h2>", view, images]
    if plotting:
        digits = _digits_figure()
        save("digits.png", lambda file: digits.savefig(file, format="png", dpi=110))
        sections.append(
            "<h2>A vision transformer on digits</h2>\n<p>Rollout and flow of the [CLS] token "
            "of a small ViT trained on scikit-learn's 8x8 digits (2x2 patches, a 4 x 4 grid), "
            f"overlaid on each input. Model: {html.escape(load_image_sample().source)}.</p>\n"
            '<p><img src="digits.png" alt="digits" style="max-width: 100%"></p>'
        )
    page = _demo_page(sample, sections, plotting=plotting)
    save("index.html", lambda file: file.write(page.encode("utf-8")))


def _digits_figure() -> Any:
    """Draw rollout and flow of [CLS] over the patches of the shipped digits (ViT)."""
    from matplotlib.figure import Figure

    import attnflow
    import attnflow.plot

    from ._sample import load_image_sample

    digits = load_image_sample()
    methods = {
        "rollout": np.asarray(attnflow.rollout(digits.attentions, rows=0)),
        "flow": np.asarray(attnflow.flow(digits.attentions, rows=0)),
    }
    count = digits.images.shape[0]
    figure = Figure(figsize=(2.0 * count, 4.4), layout="constrained")
    axes = figure.subplots(len(methods), count, squeeze=False)
    for row, (name, scores) in enumerate(methods.items()):
        for i in range(count):
            attnflow.plot.image_overlay(
                scores[i],
                digits.images[i],
                grid=(4, 4),
                extra_tokens=1,
                ax=axes[row, i],
                title=f"{name}: {int(digits.labels[i])}",
            )
    figure.suptitle("[CLS] of a small ViT trained on scikit-learn's 8x8 digits", fontsize=10)
    return figure


def _field(label: str, text: str) -> list[str]:
    """Format a header field: the label, then `text` wrapped with a hanging indent."""
    return textwrap.wrap(
        text,
        width=_WIDTH,
        initial_indent=f"{label:<9}",
        subsequent_indent=" " * 9,
        break_on_hyphens=False,
    )


def render_demo(
    sentences: Sequence[str],
    tokens: Sequence[Sequence[str]],
    mask: NDArray[np.bool_],
    raw: NDArray[np.floating],
    rollout: NDArray[np.floating],
    flow: NDArray[np.floating],
    *,
    rows: Sequence[int] | None = None,
    source: str,
    layers: int,
    heads: int,
    unicode: bool = True,
    bar_width: int = 24,
) -> list[str]:
    """Lay out the demo: a header, then one table of real tokens per sentence.

    Parameters
    ----------
    sentences : sequence of str
        The ``batch`` input sentences.
    tokens : sequence of sequence of str
        ``batch`` rows of ``n`` tokens, padding included.
    mask : ndarray of bool, shape (batch, n)
        True for real tokens; padding is not shown.
    raw, rollout, flow : ndarray, shape (batch, n)
        Last-layer raw attention, rollout and attention flow of each sentence's explained
        row.
    rows : sequence of int, optional
        The row explained in each sentence (default: 0, ``[CLS]``).
    source : str
        Where the attention comes from (model, versions).
    layers, heads : int
        Size of the model, for the header.
    unicode : bool, default True
        Draw bars with block characters, else with ``#``.
    bar_width : int, default 24
        Characters in the longest bar of each sentence.

    Returns
    -------
    list of str
        The lines to print.
    """
    explained = [0] * len(sentences) if rows is None else list(rows)
    lines = [
        f"{PROG} demo: how much each input token reaches the explained token",
        "",
        *_field("model", source),
        *_field(
            "method",
            "attention rollout and attention flow of the explained row (the [MASK] word, as "
            f"in the paper's Figure 4, else [CLS]; the page shows the same) to the last layer "
            f"(L{layers}): the {heads} heads averaged, residual modelled as 0.5 A + 0.5 I, "
            f"padding masked, flow rows normalised; 'raw' is layer {layers}'s own "
            "head-averaged attention, the paper's baseline; bars show rollout",
        ),
        *_field("paper", PAPER),
        *_field(
            "call",
            "attnflow.rollout(attentions, rows=row, mask=mask), "
            "attnflow.flow(attentions, rows=row, mask=mask)",
        ),
    ]
    token_width = max(
        [5] + [len(t) for row, keep in zip(tokens, mask, strict=True) for t in np.array(row)[keep]]
    )
    for b, sentence in enumerate(sentences):
        real = np.flatnonzero(mask[b])
        top = float(max(rollout[b, real].max(), np.finfo(np.float64).tiny))
        lines += [
            "",
            f"[{b + 1}/{len(sentences)}] {sentence}  (row {explained[b]}: {tokens[b][explained[b]]})",
            f"  {'#':>3}  {'token':<{token_width}}  {'raw':>7}  {'rollout':>7}  {'flow':>7}",
        ]
        for i in real.tolist():
            value = float(rollout[b, i])
            drawn = bar(value / top, bar_width, unicode=unicode)
            lines.append(
                f"  {i:>3}  {tokens[b][i]:<{token_width}}  {float(raw[b, i]):>7.4f}  "
                f"{value:>7.4f}  {float(flow[b, i]):>7.4f}  {drawn}".rstrip()
            )
    lines += [
        "",
        *textwrap.wrap(
            "Each column sums to 1 over the real tokens (padding, not shown, gets exactly "
            "0); bars are scaled to the largest rollout in each sentence.",
            width=_WIDTH,
        ),
    ]
    return lines


def run_demo(args: argparse.Namespace) -> int:
    """Print raw attention, rollout and flow of each sample sentence's [MASK] (else [CLS]) row."""
    import attnflow

    from ._sample import load_sample

    sample = load_sample()
    if not args.no_files:
        _demo_file_names(sample, args.output, force=args.force)  # refuse before the table
    # The row the page explains too: the masked word (the paper's Figure 4), else [CLS].
    rows = [
        int(
            np.flatnonzero(keep)[_explained_row([t for t, k in zip(words, keep, strict=True) if k])]
        )
        for words, keep in zip(sample.tokens, sample.mask, strict=True)
    ]
    picked = np.arange(len(rows)), np.asarray(rows)
    raw = np.asarray(attnflow.raw(sample.attentions, mask=sample.mask))[picked]
    rollout = np.asarray(attnflow.rollout(sample.attentions, mask=sample.mask))[picked]
    flow = np.asarray(attnflow.flow(sample.attentions, mask=sample.mask))[picked]
    _, layers, heads, _, _ = sample.attentions.shape
    lines = render_demo(
        sample.sentences,
        sample.tokens,
        sample.mask,
        raw,
        rollout,
        flow,
        rows=rows,
        source=sample.source,
        layers=layers,
        heads=heads,
        unicode=can_encode(bar(0.99, 8, unicode=True), sys.stdout),
    )
    print("\n".join(lines))
    if not args.no_files:
        written = _write_demo_files(sample, args.output, force=args.force)
        print()
        print(f"wrote {len(written)} files to {args.output}/: open {written[0]}")
        if len(written) == 1:
            print("(install matplotlib, `pip install 'attnflow[plot]'`, for the figures)")
    return 0
