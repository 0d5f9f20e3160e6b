"""attnflow.adapters.jax against small Flax linen and NNX models."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="the JAX adapter needs flax (and jax)")

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import attnflow
from attnflow.adapters import jax as adapter

jax.config.update("jax_enable_x64", False)

B, N, D, H = 2, 5, 8, 2
VALID = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


def target(y):
    return (y[:, 0] * jnp.arange(1.0, D + 1)).sum()


# -- a small linen encoder -----------------------------------------------------------------------
class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        x = x + nn.MultiHeadDotProductAttention(num_heads=H, name="attn")(x, mask=mask)
        return x + nn.Dense(D)(jnp.tanh(nn.LayerNorm()(x)))


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        for i in range(2):
            x = Block(name=f"block{i}")(x, mask)
        return x


@pytest.fixture(scope="module")
def linen_setup():
    x = jax.random.normal(jax.random.key(1), (B, N, D))
    mask = nn.make_attention_mask(VALID, VALID)
    model = Encoder()
    variables = model.init(jax.random.key(0), x, mask)
    return model, variables, x, mask


def manual_linen(params, x, mask):
    """Recompute softmax(QK^T/sqrt(d)) layer by layer from the parameters."""
    maps = []
    for i in range(2):
        p = params[f"block{i}"]["attn"]
        q = jnp.einsum("bnd,dhk->bnhk", x, p["query"]["kernel"]) + p["query"]["bias"]
        k = jnp.einsum("bnd,dhk->bnhk", x, p["key"]["kernel"]) + p["key"]["bias"]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        maps.append(jax.nn.softmax(logits, axis=-1))
        x = Block().apply({"params": params[f"block{i}"]}, x, mask)
    return jnp.stack(maps, axis=1)


def test_linen_weights_outputs_mask(linen_setup):
    model, variables, x, mask = linen_setup
    y, cap = adapter.capture_linen(model, variables, x, mask)
    np.testing.assert_allclose(y, model.apply(variables, x, mask), rtol=1e-6, atol=1e-6)
    assert cap.attentions.shape == (B, 2, H, N, N)
    expected = manual_linen(variables["params"], x, mask)
    np.testing.assert_allclose(cap.attentions, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cap.mask, VALID.astype(bool))
    assert cap.gradients is None


def test_linen_jit_and_heads(linen_setup):
    model, variables, x, mask = linen_setup
    eager = adapter.capture_linen(model, variables, x, mask)[1]
    jitted = jax.jit(lambda v, x, m: adapter.capture_linen(model, v, x, m))
    _, cap = jitted(variables, x, mask)
    np.testing.assert_allclose(cap.attentions, eager.attentions, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cap.mask, eager.mask)
    _, fused = adapter.capture_linen(model, variables, x, mask, heads="mean")
    assert fused.attentions.shape == (B, 2, N, N)
    np.testing.assert_allclose(fused.attentions, eager.attentions.mean(axis=2), rtol=1e-6)


def test_linen_rollout_end_to_end(linen_setup):
    model, variables, x, mask = linen_setup
    _, cap = adapter.capture_linen(model, variables, x, mask)
    scores = attnflow.rollout(cap.attentions, rows=0, mask=cap.mask)
    assert isinstance(scores, jax.Array)
    assert scores.shape == (B, N)
    np.testing.assert_allclose(scores.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(scores[1, 3:], 0.0)


def test_linen_gradients_match_finite_differences(linen_setup):
    model, variables, x, mask = linen_setup
    y, cap = jax.jit(lambda v, x, m: adapter.gradients_linen(model, v, x, m, target=target))(
        variables, x, mask
    )
    np.testing.assert_allclose(y, model.apply(variables, x, mask), rtol=1e-6, atol=1e-6)
    assert cap.gradients.shape == cap.attentions.shape == (B, 2, H, N, N)
    assert not (variables.keys() - {"params"})  # the caller's variables are untouched

    # Central finite differences through an explicit additive perturbation of one entry.
    def perturbed_output(layer, index, eps):
        def patched(*args, **kwargs):
            w = original(*args, **kwargs)
            module = kwargs.get("module", args[10] if len(args) > 10 else None)
            if module is not None and module.scope.path[0] == f"block{layer}":
                w = w.at[index].add(eps)
            return w

        def force(next_fun, args, kwargs, context):
            if isinstance(context.module, nn.MultiHeadDotProductAttention):
                kwargs = {**kwargs, "sow_weights": True}
            return next_fun(*args, **kwargs)

        original = nn.attention.dot_product_attention_weights
        nn.attention.dot_product_attention_weights = patched
        try:
            with nn.intercept_methods(force):
                y, _ = model.apply(variables, x, mask, mutable=["intermediates"])
        finally:
            nn.attention.dot_product_attention_weights = original
        return float(target(y))

    eps = 1e-2
    for layer, index in [(0, (0, 1, 0, 2)), (1, (1, 0, 0, 1)), (1, (0, 1, 3, 4))]:
        fd = (perturbed_output(layer, index, eps) - perturbed_output(layer, index, -eps)) / (
            2 * eps
        )
        np.testing.assert_allclose(
            cap.gradients[(index[0], layer, *index[1:])], fd, rtol=2e-2, atol=2e-3
        )


def test_linen_nothing_captured():
    model = nn.Dense(3)
    x = jnp.ones((1, 4))
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(RuntimeError, match="No attention weights were captured"):
        adapter.capture_linen(model, variables, x)
    with pytest.raises(ValueError, match="heads"):
        adapter.capture_linen(model, variables, x, heads="median")


# -- a small NNX encoder -------------------------------------------------------------------------
class NNXEncoder(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [
                nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, rngs=rngs)
                for _ in range(2)
            ]
        )

    def __call__(self, x, mask=None):
        for layer in self.layers:
            x = x + layer(x, mask=mask)
        return x


@pytest.fixture(scope="module")
def nnx_setup():
    model = NNXEncoder(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (B, N, D))
    return model, x, nn.make_attention_mask(VALID, VALID)


def manual_nnx(model, x, mask):
    maps = []
    for layer in model.layers:
        q, k = layer.query(x), layer.key(x)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        maps.append(jax.nn.softmax(logits, axis=-1))
        x = x + layer(x, mask=mask)
    return jnp.stack(maps, axis=1)


def test_nnx_weights_outputs_mask_jit(nnx_setup):
    model, x, mask = nnx_setup
    reference = model(x, mask=mask)
    y, cap = adapter.capture_nnx(model, x, mask=mask)
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cap.attentions, manual_nnx(model, x, mask), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cap.mask, VALID.astype(bool))
    assert all(layer.attention_fn is nnx.dot_product_attention for layer in model.layers)
    _, jitted = jax.jit(lambda x, m: adapter.capture_nnx(model, x, mask=m))(x, mask)
    np.testing.assert_allclose(jitted.attentions, cap.attentions, rtol=1e-6, atol=1e-6)
    _, viannx = nnx.jit(lambda m, x, k: adapter.capture_nnx(m, x, mask=k, heads="max"))(
        model, x, mask
    )
    assert viannx.attentions.shape == (B, 2, N, N)
    scores = attnflow.rollout(cap.attentions, rows=0, mask=cap.mask)
    assert isinstance(scores, jax.Array)
    np.testing.assert_array_equal(scores[1, 3:], 0.0)


def test_nnx_gradients_match_finite_differences(nnx_setup):
    model, x, mask = nnx_setup
    _, cap = jax.jit(lambda x, m: adapter.gradients_nnx(model, x, mask=m, target=target))(x, mask)
    assert cap.gradients.shape == (B, 2, H, N, N)

    def output_with(deltas):
        recorder = adapter._NNXRecorder(deltas)
        return float(target(adapter._run_nnx(recorder, model, (x,), {"mask": mask})))

    zeros = [jnp.zeros((B, H, N, N)) for _ in range(2)]
    eps = 1e-2
    for layer, index in [(0, (0, 0, 1, 2)), (1, (1, 1, 0, 1))]:
        plus = [z.at[index].add(eps) if i == layer else z for i, z in enumerate(zeros)]
        minus = [z.at[index].add(-eps) if i == layer else z for i, z in enumerate(zeros)]
        fd = (output_with(plus) - output_with(minus)) / (2 * eps)
        got = cap.gradients[(index[0], layer, *index[1:])]
        np.testing.assert_allclose(got, fd, rtol=2e-2, atol=2e-3)


def test_nnx_nothing_captured():
    model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    with pytest.raises(RuntimeError, match="No attention weights were captured"):
        adapter.capture_nnx(model, jnp.ones((1, 3)))


def test_explain_in_one_call_equals_capture_then_rollout() -> None:
    from attnflow.adapters.jax import capture_nnx, explain_linen, explain_nnx

    attention = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(3), (2, 5, 8))
    _, cap = capture_nnx(attention, x)
    expected = attnflow.rollout(cap.attentions, rows=0)
    np.testing.assert_allclose(explain_nnx(attention, x), expected, atol=1e-6)
    assert explain_nnx(attention, x, method="flow", rows=None).shape == (2, 5, 5)
    with pytest.raises(ValueError, match="`method`"):
        explain_nnx(attention, x, method="gradients")  # type: ignore[arg-type]

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, inputs: jax.Array) -> jax.Array:
            return inputs + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(inputs)

    variables = Encoder().init(jax.random.key(1), x)
    assert explain_linen(Encoder(), variables, x, options={"residual": 0.0}).shape == (2, 5)
