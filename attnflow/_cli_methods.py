"""``attnflow rollout``, ``flow`` and ``raw``: a method on attention weights in a file.

Also the terminal table of top tokens (and its bars) that the other commands print.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._cli_common import UsageError, bar, can_encode, has_module
from ._cli_flags import (
    add_decoder_flags,
    add_flow_limits,
    add_mask_and_tokens,
    errors_in_flags,
    flow_limits,
)
from ._deprecation import REMOVED_IN
from ._methods import method_spec

__all__ = ["configure_method", "run_method"]

# -- attnflow rollout / flow / raw --------------------------------------------------------


def _parse_rows(text: str) -> int | list[int] | None:
    """``--rows``: ``all``, one position, or a comma-separated list."""
    if text == "all":
        return None
    try:
        positions = [int(part) for part in text.split(",")]
    except ValueError:
        msg = (
            f"--rows must be 'all', an integer or a comma-separated list of integers; got {text!r}"
        )
        raise UsageError(msg) from None
    return positions[0] if len(positions) == 1 and "," not in text else positions


def _parse_layers(text: str) -> str | int:
    """``--layers``: ``last``, ``all`` or a layer index."""
    if text in {"last", "all"}:
        return text
    try:
        return int(text)
    except ValueError:
        msg = f"--layers must be 'last', 'all' or an integer layer index; got {text!r}"
        raise UsageError(msg) from None


def _parse_heads(text: str, *, method: str) -> str | list[float] | None:
    """``--heads``: ``mean``, ``max``, ``min``, ``each``, ``none`` (already fused) or weights."""
    if text == "each" and not method_spec(method).composes_layers:
        msg = (
            "--heads each (one map per head) is an option of 'attnflow rollout' and "
            "'attnflow flow'; raw attention per head is the input itself"
        )
        raise UsageError(msg)
    if text in {"mean", "max", "min", "each"}:
        return text
    if text == "none":
        return None
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        msg = (
            "--heads must be 'mean', 'max', 'min', 'each' (one map per head; rollout and "
            f"flow), 'none' (heads already fused) or comma-separated weights; got {text!r}"
        )
        raise UsageError(msg) from None


def _parse_exclude(text: str | None) -> int | list[int] | None:
    """``--exclude``: one input position or a comma-separated list (attention sinks)."""
    if text is None:
        return None
    try:
        positions = [int(part) for part in text.split(",")]
    except ValueError:
        msg = (
            "--exclude must be an integer token position or a comma-separated list of them "
            f"(for example 0 for a BOS sink); got {text!r}"
        )
        raise UsageError(msg) from None
    return positions[0] if len(positions) == 1 and "," not in text else positions


def _decoder_options(args: argparse.Namespace) -> dict[str, object]:
    """``--receptive-field`` and ``--exclude`` (rollout and flow): parsed before any read."""
    options: dict[str, object] = {}
    if args.receptive_field:
        options["receptive_field"] = True
    exclude = _parse_exclude(args.exclude)
    if exclude is not None:
        options["exclude"] = exclude
    return options


def _pruning_options(args: argparse.Namespace) -> dict[str, object]:
    """``--threshold``, ``--top-k``, ``--discard``: checked before any file is read."""
    from ._validation import check_pruning

    given = {"threshold": args.threshold, "top_k": args.top_k, "discard": args.discard}
    try:
        check_pruning(**given)
    except (TypeError, ValueError) as error:
        message = str(error)
        for name, flag in (
            ("threshold", "--threshold"),
            ("top_k", "--top-k"),
            ("discard", "--discard"),
        ):
            message = message.replace(f"`{name}", f"`{flag}")
        raise UsageError(message) from None
    return {name: value for name, value in given.items() if value is not None}


def _output_and_selection(parser: argparse.ArgumentParser, *, name: str) -> None:
    """``-o``, ``--force``, ``--rows`` and ``--layers``: every method command has them."""
    parser.add_argument(
        "-o", "--output", help=f"the .npz to write (default: INPUT_STEM.{name}.npz)"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing output")
    parser.add_argument(
        "--rows", default="all", help="output positions: 'all', an integer or a list (0,4)"
    )
    parser.add_argument("--layers", default="last", help="'last', 'all' or a layer index")


def configure_method(parser: argparse.ArgumentParser, *, method: str) -> None:
    """Add the options shared by ``rollout``, ``flow`` and ``raw`` (and flow's own)."""
    spec = method_spec(method)
    parser.add_argument(
        "input",
        help="attention weights: .npy, .npz or .safetensors, shaped "
        "(*batch, layers, heads, n, n); never unpickled",
    )
    parser.add_argument("--key", help="the array to read from an .npz/.safetensors file")
    _output_and_selection(parser, name=method)
    parser.add_argument(
        "--heads",
        default="mean",
        help="'mean', 'max', 'min', 'none' or weights (h1,h2,...)"
        + ("" if not spec.composes_layers else "; 'each' for one map per head (App. A.1)"),
    )
    if spec.composes_layers:
        parser.add_argument(
            "--residual", type=float, default=0.5, help="weight of the identity (default 0.5)"
        )
        pruning = parser.add_mutually_exclusive_group()
        pruning.add_argument(
            "--threshold",
            type=float,
            default=None,
            help="drop fused attention weights below this value, then renormalise rows",
        )
        pruning.add_argument(
            "--top-k",
            type=int,
            default=None,
            help="keep the TOP_K largest entries of each row of every mixed layer",
        )
        pruning.add_argument(
            "--discard",
            type=float,
            default=None,
            help="drop this fraction of each fused layer's lowest weights (never column 0)",
        )
        add_decoder_flags(parser)  # --receptive-field, --exclude
    add_mask_and_tokens(parser)  # --mask, --mask-key, --tokens
    parser.add_argument(
        "--top", type=int, default=10, help="tokens to show in the table (default 10)"
    )
    parser.add_argument(
        "--no-validate", action="store_true", help="skip the checks on the attention values"
    )
    if spec.host_only:
        parser.add_argument(
            "--raw-values", action="store_true", help="raw max-flow values, rows not normalised"
        )
        add_flow_limits(parser)  # --jobs, --max-seconds
        parser.add_argument(
            "--no-progress", action="store_true", help="hide the progress bar (shown with tqdm)"
        )
        parser.add_argument(
            "--max-work",
            type=float,
            default=None,
            help="deprecated: the limit in edge visits of the old engine (use --max-seconds)",
        )


def _top_table(
    scores: NDArray[np.floating], tokens: Sequence[str] | None, *, top: int, title: str
) -> list[str]:
    """Lay out the `top` highest-scoring input tokens of one row of scores."""
    order = np.argsort(-scores, kind="stable")[: max(top, 0)]
    labels = [tokens[i] if tokens is not None else f"token {i}" for i in order]
    width = max([5, *(len(label) for label in labels)])
    largest = float(max(scores.max(initial=0.0), np.finfo(np.float64).tiny))
    unicode = can_encode(bar(0.99, 8, unicode=True), sys.stdout)
    lines = [title, f"  {'#':>4}  {'token':<{width}}  {'score':>8}"]
    for i, label in zip(order.tolist(), labels, strict=True):
        value = float(scores[i])
        drawn = bar(value / largest, 24, unicode=unicode)
        lines.append(f"  {i:>4}  {label:<{width}}  {value:>8.4f}  {drawn}".rstrip())
    return lines


_STORED_EPSILON = {"bfloat16": 2.0**-7}
"""Machine epsilon of stored dtypes that reach the library widened (NumPy has no bfloat16)."""


def _method_options(args: argparse.Namespace, *, method: str) -> dict[str, Any]:
    """Parse and check every option of ``rollout``/``flow``/``raw`` that needs no file."""
    from ._validation import check_residual

    options: dict[str, Any] = {
        "rows": _parse_rows(args.rows),
        "layers": _parse_layers(args.layers),
        "heads": _parse_heads(args.heads, method=method),
    }
    spec = method_spec(method)
    if spec.composes_layers:
        options |= _pruning_options(args) | _decoder_options(args)
        try:
            options["residual"] = check_residual(args.residual)
        except (TypeError, ValueError) as error:
            raise UsageError(_in_flags(str(error))) from None
    if args.top < 0:
        msg = f"--top must be a number of tokens, 0 or more; got {args.top}"
        raise UsageError(msg)
    if spec.host_only:
        options |= flow_limits(args)  # n_jobs, max_seconds
        if args.max_work is not None and not args.max_work > 0:
            msg = (
                "--max-work must be a positive number of edge visits (inf for no limit); "
                f"got {args.max_work}"
            )
            raise UsageError(msg)
        if args.max_work is not None and args.max_seconds is not None:
            msg = "pass --max-seconds only (--max-work is its deprecated predecessor)"
            raise UsageError(msg)
    return options


def _in_flags(message: str) -> str:
    from ._cli_flags import in_flags

    return in_flags(message)


def _attention_accept(options: dict[str, Any]) -> Any:
    """Check an attention file's header against the options, before its data is read."""
    from ._validation import check_attention_layout, check_exclude, check_layers, check_rows

    def accept(header: Any) -> None:
        if header.dtype.kind != "f":
            msg = (
                "attention weights must be floating point (float16, bfloat16, float32 or "
                f"float64); the file stores {header.stored}"
            )
            raise TypeError(msg)
        heads = options["heads"]
        layout = check_attention_layout(header.shape, fused=heads is None)
        check_rows(options["rows"], layout.n_tokens)
        check_layers(options["layers"], layout.n_layers)
        check_exclude(options.get("exclude"), layout.n_tokens)
        if isinstance(heads, list) and len(heads) != layout.n_heads:
            msg = f"--heads gives {len(heads)} weights for attention with {layout.n_heads} heads"
            raise ValueError(msg)

    return accept


def _mask_accept(attention: Any, *, fused: bool) -> Any:
    """Check a mask file's header: booleans of shape (*batch, n) for this attention."""

    def accept(header: Any) -> None:
        batch = attention.shape[: -3 if fused else -4]
        expected = (*batch, attention.shape[-1])
        if header.dtype != np.dtype(bool) or header.shape != expected:
            msg = (
                f"--mask must be a boolean array of shape (*batch, n) = {expected}; the file "
                f"stores {header.stored} of shape {header.shape}"
            )
            raise ValueError(msg)

    return accept


def run_method(args: argparse.Namespace, *, method: str) -> int:
    """Read attention, run one method, write the result and print its top tokens.

    Everything that can be checked is checked first, in this order: the options, the
    input's header (shape and dtype, against the options), then the output's name; only
    then is data read. Nothing is written unless the method succeeds.
    """
    import contextlib
    from pathlib import Path

    from ._arrayio import ArrayFileError, read_array, read_header
    from ._validation import stored_precision

    spec = method_spec(method)
    options = _method_options(args, method=method)
    source = Path(args.input)
    accept = _attention_accept(options)
    try:
        header = read_header(source, key=args.key, default="attentions")
        try:
            accept(header)
        except (TypeError, ValueError, IndexError) as error:
            msg = f"{source}: {_in_flags(str(error))}"
            raise UsageError(msg) from None
        output = _output_path(source, args.output, method, force=args.force)
        attentions = read_array(source, key=args.key, default="attentions", accept=accept)
        mask = None
        if args.mask:
            mask = read_array(
                args.mask,
                key=args.mask_key,
                default="mask",
                accept=_mask_accept(attentions, fused=options["heads"] is None),
            )
        tokens = _read_tokens(args.tokens, attentions, option="--tokens")
    except (ArrayFileError, OSError) as error:
        raise UsageError(_in_flags(str(error))) from None

    options |= {"mask": mask, "validate": not args.no_validate}
    if spec.host_only:
        options |= {
            "normalize_result": not args.raw_values,
            # The bar needs tqdm, an optional extra: without it the command runs quietly.
            "progress": not args.no_progress and has_module("tqdm"),
        }
        if args.max_work is not None:
            print(
                "attnflow: --max-work (edge visits of the old engine) is replaced by "
                f"--max-seconds; --max-work will be removed in attnflow {REMOVED_IN}.",
                file=sys.stderr,
            )
            options["max_work"] = args.max_work
    function = spec.function()
    precision = (
        stored_precision(header.stored, _STORED_EPSILON[header.stored])
        if header.stored in _STORED_EPSILON
        else contextlib.nullcontext()
    )
    with (
        errors_in_flags(ValueError, TypeError, IndexError, RuntimeError),
        precision,
        warnings.catch_warnings(),
    ):
        # --max-work's note is printed above; the library's warning would repeat it.
        warnings.filterwarnings("ignore", r"`max_work`", DeprecationWarning)
        # Negative --rows count from each sequence's last real token (--mask, right padding):
        # the core function resolves them from the mask it is given.
        values = np.asarray(function(attentions, **options))
    # Lay out the report before writing, so that nothing is written if it fails.
    axis = _layer_axis(
        values, rows=options["rows"], layers=options["layers"], each=options["heads"] == "each"
    )
    table = _first_row_table(values, tokens, top=args.top, layer_axis=axis)
    written = _write_output(output, {method: values}, force=args.force)
    print(f"{method}: {source} -> {written}, shape {tuple(values.shape)}, dtype {values.dtype}")
    print("\n".join(table))
    return 0


def _output_path(source: Path, output: str | None, name: str, *, force: bool) -> Path:
    """``-o``, else ``INPUT_STEM.NAME.npz`` beside the input; an existing one needs --force.

    A symbolic link counts as existing even when it points nowhere. This early check
    saves the work; the write itself is exclusive too (two runs cannot both win).
    """
    from ._arrayio import ArrayFileError

    path = Path(output) if output else source.with_name(f"{source.name.split('.')[0]}.{name}.npz")
    if os.path.lexists(path) and not force:
        msg = f"{path} exists; pass --force to replace it"
        raise ArrayFileError(msg)
    if not path.parent.is_dir():  # found now, not after the work
        msg = f"-o {path}: folder {path.parent} does not exist; create it first"
        raise ArrayFileError(msg)
    return path


def _read_tokens(path: str | None, values: NDArray[Any], *, option: str) -> list[str] | None:
    """Read a token file (one per line) and check it labels the last axis of `values`."""
    if not path:
        return None
    tokens = read_tokens(path, option=option)
    if values.ndim and len(tokens) != values.shape[-1]:
        msg = f"{option} has {len(tokens)} lines but the attention has {values.shape[-1]} tokens"
        raise UsageError(msg)
    return tokens


def read_tokens(path: str, *, option: str) -> list[str]:
    """Read a token file, one token per line: a regular file of bounded size, never a FIFO."""
    from ._textio import TextFileError, read_text_file

    try:
        return read_text_file(path, option=option).splitlines()
    except TextFileError as error:
        raise UsageError(str(error)) from None


def _write_output(output: Path, arrays: dict[str, NDArray[Any]], *, force: bool) -> Path:
    """Write the result's ``.npz`` atomically; a refused write is a usage error."""
    from ._arrayio import ArrayFileError, write_npz

    try:
        return write_npz(output, arrays, force=force)
    except ArrayFileError as error:
        raise UsageError(str(error)) from None


def _layer_axis(
    values: NDArray[Any],
    *,
    rows: object,
    layers: object,
    each: bool,
    n_tokens: int | None = None,
) -> int | None:
    """Return the layers axis of a method's result with ``--layers all``, else None.

    A result is ``(*batch, [layers,] [heads,] [r,] n)``: the row axis is absent for one row
    (what :func:`check_rows` reads as ``single``), the heads axis present with
    ``--heads each``. `n_tokens` is the number of positions `rows` index (the result's
    last axis unless given: the decoder's for encoder-decoder source maps).
    """
    from ._validation import check_rows

    if layers != "all":
        return None
    n = values.shape[-1] if n_tokens is None else n_tokens
    row_axes = 0 if check_rows(rows, n).single else 1
    return values.ndim - (1 + row_axes + (1 if each else 0)) - 1


def _first_row_table(
    values: NDArray[np.floating],
    tokens: Sequence[str] | None,
    *,
    top: int,
    what: str = "tokens",
    layer_axis: int | None = None,
) -> list[str]:
    """Lay out the top-tokens table of the first row of `values` (first sequence).

    With `layer_axis` (``--layers all``) the row is the last layer's, as with
    ``--layers last``; the first layer's would be the least mixed.
    """
    if values.size == 0:
        # An empty batch (or no rows): a result of shape (0, ...) has no first row.
        return [f"no {what} to show: the result is empty, shape {tuple(values.shape)}"]
    where = "the first row of the first sequence" if values.ndim > 1 else "the requested row"
    if layer_axis is not None:
        layers = values.shape[layer_axis]
        values = np.take(values, -1, axis=layer_axis)
        where = (
            f"the first row of the first sequence at the last layer ({layers} of {layers})"
            if values.ndim > 1
            else f"the requested row at the last layer ({layers} of {layers})"
        )
    first = values.reshape(-1, values.shape[-1])[0]
    return _top_table(first, tokens, top=top, title=f"top {what} of {where}:")
