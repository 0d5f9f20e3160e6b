"""``attnflow plot``: scores or attention from a file drawn as PNG, SVG, PDF or HTML."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._cli import UsageError, _has_module

__all__ = ["configure_plot", "run_plot"]


# -- attnflow plot ------------------------------------------------------------------------

_PLOT_KINDS = ("tokens", "layers", "graph", "overlay")


def configure_plot(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``attnflow plot``."""
    parser.add_argument(
        "input", help="scores or attention: .npy, .npz or .safetensors (never unpickled)"
    )
    parser.add_argument("--key", help="the array to read from an .npz/.safetensors file")
    parser.add_argument(
        "--kind",
        choices=_PLOT_KINDS,
        default="tokens",
        help="tokens: one row of scores (n,); layers: a layer x token map (L, n); "
        "graph: head-fused attention (L, n, n), see --heads; overlay: patch scores on --image",
    )
    parser.add_argument(
        "--heads",
        choices=("mean", "max", "min", "none"),
        help="--kind graph: what the input's heads are. mean, max or min: per-head attention "
        "(*batch, layers, heads, n, n), fused so; none: already fused (*batch, layers, n, n). "
        "Needed for input of 4 or more dimensions, whose shape cannot tell a heads axis from "
        "a batch axis",
    )
    parser.add_argument(
        "--index",
        default="",
        help="indices of the leading axes to select first, e.g. '0' or '0,3' (batch, row)",
    )
    parser.add_argument("-o", "--output", required=True, help="the .png, .svg or .html to write")
    parser.add_argument("--force", action="store_true", help="replace an existing output")
    parser.add_argument("--tokens", help="a text file with one token per line")
    parser.add_argument("--image", help="for --kind overlay: the image as .npy (H, W[, 3])")
    parser.add_argument("--title", help="a title for the figure or page")


def _apply_index(values: NDArray[Any], index: str) -> NDArray[Any]:
    """Apply ``--index`` (integers for the leading axes) to `values`."""
    if not index:
        return values
    try:
        positions = tuple(int(part) for part in index.split(","))
    except ValueError:
        msg = f"--index must be comma-separated integers; got {index!r}"
        raise UsageError(msg) from None
    try:
        return np.asarray(values[positions])
    except IndexError:
        msg = f"--index {index} does not fit an array of shape {tuple(values.shape)}"
        raise UsageError(msg) from None


def run_plot(args: argparse.Namespace) -> int:
    """Render one of attnflow's pictures from a file of scores or attention."""
    from pathlib import Path

    from ._arrayio import ArrayFileError, read_array

    output = Path(args.output)
    suffix = output.suffix.lower()
    if suffix not in {".png", ".svg", ".pdf", ".html"}:
        msg = f"--output must end in .png, .svg, .pdf or .html; got {output.name!r}"
        raise UsageError(msg)
    if suffix == ".html" and args.kind != "tokens":
        msg = f"HTML output shows token scores: use --kind tokens (got --kind {args.kind})"
        raise UsageError(msg)
    if suffix != ".html" and not _has_module("matplotlib"):
        msg = "PNG, SVG and PDF figures need matplotlib: pip install 'attnflow[plot]'"
        raise UsageError(msg)
    if args.heads is not None and args.kind != "graph":
        msg = f"--heads applies to --kind graph (the attention it draws); got --kind {args.kind}"
        raise UsageError(msg)
    if os.path.lexists(output) and not args.force:  # a dangling link counts
        msg = f"{output} exists; pass --force to replace it"
        raise UsageError(msg)
    default = "attentions" if args.kind == "graph" else "scores"
    try:
        stored = read_array(args.input, key=args.key, default=default)
        values = _apply_index(stored, args.index)
        tokens = None
        if args.tokens:
            tokens = Path(args.tokens).read_text(encoding="utf-8").splitlines()
        image = None if args.image is None else read_array(args.image, key=None, default="")
    except (ArrayFileError, OSError) as error:
        raise UsageError(str(error)) from None
    if args.kind == "graph":
        values = _graph_attention(values, stored_shape=tuple(stored.shape), args=args)
    expected = {"tokens": 1, "layers": 2, "graph": 3, "overlay": 1}[args.kind]
    if values.ndim != expected:
        msg = (
            f"--kind {args.kind} draws an array of {expected} dimension(s); after --index the "
            f"input has shape {tuple(values.shape)}: select with --index"
        )
        raise UsageError(msg)
    n = values.shape[-1]
    labels = tokens if tokens is not None else [str(i) for i in range(n)]

    if suffix == ".html":
        from attnflow.html import TokenView

        page = TokenView(values, labels, title=args.title).to_html()
        written = _write_plot(output, lambda file: file.write(page.encode()), force=args.force)
    else:
        import attnflow.plot

        if args.kind == "tokens":
            figure = attnflow.plot.token_heatmap(values, tokens=labels, title=args.title)
        elif args.kind == "layers":
            figure = attnflow.plot.layer_token_map(values, tokens=labels, title=args.title)
        elif args.kind == "graph":
            figure = attnflow.plot.attention_graph(values, tokens=labels, title=args.title)
        else:
            if image is None:
                msg = "--kind overlay needs --image"
                raise UsageError(msg)
            figure = attnflow.plot.image_overlay(values, image, title=args.title)
        written = _write_plot(
            output, lambda file: figure.savefig(file, format=suffix[1:]), force=args.force
        )
    print(f"plot: {args.input} -> {written}")
    return 0


def _graph_attention(
    values: NDArray[Any], *, stored_shape: tuple[int, ...], args: argparse.Namespace
) -> NDArray[Any]:
    """``plot --kind graph``: the (layers, n, n) head-fused attention to draw, or a refusal.

    A stored array of 4 or more dimensions is ambiguous: ``(layers, heads, n, n)`` per-head
    attention and ``(batch, layers, n, n)`` fused attention look alike, and after
    ``--index 0`` the first would be drawn with its heads as layers. So such input needs
    ``--heads``: mean, max or min declare per-head attention (fused here after
    ``--index``), none declares fused attention. A 3-dimensional array is read as
    ``(layers, n, n)``.
    """
    import attnflow

    after = f" (after --index {args.index}: {tuple(values.shape)})" if args.index else ""
    given = f"{args.input} holds shape {stored_shape}{after}"
    if args.heads is None:
        if len(stored_shape) >= 4:
            msg = (
                f"--kind graph draws head-fused attention (layers, n, n); {given}, which "
                "could be per-head attention (..., layers, heads, n, n) or fused attention "
                "of a batch (batch, layers, n, n): the shape cannot tell. Pass --heads mean "
                "(or max, min) to fuse the heads of per-head attention, or --heads none if "
                "the heads are already fused; pick one sample with --index (batch axes only)"
            )
            raise UsageError(msg)
        return values
    if args.heads == "none":
        if values.ndim != 3:
            msg = (
                f"--heads none: the input must be fused attention (layers, n, n) after "
                f"--index; {given}: select the sample with --index"
                + (" (--index picks batch axes only)" if values.ndim < 3 else "")
            )
            raise UsageError(msg)
        return values
    if values.ndim != 4:
        hint = (
            "pick one sample with --index (batch axes only)"
            if values.ndim > 4
            else "it has no heads axis left: --index picks batch axes only (not a layer), "
            "and fused (layers, n, n) attention takes --heads none"
        )
        msg = (
            f"--heads {args.heads}: the input must be per-head attention (layers, heads, n, "
            f"n) after --index; {given}: {hint}"
        )
        raise UsageError(msg)
    try:
        return np.asarray(attnflow.fuse_heads(values, heads=args.heads))
    except (ValueError, TypeError) as error:
        msg = f"--heads {args.heads}: cannot fuse the heads of {args.input}: {error}"
        raise UsageError(msg) from None


def _write_plot(output: Path, write: Callable[[Any], object], *, force: bool) -> Path:
    """Write a figure or page atomically (exclusively without --force)."""
    from ._arrayio import ArrayFileError, write_atomically

    try:
        return write_atomically(output, write, force=force)
    except ArrayFileError as error:
        raise UsageError(str(error)) from None
