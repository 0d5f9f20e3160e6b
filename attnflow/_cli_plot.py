"""``attnflow plot``: scores or attention from a file drawn as PNG, SVG, PDF or HTML."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._cli_common import UsageError, has_module
from ._cli_methods import read_tokens

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


_DRAWN_LIMIT = 2**26
"""The most values a figure or page is drawn from (64 Mi): more cannot be seen."""


_STORED_LIMIT = 2**29
"""The most values read from a file to draw a part of (512 Mi: 2 GiB of float32)."""


def _parse_index(index: str) -> tuple[int, ...]:
    """``--index``: integers for the leading axes."""
    if not index:
        return ()
    try:
        return tuple(int(part) for part in index.split(","))
    except ValueError:
        msg = f"--index must be comma-separated integers; got {index!r}"
        raise UsageError(msg) from None


def _shape_after_index(
    shape: tuple[int, ...], positions: tuple[int, ...], index: str
) -> tuple[int, ...]:
    """Return the shape ``--index`` leaves; refuse an index that does not fit."""
    if len(positions) > len(shape) or any(
        not -size <= position < size for position, size in zip(positions, shape, strict=False)
    ):
        msg = f"--index {index} does not fit an array of shape {shape}"
        raise UsageError(msg)
    return shape[len(positions) :]


def _apply_index(values: NDArray[Any], positions: tuple[int, ...]) -> NDArray[Any]:
    """Apply ``--index`` (integers for the leading axes) to `values`."""
    return np.asarray(values[positions]) if positions else values


def run_plot(args: argparse.Namespace) -> int:
    """Render one of attnflow's pictures from a file of scores or attention."""
    from pathlib import Path

    from ._arrayio import ArrayFileError, ArrayHeader, read_array, read_header

    output = Path(args.output)
    suffix = output.suffix.lower()
    if suffix not in {".png", ".svg", ".pdf", ".html"}:
        msg = f"--output must end in .png, .svg, .pdf or .html; got {output.name!r}"
        raise UsageError(msg)
    if suffix == ".html" and args.kind != "tokens":
        msg = f"HTML output shows token scores: use --kind tokens (got --kind {args.kind})"
        raise UsageError(msg)
    if suffix != ".html" and not has_module("matplotlib"):
        msg = "PNG, SVG and PDF figures need matplotlib: pip install 'attnflow[plot]'"
        raise UsageError(msg)
    if args.heads is not None and args.kind != "graph":
        msg = f"--heads applies to --kind graph (the attention it draws); got --kind {args.kind}"
        raise UsageError(msg)
    if os.path.lexists(output) and not args.force:  # a dangling link counts
        msg = f"{output} exists; pass --force to replace it"
        raise UsageError(msg)
    if not output.parent.is_dir():
        msg = f"-o {output}: folder {output.parent} does not exist; create it first"
        raise UsageError(msg)
    default = "attentions" if args.kind == "graph" else "scores"
    positions = _parse_index(args.index)
    expected = {"tokens": 1, "layers": 2, "graph": 3, "overlay": 1}[args.kind]
    if args.kind == "graph" and args.heads in {"mean", "max", "min"}:
        expected = 4  # fused after --index

    def accept(header: ArrayHeader) -> None:
        """Refuse what cannot be drawn from the header alone, before the data is read."""
        shape = _shape_after_index(header.shape, positions, args.index)
        if args.kind == "graph":
            _check_graph_shape(shape, stored_shape=header.shape, args=args)
        if len(shape) != expected:
            msg = (
                f"--kind {args.kind} draws an array of {expected} dimension(s); after --index "
                f"the input has shape {shape}: select with --index"
            )
            raise UsageError(msg)
        if math.prod(header.shape) > _STORED_LIMIT:
            msg = (
                f"{args.input}: array {header.name!r} declares shape {header.shape}, "
                f"{math.prod(header.shape):,} values, more than the {_STORED_LIMIT:,} that "
                "attnflow plot reads to draw a part of; save the part to draw on its own"
            )
            raise UsageError(msg)
        if math.prod(shape) > _DRAWN_LIMIT:
            msg = (
                f"{args.input}: --kind {args.kind} would draw {math.prod(shape):,} values "
                f"(shape {shape} after --index), more than the {_DRAWN_LIMIT:,} a figure "
                "can show; select a part with --index"
            )
            raise UsageError(msg)

    try:
        tokens = None if not args.tokens else read_tokens(args.tokens, option="--tokens")
        accept(read_header(args.input, key=args.key, default=default))
        if args.image is not None:
            _image_accept(read_header(args.image, key=None, default=""))
        stored = read_array(args.input, key=args.key, default=default)
        values = _apply_index(stored, positions)
        image = None if args.image is None else read_array(args.image, key=None, default="")
    except (ArrayFileError, OSError) as error:
        raise UsageError(str(error)) from None
    if args.kind == "graph":
        values = _graph_attention(values, args=args)
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


def _check_graph_shape(
    shape: tuple[int, ...], *, stored_shape: tuple[int, ...], args: argparse.Namespace
) -> None:
    """``plot --kind graph``: refuse a shape that is not the attention it can draw.

    Checked on the file's header, before its data is read. A stored array of 4 or more
    dimensions is ambiguous: ``(layers, heads, n, n)`` per-head attention and
    ``(batch, layers, n, n)`` fused attention look alike, and after ``--index 0`` the first
    would be drawn with its heads as layers. So such input needs ``--heads``: mean, max or
    min declare per-head attention (fused here after ``--index``), none declares fused
    attention. A 3-dimensional array is read as ``(layers, n, n)``.
    """
    after = f" (after --index {args.index}: {shape})" if args.index else ""
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
        return
    if args.heads == "none":
        if len(shape) != 3:
            msg = (
                f"--heads none: the input must be fused attention (layers, n, n) after "
                f"--index; {given}: select the sample with --index"
                + (" (--index picks batch axes only)" if len(shape) < 3 else "")
            )
            raise UsageError(msg)
        return
    if len(shape) != 4:
        hint = (
            "pick one sample with --index (batch axes only)"
            if len(shape) > 4
            else "it has no heads axis left: --index picks batch axes only (not a layer), "
            "and fused (layers, n, n) attention takes --heads none"
        )
        msg = (
            f"--heads {args.heads}: the input must be per-head attention (layers, heads, n, "
            f"n) after --index; {given}: {hint}"
        )
        raise UsageError(msg)


def _graph_attention(values: NDArray[Any], *, args: argparse.Namespace) -> NDArray[Any]:
    """``plot --kind graph``: the (layers, n, n) head-fused attention to draw."""
    import attnflow

    if args.heads is None or args.heads == "none":
        return values
    try:
        return np.asarray(attnflow.fuse_heads(values, heads=args.heads))
    except (ValueError, TypeError) as error:
        msg = f"--heads {args.heads}: cannot fuse the heads of {args.input}: {error}"
        raise UsageError(msg) from None


def _image_accept(header: Any) -> None:
    """``--image``: (H, W[, 3 or 4]) numbers of a drawable size, checked before reading."""
    if (
        len(header.shape) not in (2, 3)
        or (len(header.shape) == 3 and header.shape[-1] not in (3, 4))
        or header.dtype.kind not in "biuf"
        or math.prod(header.shape) > _DRAWN_LIMIT
    ):
        msg = (
            f"--image must be an image (H, W), (H, W, 3) or (H, W, 4) of numbers, at most "
            f"{_DRAWN_LIMIT:,} values; the file stores {header.stored} of shape {header.shape}"
        )
        raise UsageError(msg)


def _write_plot(output: Path, write: Callable[[Any], object], *, force: bool) -> Path:
    """Write a figure or page atomically (exclusively without --force)."""
    from ._arrayio import ArrayFileError, write_atomically

    try:
        return write_atomically(output, write, force=force)
    except ArrayFileError as error:
        raise UsageError(str(error)) from None
