"""Development run of the ground-truth variants (round 2 of the study): dev seeds only.

``python lab/protocols/_dev_gt2.py SEED ITEMS TASKS FOLDER`` scores every candidate variant
on ``ITEMS`` items per task of ``SEED`` (100 and 101 were used; never a report seed) and
writes ``FOLDER/dev-TASK-SEED.npz``; ``lab/protocols/_dev_gt2_analyse.py FOLDER 100,101``
prints the table of the study's data file (docs/_data/llm_ground_truth.md).

A record: it is written against attnflow as of commit 34f2e4c, whose ``attnflow.evaluate``
exported the task generators (``copying_task`` & co., ``locate_source``) and
``source_ranks``; they are private since, behind ``attnflow.evaluate.ground_truth``. Rerun
it with that commit installed; ``eval_llm_ground_truth.py`` is the current protocol.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _ragged(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def main() -> None:
    seed = int(sys.argv[1])
    count = int(sys.argv[2])
    tasks = sys.argv[3].split(",")
    out = Path(sys.argv[4])
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from llm_models import load_smollm2

    import attnflow
    from attnflow.adapters.torch import attention_gradients, capture
    from attnflow.evaluate import copying_task, locate_source, retrieval_task, stated_facts_task

    model, tokenizer = load_smollm2(attn_implementation="sdpa")
    config = model.config
    L, H, KV, D = (
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    o_weights = [
        layer.self_attn.o_proj.weight.detach().double().reshape(-1, H, D)
        for layer in model.model.layers
    ]  # (d, H, D)
    values: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda _m, _a, o: values.append(o.detach()))

    def tokenize(text):
        e = tokenizer(text, return_offsets_mapping=True)
        return e["input_ids"], e["offset_mapping"]

    def chat(message):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )

    sizes = {"copying": {"words": 12}, "retrieval": {"pairs": 5}, "stated_facts": {"facts": 2}}
    gens = {"copying": copying_task, "retrieval": retrieval_task, "stated_facts": stated_facts_task}
    for task in tasks:
        opts = dict(sizes[task])
        if task != "copying":
            opts["chat"] = chat
        items = [locate_source(i, tokenize) for i in gens[task](count, seed=seed, **opts)]
        store: dict[str, list] = {}
        correct, sources, contexts = [], [], []
        t0, c0 = time.perf_counter(), cpu()
        for item in items:
            ids = torch.as_tensor(item.ids[None])
            n = ids.shape[1]
            values.clear()
            with torch.no_grad(), capture(model) as rec:
                logits = model(ids).logits[0, -1]
            correct.append(int(logits.argmax()) == item.answer_id)
            sources.append(item.source)
            contexts.append(item.context)
            W = rec.attentions[0].double()  # (L, H, n, n)
            v = torch.stack(values)[:, 0].double().reshape(L, n, KV, D)
            v = v.repeat_interleave(H // KV, dim=2)  # (L, n, H, D)
            f = torch.einsum("lnhe,ldhe->lhnd", v, torch.stack(o_weights))  # (L, H, n, d)
            fnorm = f.norm(dim=-1)  # (L, H, n)
            row = W[:, :, -1, :]  # (L, H, n)
            res = {}
            res["max attention"] = row.amax((0, 1)).numpy()
            # per-head norm-based contribution of the explained row
            nh = row * fnorm  # (L, H, n)
            res["max norm contribution (head)"] = nh.amax((0, 1)).numpy()
            # per-layer summed (vector sum over heads) norm contributions: exact
            summed = torch.einsum("lhj,lhjd->ljd", row, f).norm(dim=-1)  # (L, n)
            res["norm row per layer"] = summed.numpy()
            res["max norm contribution (layer)"] = summed.amax(0).numpy()
            res["raw"] = row.mean(1).numpy()
            Wn = W.numpy()
            res["rollout"] = np.asarray(attnflow.rollout(Wn, rows=-1, layers="all"))
            for method in ("norm", "alti", "globenc"):
                with torch.no_grad(), capture(model, contributions=method) as rc:
                    model(ids)
                C = rc.contributions[0].double().numpy()  # (L, n, n)
                if method == "alti":
                    r = attnflow.rollout(
                        C, heads=None, residual=0.0, rows=-1, layers="all", renormalize=True
                    )
                elif method == "norm":
                    r = attnflow.rollout(
                        C, heads=None, residual=0.5, rows=-1, layers="all", renormalize=True
                    )
                    res["norm rollout (res 0)"] = np.asarray(
                        attnflow.rollout(
                            C, heads=None, residual=0.0, rows=-1, layers="all", renormalize=True
                        )
                    )
                else:
                    r = attnflow.rollout(
                        C, heads=None, residual=0.0, rows=-1, layers="all", renormalize=True
                    )
                res[f"{method} rollout"] = np.asarray(r)
                res[f"{method} matrix row"] = C[:, -1, :]
                if method == "alti":
                    res["alti flow"] = np.asarray(
                        attnflow.flow(
                            C, heads=None, residual=0.0, rows=-1, layers="all", renormalize=True
                        )
                    )
            answer = item.answer_id
            for tname, target in (
                ("logit", lambda o, a=answer: o.logits[0, -1, a]),
                ("logprob", lambda o, a=answer: torch.log_softmax(o.logits[0, -1], -1)[a]),
            ):
                w, g = attention_gradients(model, ids, target=target)
                w, g = w[0].double().numpy(), g[0].double().numpy()
                res[f"gae {tname}"] = np.asarray(
                    attnflow.gradient_rollout(w, g, rows=-1, layers="all")
                )
                cam = np.clip(g * w, 0, None).mean(1)  # (L, n, n)
                res[f"gradxattn sum {tname}"] = np.cumsum(cam[:, -1, :], 0)
                res[f"gradxattn max {tname}"] = cam[:, -1, :].max(0)
                res[f"gae rollout-normalised {tname}"] = np.asarray(
                    attnflow.rollout(
                        cam / np.maximum(cam.sum(-1, keepdims=True), 1e-30),
                        heads=None,
                        residual=0.5,
                        rows=-1,
                        layers="all",
                        validate=False,
                    )
                )
            for k, val in res.items():
                store.setdefault(k, []).append(np.atleast_2d(val))
        wall, c = time.perf_counter() - t0, cpu() - c0
        np.savez(
            out / f"dev-{task}-{seed}.npz",
            correct=np.array(correct),
            sources=np.array(sources),
            contexts=np.array(contexts),
            **{f"s/{k}": _ragged(v) for k, v in store.items()},
        )
        print(
            f"{task} seed {seed}: {len(items)} items, acc {np.mean(correct):.2f}, {wall:.0f} s wall {c:.0f} s cpu",
            flush=True,
        )


if __name__ == "__main__":
    main()
