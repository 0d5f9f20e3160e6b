"""capture(model, contributions=...) on the pretrained SmolLM2 decoder (Llama, GQA, RoPE).

SmolLM2-135M-Instruct has RMSNorm pre-norm layers, separate ``q/k/v/o_proj`` without
biases, 9 query heads over 3 key-value heads and rotary position embeddings. The block
output the decomposition rebuilds is the stream after the attention's residual sum, which
the test reads itself as the input of ``post_attention_layernorm``. The matrices are
checked against a reference built here with torch from the layer's weights, Hugging
Face's own ``output_attentions`` and the layer's input and normalised input, in float64;
the batch is left-padded, as for generation.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attnflow.adapters import torch as adapter

METHODS = ("norm", "globenc", "alti")
LAYERS = (0, 14, 29)  # first, middle, last


def _capture(model: Any, batch: dict[str, Any], method: str) -> tuple[Any, dict[str, Any]]:
    """capture(contributions=method) with the test's own hooks in the same call.

    The hooks read each layer's input x, what its attention reads (input_layernorm's
    output z) and the stream entering post_attention_layernorm (x + o_proj(Attn(z))).
    """
    seen: dict[str, list[Any]] = {"x": [], "z": [], "y": []}
    handles = []
    for layer in model.model.layers:
        handles += [
            layer.register_forward_pre_hook(lambda m, a: seen["x"].append(a[0])),
            layer.input_layernorm.register_forward_hook(lambda m, a, o: seen["z"].append(o)),
            layer.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a: seen["y"].append(a[0])
            ),
        ]
    try:
        with torch.no_grad(), adapter.capture(model, contributions=method) as cap:
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return cap, {key: torch.stack(value, dim=1) for key, value in seen.items()}


@pytest.fixture(scope="module")
def captured(smollm2, left_padded):
    """{(implementation, method): (cap, seen)} for both attention implementations."""
    models, _ = smollm2
    return {
        (implementation, method): _capture(models[implementation], left_padded, method)
        for implementation in ("sdpa", "eager")
        for method in METHODS
    }


def _reference(layer: Any, alpha: Any, z: Any, x: Any) -> dict[str, Any]:
    """The three matrices of one layer and sequence, from the formulas, in float64.

    ``alpha`` ``(H, n, n)``, ``z`` and ``x`` ``(n, d)``. The value heads are repeated
    across their query-head group as Hugging Face's ``repeat_kv`` does, every per-source
    term ``T_i(x_j)`` is formed whole (``(n, n, d)``) and reduced by its rule.
    """
    attention = layer.self_attn
    heads, n = alpha.shape[0], alpha.shape[1]
    d_head = attention.head_dim
    value_heads = attention.v_proj.out_features // d_head
    w_v = attention.v_proj.weight.detach().double()
    w_o = attention.o_proj.weight.detach().double()  # (d, H * d_head)
    assert attention.v_proj.bias is None  # as in SmolLM2
    assert attention.o_proj.bias is None
    values = (z @ w_v.T).reshape(n, value_heads, d_head).transpose(0, 1)
    values = values.repeat_interleave(heads // value_heads, dim=0)  # (H, n, d_head)
    f = torch.einsum("hjk,dhk->hjd", values, w_o.reshape(-1, heads, d_head))  # f^h(z_j)
    through_attention = torch.einsum("hij,hjd->ijd", alpha, f)  # Σ_h α^h_ij f^h(z_j)
    terms = through_attention + torch.diag_embed(x.T).permute(1, 2, 0)  # + δ_ij x_j
    y = terms.sum(dim=1)  # no o_proj bias
    alti = (y.abs().sum(-1)[:, None] - (y[:, None, :] - terms).abs().sum(-1)).clamp_min(0)
    return {
        "y": y,
        "norm": through_attention.norm(dim=-1),
        "globenc": terms.norm(dim=-1),
        "alti": alti / alti.sum(-1, keepdim=True),
    }


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("method", METHODS)
def test_decomposition_is_complete(captured, left_padded, implementation, method):
    """The terms plus the bias are the stream entering post_attention_layernorm.

    Relative to each token's largest coordinate: SmolLM2's stream reaches 2.4e4 on the
    first token, where float32 rounds at 2e-3, so an absolute bound would measure the
    rounding of the model rather than the decomposition.
    """
    cap, seen = captured[implementation, method]
    batch, n = left_padded["input_ids"].shape
    assert cap.contributions.shape == (batch, 30, n, n)
    assert cap.outputs.shape == seen["y"].shape == (batch, 30, n, 576)
    scale = seen["y"].abs().amax(dim=-1)
    error = (cap.outputs - seen["y"]).abs().amax(dim=-1) / scale
    assert float(error.max()) < 1e-5, float(error.max())  # measured: 6.3e-7
    assert bool(torch.isfinite(cap.contributions).all())


@pytest.fixture(scope="module")
def hf_weights(smollm2, left_padded):
    """Hugging Face's own eager attention weights, one ``(batch, H, n, n)`` per layer."""
    models, _ = smollm2
    with torch.no_grad():
        return models["eager"](**left_padded, output_attentions=True).attentions


@pytest.mark.parametrize("method", METHODS)
def test_matrices_equal_the_reference(smollm2, left_padded, captured, hf_weights, method):
    """Against the formulas fed Hugging Face's own eager attention weights."""
    models, _ = smollm2
    model = models["eager"]
    weights = hf_weights
    cap, seen = captured["eager", method]
    mask = left_padded["attention_mask"].bool()
    for index in LAYERS:
        layer = model.model.layers[index]
        for b in range(len(mask)):
            real = mask[b]
            alpha = weights[index][b][:, real][:, :, real].double()
            z, x = seen["z"][b, index, real].double(), seen["x"][b, index, real].double()
            expected = _reference(layer, alpha, z, x)
            # The reference is itself complete: it rebuilds the model's stream.
            y = seen["y"][b, index, real].double()
            assert float(((expected["y"] - y).abs().amax(-1) / y.abs().amax(-1)).max()) < 1e-5
            got = cap.contributions[b, index][real][:, real].double()
            row_scale = expected[method].amax(dim=-1, keepdim=True)
            error = float(((got - expected[method]).abs() / row_scale).max())
            assert error < 1e-5, (index, b, error)  # measured: 2.2e-6 (ALTI), 3e-7


@pytest.mark.parametrize("method", METHODS)
def test_padding_gives_and_takes_nothing(captured, left_padded, method):
    mask = left_padded["attention_mask"].bool()
    for implementation in ("sdpa", "eager"):
        matrices = captured[implementation, method][0].contributions
        for b in range(len(mask)):
            real, padded = mask[b], ~mask[b]
            assert bool((matrices[b][:, real][:, :, padded] == 0).all())
            # Causal: nothing from later tokens.
            later = torch.ones(len(real), len(real), dtype=torch.bool).triu(1)
            assert bool((matrices[b][:, later & real[:, None]] == 0).all())


def test_explain_last_token_alti(smollm2, left_padded):
    """explain(method="alti", rows=-1): rows sum to 1, zero on padding, and the shorter
    prompt padded gives (nearly) the row it gives alone: RoPE angles are relative, but
    Hugging Face computes them in float32 at shifted positions."""
    models, _ = smollm2
    mask = left_padded["attention_mask"].bool()
    scores = adapter.explain(models["sdpa"], left_padded, method="alti", rows=-1)
    assert scores.shape == mask.shape
    assert bool((scores[~mask] == 0).all())
    torch.testing.assert_close(scores.sum(-1), torch.ones(len(mask)), atol=1e-5, rtol=0)
    ids = left_padded["input_ids"][0, mask[0]][None]
    alone = adapter.explain(models["sdpa"], {"input_ids": ids}, method="alti", rows=-1)
    torch.testing.assert_close(scores[0, mask[0]], alone[0], atol=1e-5, rtol=0)
