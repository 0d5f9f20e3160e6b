r"""FlashTrace's IFR (PyPI ``flashtrace``, run unmodified) against attnflow's ``ifr`` and a NumPy oracle.

Research harness for issue 37 (not a test). It installs nothing: run it with ``flashtrace``
installed in the interpreter's environment (``pip install flashtrace``; its dependencies
keep the installed torch and transformers), from outside the checkout::

    PYTHONSAFEPATH=1 HF_HUB_OFFLINE=1 python lab/peers/compare_flashtrace.py --model llama
    PYTHONSAFEPATH=1 HF_HUB_OFFLINE=1 python lab/peers/compare_flashtrace.py --model smollm2

It builds a small random Llama or Qwen2 from a config in float64 (or loads SmolLM2 in
float64, eager attention), runs FlashTrace's span IFR (hop 0, ``compute_ifr_sentence_
aggregate``, what ``FlashTrace.trace(method="ifr-span")`` returns) on a prompt and a
target span, and prints the largest absolute difference of

* FlashTrace against the oracle of the formula in FlashTrace's own conventions (the
  RMSNorm's epsilon fixed at 1e-6, no value bias): what FlashTrace computes, up to its
  float32 arithmetic;
* FlashTrace against the exact oracle (the model's epsilon, the value bias): what its
  quirks cost on this model;
* attnflow's ``ifr`` against FlashTrace and the oracle, once ``method="ifr"`` exists in
  ``attnflow.adapters.torch.explain`` (otherwise it says so).

The oracle is an independent NumPy float64 transcription of the formula of
``/work/briefs/peers-spec.md`` §2: per layer, the span's wholes
:math:`y_S = \\sum_{t \\in S} y_t` (residual after attention) and residual part
:math:`r_S = \\sum_{t\\in S} x_t` (block input); the parts
:math:`z_{hj} = (\\sum_{t \\in S, j \\le t} A^h_{tj}) f^h(x_j)` with
:math:`f^h(x_j) = (\\mathrm{norm}(x_j) W_V^h [+ b_V^h]) W_O^h`; proximity
:math:`\\max(\\lVert y_S\\rVert_1 - \\lVert y_S - z\\rVert_1, 0)`; normalised over all parts
and the residual; summed over layers.
"""

# ruff: noqa: T201  (a lab script: it reports by printing)

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers


def random_model(arch: str, seed: int, layers: int) -> tuple[Any, None]:
    """Build a small random Llama or Qwen2 in float64 with eager attention (output_attentions)."""
    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,  # FlashTrace's fixed epsilon (spec §2.1 quirk 1)
        "tie_word_embeddings": False,
        "attn_implementation": "eager",
    }
    model: Any
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
        model = transformers.Qwen2ForCausalLM(config)
    model = model.to(torch.float64).eval()
    # Random inits leave the norms at one; give the gains some spread so they matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "norm.weight")):
                p.uniform_(0.5, 1.5)
            if name.endswith("v_proj.bias"):
                p.normal_(0.0, 0.1)
    return model, None


def smollm2() -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct in float64 with eager attention (tests/llm_models.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from llm_models import load_smollm2  # type: ignore[import-not-found]

    return load_smollm2(  # type: ignore[no-any-return]
        attn_implementation="eager", dtype=torch.float64
    )


def capture(model: Any, ids: torch.Tensor) -> dict[str, Any]:
    """Block inputs x, residuals after attention y and attention weights, by our own hooks."""
    layers = model.model.layers
    xs: list[np.ndarray] = [None] * len(layers)  # type: ignore[list-item]
    ys: list[np.ndarray] = [None] * len(layers)  # type: ignore[list-item]
    handles = []
    for i, layer in enumerate(layers):

        def pre_in(_mod: Any, args: Any, i: int = i) -> None:
            xs[i] = args[0][0].detach().double().numpy().copy()

        def pre_post(_mod: Any, args: Any, i: int = i) -> None:
            ys[i] = args[0][0].detach().double().numpy().copy()

        handles.append(layer.input_layernorm.register_forward_pre_hook(pre_in))
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(pre_post))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    attn = [a[0].detach().double().numpy() for a in out.attentions]
    return {"x": xs, "y": ys, "A": attn}


def oracle_ifr(
    model: Any,
    pieces: dict[str, Any],
    span: tuple[int, int],
    *,
    eps: float | None,
    value_bias: bool,
) -> np.ndarray:
    """``(layers, heads, n)`` IFR shares of each head and token at the span, float64.

    ``eps=None`` takes each RMSNorm's own epsilon; ``value_bias`` adds ``b_V``.
    """
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    s0, s1 = span
    rows = np.arange(s0, s1 + 1)
    out = []
    for li, layer in enumerate(model.model.layers):
        x, y, A = pieces["x"][li], pieces["y"][li], pieces["A"][li]
        n = x.shape[0]
        norm = layer.input_layernorm
        gamma = norm.weight.detach().double().numpy()
        e = norm.variance_epsilon if eps is None else eps
        xn = x * gamma / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + e)
        attn = layer.self_attn
        wv = attn.v_proj.weight.detach().double().numpy()  # (kv*dh, d)
        v = xn @ wv.T
        if value_bias and attn.v_proj.bias is not None:
            v = v + attn.v_proj.bias.detach().double().numpy()
        v = v.reshape(n, kv, dh)
        v = np.repeat(v, heads // kv, axis=1)  # query head h reads kv head h // group
        wo = attn.o_proj.weight.detach().double().numpy()  # (d, heads*dh)
        wo = wo.reshape(-1, heads, dh)  # (d, h, dh)
        f = np.einsum("jhz,dhz->hjd", v, wo)  # (h, n, d), no b_O
        causal = (np.arange(n)[None, :] <= rows[:, None]).astype(float)  # (|S|, n)
        alpha = (A[:, rows, :] * causal[None]).sum(axis=1)  # (h, n)
        z = alpha[..., None] * f
        yS, rS = y[rows].sum(0), x[rows].sum(0)
        whole = np.abs(yS).sum()
        prox = np.clip(whole - np.abs(z - yS).sum(-1), 0.0, None)  # (h, n)
        prox_res = max(whole - np.abs(rS - yS).sum(), 0.0)
        out.append(prox / (prox.sum() + prox_res + 1e-12))
    return np.stack(out)


def flashtrace_span(
    model: Any, ids: torch.Tensor, span: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run FlashTrace's capture and span aggregate: total ``(n,)``, per layer ``(L, n)``, ``(L, H)``."""
    from flashtrace.attribution import LLMIFRAttribution  # type: ignore[import-not-found]
    from flashtrace.core import (  # type: ignore[import-not-found]
        compute_ifr_sentence_aggregate,
    )

    # The engine's capture and parameters (attribution.py:990-1031), as calculate_ifr_span uses them.
    engine = LLMIFRAttribution(model, tokenizer=None, show_progress=False)
    mask = torch.ones_like(ids)
    cache, attentions, metadata, weight_pack = engine._capture_model_state(ids, mask)
    params = engine._build_ifr_params(metadata, int(ids.shape[1]))
    agg = compute_ifr_sentence_aggregate(
        sink_start=span[0],
        sink_end=span[1],
        cache=cache,
        attentions=attentions,
        weight_pack=weight_pack,
        params=params,
        renorm_threshold=0.0,
        rotary_emb=metadata.rotary_emb,
    )
    per_layer = np.stack([r.e_attn_tokens.double().numpy() for r in agg.per_layer])
    heads = np.stack([r.head_importance.double().numpy() for r in agg.per_layer])
    return agg.token_importance_total.double().numpy(), per_layer, heads


def flashtrace_rows(model: Any, ids: torch.Tensor, span: tuple[int, int]) -> np.ndarray:
    """Run FlashTrace's per-row IFR (``ifr-matrix``, ``compute_ifr_for_all_positions``): ``(r, n)``."""
    from flashtrace.attribution import LLMIFRAttribution
    from flashtrace.core import (
        compute_ifr_for_all_positions,
    )

    engine = LLMIFRAttribution(model, tokenizer=None, show_progress=False)
    cache, attentions, metadata, weight_pack = engine._capture_model_state(
        ids, torch.ones_like(ids)
    )
    params = engine._build_ifr_params(metadata, int(ids.shape[1]))
    every = compute_ifr_for_all_positions(
        cache=cache,
        attentions=attentions,
        weight_pack=weight_pack,
        params=params,
        renorm_threshold=0.0,
        sink_range=span,
        return_layerwise=False,
        rotary_emb=metadata.rotary_emb,
    )
    out: np.ndarray = every.token_importance_matrix.double().numpy()
    return out


def attnflow_rows(model: Any, ids: torch.Tensor, span: tuple[int, int]) -> np.ndarray | str:
    """Return attnflow's per-row ``ifr`` (``span=False``) at the span rows ``(r, n)``, or why not."""
    from attnflow.adapters.torch import explain  # type: ignore[import-not-found]

    rows = list(range(span[0], span[1] + 1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    try:
        scores = explain(model, inputs, method="ifr", rows=rows)
    except (ValueError, TypeError, NotImplementedError) as err:
        return f"attnflow's explain(method='ifr') per row not available: {str(err)[:200]}"
    out: np.ndarray = torch.as_tensor(scores).detach().double().cpu().numpy()
    return out.reshape(len(rows), int(ids.shape[1]))


def flashtrace_public(
    model: Any, tokenizer: Any, prompt: str, target: str
) -> tuple[np.ndarray, torch.Tensor, int]:
    """``FlashTrace(model, tokenizer).trace(method="ifr-span")``: prompt scores, the ids it ran, prompt length."""
    from flashtrace import FlashTrace  # type: ignore[import-not-found]

    tracer = FlashTrace(model, tokenizer)
    res = tracer.trace(prompt=prompt, target=target, method="ifr-span")
    p = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    g = tokenizer(
        target + (tokenizer.eos_token or ""), return_tensors="pt", add_special_tokens=False
    ).input_ids
    return np.asarray(res.scores, dtype=float), torch.cat([p, g], dim=1), int(p.shape[1])


def attnflow_ifr(
    model: Any, ids: torch.Tensor, span: tuple[int, int], heads: str = "sum"
) -> np.ndarray | str:
    """Return attnflow's span ``ifr`` per layer ``(L, n)``, or why it could not run.

    The lead's API (branch ``logit``): ``explain(model, inputs, method="ifr", rows=[...],
    span=True, layers="all")``; a single-row span is the same as ``rows=t``.
    """
    try:
        from attnflow.adapters.torch import explain
    except ImportError as err:  # pragma: no cover - environment
        return f"attnflow not importable: {err}"
    rows = list(range(span[0], span[1] + 1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    try:
        scores = explain(
            model, inputs, method="ifr", rows=rows, span=True, layers="all", heads=heads
        )
    except (ValueError, TypeError, NotImplementedError) as err:
        first = str(err).splitlines()[0][:200]
        return f"attnflow's explain(method='ifr', span=True) not available: {first}"
    s = getattr(scores, "scores", scores)
    out: np.ndarray = torch.as_tensor(s).detach().double().cpu().numpy()
    return out.reshape(-1, int(ids.shape[1])) if heads == "sum" else out


def report(name: str, a: np.ndarray, b: np.ndarray) -> float:
    """Print and return the largest absolute difference (inf if either is not finite)."""
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        print(f"  {name:58s} NOT FINITE")
        return float("inf")
    d = float(np.max(np.abs(a - b)))
    rel = d / max(float(np.max(np.abs(b))), 1e-300)
    print(f"  {name:58s} max|diff| = {d:.3e}  (relative to max {rel:.1e})")
    return d


def main(argv: list[str] | None = None) -> int:
    """Compare; exit status 1 if FlashTrace and the oracle differ by 1e-5 or more."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("llama", "qwen2", "smollm2"), default="llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--n", type=int, default=16, help="sequence length (random models)")
    ap.add_argument(
        "--span",
        type=int,
        nargs=2,
        default=None,
        help="inclusive absolute span (default: the last three positions)",
    )
    ap.add_argument("--prompt", default="Alice gave the book to Bob. Then Bob gave the book to")
    ap.add_argument("--target", default=" Alice")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    if args.model == "smollm2":
        model, tok = smollm2()
        print(f"SmolLM2-135M float64, rms_norm_eps={model.config.rms_norm_eps}")
        public, ids, plen = flashtrace_public(model, tok, args.prompt, args.target)
        span = (plen, int(ids.shape[1]) - 1)  # ifr-span's default: the whole target incl. EOS
    else:
        model, _ = random_model(args.model, args.seed, args.layers)
        print(
            f"random {args.model}, float64, {args.layers} layers, rms_norm_eps={model.config.rms_norm_eps}"
        )
        g = torch.Generator().manual_seed(args.seed + 1)
        ids = torch.randint(0, model.config.vocab_size, (1, args.n), generator=g)
        span = tuple(args.span) if args.span else (args.n - 3, args.n - 1)
        public, plen = None, None
    n = int(ids.shape[1])
    print(f"n={n}, span={span}")

    total, per_layer, heads = flashtrace_span(model, ids, span)
    pieces = capture(model, ids)
    ft_style = oracle_ifr(model, pieces, span, eps=1e-6, value_bias=False)
    exact = oracle_ifr(model, pieces, span, eps=None, value_bias=True)
    print("FlashTrace (float32 inside) vs the NumPy float64 oracle:")
    worst = report(
        "per layer e_l[j], FT conventions (eps 1e-6, no b_V)", per_layer, ft_style.sum(1)
    )
    worst = max(worst, report("per layer head totals, FT conventions", heads, ft_style.sum(2)))
    worst = max(
        worst, report("layer sum (the scores), FT conventions", total, ft_style.sum((0, 1)))
    )
    report("layer sum, exact (model's eps, b_V)", total, exact.sum((0, 1)))
    if public is not None:
        report("FlashTrace.trace(ifr-span) prompt scores vs core total", public, total[:plen])
    got = attnflow_ifr(model, ids, span)
    if isinstance(got, str):
        print("attnflow:", got)
    else:
        print("attnflow's ifr (span=True):")
        report("layer sum vs FlashTrace", got.sum(0), total)
        report("per layer vs FlashTrace", got, per_layer)
        report("layer sum vs oracle (exact: model's eps, b_V)", got.sum(0), exact.sum((0, 1)))
        report("per layer vs oracle (exact)", got, exact.sum(1))
        report("layer sum vs oracle (FT conventions)", got.sum(0), ft_style.sum((0, 1)))
        each = attnflow_ifr(model, ids, span, heads="each")
        if not isinstance(each, str):
            h = int(model.config.num_attention_heads)
            each = each.reshape(-1, h, n)
            report("heads='each' (L, H, n) vs oracle (exact)", each, exact)
            report(
                "heads='each' summed over tokens vs FlashTrace's head totals", each.sum(-1), heads
            )
    # Per row (|S| = 1 each): FlashTrace's ifr-matrix against the oracle row by row and attnflow.
    by_row = flashtrace_rows(model, ids, span)
    rows_oracle = np.stack(
        [
            oracle_ifr(model, pieces, (t, t), eps=1e-6, value_bias=False).sum((0, 1))
            for t in range(span[0], span[1] + 1)
        ]
    )
    print("per row (ifr-matrix):")
    worst = max(worst, report("FlashTrace vs oracle, FT conventions", by_row, rows_oracle))
    rows_got = attnflow_rows(model, ids, span)
    if isinstance(rows_got, str):
        print("attnflow:", rows_got)
    else:
        report("attnflow ifr (rows, span=False) vs FlashTrace", rows_got, by_row)
    top = np.argsort(-ft_style.sum((0, 1)))[:5]
    print("top tokens (oracle, FT conventions):", top.tolist())
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
