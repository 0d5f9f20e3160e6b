"""capture_linen / capture_nnx(..., contributions=...) on small Flax encoders built here.

The rebuilt block outputs are checked against the blocks' actual outputs (read by an
interceptor / wrapper of the test's own), the matrices against the loop oracle of
``tests/oracle.py`` (written from the papers' formulas) fed with pieces the test reads
itself (block inputs, LayerNorm outputs, the plain capture's weights, the parameters), and
explain against rollout over the oracle's renormalised matrices.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("flax", reason="the JAX adapter needs flax (and jax)")

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.errors import ScopeParamShapeError
from flax.linen import attention as linen_attention

import attnflow
from attnflow.adapters import jax as adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import oracle_contributions, oracle_head_values, oracle_rollout

jax.config.update("jax_enable_x64", False)
x64 = jax.enable_x64

B, N, D, H, LAYERS = 2, 6, 8, 2, 2
METHODS = ("norm", "globenc", "alti")
VALID = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=bool)
ORIGINAL_WEIGHTS = linen_attention.dot_product_attention_weights


# -- linen encoders ------------------------------------------------------------------------------
class PostBlock(nn.Module):
    """BERT-like: h = LN1(x + Attn(x)); y = LN2(h + FFN(h))."""

    @nn.compact
    def __call__(self, x: Any, mask: Any) -> Any:
        attention = nn.MultiHeadDotProductAttention(num_heads=H, dropout_rate=0.1, name="attn")
        h = nn.LayerNorm(name="ln1")(x + attention(x, mask=mask, deterministic=True))
        ffn = nn.Dense(D, name="ffn_out")(nn.gelu(nn.Dense(2 * D, name="ffn_in")(h)))
        return nn.LayerNorm(name="ln2")(h + nn.Dropout(0.1)(ffn, deterministic=True))


class PreBlock(nn.Module):
    """GPT-2 / ViT-like: h = x + Attn(LN1(x)); y = h + FFN(LN2(h))."""

    @nn.compact
    def __call__(self, x: Any, mask: Any) -> Any:
        attention = nn.MultiHeadDotProductAttention(num_heads=H, name="attn")
        h = x + attention(nn.LayerNorm(name="ln1")(x), mask=mask)
        return h + nn.Dense(D, name="ffn")(nn.gelu(nn.LayerNorm(name="ln2")(h)))


class Encoder(nn.Module):
    pre: bool

    @nn.compact
    def __call__(self, x: Any, mask: Any = None) -> Any:
        for i in range(LAYERS):
            x = (PreBlock if self.pre else PostBlock)(name=f"block{i}")(x, mask)
        return x


def linen_model(pre: bool, dtype: Any = jnp.float32) -> tuple[Encoder, Any, Any, Any]:
    x = 2.0 * jax.random.normal(jax.random.key(3), (B, N, D), dtype)
    mask = nn.make_attention_mask(VALID, VALID)
    model = Encoder(pre=pre)
    variables = model.init(jax.random.key(0), x, mask)
    # Scale the projections so that attention moves the stream visibly.
    variables = jax.tree.map(lambda p: (3.0 * p).astype(dtype), variables)
    return model, variables, x, mask


@pytest.fixture(params=[False, True], ids=["post-LN", "pre-LN"])
def linen_encoder(request: pytest.FixtureRequest) -> tuple[Encoder, Any, Any, Any]:
    return linen_model(request.param)


def seen_linen(model: nn.Module, variables: Any, x: Any, mask: Any) -> dict[str, list[Any]]:
    """The test's own look at each block: input, LN1 output, LN2 input, actual output."""
    seen: dict[str, list[Any]] = {"x": [], "ln1": [], "ln2_in": []}

    def look(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        module = context.module
        if context.method_name == "__call__":
            if isinstance(module, PostBlock | PreBlock):
                seen["x"].append(args[0])
            elif module.name == "ln1":
                seen["ln1"].append(out)
            elif module.name == "ln2":
                seen["ln2_in"].append(args[0])
        return out

    with nn.intercept_methods(look):
        model.apply(variables, x, mask)
    return seen


def actual_block_outputs(seen: dict[str, list[Any]], pre: bool) -> np.ndarray:
    """The attention block's output: LN1's output (post-LN), LN2's input (pre-LN)."""
    return np.stack([np.asarray(a) for a in seen["ln2_in" if pre else "ln1"]], axis=1)


# -- (a) completeness ----------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_linen_decomposition_is_complete(linen_encoder: Any, method: str) -> None:
    model, variables, x, mask = linen_encoder
    _, cap = adapter.capture_linen(model, variables, x, mask, contributions=method)
    assert isinstance(cap, adapter.ContributionCapture)
    assert cap.contributions.shape == (B, LAYERS, N, N)
    assert cap.outputs.shape == (B, LAYERS, N, D)
    np.testing.assert_array_equal(cap.mask, VALID)
    actual = actual_block_outputs(seen_linen(model, variables, x, mask), model.pre)
    np.testing.assert_allclose(np.asarray(cap.outputs), actual, rtol=1e-5, atol=1e-5)
    assert bool(jnp.isfinite(cap.contributions).all())
    # Real tokens get nothing from padded keys.
    assert (np.asarray(cap.contributions)[1, :, :4, 4:] == 0).all()


def test_linen_jit_equals_eager(linen_encoder: Any) -> None:
    model, variables, x, mask = linen_encoder
    _, eager = adapter.capture_linen(model, variables, x, mask, contributions="alti")
    run = jax.jit(lambda v, x, m: adapter.capture_linen(model, v, x, m, contributions="alti"))
    _, jitted = run(variables, x, mask)
    np.testing.assert_allclose(jitted.contributions, eager.contributions, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jitted.outputs, eager.outputs, rtol=1e-5, atol=1e-5)


# -- (b) the matrices equal the oracle -----------------------------------------------------------
def linen_oracle(model: Encoder, variables: Any, x: Any, mask: Any, method: str) -> np.ndarray:
    """(B, L, n, n) from the loop oracle, in float64, with pieces read by the test."""
    seen = seen_linen(model, variables, x, mask)
    _, plain = adapter.capture_linen(model, variables, x, mask)  # the per-head weights
    weights = np.asarray(plain.attentions, np.float64)
    params = variables["params"]
    out = np.zeros((B, LAYERS, N, N))

    def array(value: Any) -> np.ndarray:
        return np.asarray(value, np.float64)

    for layer in range(LAYERS):
        p = params[f"block{layer}"]
        attn = p["attn"]
        w_v = array(attn["value"]["kernel"]).reshape(D, -1)
        b_v = array(attn["value"]["bias"]).reshape(-1)
        w_o = array(attn["out"]["kernel"]).reshape(-1, D)
        b_o = array(attn["out"]["bias"])
        ln1 = (array(p["ln1"]["scale"]), array(p["ln1"]["bias"]), 1e-6)
        for b in range(B):
            stream = array(seen["x"][layer][b])
            z = array(seen["ln1"][layer][b]) if model.pre else stream
            f = oracle_head_values(z, w_v, b_v, w_o, H)
            second = None
            if method == "globenc" and not model.pre:
                h = array(seen["ln1"][layer][b])
                attention_block = array(seen["ln2_in"][layer][b])  # h + FFN(h)
                second = (array(p["ln2"]["scale"]), 1e-6, attention_block)
                assert h.shape == attention_block.shape
            out[b, layer] = oracle_contributions(
                weights[b, layer], f, stream, b_o, None if model.pre else ln1, method, second
            )
    return out


@pytest.mark.parametrize("method", METHODS)
def test_linen_matrices_equal_the_oracle_float32(linen_encoder: Any, method: str) -> None:
    model, variables, x, mask = linen_encoder
    _, cap = adapter.capture_linen(model, variables, x, mask, contributions=method)
    expected = linen_oracle(model, variables, x, mask, method)
    got = np.asarray(cap.contributions, np.float64)
    scale = np.abs(expected).max(axis=-1, keepdims=True) + 1e-12
    assert (np.abs(got - expected) / scale).max() < 1e-5


@pytest.mark.parametrize("pre", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("method", METHODS)
def test_linen_matrices_equal_the_oracle_float64(pre: bool, method: str) -> None:
    with x64(True):
        model, variables, x, mask = linen_model(pre, jnp.float64)
        _, cap = adapter.capture_linen(model, variables, x, mask, contributions=method)
        assert cap.contributions.dtype == jnp.float64
        expected = linen_oracle(model, variables, x, mask, method)
        np.testing.assert_allclose(np.asarray(cap.contributions), expected, rtol=1e-10, atol=1e-12)
        actual = actual_block_outputs(seen_linen(model, variables, x, mask), pre)
        np.testing.assert_allclose(np.asarray(cap.outputs), actual, rtol=1e-11, atol=1e-11)


# -- (c) explain = rollout over the renormalised matrices ---------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_explain_linen_is_rollout_of_the_renormalised_matrices(method: str) -> None:
    with x64(True):
        model, variables, x, mask = linen_model(False, jnp.float64)
        scores = adapter.explain_linen(model, variables, x, mask, method=method, rows=None)
        matrices = linen_oracle(model, variables, x, mask, method)
    sums = matrices.sum(-1, keepdims=True)
    rows = matrices / np.where(sums > 0, sums, 1.0)
    residual = 0.5 if method == "norm" else 0.0
    expected = oracle_rollout(rows, heads=None, residual=residual, mask=VALID)
    if method == "globenc":  # issue 23: the authors' raw products, C_L ... C_1
        expected = np.zeros_like(expected)
        for b, real in enumerate(np.asarray(VALID, dtype=bool)):
            product = np.eye(int(real.sum()))
            for layer in matrices[b][:, real][:, :, real]:
                product = layer @ product
            expected[b][np.ix_(real, real)] = product
    np.testing.assert_allclose(np.asarray(scores), expected, rtol=1e-9, atol=1e-10)


def test_explain_rows_and_options() -> None:
    model, variables, x, mask = linen_model(True)
    _, cap = adapter.capture_linen(model, variables, x, mask, contributions="globenc")
    options = {"residual": 0.25, "normalize_layers": True}  # GlobEnc's renormalised variant
    got = adapter.explain_linen(
        model, variables, x, mask, method="globenc", rows=0, options=options
    )
    expected = attnflow.rollout(
        cap.contributions, heads=None, residual=0.25, normalize_layers=True, rows=0, mask=cap.mask
    )
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    flow = attnflow.flow(
        cap.contributions, heads=None, residual=0.0, normalize_layers=True, rows=0, mask=cap.mask
    )
    assert flow.shape == (B, N)


# -- (d) outputs unchanged, everything restored ---------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_linen_outputs_are_bitwise_unchanged(linen_encoder: Any, method: str) -> None:
    model, variables, x, mask = linen_encoder
    before = model.apply(variables, x, mask)
    during, _ = adapter.capture_linen(model, variables, x, mask, contributions=method)
    np.testing.assert_array_equal(np.asarray(during), np.asarray(before))
    plain = jax.jit(model.apply)(variables, x, mask)
    run = jax.jit(lambda v, x, m: adapter.capture_linen(model, v, x, m, contributions=method))
    np.testing.assert_array_equal(np.asarray(run(variables, x, mask)[0]), np.asarray(plain))
    assert linen_attention.dot_product_attention_weights is ORIGINAL_WEIGHTS


def test_linen_restored_when_the_model_raises() -> None:
    model, variables, x, mask = linen_model(True)
    with pytest.raises(ScopeParamShapeError):
        adapter.capture_linen(model, variables, x[..., :5], mask, contributions="alti")
    assert linen_attention.dot_product_attention_weights is ORIGINAL_WEIGHTS
    _, cap = adapter.capture_linen(model, variables, x, mask)  # a plain capture still works
    assert cap.attentions.shape == (B, LAYERS, H, N, N)


# -- NNX -----------------------------------------------------------------------------------------
RECORD: list[dict[str, list[Any]]] = []


class NNXBlock(nnx.Module):
    def __init__(self, pre: bool, rngs: nnx.Rngs, dtype: Any = jnp.float32) -> None:
        self.pre = pre
        self.attention = nnx.MultiHeadAttention(
            num_heads=H, in_features=D, decode=False, param_dtype=dtype, rngs=rngs
        )
        self.ln1 = nnx.LayerNorm(D, param_dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, param_dtype=dtype, rngs=rngs)
        self.ffn = nnx.Linear(D, D, param_dtype=dtype, rngs=rngs)

    def __call__(self, x: Any, mask: Any) -> Any:
        seen = RECORD[0] if RECORD else {"x": [], "ln1": [], "ln2_in": []}
        seen["x"].append(x)
        if self.pre:
            z = self.ln1(x)
            seen["ln1"].append(z)
            h = x + self.attention(z, mask=mask)
            seen["ln2_in"].append(h)
            return h + self.ffn(nnx.gelu(self.ln2(h)))
        h = self.ln1(x + self.attention(x, mask=mask))
        seen["ln1"].append(h)
        v = h + self.ffn(nnx.gelu(h))
        seen["ln2_in"].append(v)
        return self.ln2(v)


class NNXEncoder(nnx.Module):
    def __init__(self, pre: bool, rngs: nnx.Rngs, dtype: Any = jnp.float32) -> None:
        self.blocks = nnx.List([NNXBlock(pre, rngs, dtype) for _ in range(LAYERS)])

    def __call__(self, x: Any, mask: Any = None) -> Any:
        for block in self.blocks:
            x = block(x, mask)
        return x


CALLS = {
    cls: cls.__call__
    for cls in (NNXEncoder, NNXBlock, nnx.MultiHeadAttention, nnx.LayerNorm, nnx.Linear)
}


def nnx_model(pre: bool, dtype: Any = jnp.float32) -> tuple[NNXEncoder, Any, Any]:
    model = NNXEncoder(pre, nnx.Rngs(0), dtype)
    for _, sub in nnx.iter_modules(model):
        if isinstance(sub, nnx.LinearGeneral):
            sub.kernel[...] = 3.0 * sub.kernel[...]
            sub.bias[...] = 0.5 * jax.random.normal(jax.random.key(7), sub.bias.shape, dtype)
    x = 2.0 * jax.random.normal(jax.random.key(3), (B, N, D), dtype)
    return model, x, nnx.make_attention_mask(VALID, VALID)


def nnx_seen(model: NNXEncoder, x: Any, mask: Any) -> dict[str, list[Any]]:
    """The test's own look at each block (recorded by NNXBlock.__call__ itself)."""
    seen: dict[str, list[Any]] = {"x": [], "ln1": [], "ln2_in": []}
    RECORD.append(seen)
    try:
        model(x, mask)
    finally:
        RECORD.clear()
    return seen


def nnx_oracle(model: NNXEncoder, x: Any, mask: Any, method: str, pre: bool) -> np.ndarray:
    seen = nnx_seen(model, x, mask)
    out = np.zeros((B, LAYERS, N, N))

    def array(value: Any) -> np.ndarray:
        return np.asarray(value, np.float64)

    for layer, block in enumerate(model.blocks):
        attn = block.attention
        w_v = array(attn.value.kernel[...]).reshape(D, -1)
        b_v = array(attn.value.bias[...]).reshape(-1)
        w_o = array(attn.out.kernel[...]).reshape(-1, D)
        b_o = array(attn.out.bias[...])
        ln1 = (array(block.ln1.scale[...]), array(block.ln1.bias[...]), block.ln1.epsilon)
        for b in range(B):
            stream = array(seen["x"][layer][b])
            z = array(seen["ln1"][layer][b]) if pre else stream
            weights = softmax_weights(attn, z, VALID[b])
            f = oracle_head_values(z, w_v, b_v, w_o, H)
            second = None
            if method == "globenc" and not pre:
                v = array(seen["ln2_in"][layer][b])
                second = (array(block.ln2.scale[...]), block.ln2.epsilon, v)
            out[b, layer] = oracle_contributions(
                weights, f, stream, b_o, None if pre else ln1, method, second
            )
    return out


def softmax_weights(attn: nnx.MultiHeadAttention, z: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """softmax(q k^T / sqrt(d_head)) of one sequence from the module's parameters, (H, n, n).

    Computed here, not read from a plain capture: NNX's default attention runs the fused
    jax.nn.dot_product_attention, whose stream a plain capture (explicit weights) does
    not reproduce to float64 precision.
    """
    q = np.einsum("nd,dhk->hnk", z, np.asarray(attn.query.kernel[...], np.float64))
    q = q + np.asarray(attn.query.bias[...], np.float64)[:, None, :]
    k = np.einsum("nd,dhk->hnk", z, np.asarray(attn.key.kernel[...], np.float64))
    k = k + np.asarray(attn.key.bias[...], np.float64)[:, None, :]
    logits = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    allowed = valid[:, None] & valid[None, :]
    logits = np.where(allowed, logits, -np.inf)
    logits = np.where(allowed.any(-1, keepdims=True), logits, 0.0)  # fully masked: uniform
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True)


@pytest.mark.parametrize("pre", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("method", METHODS)
def test_nnx_complete_oracle_and_unchanged(pre: bool, method: str) -> None:
    model, x, mask = nnx_model(pre)
    before = model(x, mask)
    during, cap = adapter.capture_nnx(model, x, mask, contributions=method)
    np.testing.assert_array_equal(np.asarray(during), np.asarray(before))
    assert isinstance(cap, adapter.ContributionCapture)
    np.testing.assert_array_equal(cap.mask, VALID)
    seen = nnx_seen(model, x, mask)
    actual = np.stack([np.asarray(a) for a in seen["ln2_in" if pre else "ln1"]], axis=1)
    np.testing.assert_allclose(np.asarray(cap.outputs), actual, rtol=1e-5, atol=1e-5)
    expected = nnx_oracle(model, x, mask, method, pre)
    got = np.asarray(cap.contributions, np.float64)
    scale = np.abs(expected).max(axis=-1, keepdims=True) + 1e-12
    # ALTI's entries are differences of l1 norms of the whole output (||y||_1 -
    # ||y - T||_1), so float32 rounding of ||y||_1 (~1e-6 here) shows in them; the
    # float64 tests below check them to 1e-10.
    assert (np.abs(got - expected) / scale).max() < (1e-4 if method == "alti" else 1e-5)
    assert_nnx_restored(model)


@pytest.mark.parametrize("method", METHODS)
def test_nnx_float64_and_explain(method: str) -> None:
    with x64(True):
        model, x, mask = nnx_model(False, jnp.float64)
        x = x.astype(jnp.float64)
        _, cap = adapter.capture_nnx(model, x, mask, contributions=method)
        assert cap.contributions.dtype == jnp.float64
        expected = nnx_oracle(model, x, mask, method, False)
        np.testing.assert_allclose(np.asarray(cap.contributions), expected, rtol=1e-10, atol=1e-12)
        scores = adapter.explain_nnx(model, x, mask, method=method, rows=None)
    sums = expected.sum(-1, keepdims=True)
    residual = 0.5 if method == "norm" else 0.0
    rollout = oracle_rollout(expected / sums, heads=None, residual=residual, mask=VALID)
    if method == "globenc":  # issue 23: the authors' raw products, C_L ... C_1
        rollout = np.zeros_like(rollout)
        for b, real in enumerate(np.asarray(VALID, dtype=bool)):
            product = np.eye(int(real.sum()))
            for layer in expected[b][:, real][:, :, real]:
                product = layer @ product
            rollout[b][np.ix_(real, real)] = product
    np.testing.assert_allclose(np.asarray(scores), rollout, rtol=1e-9, atol=1e-10)


def test_nnx_jit_equals_eager() -> None:
    model, x, mask = nnx_model(True)
    _, eager = adapter.capture_nnx(model, x, mask, contributions="alti")

    @nnx.jit
    def run(model: NNXEncoder, x: Any, mask: Any) -> Any:
        return adapter.capture_nnx(model, x, mask, contributions="alti")

    outputs, jitted = run(model, x, mask)
    np.testing.assert_allclose(jitted.contributions, eager.contributions, rtol=1e-5, atol=1e-6)
    plain = nnx.jit(lambda model, x, mask: model(x, mask))(model, x, mask)
    np.testing.assert_array_equal(np.asarray(outputs), np.asarray(plain))
    assert_nnx_restored(model)


def assert_nnx_restored(model: NNXEncoder) -> None:
    for cls in (NNXEncoder, NNXBlock, nnx.MultiHeadAttention, nnx.LayerNorm, nnx.Linear):
        assert cls.__call__ is CALLS[cls], cls
    for _, sub in nnx.iter_modules(model):
        if isinstance(sub, nnx.MultiHeadAttention):
            assert sub.attention_fn is nnx.dot_product_attention


# -- (e) clear errors ------------------------------------------------------------------------
def test_bad_arguments_are_refused() -> None:
    model, variables, x, mask = linen_model(True)
    with pytest.raises(ValueError, match="`contributions` must be None"):
        adapter.capture_linen(model, variables, x, mask, contributions="rollout")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="drop `heads`"):
        adapter.capture_linen(model, variables, x, mask, contributions="alti", heads="mean")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="`method` must be"):
        adapter.explain_linen(model, variables, x, mask, method="ALTI")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drop `heads`"):
        adapter.explain_linen(model, variables, x, mask, method="alti", heads="max")
    nnx_encoder, nx, nmask = nnx_model(True)
    with pytest.raises(ValueError, match="`contributions` must be None"):
        adapter.capture_nnx(nnx_encoder, nx, nmask, contributions="ALTI")  # type: ignore[call-overload]
    _, plain = adapter.capture_linen(model, variables, x, mask)
    with pytest.raises(RuntimeError, match="needs capture_linen"):
        _ = plain.contributions
    with pytest.raises(RuntimeError, match="needs capture_linen"):
        _ = plain.outputs
    _, mixing = adapter.capture_linen(model, variables, x, mask, contributions="norm")
    with pytest.raises(RuntimeError, match="read `contributions`"):
        _ = mixing.attentions


class NoResidual(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.MultiHeadDotProductAttention(num_heads=H)(nn.LayerNorm()(x))


class Wrapper(nn.Module):
    block: type[nn.Module]

    @nn.compact
    def __call__(self, x: Any) -> Any:
        return self.block()(x)


class Inline(nn.Module):
    """Two layers written inline in one module: the second has no block of its own."""

    @nn.compact
    def __call__(self, x: Any) -> Any:
        for _ in range(2):
            x = nn.LayerNorm()(x + nn.MultiHeadDotProductAttention(num_heads=H)(x))
        return x


class Cross(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        return x + nn.MultiHeadDotProductAttention(num_heads=H)(x, 2.0 * x)


class DenseBefore(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        return x + nn.MultiHeadDotProductAttention(num_heads=H)(nn.Dense(D)(x))


class Dropped(nn.Module):
    train: bool

    @nn.compact
    def __call__(self, x: Any) -> Any:
        attention = nn.MultiHeadDotProductAttention(num_heads=H)(x)
        return nn.LayerNorm()(x + nn.Dropout(0.5, deterministic=not self.train)(attention))


def linen_refused(model: nn.Module, **kwargs: Any) -> tuple[nn.Module, Any, Any]:
    x = jax.random.normal(jax.random.key(1), (1, 4, D))
    return model, model.init(jax.random.key(0), x), x


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (Wrapper(NoResidual), "does not add the attention to its input"),
        (Inline(), "calls two attention modules"),
        (Wrapper(Cross), "is cross-attention"),
        (Wrapper(DenseBefore), r"reads the output of .*Dense.*not a LayerNorm"),
        (nn.MultiHeadDotProductAttention(num_heads=H), "there is no block around it"),
    ],
    ids=["no-residual", "inline", "cross", "dense-before", "bare"],
)
def test_unsupported_linen_structures_are_refused(model: nn.Module, match: str) -> None:
    model, variables, x = linen_refused(model)
    with pytest.raises(ValueError, match=match) as info:
        adapter.capture_linen(model, variables, x, contributions="globenc")
    assert "post-LN" in str(info.value)  # says what is supported
    assert linen_attention.dot_product_attention_weights is ORIGINAL_WEIGHTS


class Rematerialised(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        return nn.remat(PreBlock)()(x, None)


def test_lifted_transforms_are_refused() -> None:
    model, variables, x = linen_refused(Rematerialised())
    with pytest.raises(ValueError, match=r"inside the model's own JAX transforms \(nn.remat"):
        adapter.capture_linen(model, variables, x, contributions="alti")


def test_no_residual_under_jit_gives_nan_not_numbers() -> None:
    model, variables, x = linen_refused(Wrapper(NoResidual))
    run = jax.jit(lambda v, x: adapter.capture_linen(model, v, x, contributions="alti"))
    _, cap = run(variables, x)
    assert bool(jnp.isnan(cap.contributions).all())
    assert bool(jnp.isnan(cap.outputs).all())


def test_active_dropout_is_refused() -> None:
    x = jax.random.normal(jax.random.key(1), (1, 4, D))
    variables = Dropped(train=False).init(jax.random.key(0), x)
    _, cap = adapter.capture_linen(Dropped(train=False), variables, x, contributions="alti")
    assert cap.contributions.shape == (1, 1, 4, 4)
    rngs = {"dropout": jax.random.key(2)}
    with pytest.raises(ValueError, match=r"dropout at .* is active"):
        adapter.capture_linen(Dropped(train=True), variables, x, rngs=rngs, contributions="alti")

    class Training(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            attention = nn.MultiHeadDotProductAttention(num_heads=H, dropout_rate=0.1)
            return nn.LayerNorm()(x + attention(x, deterministic=False))

    wrapped = Wrapper(Training)
    params = wrapped.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    with pytest.raises(ValueError, match=r"attention dropout of .*MultiHeadDotProductAttention_0"):
        adapter.capture_linen(wrapped, params, x, rngs=rngs, contributions="norm")


def test_unsupported_nnx_structures_are_refused() -> None:
    class Custom(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.attention = nnx.MultiHeadAttention(
                num_heads=H,
                in_features=D,
                decode=False,
                attention_fn=functools.partial(nnx.dot_product_attention),
                rngs=rngs,
            )

        def __call__(self, x: Any) -> Any:
            return x + self.attention(x)

    x = jax.random.normal(jax.random.key(1), (1, 4, D))
    with pytest.raises(ValueError, match="custom attention_fn"):
        adapter.capture_nnx(Custom(nnx.Rngs(0)), x, contributions="alti")
    bare = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no block around it"):
        adapter.capture_nnx(bare, x, contributions="alti")
    assert nnx.MultiHeadAttention.__call__ is CALLS[nnx.MultiHeadAttention]
    assert bare.attention_fn is nnx.dot_product_attention


def test_the_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The example of docs/adapters/jax.md runs as written and prints what it says."""
    page = Path(__file__).resolve().parents[2] / "docs" / "adapters" / "jax.md"
    text = page.read_text(encoding="utf-8")
    (example,) = re.findall(r"## Value-aware contributions.*?```python\n(.*?)```", text, re.DOTALL)
    exec(compile(example, str(page), "exec"), {"__name__": "docs_example"})  # noqa: S102
    assert capsys.readouterr().out.split("\n")[:2] == ["(2, 3, 5, 5)", "True"]
