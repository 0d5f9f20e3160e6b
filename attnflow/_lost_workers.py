"""Why a pool's worker processes died, worded for the error that reports it.

Workers started by ``forkserver`` or ``spawn`` import the caller's main module. A script
that calls a parallel function at import time, without the ``if __name__ == "__main__":``
guard, makes each worker start the work again, and the workers die. That is one cause among
others (a worker killed by a signal, or by the kernel when memory runs out), so the guard
is named only when the main module is a script whose source lacks it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["WorkersLostError", "lost_workers_message", "unguarded_main_script"]


class WorkersLostError(RuntimeError):
    """Attention flow's worker processes died (killed, or out of memory) before finishing.

    :func:`attnflow.flow` raises it when a process pool it was given (``executor=``) loses
    its workers; the message says why where it can tell (a script without the
    ``if __name__ == "__main__":`` guard, a signal, memory). Nothing partial is returned.

    Parameters
    ----------
    message : str
        What happened and how to fix it.

    Examples
    --------
    >>> import attnflow
    >>> issubclass(attnflow.WorkersLostError, RuntimeError)
    True
    >>> try:
    ...     raise attnflow.WorkersLostError("the workers died")
    ... except attnflow.WorkersLostError as error:
    ...     print(error)
    the workers died
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)


_GUARD = re.compile(r"""__name__\s*==\s*["']__main__["']|["']__main__["']\s*==\s*__name__""")


def unguarded_main_script() -> Path | None:
    """Return the main script if workers re-import it and it has no ``__main__`` guard.

    None for an interactive session, ``python -c``, ``python -m`` of a module that has the
    guard (the ``attnflow`` command line, pytest), a frozen program or a source that cannot
    be read.
    """
    main = sys.modules.get("__main__")
    name = getattr(main, "__file__", None)
    if main is None or name is None:
        return None  # interactive, or `python -c`: workers do not import it
    path = Path(name)
    if path.suffix != ".py":
        return None
    try:
        source = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return None if _GUARD.search(source) else path


def lost_workers_message(what: str, *, serial_hint: str) -> str:
    """Word the error for worker processes of `what` that died before finishing.

    Parameters
    ----------
    what : str
        The work, for example "attention flow".
    serial_hint : str
        How to run it in this process instead, for example "pass `n_jobs=1`".

    Returns
    -------
    str
        One line: the likely cause and what to do.
    """
    script = unguarded_main_script()
    if script is not None:
        return (
            f"{what}'s worker processes stopped before finishing: they import the main "
            f'script {script.name}, which has no `if __name__ == "__main__":` guard, so '
            f"each worker started the work again. Put the call under that guard, or "
            f"{serial_hint} to run in this process."
        )
    return (
        f"{what}'s worker processes died before finishing (killed by a signal, or by the "
        "system when memory ran out). Free memory or use fewer processes, or "
        f"{serial_hint} to run in this process."
    )
