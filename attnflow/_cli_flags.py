"""Library messages reworded for the command line: Python keywords become the CLI's flags.

The library's errors name its parameters (`` `validate=False` ``, `` `max_work=None` ``),
which a command-line user cannot type. :func:`in_flags` rewrites each back-quoted keyword
of a message that has a flag into that flag, so that the advice in an error can be
followed where the error is read.
"""

from __future__ import annotations

import re

__all__ = ["in_flags"]

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
