"""Deprecated alias of ``attnflow._experiments.sentiment_torch`` (the very module), until 0.2."""

from __future__ import annotations

import sys

from attnflow._experiments import sentiment_torch as _module

__all__: list[str] = []

sys.modules[__name__] = _module
