"""The method registry: one table of names, each with the function it composes and what it
needs, read by every entry point."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import attnflow
from attnflow._methods import (
    ATTENTION_METHODS,
    METHODS,
    TARGET_CONDITIONED_METHODS,
    VALUE_AWARE_METHODS,
    check_methods,
    method_of_function,
    method_spec,
)


def test_the_table_names_each_method_once_with_its_function() -> None:
    assert list(METHODS) == [
        "raw",
        "rollout",
        "flow",
        "gradient_rollout",
        "norm",
        "globenc",
        "alti",
        "direct_logit",
        "alti_logit",
        "ifr",
    ]
    assert tuple(METHODS) == ATTENTION_METHODS + VALUE_AWARE_METHODS + TARGET_CONDITIONED_METHODS
    for name in ATTENTION_METHODS + VALUE_AWARE_METHODS:
        spec = METHODS[name]
        assert spec.name == name
        assert spec.function() is getattr(attnflow, spec.composes)
    # The target-conditioned methods read a causal LM's values and readout: no function of
    # attention weights alone computes them, and asking for one says where they run.
    for name in TARGET_CONDITIONED_METHODS:
        with pytest.raises(ValueError, match=r"PyTorch adapter's explain"):
            METHODS[name].function()
    assert [n for n, s in METHODS.items() if s.signed] == ["direct_logit", "alti_logit"]
    targets = ["gradient_rollout", "direct_logit", "alti_logit"]
    assert [n for n, s in METHODS.items() if s.uses_target] == targets
    assert [n for n, s in METHODS.items() if s.gradients] == ["gradient_rollout"]
    assert [n for n, s in METHODS.items() if s.host_only] == ["flow"]
    # The value-aware rule: the norm-based matrix has no residual path (the paper's 0.5);
    # GlobEnc and ALTI carry theirs.
    assert {n: METHODS[n].residual for n in VALUE_AWARE_METHODS} == {
        "norm": 0.5,
        "globenc": 0.0,
        "alti": 0.0,
    }
    # GlobEnc's authors multiply the raw matrices; the others renormalise each layer's rows.
    assert [n for n in VALUE_AWARE_METHODS if METHODS[n].normalize_layers] == ["norm", "alti"]
    assert METHODS["rollout"].residual is None


def test_a_method_is_told_from_its_function_through_partials() -> None:
    assert method_of_function(attnflow.flow) is METHODS["flow"]
    partial = functools.partial(attnflow.gradient_rollout, rows=0)
    assert method_of_function(partial) is METHODS["gradient_rollout"]
    assert method_of_function(lambda weights: weights) is None


def test_unknown_names_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r'`method` must be "raw", .* or "ifr"; got \'rolout\''):
        method_spec("rolout")
    with pytest.raises(ValueError, match=r'--method must be "rollout" or "flow"; got \'raw\''):
        method_spec("raw", parameter="--method", among=("rollout", "flow"))
    with pytest.raises(TypeError, match="a sequence of method names"):
        check_methods("rollout")
    with pytest.raises(ValueError, match=r"`methods` must name some of .*; got \[\]"):
        check_methods([])
    assert [spec.name for spec in check_methods(("flow", "raw"))] == ["flow", "raw"]


@pytest.mark.parametrize("name", ATTENTION_METHODS)
def test_each_attention_method_is_offered_and_runs_as_the_entry_points_call_it(name: str) -> None:
    from attnflow import _cli_explain

    assert name in _cli_explain.METHODS
    # The registry's function runs on attention weights as the entry points call it.
    weights = np.full((1, 2, 1, 3, 3), 1 / 3)
    # Two layers of uniform attention U (U @ U = U), row 0, worked by hand: rollout and flow
    # compose M = (I + U) / 2, so M @ M = (I + 3 U) / 4; GAE adds U once per layer to I.
    expected = {
        "raw": [1 / 3] * 3,
        "rollout": [0.5, 0.25, 0.25],
        "flow": [0.5, 0.25, 0.25],
        "gradient_rollout": [2.0, 1.0, 1.0],
    }[name]
    arrays = (weights, np.ones_like(weights)) if METHODS[name].gradients else (weights,)
    np.testing.assert_allclose(METHODS[name].function()(*arrays, rows=0), [expected])
