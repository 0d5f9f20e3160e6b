"""The causal rollout cache (issue 21, item 4) against the rollout oracle, on every backend.

The cache appends rollout rows block by block (a prompt, then one token at a time, as a
decoder with a KV cache runs); read back, every layer's rows must equal the oracle's
rollout of the whole causal attention (``oracle.py``: full matrix products, loops), with
``receptive_field`` and ``exclude`` from the oracle's definitions too. Under ``jax.jit``
and on Dask graphs (computing forbidden) as well.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from backends import Variant, tolerance
from oracle import oracle_decoder, oracle_rollout

import attnflow
from attnflow._causal_cache import CausalRolloutCache

SHAPE = (2, 3, 4, 8, 8)  # batch, layers, heads, n, n
#: How the 8 positions arrive: a prompt of 3, single tokens, a block of 2, a last token.
BLOCKS = ((0, 3), (3, 4), (4, 5), (5, 7), (7, 8))


def causal_softmax(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random causal attention: a softmax of Gaussian logits over keys ``0..i``."""
    n = shape[-1]
    logits = rng.normal(scale=2.0, size=shape)
    logits = np.where(np.tril(np.ones((n, n), dtype=bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


@functools.cache
def _weights(dtype_name: str) -> np.ndarray:
    return causal_softmax(np.random.default_rng(20261125), SHAPE).astype(dtype_name)


def _roll(fused: Any, *, layer: int, **options: Any) -> Any:
    """Append the blocks of `fused` ``(*batch, L, n, n)``; return one layer's rows."""
    exclude = options.pop("exclude", ())
    cache = CausalRolloutCache(**options)
    for start, stop in BLOCKS:
        cache.append(fused[..., start:stop, :stop])
    return cache.rows(0, SHAPE[-1], layer=layer, exclude=exclude)


CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "residual=0": {"residual": 0.0},
    "residual=0.3": {"residual": 0.3},
    "residual=1": {"residual": 1.0},
    "receptive_field": {"receptive_field": True},
    "receptive_field,exclude=0": {"receptive_field": True, "exclude": (0,)},
    "exclude=[0,2]": {"exclude": (0, 2)},
}


@pytest.mark.parametrize("case", list(CASES))
def test_cache_equals_rollout_oracle(backend: Variant, dtype_name: str, case: str) -> None:
    options = dict(CASES[case])
    weights = _weights(dtype_name)
    fused = weights.mean(axis=2)
    batch, layers, _, n, _ = SHAPE
    values = np.stack(
        [
            backend.check(
                backend.run(
                    lambda a, layer=layer: _roll(a, layer=layer, **dict(options)),
                    backend.asarray(fused),
                ),
                dtype_name=dtype_name,
                shape=(batch, n, n),
            )
            for layer in range(layers)
        ],
        axis=1,
    )
    residual = options.get("residual", 0.5)
    if "receptive_field" in options or "exclude" in options:
        expected = oracle_decoder(
            "rollout",
            weights.astype(np.float64),
            receptive_field=options.get("receptive_field", False),
            exclude=list(options.get("exclude", ())) or None,
            residual=residual,
            layers="all",
        )
    else:
        expected = oracle_rollout(weights.astype(np.float64), residual=residual, layers="all")
    tol = tolerance(dtype_name)
    np.testing.assert_allclose(values, expected, rtol=tol, atol=tol)


def test_rows_never_change_and_match_each_prefix() -> None:
    """Row i read right after it was appended equals the rollout of prefix 0..i alone."""
    weights = _weights("float64")[0]  # (L, H, n, n)
    fused = weights.mean(axis=1)
    cache = CausalRolloutCache(receptive_field=True)
    for start, stop in BLOCKS:
        cache.append(fused[:, start:stop, :stop])
        for i in range(start, stop):
            prefix = attnflow.rollout(
                weights[:, :, : i + 1, : i + 1], rows=i, receptive_field=True, exclude=0
            )
            row = cache.rows(i, i + 1, exclude=(0,))[0]
            np.testing.assert_allclose(row[: i + 1], prefix, rtol=1e-12, atol=1e-12)
            assert not row[i + 1 :].any()
    assert cache.length == SHAPE[-1]
    np.testing.assert_allclose(cache.state(), attnflow.rollout(weights), rtol=1e-12, atol=1e-12)


# -- errors: one test per message -------------------------------------------------------------
@pytest.fixture
def fused() -> np.ndarray:
    return _weights("float64")[0].mean(axis=1)  # (L, n, n)


def test_keys_must_continue_the_cache(fused: np.ndarray) -> None:
    cache = CausalRolloutCache()
    cache.append(fused[:, :3, :3])
    with pytest.raises(ValueError, match=r"must have 4 keys: the 3 positions rolled out"):
        cache.append(fused[:, 3:4, :5])
    assert cache.length == 3  # nothing appended


def test_layers_and_batch_must_continue_the_cache(fused: np.ndarray) -> None:
    cache = CausalRolloutCache()
    cache.append(fused[:, :3, :3])
    with pytest.raises(ValueError, match=r"continue the cache's 3 layers"):
        cache.append(fused[:2, 3:4, :4])
    with pytest.raises(ValueError, match=r"batch shape \(\)"):
        cache.append(fused[None, :, 3:4, :4])


def test_dtype_must_continue_the_cache(fused: np.ndarray) -> None:
    cache = CausalRolloutCache()
    cache.append(fused[:, :3, :3])
    with pytest.raises(TypeError, match=r"library and dtype of the first block \(float64\)"):
        cache.append(fused[:, 3:4, :4].astype(np.float32))


def test_refuses_non_causal_attention() -> None:
    rows = np.full((2, 3, 3), 1 / 3)  # encoder-like: weight on later keys
    with pytest.raises(ValueError, match=r"must be causal attention.*up to 0\.667"):
        CausalRolloutCache().append(rows)
    CausalRolloutCache(validate=False).append(rows)  # the caller's responsibility


def test_refuses_bad_values_and_shapes(fused: np.ndarray) -> None:
    with pytest.raises(ValueError, match=r"`rows` rows must sum to 1"):
        CausalRolloutCache().append(fused[:, :3, :3] * 2)
    with pytest.raises(ValueError, match=r"shape \(\*batch, layers, q, keys\)"):
        CausalRolloutCache().append(fused[0, 0])
    with pytest.raises(TypeError, match=r"real floating dtype"):
        CausalRolloutCache().append(np.zeros((1, 1, 1), dtype=np.int64))
    with pytest.raises(ValueError, match=r"`residual` must be in \[0, 1\]"):
        CausalRolloutCache(residual=2.0)


def test_reading_errors(fused: np.ndarray) -> None:
    cache = CausalRolloutCache()
    with pytest.raises(RuntimeError, match=r"The cache is empty"):
        cache.rows(0, 1)
    cache.append(fused[:, :3, :3])
    with pytest.raises(IndexError, match=r"0 <= start < stop <= 3"):
        cache.rows(2, 4)
    with pytest.raises(IndexError, match=r"`layer` must index the 3 layers"):
        cache.rows(0, 1, layer=3)
    with pytest.raises(ValueError, match=r"`exclude` must hold non-negative positions"):
        cache.rows(0, 1, exclude=(-1,))
