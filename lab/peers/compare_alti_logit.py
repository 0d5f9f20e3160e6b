r"""mt-upc/logit-explanations (ALTI-Logit, Logit; run unmodified) against attnflow and a NumPy oracle.

Research harness for issue 37 (not a test). The authors' code is imported at run time from a
checkout given by ``--repo`` (never copied into attnflow)::

    git -C /work/.mirror/mt-upc+logit-explanations/repo archive fadf415 \
        src extract_explanations.py lm_saliency.py | tar -x -C /tmp/logit-explanations
    pip install pyaml_env        # src/contributions.py reads src/config.yaml with it
    PYTHONSAFEPATH=1 python lab/peers/compare_alti_logit.py --repo /tmp/logit-explanations

Their modules import packages that the ALTI-Logit path never calls (``captum``'s
visualisation, ``ipywidgets``, ``python-dotenv``, and ``lm_saliency``, the gradient and
erasure baselines, which needs transformers 4's ``WEIGHTS_NAME``). Where one is missing, an
empty stand-in module is registered so that the import succeeds; a call into one would
fail loudly. Their functions run as they are.

It builds a small random GPT-2 from a config in float64 (``torch.set_default_dtype``: their
``normalize_contributions`` allocates its output in the default dtype), runs their pipeline
as ``extract_explanations.main`` does for ``--explanation_type ours`` (``ModelWrapper``,
``get_logit_contributions`` with ``[target, foil]``, ``compute_alti``,
``track2input_tokens``, the contrastive layer sum) and compares, per layer and summed:

* their ``logit_aff_x_j`` and ``logit_aff_x_j_alti`` with an independent NumPy float64
  oracle of ``/work/briefs/peers-spec.md`` §1;
* attnflow's ``direct_logit`` / ``alti_logit`` (``explain(..., target=w) - explain(...,
  target=foil)`` at the last row), once they exist in ``attnflow.adapters.torch.explain``.
"""

# ruff: noqa: T201  (a lab script: it reports by printing)

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers


def _stand_in(name: str, **attrs: Any) -> None:
    """Register an empty module `name` (and its parents) unless it can be imported."""
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        return
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            sys.modules[sub] = types.ModuleType(sub)
        if i > 1:
            setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], sys.modules[sub])
    for k, v in attrs.items():
        setattr(sys.modules[name], k, v)


def _unused(*_: Any, **__: Any) -> Any:
    msg = "a stand-in for a package the ALTI-Logit path does not use was called"
    raise RuntimeError(msg)


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def load_authors(repo: Path) -> tuple[Any, Any, Any]:
    """(ModelWrapper, utils_contributions, extract_explanations) from the authors' checkout."""
    if not (repo / "src" / "contributions.py").is_file():
        msg = f"--repo {repo}: no src/contributions.py there (see this file's docstring)"
        raise SystemExit(msg)
    _stand_in("captum.attr", visualization=types.SimpleNamespace(VisualizationDataRecord=_unused))
    _stand_in("ipywidgets", IntProgress=_unused)
    _stand_in("dotenv", load_dotenv=lambda *_, **__: None)
    _stand_in("lm_saliency")  # the baselines module; `from lm_saliency import *` imports nothing
    sys.path.insert(0, str(repo))
    with _cwd(repo):  # src/contributions.py reads ./src/config.yaml at import
        contributions = importlib.import_module("src.contributions")
        utils = importlib.import_module("src.utils_contributions")
        extract = importlib.import_module("extract_explanations")
    return contributions.ModelWrapper, utils, extract


def random_gpt2(seed: int, layers: int, d: int = 64) -> Any:
    """Build a small random GPT-2 in float64, eager attention, with spread norms and biases."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(  # type: ignore[call-arg]
        vocab_size=96,
        n_positions=64,
        n_embd=d,
        n_layer=layers,
        n_head=4,
        attn_implementation="eager",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model: Any = transformers.GPT2LMHeadModel(config)
    model = model.to(torch.float64).eval()
    with torch.no_grad():  # spread the norms' gains and biases, and the linear biases
        for name, p in model.named_parameters():
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith(
                ("ln_1.bias", "ln_2.bias", "ln_f.bias", "c_attn.bias", "c_proj.bias")
            ):
                p.normal_(0.0, 0.02)  # GPT-2's init scale: larger b_O empties ALTI rows (0/0)
    return model


def authors_scores(
    wrapper_cls: Any,
    utils: Any,
    extract: Any,
    model: Any,
    ids: torch.Tensor,
    target: int,
    foil: int,
) -> dict[str, np.ndarray]:
    """Run what extract_explanations.main stores for one sentence (E:185-209), per layer ``(L, n)``."""
    wrapped = wrapper_cls(model)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    logits, hidden_states, attentions = wrapped(batch)
    token = [target, foil]
    logit_trans_vect_dict, logits_modules, layer_alti_data = wrapped.get_logit_contributions(
        hidden_states, attentions, token
    )
    contributions_mix_alti = utils.compute_alti(layer_alti_data)
    alti_lg_dict = extract.track2input_tokens(
        logit_trans_vect_dict, ["aff_x_j"], contributions_mix_alti, token
    )
    out: dict[str, np.ndarray] = {}
    for method in extract.our_methods:  # ['logit_aff_x_j', 'logit_aff_x_j_alti']
        out[method] = (alti_lg_dict[method][0] - alti_lg_dict[method][1]).double().numpy()
    # The head-resolved Logit terms the paper computes but does not use (C:303-307):
    # (L, H, t, vocab=[w, foil], n) -> (L, H, n) at the last row.
    heads = logit_trans_vect_dict["aff_x_j_h"][:, :, -1]
    out["logit_aff_x_j_h"] = (heads[:, :, 0] - heads[:, :, 1]).double().numpy()
    out["init_logit"] = np.asarray(
        float(logits_modules["init_logit"][0] - logits_modules["init_logit"][1])
    )
    out["logit_diff"] = np.asarray(float(logits[0, -1, target] - logits[0, -1, foil]))
    return out


def capture(model: Any, ids: torch.Tensor) -> dict[str, Any]:
    """Block inputs, attention-sublayer outputs + residual, final residual, attention: own hooks."""
    blocks = model.transformer.h
    x: list[np.ndarray] = [None] * len(blocks)  # type: ignore[list-item]
    mid: list[np.ndarray] = [None] * len(blocks)  # type: ignore[list-item]
    mlp: list[np.ndarray] = [None] * len(blocks)  # type: ignore[list-item]
    final: list[np.ndarray] = [None]  # type: ignore[list-item]
    hs = []
    for i, b in enumerate(blocks):
        hs.append(
            b.ln_1.register_forward_pre_hook(
                lambda _m, a, i=i: x.__setitem__(i, a[0][0].double().numpy().copy())
            )
        )
        hs.append(
            b.ln_2.register_forward_pre_hook(
                lambda _m, a, i=i: mid.__setitem__(i, a[0][0].double().numpy().copy())
            )
        )
        hs.append(
            b.mlp.register_forward_hook(
                lambda _m, _a, o, i=i: mlp.__setitem__(i, o[0].double().numpy().copy())
            )
        )
    hs.append(
        model.transformer.ln_f.register_forward_pre_hook(
            lambda _m, a: final.__setitem__(0, a[0][0].double().numpy().copy())
        )
    )
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
    finally:
        for h in hs:
            h.remove()
    return {
        "x": x,
        "mid": mid,
        "mlp": mlp,
        "final": final[0],
        "A": [a[0].double().numpy() for a in out.attentions],
        "logits": out.logits[0].double().numpy(),
    }


#: The eps that ``torch.nn.functional.pairwise_distance`` adds to every coordinate difference.
PAIRWISE_EPS = 1e-6


def _ln(v: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = v.mean(-1, keepdims=True)
    out: np.ndarray = (v - mu) / np.sqrt(((v - mu) ** 2).mean(-1, keepdims=True) + eps) * g + b
    return out


def oracle(
    model: Any, p: dict[str, Any], target: int, foil: int, *, pairwise_eps: float = PAIRWISE_EPS
) -> dict[str, np.ndarray]:
    """Spec §1.4: per-layer Logit and ALTI-Logit scores ``(L, n)`` for w - foil at the last row.

    ``pairwise_eps=0`` gives ALTI's exact Manhattan distance (the authors' code adds 1e-6).
    """
    t = p["x"][0].shape[0] - 1
    lnf = model.transformer.ln_f
    gf = lnf.weight.detach().double().numpy()
    WU = model.lm_head.weight.detach().double().numpy()
    xl = p["final"][t]
    sig = np.sqrt(((xl - xl.mean()) ** 2).mean() + lnf.eps)
    u = gf * (WU[target] - WU[foil])
    u = (u - u.mean()) / sig
    H = model.config.n_head
    d = model.config.n_embd
    dh = d // H
    logit, alti, R = [], [], None
    identity_parts = []
    for li, blk in enumerate(model.transformer.h):
        x, A = p["x"][li], p["A"][li]
        n = x.shape[0]
        xn = _ln(
            x,
            blk.ln_1.weight.detach().double().numpy(),
            blk.ln_1.bias.detach().double().numpy(),
            blk.ln_1.eps,
        )
        Wqkv = blk.attn.c_attn.weight.detach().double().numpy()  # (d, 3d), x @ W
        bqkv = blk.attn.c_attn.bias.detach().double().numpy()
        WV, bV = Wqkv[:, 2 * d :], bqkv[2 * d :]
        WO = blk.attn.c_proj.weight.detach().double().numpy()  # (d, d), ctx @ W
        bO = blk.attn.c_proj.bias.detach().double().numpy()
        f = (xn @ WV + bV).reshape(n, H, dh)
        g = np.einsum("jhz,hzd->hjd", f, WO.reshape(H, dh, d))  # (H, n, d) head outputs
        D = (A[:, t, :] * (g @ u)).sum(0)  # (n,)
        T = np.einsum("hrj,hjd->rjd", A, g)  # (r, n, d)
        T[np.arange(n), np.arange(n)] += x
        y = T.sum(1) + bO
        assert np.allclose(y, p["mid"][li], atol=1e-10), "attention decomposition"
        # torch.nn.functional.pairwise_distance(a, b, p=1) is ||a - b + eps||_1, eps = 1e-6 (C:337)
        dist = np.abs(T - y[:, None, :] + pairwise_eps).sum(-1)
        C = np.clip(np.abs(y).sum(-1)[:, None] - dist, 0.0, None)
        C = C / C.sum(1, keepdims=True)
        logit.append(D)
        alti.append(D if li == 0 else D @ R)
        R = C if li == 0 else C @ R
        identity_parts.append(D.sum() + bO @ u + p["mlp"][li][t] @ u)
    # The decomposition identity (spec §1.3) on the contrast: beta_f cancels in w - foil.
    logit_diff = p["logits"][t, target] - p["logits"][t, foil]
    embed = p["x"][0][t] @ u
    lhs = embed + lnf.bias.detach().double().numpy() @ (WU[target] - WU[foil]) + sum(identity_parts)
    return {
        "logit_aff_x_j": np.stack(logit),
        "logit_aff_x_j_alti": np.stack(alti),
        "identity_gap": np.asarray(lhs - logit_diff),
        "init_logit": np.asarray(embed),
    }


def attnflow_scores(
    model: Any, ids: torch.Tensor, target: int, foil: int
) -> dict[str, np.ndarray] | str:
    """Return attnflow's direct_logit / alti_logit contrasts ``(L, n)`` at the last row, or why not.

    The lead's API (branch ``logit``): ``explain(model, inputs, method=..., rows=n - 1,
    target=w, foil=f, layers="all")``.
    """
    try:
        from attnflow.adapters.torch import explain  # type: ignore[import-not-found]
    except ImportError as err:  # pragma: no cover
        return f"attnflow not importable: {err}"
    out: dict[str, np.ndarray] = {}
    row = int(ids.shape[1]) - 1
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for ours, theirs in (("direct_logit", "logit_aff_x_j"), ("alti_logit", "logit_aff_x_j_alti")):
        try:
            got = explain(
                model, inputs, method=ours, rows=row, target=target, foil=foil, layers="all"
            )
        except (ValueError, TypeError, NotImplementedError) as err:
            first = str(err).splitlines()[0][:200]
            return f"attnflow's explain(method={ours!r}) not available: {first}"
        got = getattr(got, "scores", got)
        out[theirs] = torch.as_tensor(got).detach().double().cpu().numpy().reshape(-1, row + 1)
    try:
        got = explain(
            model,
            inputs,
            method="direct_logit",
            rows=row,
            target=target,
            foil=foil,
            layers="all",
            heads="each",
        )
    except (ValueError, TypeError, NotImplementedError) as err:
        return f"attnflow's direct_logit heads='each' not available: {str(err)[:200]}"
    got = getattr(got, "scores", got)
    heads = int(model.config.n_head)
    out["logit_aff_x_j_h"] = (
        torch.as_tensor(got).detach().double().cpu().numpy().reshape(-1, heads, row + 1)
    )
    return out


def report(name: str, a: np.ndarray, b: np.ndarray) -> float:
    """Print and return the largest absolute difference (inf if either is not finite)."""
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        print(f"  {name:60s} NOT FINITE (an ALTI row whose shares all clip to 0 divides 0 by 0)")
        return float("inf")
    diff = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    print(f"  {name:60s} max|diff| = {diff:.3e}  (scale {float(np.max(np.abs(b))):.2e})")
    return diff


def main(argv: list[str] | None = None) -> int:
    """Compare; exit status 1 if the authors' code and the oracle differ by 1e-9 or more."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--repo", type=Path, required=True, help="checkout of mt-upc/logit-explanations"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--d", type=int, default=64, help="hidden size (4 heads)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    wrapper_cls, utils, extract = load_authors(args.repo.resolve())
    model = random_gpt2(args.seed, args.layers, args.d)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, args.n), generator=g)
    target, foil = 5, 17
    print(
        f"random GPT-2, float64, {args.layers} layers, d={args.d}, n={args.n}, w={target}, foil={foil}"
    )
    theirs = authors_scores(wrapper_cls, utils, extract, model, ids, target, foil)
    pieces = capture(model, ids)
    mine = oracle(model, pieces, target, foil)
    exact = oracle(model, pieces, target, foil, pairwise_eps=0.0)
    print("the authors' code vs the NumPy float64 oracle (contrast w - foil, last row):")
    worst = 0.0
    for k in ("logit_aff_x_j", "logit_aff_x_j_alti"):
        worst = max(worst, report(f"{k} per layer (L, n)", theirs[k], mine[k]))
        worst = max(
            worst, report(f"{k} layer sum (the explanation)", theirs[k].sum(0), mine[k].sum(0))
        )
    report(
        "ALTI-Logit layer sum, exact L1 distance (no 1e-6 eps)",
        theirs["logit_aff_x_j_alti"].sum(0),
        exact["logit_aff_x_j_alti"].sum(0),
    )
    worst = max(
        worst,
        report(
            "init_logit (embedding term, evaluation only)", theirs["init_logit"], mine["init_logit"]
        ),
    )
    print(
        f"  decomposition identity gap (oracle): {float(mine['identity_gap']):.3e}; "
        f"logit diff {float(theirs['logit_diff']):.4f}"
    )
    got = attnflow_scores(model, ids, target, foil)
    if isinstance(got, str):
        print("attnflow:", got)
    else:
        print("attnflow (explain(..., target, foil, layers='all')):")
        for k, v in got.items():
            report(f"vs authors: {k} per layer", v, theirs[k])
            report(f"vs authors: {k} layer sum", v.sum(0), theirs[k].sum(0))
            if k in exact:
                report(
                    f"vs oracle without the pairwise eps: {k} layer sum", v.sum(0), exact[k].sum(0)
                )
    return 0 if worst < 1e-9 else 1


if __name__ == "__main__":
    raise SystemExit(main())
