"""The Hypothesis profiles of the test suite, shared by ``property_tests/`` and ``tests/``.

``ci``: deterministic and reproducible (derandomized, no example database); ``dev``: quick
local runs; ``thorough``: many examples, for a change to the maths. ``ATTNFLOW_HYPOTHESIS_PROFILE``
picks one (default ``ci``): ``property_tests/conftest.py`` loads it for the whole folder, and a
property test in ``tests/`` takes it with ``@settings(parent=PROFILE)``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["PROFILE", "PROFILE_NAME"]

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)

PROFILE_NAME = os.environ.get("ATTNFLOW_HYPOTHESIS_PROFILE", "ci")
PROFILE = settings.get_profile(PROFILE_NAME)
