"""The command line's flags and the library's keywords, in one place.

The library's errors name its parameters (`` `validate=False` ``, `` `max_work=None` ``),
which a command-line user cannot type. :func:`in_flags` rewrites each back-quoted keyword
of a message that has a flag into that flag, so that the advice in an error can be
followed where the error is read.

The flags that several commands share are defined here once: :func:`add_flow_limits`
(``--jobs``, ``--max-seconds``: ``attnflow flow`` and ``attnflow encoder-decoder --rule
flow``) and :func:`flow_limits`, which checks them and returns the library's keywords;
:func:`add_decoder_flags` (``--receptive-field``, ``--exclude``: rollout, flow,
gradient-rollout, explain) and :func:`add_mask_and_tokens` (``--mask``, ``--mask-key``,
``--tokens``: rollout, flow, raw, gradient-rollout);
:func:`errors_in_flags` rewords the errors of the library call a command makes.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator

__all__ = [
    "add_decoder_flags",
    "add_flow_limits",
    "add_mask_and_tokens",
    "errors_in_flags",
    "flow_limits",
    "in_flags",
]

# Whole phrases first: where the library's advice has no one-flag equivalent.
_PHRASES = {
    "spread the work over a cluster (`executor=`)": "use more processes (--jobs N)",
    "`executor=`": "--jobs",
    "pass either `executor` or `n_jobs`": "pass --jobs",
    "`max_work`=": "--max-work ",
    "`max_seconds`=": "--max-seconds ",
}
# keyword=value as typed in Python -> the flag that does it.
_SETTINGS = {
    "validate=False": "--no-validate",
    "normalize_result=False": "--raw-values",
    "normalize=False": "--raw-values",
    "max_work=None": "--max-work inf",
    "max_seconds=None": "--max-seconds inf",
    "heads=None": "--heads none",
    "receptive_field=True": "--receptive-field",
    "progress=True": "the progress bar (tqdm)",
}
_FLAGS = {
    "attentions": "INPUT",
    "rows": "--rows",
    "layers": "--layers",
    "heads": "--heads",
    "residual": "--residual",
    "mask": "--mask",
    "threshold": "--threshold",
    "top_k": "--top-k",
    "discard": "--discard",
    "receptive_field": "--receptive-field",
    "exclude": "--exclude",
    "normalize_result": "--raw-values",
    "normalize": "--raw-values",
    "n_jobs": "--jobs",
    "max_work": "--max-work",
    "max_seconds": "--max-seconds",
    "validate": "--no-validate",
    "progress": "--no-progress",
    "executor": "--jobs",
}
_KEYWORD = re.compile(r"`(\w+)(?:=([^`]*))?`")


def _flag(match: re.Match[str], flags: dict[str, str]) -> str:
    name, value = match.group(1), match.group(2)
    if value is not None and f"{name}={value}" in _SETTINGS and name not in flags:
        return _SETTINGS[f"{name}={value}"]
    flag = flags.get(name, _FLAGS.get(name))
    if flag is None:
        return match.group(0)
    if value is None or not value:
        return flag
    return f"{flag} {value.strip(chr(39) + chr(34))}"


def in_flags(message: str, *, flags: dict[str, str] | None = None) -> str:
    """Reword a library message for the command line.

    Parameters
    ----------
    message : str
        An error message of the library.
    flags : dict of str to str, optional
        A command's own flags where they differ from flow's and rollout's (for example
        ``{"normalize_result": "--normalize-result"}`` for ``gradient-rollout``).

    Returns
    -------
    str
        The message with Python keywords (`` `max_work=None` ``) replaced by flags
        (``--max-work inf``); keywords without a flag are left as they are.

    Examples
    --------
    >>> in_flags("pass `validate=False` to skip it, or `rows=0` for [CLS]")
    'pass --no-validate to skip it, or --rows 0 for [CLS]'
    """
    for phrase, replacement in _PHRASES.items():
        message = message.replace(phrase, replacement)
    own = flags or {}
    return _KEYWORD.sub(lambda match: _flag(match, own), message)


@contextlib.contextmanager
def errors_in_flags(
    *errors: type[Exception], flags: dict[str, str] | None = None
) -> Iterator[None]:
    """Reraise the `errors` raised inside with their message :func:`in_flags`-reworded.

    An error whose message names no keyword with a flag is reraised as it is; a reworded
    one is a new error of the same type, chained to the library's.
    """
    try:
        yield
    except errors as error:
        reworded = in_flags(str(error), flags=flags)
        if reworded == str(error):
            raise
        raise type(error)(reworded) from error


def add_decoder_flags(
    parser: argparse.ArgumentParser,
    *,
    uniform: str = "the method's result on uniform causal attention",
    applies: str = "",
) -> None:
    """Add ``--receptive-field`` and ``--exclude``, the decoder options of the core methods.

    `uniform` says what ``--receptive-field`` divides by; `applies` ends both help texts
    where the flags reach some of a command's methods only (e.g. ``"; all methods but
    raw"``). They are parsed by ``_cli_methods._decoder_options``.
    """
    parser.add_argument(
        "--receptive-field",
        action="store_true",
        help=f"decoders: divide by {uniform}, then renormalise rows (paper, Conclusion{applies})",
    )
    parser.add_argument(
        "--exclude",
        default=None,
        help="input positions left out of the attribution, rows renormalised: an integer or "
        f"a list (0 for a [CLS] or BOS attention sink{applies})",
    )


def add_mask_and_tokens(parser: argparse.ArgumentParser) -> None:
    """Add ``--mask``, ``--mask-key`` and ``--tokens``: the files beside an attention file."""
    parser.add_argument("--mask", help="boolean padding mask (*batch, n): .npy/.npz/.safetensors")
    parser.add_argument("--mask-key", help="the array to read from the mask file")
    parser.add_argument("--tokens", help="a text file with one token per line, for the table")


def add_flow_limits(parser: argparse.ArgumentParser, *, applies: str = "") -> None:
    """Add ``--jobs`` and ``--max-seconds``, the options of the flow engine's runner.

    `applies` starts each help text where the flags serve one mode of a command (for
    example ``"--rule flow: "``).
    """
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"{applies}threads (default: automatic; -1 all cores)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help=f"{applies}refuse above this estimated single-core time (default 600; inf: no limit)",
    )


def flow_limits(args: argparse.Namespace) -> dict[str, float | int | None]:
    """Check ``--jobs`` and ``--max-seconds``; return ``n_jobs`` (and ``max_seconds`` if given).

    Raises
    ------
    attnflow._cli_common.UsageError
        For ``--jobs`` below 1 other than -1, and a ``--max-seconds`` that is not a
        positive number of seconds (NaN included, which would lift the limit).

    Examples
    --------
    >>> flow_limits(argparse.Namespace(jobs=2, max_seconds=None))
    {'n_jobs': 2}
    >>> flow_limits(argparse.Namespace(jobs=None, max_seconds=float("inf")))
    {'n_jobs': None, 'max_seconds': inf}
    """
    from ._cli_common import UsageError

    if args.jobs is not None and args.jobs < 1 and args.jobs != -1:
        msg = (
            "--jobs must be a positive number of processes or -1 (one per CPU core); "
            f"got {args.jobs}. Leave it out to choose automatically."
        )
        raise UsageError(msg)
    # `not > 0` refuses NaN too, which would otherwise disable the limit.
    if args.max_seconds is not None and not args.max_seconds > 0:
        msg = (
            "--max-seconds must be a positive number of seconds (inf for no limit); "
            f"got {args.max_seconds}"
        )
        raise UsageError(msg)
    limits: dict[str, float | int | None] = {"n_jobs": args.jobs}
    if args.max_seconds is not None:
        limits["max_seconds"] = args.max_seconds
    return limits
