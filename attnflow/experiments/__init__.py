"""Deprecated: the reproduction experiments are private to the command line since 0.1.

``attnflow evaluate`` and the scripts in ``scripts/`` run them; their code lives in
``attnflow._experiments``. Importing ``attnflow.experiments`` (or one of its modules, which
are the very modules of ``attnflow._experiments``) keeps working until attnflow 0.2, with a
DeprecationWarning.
"""

from __future__ import annotations

from attnflow._deprecation import warn_deprecated

__all__: list[str] = []

warn_deprecated(
    "attnflow.experiments",
    "the experiments are private to the command line (attnflow evaluate, scripts/); their "
    "code is in attnflow._experiments",
    stacklevel=2,
)
