"""The options renamed before 0.1 (issue 25.5) keep working for one release, warning.

``normalize`` (divide each row of the result by its sum) is ``normalize_result`` and
``renormalize`` (divide each row of every layer's matrix by its sum) is
``normalize_layers``: each is named after what it acts on. The old spelling gives the very
result of the new one, with a DeprecationWarning naming both; passing both, with different
values, is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from oracle import oracle_flow, oracle_rollout, softmax_attention

import attnflow

RNG = np.random.default_rng(25)
ATTENTION = softmax_attention(RNG, (2, 3, 2, 5, 5))
GRADIENTS = RNG.standard_normal(ATTENTION.shape)
# Non-negative rows that do not sum to one: what normalize_layers is for.
MIXING = RNG.uniform(0.1, 2.0, size=(2, 3, 5, 5))
SEQ2SEQ = (
    softmax_attention(RNG, (2, 2, 4, 4)),
    softmax_attention(RNG, (2, 2, 3, 3)),
    softmax_attention(RNG, (2, 2, 3, 4)),
)
SEQ2SEQ_GRADIENTS = tuple(RNG.standard_normal(a.shape) for a in SEQ2SEQ)

Call = Callable[..., Any]


def _rows(result: Any) -> list[np.ndarray]:
    return [np.asarray(part) for part in (result if isinstance(result, tuple) else (result,))]


CASES: dict[str, tuple[Call, str, str, object, object]] = {
    # name: (call, old keyword, new keyword, value, the other value)
    "flow-normalize": (
        lambda **kw: attnflow.flow(ATTENTION, rows=[0, 3], n_jobs=1, **kw),
        "normalize",
        "normalize_result",
        False,
        True,
    ),
    "flow-renormalize": (
        lambda **kw: attnflow.flow(MIXING, heads=None, rows=0, n_jobs=1, validate=False, **kw),
        "renormalize",
        "normalize_layers",
        True,
        False,
    ),
    "rollout-renormalize": (
        lambda **kw: attnflow.rollout(MIXING, heads=None, residual=0.0, validate=False, **kw),
        "renormalize",
        "normalize_layers",
        True,
        False,
    ),
    "gradient_rollout-normalize": (
        lambda **kw: attnflow.gradient_rollout(ATTENTION, GRADIENTS, rows=-1, **kw),
        "normalize",
        "normalize_result",
        True,
        False,
    ),
    "encoder_decoder_rollout-normalize": (
        lambda **kw: attnflow.encoder_decoder_rollout(
            *SEQ2SEQ, rule="gae", gradients=SEQ2SEQ_GRADIENTS, **kw
        ),
        "normalize",
        "normalize_result",
        True,
        False,
    ),
    "encoder_decoder_flow-normalize": (
        lambda **kw: attnflow.encoder_decoder_flow(*SEQ2SEQ, rows=0, **kw),
        "normalize",
        "normalize_result",
        False,
        True,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_old_spelling_gives_the_new_result_with_a_warning(case: str) -> None:
    call, old, new, value, other = CASES[case]
    expected = call(**{new: value})
    with pytest.warns(DeprecationWarning, match=f"`{old}` is renamed `{new}` \\(same meaning\\)"):
        got = call(**{old: value})
    for a, b in zip(_rows(got), _rows(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    # The option changes the result, so the equality above is not vacuous.
    assert any(
        not np.allclose(a, b)
        for a, b in zip(_rows(call(**{new: other})), _rows(expected), strict=True)
    )
    with pytest.raises(TypeError, match=f"pass `{new}` only"):
        call(**{old: other, new: value})


def test_the_new_names_mean_what_they_say() -> None:
    # normalize_layers divides each row of each layer's matrix by its sum before the product;
    # normalize_result divides each row of the result (raw max-flow values otherwise).
    stochastic = MIXING / MIXING.sum(-1, keepdims=True)
    np.testing.assert_allclose(
        attnflow.rollout(MIXING, heads=None, residual=0.0, normalize_layers=True),
        oracle_rollout(stochastic, heads=None, residual=0.0),
        atol=1e-12,
    )
    raw = attnflow.flow(ATTENTION, rows=[0, 3], n_jobs=1, normalize_result=False)
    np.testing.assert_allclose(
        raw, oracle_flow(ATTENTION, rows=[0, 3], normalize_result=False), atol=1e-8
    )
    np.testing.assert_allclose(
        attnflow.flow(ATTENTION, rows=[0, 3], n_jobs=1),
        raw / raw.sum(-1, keepdims=True),
        atol=1e-12,
    )
