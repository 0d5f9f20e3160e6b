"""The ``attnflow`` command line.

``attnflow COMMAND [options]``; ``python -m attnflow`` is the same. Each command is a
:class:`Command` in :data:`COMMANDS`: a name, a help line, a function adding its options to
its sub-parser and a function running it. Exit status: 0 on success, 1 when a command
fails, 2 on a usage error; errors are one line on stderr, with the traceback only under
``--debug``.

This module is imported by the entry points only, never by ``import attnflow``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TextIO

import numpy as np
from numpy.typing import NDArray

__all__ = ["COMMANDS", "EXIT_FAILURE", "EXIT_USAGE", "Command", "main"]

EXIT_FAILURE = 1
"""Exit status of a command that failed."""
EXIT_USAGE = 2
"""Exit status of a usage error (unknown command or option, bad value)."""
_EXIT_INTERRUPTED = 130

PROG = "attnflow"
PAPER = (
    'S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020, '
    "https://arxiv.org/abs/2005.00928"
)
_FULL_BLOCK = "\u2588"
_EIGHTH_BLOCKS = "\u258f\u258e\u258d\u258c\u258b\u258a\u2589"  # 1/8 ... 7/8


class UsageError(Exception):
    """A bad command line; reported in one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises :class:`UsageError` instead of exiting.

    Abbreviated options are refused (``--row`` is not ``--rows``: a later option could make
    it ambiguous, and a typo must not silently pick a flag), and an unknown option gets
    the closest known one as a suggestion.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._argv: list[str] = []

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _known_flags(self) -> list[str]:
        """Return the option strings of this parser and of the command on the line."""
        flags = [flag for action in self._actions for flag in action.option_strings]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for word in self._argv:
                    if word in action.choices:
                        chosen = action.choices[word]
                        flags += [f for a in chosen._actions for f in a.option_strings]
                        break
        return flags

    def error(self, message: str) -> NoReturn:
        hint = ""
        if message.startswith("unrecognized arguments:"):
            unknown = [w.split("=")[0] for w in message.split(":", 1)[1].split() if w[:1] == "-"]
            for word in unknown:
                close = difflib.get_close_matches(word, self._known_flags(), n=1, cutoff=0.6)
                if close:
                    hint += f"; did you mean {close[0]} for {word}?"
        msg = f"{self.prog}: error: {message}{hint} (see '{self.prog} --help')"
        raise UsageError(msg)


@dataclass(frozen=True)
class Command:
    """One ``attnflow`` subcommand.

    Attributes
    ----------
    name : str
        What the user types.
    help : str
        One line for ``attnflow --help``.
    description : str
        The paragraph at the top of ``attnflow NAME --help``.
    configure : callable
        Adds the command's arguments to its parser.
    run : callable
        Runs the command on the parsed arguments and returns the exit status.
    """

    name: str
    help: str
    description: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- attnflow demo ------------------------------------------------------------------------


def _configure_demo(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``attnflow demo``: where its figures and page go."""
    parser.add_argument(
        "-o",
        "--output",
        default="attnflow-demo",
        help="folder for the figures and the HTML page (default: ./attnflow-demo)",
    )
    parser.add_argument("--force", action="store_true", help="replace files already there")
    parser.add_argument(
        "--no-files", action="store_true", help="print the table only; write no files"
    )


# -- bars in the terminal tables (the demo's too) ----------------------------------------


def _bar(fraction: float, width: int, *, unicode: bool) -> str:
    """Draw a horizontal bar ``fraction * width`` characters long (eighths in Unicode)."""
    fraction = min(max(fraction, 0.0), 1.0)
    if not unicode:
        return "#" * round(fraction * width)
    eighths = round(fraction * width * 8)
    full, rest = divmod(eighths, 8)
    return _FULL_BLOCK * full + (_EIGHTH_BLOCKS[rest - 1] if rest else "")


def _can_encode(text: str, stream: TextIO) -> bool:
    """Whether `stream` can write `text` (block characters on a non-UTF-8 console)."""
    try:
        text.encode(getattr(stream, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


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
    if text == "each" and method == "raw":
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


def _configure_method(parser: argparse.ArgumentParser, *, method: str) -> None:
    """Add the options shared by ``rollout``, ``flow`` and ``raw`` (and flow's own)."""
    parser.add_argument(
        "input",
        help="attention weights: .npy, .npz or .safetensors, shaped "
        "(*batch, layers, heads, n, n); never unpickled",
    )
    parser.add_argument("--key", help="the array to read from an .npz/.safetensors file")
    parser.add_argument(
        "-o", "--output", help=f"the .npz to write (default: INPUT_STEM.{method}.npz)"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing output")
    parser.add_argument(
        "--rows", default="all", help="output positions: 'all', an integer or a list (0,4)"
    )
    parser.add_argument("--layers", default="last", help="'last', 'all' or a layer index")
    parser.add_argument(
        "--heads",
        default="mean",
        help="'mean', 'max', 'min', 'none' or weights (h1,h2,...)"
        + ("" if method == "raw" else "; 'each' for one map per head (App. A.1)"),
    )
    if method != "raw":
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
        parser.add_argument(
            "--receptive-field",
            action="store_true",
            help="decoders: divide by the method's result on uniform causal attention, "
            "then renormalise rows (paper, Conclusion)",
        )
        parser.add_argument(
            "--exclude",
            default=None,
            help="input positions left out of the attribution, rows renormalised: an "
            "integer or a list (0 for a BOS attention sink)",
        )
    parser.add_argument("--mask", help="boolean padding mask (*batch, n): .npy/.npz/.safetensors")
    parser.add_argument("--mask-key", help="the array to read from the mask file")
    parser.add_argument("--tokens", help="a text file with one token per line, for the table")
    parser.add_argument(
        "--top", type=int, default=10, help="tokens to show in the table (default 10)"
    )
    parser.add_argument(
        "--no-validate", action="store_true", help="skip the checks on the attention values"
    )
    if method == "flow":
        parser.add_argument(
            "--raw-values", action="store_true", help="raw max-flow values, rows not normalised"
        )
        parser.add_argument(
            "--jobs", type=int, default=None, help="threads (default: automatic; -1 all cores)"
        )
        parser.add_argument(
            "--no-progress", action="store_true", help="hide the progress bar (shown with tqdm)"
        )
        parser.add_argument(
            "--max-work",
            type=float,
            default=None,
            help="refuse above this many edge visits (default: the library's limit)",
        )


def _top_table(
    scores: NDArray[np.floating], tokens: Sequence[str] | None, *, top: int, title: str
) -> list[str]:
    """Lay out the `top` highest-scoring input tokens of one row of scores."""
    order = np.argsort(-scores, kind="stable")[: max(top, 0)]
    labels = [tokens[i] if tokens is not None else f"token {i}" for i in order]
    width = max([5, *(len(label) for label in labels)])
    largest = float(max(scores.max(initial=0.0), np.finfo(np.float64).tiny))
    unicode = _can_encode(_bar(0.99, 8, unicode=True), sys.stdout)
    lines = [title, f"  {'#':>4}  {'token':<{width}}  {'score':>8}"]
    for i, label in zip(order.tolist(), labels, strict=True):
        value = float(scores[i])
        bar = _bar(value / largest, 24, unicode=unicode)
        lines.append(f"  {i:>4}  {label:<{width}}  {value:>8.4f}  {bar}".rstrip())
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
    if method != "raw":
        options |= _pruning_options(args) | _decoder_options(args)
        try:
            options["residual"] = check_residual(args.residual)
        except (TypeError, ValueError) as error:
            raise UsageError(_in_flags(str(error))) from None
    if args.top < 0:
        msg = f"--top must be a number of tokens, 0 or more; got {args.top}"
        raise UsageError(msg)
    if method == "flow":
        if args.jobs is not None and args.jobs < 1 and args.jobs != -1:
            msg = (
                "--jobs must be a positive number of processes or -1 (one per CPU core); "
                f"got {args.jobs}. Leave it out to choose automatically."
            )
            raise UsageError(msg)
        # `not > 0` refuses NaN too, which would otherwise disable the limit.
        if args.max_work is not None and not args.max_work > 0:
            msg = (
                "--max-work must be a positive number of edge visits (inf for no limit); "
                f"got {args.max_work}"
            )
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


def _run_method(args: argparse.Namespace, *, method: str) -> int:
    """Read attention, run one method, write the result and print its top tokens.

    Everything that can be checked is checked first, in this order: the options, the
    input's header (shape and dtype, against the options), then the output's name; only
    then is data read. Nothing is written unless the method succeeds.
    """
    import contextlib
    from pathlib import Path

    import attnflow

    from ._arrayio import ArrayFileError, read_array, read_header
    from ._validation import stored_precision

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
    if method == "flow":
        options |= {
            "normalize": not args.raw_values,
            "n_jobs": args.jobs,
            # The bar needs tqdm, an optional extra: without it the command runs quietly.
            "progress": not args.no_progress and _has_module("tqdm"),
        }
        if args.max_work is not None:
            options["max_work"] = args.max_work
    function = {"flow": attnflow.flow, "rollout": attnflow.rollout, "raw": attnflow.raw}[method]
    precision = (
        stored_precision(header.stored, _STORED_EPSILON[header.stored])
        if header.stored in _STORED_EPSILON
        else contextlib.nullcontext()
    )
    try:
        with precision:
            values = np.asarray(function(attentions, **options))
    except (ValueError, TypeError, IndexError, RuntimeError) as error:
        reworded = _in_flags(str(error))
        if reworded == str(error):
            raise
        raise type(error)(reworded) from error
    # Lay out the report before writing, so that nothing is written if it fails.
    table = _first_row_table(values, tokens, top=args.top)
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
    return path


def _read_tokens(path: str | None, values: NDArray[Any], *, option: str) -> list[str] | None:
    """Read a token file (one per line) and check it labels the last axis of `values`."""
    if not path:
        return None
    tokens = Path(path).read_text(encoding="utf-8").splitlines()
    if values.ndim and len(tokens) != values.shape[-1]:
        msg = f"{option} has {len(tokens)} lines but the attention has {values.shape[-1]} tokens"
        raise UsageError(msg)
    return tokens


def _write_output(output: Path, arrays: dict[str, NDArray[Any]], *, force: bool) -> Path:
    """Write the result's ``.npz`` atomically; a refused write is a usage error."""
    from ._arrayio import ArrayFileError, write_npz

    try:
        return write_npz(output, arrays, force=force)
    except ArrayFileError as error:
        raise UsageError(str(error)) from None


def _first_row_table(
    values: NDArray[np.floating], tokens: Sequence[str] | None, *, top: int, what: str = "tokens"
) -> list[str]:
    """Lay out the top-tokens table of the first row of `values` (first sequence)."""
    if values.size == 0:
        # An empty batch (or no rows): a result of shape (0, ...) has no first row.
        return [f"no {what} to show: the result is empty, shape {tuple(values.shape)}"]
    first = values.reshape(-1, values.shape[-1])[0]
    where = "the first row of the first sequence" if values.ndim > 1 else "the requested row"
    return _top_table(first, tokens, top=top, title=f"top {what} of {where}:")


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _demo() -> Any:
    from . import _demo

    return _demo


def _evaluate() -> Any:
    from . import _cli_evaluate

    return _cli_evaluate


def _variants() -> Any:
    from . import _cli_variants

    return _cli_variants


def _explain() -> Any:
    from . import _cli_explain

    return _cli_explain


def _method_command(method: str, help_line: str, description: str) -> Command:
    return Command(
        name=method,
        help=help_line,
        description=description,
        configure=lambda parser: _configure_method(parser, method=method),
        run=lambda args: _run_method(args, method=method),
    )


# -- attnflow plot ------------------------------------------------------------------------

_PLOT_KINDS = ("tokens", "layers", "graph", "overlay")


def _configure_plot(parser: argparse.ArgumentParser) -> None:
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


def _run_plot(args: argparse.Namespace) -> int:
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


COMMANDS: tuple[Command, ...] = (
    Command(
        name="demo",
        help="show rollout and flow on a real model's attention (shipped sample)",
        description=(
            "Print raw attention, attention rollout and attention flow of the [CLS] token "
            "of the pretrained "
            "all-MiniLM-L6-v2 on three sentences from Abnar & Zuidema (2020), recorded "
            "once and shipped with attnflow (no model or network needed)."
        ),
        configure=_configure_demo,
        run=lambda args: _demo().run_demo(args),
    ),
    _method_command(
        "rollout",
        "attention rollout of attention weights in a file",
        "Attention rollout (Abnar & Zuidema 2020) of the attention weights in a file; "
        "writes an .npz and prints the top input tokens. Options mirror attnflow.rollout.",
    ),
    _method_command(
        "flow",
        "attention flow (exact max-flow) of attention weights in a file",
        "Attention flow (Abnar & Zuidema 2020) of the attention weights in a file, with a "
        "progress bar; writes an .npz and prints the top input tokens. Options mirror "
        "attnflow.flow.",
    ),
    _method_command(
        "raw",
        "head-fused raw attention of attention weights in a file",
        "The head-fused raw attention, the paper's baseline; writes an .npz and prints the "
        "top input tokens. Options mirror attnflow.raw.",
    ),
    Command(
        name="gradient-rollout",
        help="gradient-weighted rollout (Chefer's GAE or weighted) of attention and gradients",
        description=(
            "Gradient-weighted rollout (Chefer et al. 2021) of attention weights and their "
            "gradients dy/dA, from two files or from one .npz/.safetensors holding "
            "'attentions' and 'gradients'; writes an .npz and prints the top input tokens. "
            "Options mirror attnflow.gradient_rollout."
        ),
        configure=lambda parser: _variants().configure_gradient_rollout(parser),
        run=lambda args: _variants().run_gradient_rollout(args),
    ),
    Command(
        name="encoder-decoder",
        help="encoder-decoder rollout: decoder positions over source and target tokens",
        description=(
            "Encoder-decoder rollout (or Chefer's encoder-decoder GAE rules) of the encoder, "
            "decoder and cross attentions in one .npz/.safetensors file; writes an .npz "
            "holding 'source' and 'target' and prints the top tokens of each. Options mirror "
            "attnflow.encoder_decoder_rollout."
        ),
        configure=lambda parser: _variants().configure_encoder_decoder(parser),
        run=lambda args: _variants().run_encoder_decoder(args),
    ),
    Command(
        name="evaluate",
        help="faithfulness tables: the paper's Tables 1-2 reproduced, or your saved outputs",
        description=(
            "Measure how faithful raw attention, rollout and flow are, layer by layer: rank "
            "correlation with blank-out and input gradients (Abnar & Zuidema 2020, Tables "
            "1-2) and ERASER AOPC. 'agreement' reproduces the paper's experiment offline "
            "(needs torch); a file evaluates saved model outputs. Shows progress; a rerun "
            "with the same folder resumes."
        ),
        configure=lambda parser: _evaluate().configure_evaluate(parser),
        run=lambda args: _evaluate().run_evaluate(args),
    ),
    Command(
        name="explain",
        help="explain a text (or an --image) with a local Hugging Face model: a table and an "
        "HTML page",
        description=(
            "Tokenize TEXT, run the model of a local Hugging Face folder on it (capture works "
            "with sdpa and eager attention), and score the [CLS] row (--row) at every layer "
            "with raw attention, rollout and flow (--method); print the last layer's table "
            "(--layer) and write an HTML page (-o) or the data (--save). With --image FILE "
            "and a vision transformer folder (with its preprocessor_config.json), explain "
            "the image instead: a summary of the patch scores, and a page with them drawn "
            "over the image."
        ),
        configure=lambda parser: _explain().configure_explain(parser),
        run=lambda args: _explain().run_explain(args),
    ),
    Command(
        name="plot",
        help="draw scores or attention from a file as PNG, SVG, PDF or HTML",
        description=(
            "Render a token heatmap, a layer x token map, the attention graph or an image "
            "overlay (matplotlib), or an HTML token view, from an .npy/.npz/.safetensors "
            "file such as the output of `attnflow rollout`."
        ),
        configure=_configure_plot,
        run=_run_plot,
    ),
)
"""The subcommands, in the order ``attnflow --help`` lists them."""


# -- the entry point ----------------------------------------------------------------------


def _add_debug(parser: argparse.ArgumentParser, *, default: object) -> None:
    """Add ``--debug`` to `parser` (each parser gets its own action object)."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=default,
        help="show the full traceback when a command fails",
    )


def build_parser() -> argparse.ArgumentParser:
    """Build the ``attnflow`` parser, one sub-parser per :data:`COMMANDS` entry.

    Returns
    -------
    argparse.ArgumentParser
        A parser whose ``error`` raises :class:`UsageError`.
    """
    from attnflow import __version__

    parser = _Parser(
        prog=PROG,
        description="Attention rollout and attention flow (Abnar & Zuidema 2020).",
    )
    _add_debug(parser, default=False)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", title="commands", required=True
    )
    for command in COMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.description)
        # Also after the command; SUPPRESS keeps the sub-parser from overwriting a --debug
        # given before it.
        _add_debug(sub, default=argparse.SUPPRESS)
        command.configure(sub)
    return parser


def _report(message: str) -> None:
    """Write one line to stderr."""
    print(" ".join(message.split()), file=sys.stderr)


def _exit_status(exit_: SystemExit) -> int:
    """Return the status of a ``SystemExit`` from argparse (``--help``, ``--version``)."""
    code = exit_.code
    if code is None:
        return 0
    return code if isinstance(code, int) else EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``attnflow`` command line.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments after the program name; ``sys.argv[1:]`` by default.

    Returns
    -------
    int
        The exit status: 0 on success, 1 on failure, 2 on a usage error.

    Examples
    --------
    >>> from attnflow._cli import main
    >>> main(["--version"])  # doctest: +ELLIPSIS
    attnflow ...
    0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as error:
        _report(str(error))
        return EXIT_USAGE
    except SystemExit as exit_:
        return _exit_status(exit_)

    by_name = {command.name: command for command in COMMANDS}
    command = by_name[args.command]
    prog = f"{PROG} {command.name}"
    debug: bool = args.debug
    try:
        return command.run(args)
    except UsageError as error:
        _report(f"{prog}: error: {error}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        if debug:
            raise
        _report(f"{prog}: interrupted")
        return _EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``attnflow demo | head``): stop quietly, and keep Python
        # from complaining again when it flushes stdout at exit.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_FAILURE
    except Exception as error:
        if debug:
            raise
        detail = str(error) or type(error).__name__
        _report(f"{prog}: error: {detail} (run with --debug for the traceback)")
        return EXIT_FAILURE
