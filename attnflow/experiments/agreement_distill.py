"""Deprecated alias of ``attnflow._experiments.agreement_distill`` (the very module), until 0.2."""

from __future__ import annotations

import sys

from attnflow._experiments import agreement_distill as _module

__all__: list[str] = []

sys.modules[__name__] = _module
