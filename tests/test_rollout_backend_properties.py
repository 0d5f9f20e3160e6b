"""Rollout agrees with NumPy on every backend of the session, for any valid attention tensor.

The Hypothesis property of the design card run across the backend matrix: it lives here,
not in ``property_tests/`` (NumPy only, no framework installed), so that it runs wherever
the backends are installed (the ``tests`` session, every CPU backend; ``tests-tensorflow``).
Examples follow ``ATTNFLOW_HYPOTHESIS_PROFILE`` (tests/hypothesis_profiles.py).
"""

from __future__ import annotations

import numpy as np
from backends import Variant
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import PROFILE
from strategies import AttentionCase, attention_cases, masks_for

import attnflow


@settings(parent=PROFILE)
@given(attention_cases(), st.sampled_from(["float32", "float64"]), st.data())
def test_every_backend_agrees_with_numpy(
    backend: Variant, case: AttentionCase, dtype_name: str, data: st.DataObject
) -> None:
    weights = case.weights.astype(dtype_name)
    n = weights.shape[-1]
    batch = weights.shape[:-4]
    mask = data.draw(st.none() | masks_for(batch, n))
    rows = data.draw(st.none() | st.integers(0, n - 1))
    options = {"heads": case.heads, "residual": case.residual, "rows": rows, "layers": "all"}
    expected = attnflow.rollout(weights.astype(np.float64), mask=mask, **options)
    native_mask = None if mask is None else backend.asarray(mask)
    result = backend.run(attnflow.rollout, backend.asarray(weights), mask=native_mask, **options)
    values = backend.check(result, dtype_name=dtype_name, shape=expected.shape)
    # float32 rounding grows with the number of layers and tokens multiplied together.
    eps = float(np.finfo(dtype_name).eps)
    tolerance = 16 * eps * weights.shape[-4] * max(n, 1)
    np.testing.assert_allclose(values, expected, atol=tolerance, rtol=tolerance)
