"""explain(..., blockwise=True): rollout and GAE rows without materialising attention.

The reference is the materialised path: every layer's weights captured with
:func:`attnflow.adapters.torch.capture` (and, for GAE, their gradients with respect to the
target logit at the explained row), then :func:`attnflow.rollout` or
:func:`attnflow.gradient_rollout`. Compared on the pretrained SmolLM2 (grouped-query
attention, RoPE, left padding) in float32, and on small random Llama, Mistral (sliding
window) and Qwen2 (biases) models in float64.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode

import attnflow
from attnflow.adapters import _torch_blockwise as blockwise
from attnflow.adapters import torch as adapter


def _materialised_rollout(model, inputs, rows, **options):
    with torch.no_grad(), adapter.capture(model) as cap:
        model(**inputs)
    return attnflow.rollout(cap.attentions, rows=rows, mask=cap.mask, **options)


def _materialised_gae(model, inputs, row, target=None, log_probability=False, **options):
    """GAE of the logit of `target` (default: the argmax) at `row`, from captured weights.

    With `log_probability`, of its log-probability: the log-softmax over the vocabulary.
    """
    with torch.enable_grad():
        with adapter.capture(model) as cap:
            logits = model(**inputs).logits[:, row]
        classes = logits.argmax(-1) if target is None else torch.full_like(logits[:, 0], target)
        scores = torch.log_softmax(logits, dim=-1) if log_probability else logits
        score = scores.gather(-1, classes.long()[:, None]).sum()
        gradients = torch.autograd.grad(score, cap.records)
    weights = cap.attentions.detach()
    return attnflow.gradient_rollout(
        weights, torch.stack(gradients, dim=-4), rows=row, mask=cap.mask, **options
    )


# -- SmolLM2, float32 ---------------------------------------------------------------------------
ROLLOUT_CASES = [
    {},
    {"heads": "max"},
    {"heads": "min", "residual": 0.2, "layers": 12},
    {"residual": 0.0, "layers": "all"},
    {"receptive_field": True, "exclude": 0},
    {"heads": "max", "receptive_field": True, "layers": "all"},
]


@pytest.fixture(scope="module")
def captured(smollm2, left_padded):
    models, _ = smollm2
    with torch.no_grad(), adapter.capture(models["sdpa"]) as cap:
        models["sdpa"](**left_padded)
    return cap.attentions, cap.mask


def test_blockwise_logit_and_value_aware_paths_find_the_same_attention(smollm2):
    # One rule (_torch_hooks.attention_sites) behind the three consumers that read
    # SmolLM2's layers: the blockwise rows, the logit gatherer, value-aware capture.
    from attnflow.adapters._torch_contributions import find_blocks
    from attnflow.adapters._torch_logit import _decoder_layers

    model = smollm2[0]["sdpa"]
    attention = blockwise._attention_modules(model)
    assert len(attention) == model.config.num_hidden_layers
    assert attention == [a for _, a, _ in _decoder_layers(model)]
    assert attention == [spec.block.self_attn for spec in find_blocks(model)]
    assert [spec.block for spec in find_blocks(model)] == list(model.model.layers)


@pytest.mark.parametrize("options", ROLLOUT_CASES)
def test_rollout_rows_equal_the_materialised_path_on_smollm2(
    smollm2, left_padded, captured, options
):
    models, _ = smollm2
    weights, mask = captured
    assert not bool(mask.all())  # left padding is inside the comparison
    rows = [4, 9, -1]
    expected = attnflow.rollout(weights, rows=rows, mask=mask, **options)
    got = adapter.explain(models["sdpa"], left_padded, rows=rows, blockwise=True, **options)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    padded = (~mask).reshape(2, *([1] * (got.ndim - 2)), -1)
    assert bool((got * padded == 0).all())  # padding gets nothing


def test_per_head_weights_and_the_sdpa_engine_on_smollm2(smollm2, left_padded, captured):
    models, _ = smollm2
    weights, mask = captured
    heads = torch.rand(30, 9, generator=torch.Generator().manual_seed(0))
    expected = attnflow.rollout(weights, rows=-1, mask=mask, heads=heads)
    for engine in ("matmul", "sdpa"):
        got = adapter.explain(
            models["sdpa"], left_padded, rows=-1, blockwise=True, heads=heads, engine=engine
        )
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "options", [{}, {"layers": "all", "exclude_self": True, "normalize_result": True}]
)
def test_gae_rows_equal_the_materialised_path_on_smollm2(smollm2, left_padded, options):
    models, _ = smollm2
    model = models["sdpa"]
    expected = _materialised_gae(model, left_padded, -1, **options)
    got = adapter.explain(
        model, left_padded, method="gradient_rollout", rows=-1, blockwise=True, **options
    )
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, atol=1e-5 * scale, rtol=0)


def test_gae_rows_with_a_given_target_each_row_its_own_logit():
    """Each explained row differentiates the target's logit at that row (float64)."""
    model = _tiny("llama")
    inputs = _padded_inputs()
    expected = torch.stack(
        [_materialised_gae(model, inputs, row, target=7) for row in (5, -1)], dim=-2
    )
    got = adapter.explain(
        model, inputs, method="gradient_rollout", rows=[5, -1], target=7, blockwise=True
    )
    torch.testing.assert_close(got, expected, atol=1e-11, rtol=0)
    # explain's materialised path gives a causal LM's target the same meaning.
    materialised = adapter.explain(
        model, inputs, method="gradient_rollout", rows=[5, -1], target=7, blockwise=False
    )
    torch.testing.assert_close(got, materialised, atol=1e-11, rtol=0)


@pytest.mark.parametrize("target", [None, 7])
def test_gae_rows_of_the_log_probability_each_row_its_own(target):
    """target_score="log_probability": log_softmax(logits at the row)[target], both paths."""
    model = _tiny("llama")
    inputs = _padded_inputs()
    expected = torch.stack(
        [
            _materialised_gae(model, inputs, row, target=target, log_probability=True)
            for row in (5, -1)
        ],
        dim=-2,
    )
    for rows_blockwise in (True, False):
        got = adapter.explain(
            model,
            inputs,
            method="gradient_rollout",
            rows=[5, -1],
            target=target,
            target_score="log_probability",
            blockwise=rows_blockwise,
        )
        torch.testing.assert_close(got, expected, atol=1e-11, rtol=0)
    logit = adapter.explain(
        model, inputs, method="gradient_rollout", rows=[5, -1], target=target, blockwise=True
    )
    assert float((logit - expected).abs().max()) > 1e-6  # another score, other relevance


# -- small random models, float64 ---------------------------------------------------------------
def _tiny(kind, dtype=torch.float64, layers=3, **extra):
    torch.manual_seed(0)
    common = {
        "vocab_size": 40,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attn_implementation": "sdpa",
        **extra,
    }
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    model = model_class(config_class(**common)).to(dtype).eval()
    if kind == "qwen2":  # random biases, so that they matter
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_()
    return model


def _padded_inputs(n=11):
    ids = torch.randint(40, (2, n), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, n, dtype=torch.long)
    attention_mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": attention_mask}


@pytest.mark.parametrize(
    ("kind", "extra"),
    [("llama", {}), ("mistral", {"sliding_window": 4}), ("qwen2", {})],
)
def test_float64_rows_of_llama_mistral_and_qwen2(kind, extra):
    model = _tiny(kind, **extra)
    inputs = _padded_inputs()
    for options in ({}, {"heads": "max", "layers": "all"}, {"receptive_field": True}):
        expected = _materialised_rollout(model, inputs, [2, 10], **options)
        got = adapter.explain(model, inputs, rows=[2, 10], blockwise=True, **options)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    for options in (
        {"layers": 1, "receptive_field": True, "exclude": 0},
        {"rule": "weighted", "residual": 0.3},
    ):
        expected = _materialised_gae(model, inputs, -1, **options)
        got = adapter.explain(
            model, inputs, method="gradient_rollout", rows=-1, blockwise=True, **options
        )
        torch.testing.assert_close(got, expected, atol=1e-11, rtol=0)


def test_sliding_window_changes_the_rows():
    """The window is really applied: without it the rows differ (the test can fail)."""
    model = _tiny("mistral", sliding_window=3)
    inputs = _padded_inputs()
    windowed = adapter.explain(model, inputs, rows=-1, blockwise=True)
    model.config.sliding_window = None
    full = adapter.explain(model, inputs, rows=-1, blockwise=True)
    assert not torch.allclose(windowed, full)
    torch.testing.assert_close(full, _materialised_rollout(model, inputs, -1), atol=1e-12, rtol=0)


def test_sdpa_engine_equals_the_matmul_engine():
    """The dV of SDPA's backward with dO = the rows is the rows' weighted column sums."""
    model = _tiny("llama")
    for inputs in (_padded_inputs(), {"input_ids": _padded_inputs()["input_ids"]}):
        for options in ({}, {"layers": "all", "residual": 0.1}, {"heads": [1.0, 0.0, 2.0, 1.0]}):
            kwargs = {"rows": [3, -1], "blockwise": True, **options}
            matmul = adapter.explain(model, inputs, engine="matmul", **kwargs)
            sdpa = adapter.explain(model, inputs, engine="sdpa", **kwargs)
            torch.testing.assert_close(sdpa, matmul, atol=1e-12, rtol=0)


def test_blocks_of_rows_equal_one_block(monkeypatch):
    model = _tiny("llama", dtype=torch.float32)
    inputs = _padded_inputs(n=40)
    one = adapter.explain(model, inputs, rows=-1, blockwise=True, heads="max")
    monkeypatch.setattr(blockwise, "BLOCK_BYTES", 1)  # 16-row blocks
    many = adapter.explain(model, inputs, rows=-1, blockwise=True, heads="max")
    torch.testing.assert_close(many, one, atol=1e-6, rtol=0)


# -- never an (H, n, n) or (n, n) array ---------------------------------------------------------
class _LargestTensor(TorchDispatchMode):
    """Record the largest number of elements of any tensor an operation returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple | list) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


@pytest.mark.parametrize("method", ["rollout", "gradient_rollout"])
def test_no_attention_sized_tensor_is_ever_created(monkeypatch, method):
    n = 768
    model = _tiny("llama", dtype=torch.float32, layers=2)
    inputs = {"input_ids": torch.randint(40, (1, n), generator=torch.Generator().manual_seed(2))}
    monkeypatch.setattr(blockwise, "BLOCK_BYTES", 1)  # blocks of 16 query rows
    with _LargestTensor() as watch:
        adapter.explain(model, inputs, method=method, rows=-1, blockwise=True)
    # (heads, n, n) would be 4 n^2 and (n, n) n^2; a block of scores is 4 x 16 x n.
    assert watch.largest < n * n // 4
    # The check can fail: the materialised path creates (heads, n, n) weights.
    with _LargestTensor() as watch:
        if method == "rollout":
            _materialised_rollout(model, inputs, -1)
        else:
            _materialised_gae(model, inputs, -1)
    assert watch.largest >= 4 * n * n


# -- the dispatch and bad input -----------------------------------------------------------------
def test_blockwise_none_follows_the_memory_estimate(monkeypatch):
    model = _tiny("llama", dtype=torch.float32)
    inputs = _padded_inputs()
    calls = []
    original = blockwise.explain_rows

    def spy(*args, **kwargs):
        calls.append(kwargs["method"])
        return original(*args, **kwargs)

    monkeypatch.setattr(blockwise, "explain_rows", spy)
    adapter.explain(model, inputs, rows=-1)
    assert calls == []  # a few kilobytes of weights: captured
    # Heads fused while capturing: 3 layers x 11^2 x 4 bytes x 2 = 2,904 bytes, and one
    # layer's scores, 4 heads' worth (3,872): 6,776 bytes; a tenth of 40 kB is less.
    from attnflow.adapters import _torch_path

    monkeypatch.setattr(_torch_path, "MEMORY_SHARE", 0.1)
    monkeypatch.setattr(blockwise, "available_bytes", lambda device: 40_000)
    adapter.explain(model, inputs, rows=-1)
    assert calls == ["rollout"]
    monkeypatch.setattr(blockwise, "available_bytes", lambda device: 1_000)
    with pytest.raises(MemoryError, match="MiB are available"):
        adapter.explain(model, inputs, rows=-1)


def test_a_context_too_long_is_refused_before_the_model_runs(monkeypatch):
    model = _tiny("llama", dtype=torch.float32)
    monkeypatch.setattr(blockwise, "available_bytes", lambda device: 1_000)
    ran = []
    model.register_forward_pre_hook(lambda *args: ran.append(1))
    with pytest.raises(MemoryError, match="Shorten the context"):
        adapter.explain(model, _padded_inputs(), rows=-1, blockwise=True)
    assert ran == []


def test_bad_input_is_refused_clearly():
    model = _tiny("llama", dtype=torch.float32)
    inputs = _padded_inputs()
    layer = torch.nn.TransformerEncoderLayer(8, nhead=2, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
    with pytest.raises(ValueError, match="LlamaAttention"):
        adapter.explain(encoder.eval(), torch.randn(1, 5, 8), blockwise=True)
    with pytest.raises(ValueError, match='method="rollout" and method="gradient_rollout"'):
        adapter.explain(model, inputs, method="flow", rows=-1, blockwise=True)
    with pytest.raises(TypeError, match="`blockwise` must be True"):
        adapter.explain(model, inputs, rows=-1, blockwise="yes")
    with pytest.raises(ValueError, match="pass `rows`"):
        adapter.explain(model, inputs, rows=None, blockwise=True)
    with pytest.raises(ValueError, match="heads='each'"):
        adapter.explain(model, inputs, rows=-1, blockwise=True, heads="each")
    with pytest.raises(ValueError, match="threshold"):
        adapter.explain(model, inputs, rows=-1, blockwise=True, threshold=0.1)
    with pytest.raises(ValueError, match="`engine` must be"):
        adapter.explain(model, inputs, rows=-1, blockwise=True, engine="flash")
    with pytest.raises(ValueError, match="`target`"):
        adapter.explain(model, inputs, rows=-1, blockwise=True, target=3)
    for blockwise_option in (True, False):  # one refusal, naming the call, either path
        with torch.inference_mode(), pytest.raises(RuntimeError, match="needs autograd") as e:
            adapter.explain(
                model, inputs, method="gradient_rollout", rows=-1, blockwise=blockwise_option
            )
        assert ("blockwise=True" in str(e.value)) == blockwise_option
        assert "an outer torch.no_grad() is fine" in str(e.value)
    with pytest.raises(ValueError, match="Drop `target_score`"):
        adapter.explain(model, inputs, rows=-1, blockwise=True, target_score="log_probability")
    with pytest.raises(ValueError, match="`target_score` must be"):
        adapter.explain(
            model, inputs, method="gradient_rollout", rows=-1, blockwise=True, target_score="p"
        )
    with pytest.raises(IndexError, match="`rows` must index"):
        adapter.explain(model, inputs, rows=11, blockwise=True)
    with pytest.raises(ValueError, match="`heads` weights must have shape"):
        adapter.explain(model, inputs, rows=-1, blockwise=True, heads=[1.0, 2.0])
    with pytest.raises(ValueError, match="got heads"):
        adapter.explain(
            model, inputs, method="gradient_rollout", rows=-1, blockwise=True, heads="max"
        )
    with pytest.raises(ValueError, match="past_key_values"):
        adapter.explain(
            model,
            {**inputs, "past_key_values": transformers.DynamicCache()},
            rows=-1,
            blockwise=True,
        )


def test_blockwise_none_takes_the_cheaper_path_and_logs_it(monkeypatch, caplog):
    """Issue 39: on a CPU, blockwise from 512 tokens (measured faster at 1,024); logged."""
    from attnflow.adapters import _torch_path

    model = _tiny("llama", dtype=torch.float32)
    calls = []
    original = blockwise.explain_rows

    def spy(*args, **kwargs):
        calls.append(kwargs["method"])
        return original(*args, **kwargs)

    monkeypatch.setattr(blockwise, "explain_rows", spy)
    long = {"input_ids": torch.randint(0, 32, (1, _torch_path.CPU_BLOCKWISE_FROM))}
    with caplog.at_level("INFO", logger="attnflow"):
        adapter.explain(model, long, rows=-1, method="gradient_rollout")
        adapter.explain(model, {"input_ids": long["input_ids"][:, :16]}, rows=-1)
    assert calls == ["gradient_rollout"]
    first, second = (r.getMessage() for r in caplog.records if r.name == "attnflow")
    assert "on 1 x 512 tokens: the blockwise path, on a CPU from 512 tokens" in first
    assert "estimated peaks: materialised" in first
    assert "on 1 x 16 tokens: the materialised (captured weights) path" in second
    # On a GPU, capturing is cheaper while it fits; never when it would not.
    gpu = _torch_path.estimate(model, "rollout", 1, 4096, 2**40, device_type="cuda")
    assert not gpu.blockwise_chosen
    tight = _torch_path.estimate(model, "rollout", 1, 4096, gpu.materialised, device_type="cuda")
    assert tight.blockwise_chosen
