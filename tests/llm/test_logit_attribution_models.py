"""direct_logit, alti_logit and ifr through the PyTorch adapter, against oracles from the papers.

Random Llama (grouped-query attention, RoPE, value and output biases) and GPT-2 models
built from configs in float64, eager attention, a right-padded batch. The oracles take
the attention weights from the model's own ``output_attentions`` and the values from the
layers' own norms, as hooks read them, and write each rule out again from its paper in
NumPy: the direct logit terms (Ferrando et al. 2023, the "Logit" variant), ALTI-Logit
with ALTI written from Ferrando et al. 2022 (parts ``Σ_h A f^h(x_j)`` plus the residual at
``j = t``, Manhattan proximity, rows normalised, rolled out without an identity), and
information flow routes (Ferrando & Voita 2024; FlashTrace's span aggregate). The direct
logit terms must add up, with the biases, the MLPs and the embedding, to the model's own
logit of the target (the decomposition identity).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnflow.adapters.torch import explain

VOCAB, N = 40, 9


def _llama(vocabulary: int = VOCAB) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=vocabulary,
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_bias=True,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    model.config._attn_implementation = "eager"
    return model


def _gpt2() -> Any:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=24,
        n_layer=3,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    model.config._attn_implementation = "eager"
    return model


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def run(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The model, a right-padded batch, and what the oracles read from one eager call."""
    model = _llama() if request.param == "llama" else _gpt2()
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, N), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding: the second text ends at position 5
    blocks = model.model.layers if request.param == "llama" else model.transformer.h
    seen: dict[Any, Any] = {}
    handles = []
    for i, block in enumerate(blocks):
        norm, attention, mlp = (
            (block.input_layernorm, block.self_attn, block.mlp)
            if request.param == "llama"
            else (block.ln_1, block.attn, block.mlp)
        )
        handles += [
            block.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("x", i), a[0])),
            norm.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(("z", i), o)),
            attention.register_forward_hook(
                lambda m, a, o, i=i: seen.__setitem__(("attn", i), o[0])
            ),
            mlp.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(("mlp", i), o)),
        ]
    final = model.model.norm if request.param == "llama" else model.transformer.ln_f
    handles.append(final.register_forward_pre_hook(lambda m, a: seen.__setitem__("last", a[0])))
    try:
        with torch.no_grad():
            output = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    return {
        "family": request.param,
        "model": model,
        "blocks": blocks,
        "final": final,
        "inputs": {"input_ids": ids, "attention_mask": mask},
        "output": output,
        "seen": {k: v.detach().numpy() for k, v in seen.items()},
        "rows": [N - 1, 5],  # the last real token of each text
    }


def _pieces(run: dict[str, Any], layer: int) -> tuple[Any, Any, Any, Any]:
    """``W_V (d, H*dh)``, ``b_V``, ``W_O (H*dh, d)``, ``b_O`` of one layer, as NumPy."""
    block = run["blocks"][layer]
    if run["family"] == "llama":
        a = block.self_attn
        w_v, b_v = a.v_proj.weight.detach().numpy().T, a.v_proj.bias.detach().numpy()
        w_o, b_o = a.o_proj.weight.detach().numpy().T, a.o_proj.bias.detach().numpy()
        return w_v, b_v, w_o, b_o
    a = block.attn
    d = a.c_attn.weight.shape[0]
    w_v = a.c_attn.weight.detach().numpy()[:, 2 * d :]
    b_v = a.c_attn.bias.detach().numpy()[2 * d :]
    return w_v, b_v, a.c_proj.weight.detach().numpy(), a.c_proj.bias.detach().numpy()


def _head_outputs(run: dict[str, Any], layer: int, b: int) -> np.ndarray:
    """``f^h(x_j) = (z_j W_V^h + b_V^h) W_O^h`` for every head and token: ``(H, n, d)``."""
    w_v, b_v, w_o, _ = _pieces(run, layer)
    heads = run["output"].attentions[layer].shape[1]
    head_dim = w_o.shape[0] // heads
    value_heads = w_v.shape[1] // head_dim
    v = run["seen"][("z", layer)][b] @ w_v + b_v  # (n, Hv*dh)
    return np.stack(
        [
            v[
                :,
                (h // (heads // value_heads)) * head_dim : (h // (heads // value_heads) + 1)
                * head_dim,
            ]
            @ w_o[h * head_dim : (h + 1) * head_dim]
            for h in range(heads)
        ]
    )


def _readout(run: dict[str, Any], b: int, t: int, target: int) -> tuple[np.ndarray, float]:
    """u and c with logit = <x_L, u> + c, the final norm written out (not the core's)."""
    x = run["seen"]["last"][b, t]
    final = run["final"]
    gamma = final.weight.detach().numpy()
    w = run["model"].lm_head.weight.detach().numpy()[target]
    if run["family"] == "llama":
        return gamma * w / np.sqrt(np.mean(x**2) + final.variance_epsilon), 0.0
    sigma = np.sqrt(np.var(x) + final.eps)
    u = gamma * w
    return (u - u.mean()) / sigma, float(final.bias.detach().numpy() @ w)


def _alti(run: dict[str, Any], layer: int, b: int) -> np.ndarray:
    """ALTI's matrix of one layer, every row (Ferrando et al. 2022)."""
    attention = run["output"].attentions[layer][b].numpy()  # (H, n, n)
    f = _head_outputs(run, layer, b)
    x = run["seen"][("x", layer)][b]
    _, _, _, b_o = _pieces(run, layer)
    matrix = np.zeros((N, N))
    for t in range(N):
        parts = np.einsum("hj,hjd->jd", attention[:, t], f)
        parts[t] += x[t]
        whole = parts.sum(0) + b_o
        proximity = np.maximum(np.abs(whole).sum() - np.abs(whole - parts).sum(-1), 0)
        matrix[t] = proximity / proximity.sum()
    return matrix


def _oracle(run: dict[str, Any], method: str) -> np.ndarray:
    logits = run["output"].logits.numpy()
    result = np.zeros((2, N))
    for b, t in enumerate(run["rows"]):
        real = run["inputs"]["attention_mask"][b].numpy().astype(bool)
        target = int(logits[b, t].argmax())
        u, _ = _readout(run, b, t, target)
        below = np.eye(N)
        for layer in range(len(run["blocks"])):
            attention = run["output"].attentions[layer][b].numpy()
            f = _head_outputs(run, layer, b)
            if method == "ifr":
                x = run["seen"][("x", layer)][b, t]
                parts = attention[:, t, :, None] * f  # (H, n, d)
                whole = run["seen"][("attn", layer)][b, t] + x
                proximity = np.maximum(np.abs(whole).sum() - np.abs(whole - parts).sum(-1), 0)
                own = max(np.abs(whole).sum() - np.abs(whole - x).sum(), 0)
                result[b] += (proximity / (proximity.sum() + own)).sum(0)
                continue
            direct = (attention[:, t, :, None] * f @ u).sum(0)  # (n,)
            result[b] += direct if method == "direct_logit" else direct @ below
            if method == "alti_logit":
                keep = real[:, None] & real[None, :]
                below = np.where(keep, _alti(run, layer, b), 0) @ below
    return result


@pytest.mark.parametrize("method", ["direct_logit", "alti_logit", "ifr"])
def test_equals_the_papers_formulas(run: dict[str, Any], method: str) -> None:
    scores = explain(run["model"], run["inputs"], method=method, rows=-1)
    assert scores.shape == (2, N)
    assert scores.dtype == torch.float64
    expected = _oracle(run, method)
    # Llama's eager softmax and RMSNorm compute in float32 whatever the model's dtype.
    atol = 1e-6 * max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(scores.numpy(), expected, atol=atol)
    assert bool((scores[1, 6:] == 0).all())  # padding gets nothing


def test_direct_logit_adds_up_to_the_models_logit(run: dict[str, Any]) -> None:
    """Σ terms + Σ_l <b_O + mlp_l, u> + <embedding, u> + c = the target's logit."""
    per_head = explain(
        run["model"], run["inputs"], method="direct_logit", rows=-1, heads="each", layers="all"
    )
    layers = len(run["blocks"])
    heads = run["output"].attentions[0].shape[1]
    assert per_head.shape == (2, layers, heads, N)
    logits = run["output"].logits.numpy()
    for b, t in enumerate(run["rows"]):
        target = int(logits[b, t].argmax())
        u, c = _readout(run, b, t, target)
        rest = sum(
            _pieces(run, layer)[3] @ u + run["seen"][("mlp", layer)][b, t] @ u
            for layer in range(layers)
        )
        embedding = run["seen"][("x", 0)][b, t] @ u  # the input of the first block
        total = float(per_head[b].sum()) + rest + embedding + c
        assert total == pytest.approx(float(logits[b, t, target]), abs=1e-6)
        # Each layer's heads add up to its attention's output read out on u.
        for layer in range(layers):
            attended = (run["seen"][("attn", layer)][b, t] - _pieces(run, layer)[3]) @ u
            assert float(per_head[b, layer].sum()) == pytest.approx(attended, abs=1e-6)


def test_a_contrast_is_the_difference_of_two_targets(run: dict[str, Any]) -> None:
    model, inputs = run["model"], run["inputs"]
    first = explain(model, inputs, method="alti_logit", rows=-1, target=3)
    second = explain(model, inputs, method="alti_logit", rows=-1, target=7)
    contrast = explain(model, inputs, method="alti_logit", rows=-1, target=3, foil=7)
    torch.testing.assert_close(contrast, first - second)


def test_ifr_span_is_one_aggregated_target(run: dict[str, Any]) -> None:
    """FlashTrace's span aggregate: rows' attention and wholes summed before the proximity."""
    model, inputs = run["model"], run["inputs"]
    span = explain(model, inputs, method="ifr", rows=[3, 4], span=True, layers="all")
    one = explain(model, inputs, method="ifr", rows=[3], span=True)
    torch.testing.assert_close(one, explain(model, inputs, method="ifr", rows=3))
    assert span.shape == (2, len(run["blocks"]), N)
    # Each layer's shares are of one whole: at most one, the residual taking the rest.
    assert bool((span.sum(-1) <= 1 + 1e-12).all())
    assert bool((span[..., 5:] == 0).all())  # causal: no row of the span sees position 5


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"method": "direct_logit", "rows": 7}, ValueError, "not one of its 6 real tokens"),
        (
            {"method": "direct_logit", "rows": -1, "target": VOCAB},
            ValueError,
            r"vocabulary ids in \[0, 40\)",
        ),
        ({"method": "direct_logit", "rows": -1, "target": 1.5}, TypeError, "vocabulary id"),
        (
            {"method": "direct_logit", "rows": [3, 4], "span": True},
            ValueError,
            "`span` aggregates IFR",
        ),
        ({"method": "ifr", "rows": -1, "target": 3}, ValueError, "drop `target`"),
        ({"method": "ifr", "rows": -1, "heads": "mean"}, ValueError, '"sum" or "each"'),
        ({"method": "ifr", "rows": -1, "blockwise": False}, ValueError, "never materialises"),
        ({"method": "ifr", "rows": "last"}, TypeError, "int or a sequence"),
        ({"method": "ifr", "rows": [3, 20], "span": True}, ValueError, "not one of its"),
        ({"method": "direct_logit", "rows": -1, "foil": -2}, ValueError, "`foil` must be"),
    ],
)
def test_bad_input_is_refused_before_work(
    run: dict[str, Any], options: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        explain(run["model"], run["inputs"], **options)


def test_a_model_without_supported_blocks_is_refused() -> None:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
    )
    model = transformers.BertForMaskedLM(config).eval()
    with pytest.raises(ValueError, match=r"cannot explain this model.*GPT-2 blocks"):
        explain(model, {"input_ids": torch.tensor([[1, 2, 3]])}, method="direct_logit", rows=-1)


def test_a_head_that_scales_its_logits_is_refused(run: dict[str, Any]) -> None:
    """Soft-capping or logit scaling after lm_head: the readout would be wrong, so no scores."""

    def scaled(module: Any, args: Any, output: Any) -> Any:
        output.logits = output.logits * 2.0
        return output

    handle = run["model"].register_forward_hook(scaled)
    try:
        with pytest.raises(ValueError, match="does more than a norm and a linear map"):
            explain(run["model"], run["inputs"], method="direct_logit", rows=-1)
    finally:
        handle.remove()


class _Tokenizer:
    """A stand-in for a Hugging Face tokenizer over the random models' small vocabulary."""

    def __call__(self, text: str, return_tensors: str = "pt") -> dict[str, Any]:
        ids = torch.tensor([[1] + [2 + ord(c) % (VOCAB - 2) for c in text]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def convert_ids_to_tokens(self, ids: Any) -> list[str]:
        return [f"t{i}" for i in ids]

    def get_special_tokens_mask(
        self, ids: Any, already_has_special_tokens: bool = True
    ) -> list[int]:
        return [int(i == 1) for i in ids]

    def decode(self, ids: Any, **kwargs: Any) -> str:
        return " ".join(f"t{i}" for i in ids)


@pytest.mark.parametrize("method", ["direct_logit", "alti_logit", "ifr"])
def test_generation_rows_equal_each_prefix(run: dict[str, Any], method: str) -> None:
    """Every generated token's row, from one forward, equals explain() on its prefix."""
    from attnflow.adapters.torch import explain_generation

    model = run["model"]
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    g = explain_generation(
        model, _Tokenizer(), "abcde", max_new_tokens=4, methods=[method], exclude_self=False
    )
    default = explain_generation(model, _Tokenizer(), "abcde", max_new_tokens=4, methods=[method])
    ids = [int(i) for i in g.prompt_ids] + [int(i) for i in g.generated_ids]
    prompt = len(g.prompt_ids)
    assert g.scores[method].shape == (4, prompt + 3)
    for t in range(4):
        prefix = torch.tensor([ids[: prompt + t]])
        options = {} if method == "ifr" else {"target": ids[prompt + t]}
        expected = explain(model, {"input_ids": prefix}, method=method, rows=-1, **options)[0]
        np.testing.assert_allclose(g.scores[method][t, : prompt + t], expected.numpy(), atol=1e-12)
        assert not g.scores[method][t, prompt + t :].any()
        # By default the predicting position itself is left out (its own residual).
        assert default.scores[method][t, prompt + t - 1] == 0


def test_diagnose_reports_sinks_heads_and_methods(tmp_path: Any) -> None:
    """The report's reductions against the model's own attention and the explain() terms."""
    import attnflow
    from attnflow.adapters.torch import diagnose

    model = _llama(vocabulary=200)
    words: dict[str, int] = {}

    class WordTokenizer:
        """Words and punctuation, one id per distinct piece, with character offsets."""

        def __call__(self, text: str, return_offsets_mapping: bool = False) -> dict[str, Any]:
            import re

            spans = [m.span() for m in re.finditer(r"\w+|[^\w\s]", text)]
            ids = [words.setdefault(text[a:b], 2 + len(words)) for a, b in spans]
            return {"input_ids": ids, "offset_mapping": spans}

    report = diagnose(model, WordTokenizer(), items=2, methods=["rollout", "direct_logit"])
    layers, heads = 3, 4
    assert report.sink_mass.shape == report.output_share.shape == (layers, heads)
    assert report.rollout_first.shape == (layers,)
    np.testing.assert_allclose(report.output_share.sum(-1), 1.0)
    assert set(report.hit_rate) == {"rollout", "direct_logit"}
    assert 0 <= report.accuracy <= 1
    # The sink mass is the attention of the rows after the first to the first token.
    attentions = torch.softmax(torch.randn(layers, heads, 5, 5, dtype=torch.float64), -1)
    expected = attentions[..., 1:, 0].mean(-1)
    from attnflow.diagnosis import sink_mass

    torch.testing.assert_close(sink_mass(attentions), expected)
    assert "hit@1" in report.summary()
    page = report.to_html(tmp_path / "report.html")
    assert page.read_text().count("data:image/png;base64,") == 4
    with pytest.raises(FileExistsError):
        report.to_html(tmp_path / "report.html")
    assert attnflow  # the package stays importable next to the report


def test_the_diagnose_command_reports_smollm2(smollm2: Any, tmp_path: Any, capsys: Any) -> None:
    """``attnflow diagnose --model FOLDER``: the report of SmolLM2, its page, and refusals."""
    from llm_models import smollm2_folder

    from attnflow._cli import main

    page = tmp_path / "report.html"
    folder = str(smollm2_folder())
    assert main(["diagnose", "--model", folder, "--items", "2", "-o", str(page)]) == 0
    out = capsys.readouterr().out
    # Rollout never finds the copied word's source on SmolLM2; direct_logit does.
    assert "rollout 0.00" in out
    assert "direct_logit 1.00" in out
    assert page.read_text().count("data:image/png;base64,") == 4
    assert main(["diagnose", "--model", folder, "-o", str(page)]) == 2  # no --force
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["diagnose", "--model", folder, "--items", "0"]) == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_models_are_read_in_float32(dtype: str) -> None:
    """A bf16/fp16 model's rows, softmax and sums run in float32, close to the float32 model's."""
    model = _llama().float()
    half = _llama().float()
    half.load_state_dict(model.state_dict())
    half = half.to(getattr(torch, dtype))
    ids = {
        "input_ids": torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    }
    for method, options in (("direct_logit", {"target": 5}), ("ifr", {})):
        reference = explain(model, ids, method=method, rows=-1, **options)
        scores = explain(half, ids, method=method, rows=-1, **options)
        assert scores.dtype == torch.float32
        # The half model's own weights and hidden states are rounded: a few percent.
        torch.testing.assert_close(
            scores, reference, rtol=0, atol=0.05 * float(reference.abs().max())
        )
