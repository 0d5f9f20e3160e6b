"""Deprecated alias of ``attnflow._experiments.reproduction`` (the very module), until 0.2."""

from __future__ import annotations

import sys

from attnflow._experiments import reproduction as _module

__all__: list[str] = []

sys.modules[__name__] = _module
