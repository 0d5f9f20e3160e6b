"""Encoder-decoder flow on flow's engine against the igraph engine it replaced, same run.

What is measured
----------------
``attnflow.encoder_decoder_flow(encoder, decoder, cross, normalize=False, n_jobs=1)`` on
encoder-decoder shapes of translation models, CPU seconds (:func:`time.process_time`) and
wall seconds, against the engine it had before issue 25 (item 3): one igraph graph per
sequence, ``Graph.maxflow_value`` for every (decoder position, token) pair, serially
(`igraph_engine` below, the code of that engine, fed the same head-fused attention; the
library's checks are timed in the new engine's call only). The two must agree to 1e-12. Also ``n_jobs=2`` (wall), and the cost model's estimate
(``FlowCost.estimated_seconds``, what ``max_seconds`` is compared with) against the
measured CPU time.

The attention is synthetic but shaped like a trained model's: softmax of
``N(0, 1) * 3`` logits, plus 3 on the first key (an ``<s>``/``</s>`` sink) and 2 on the
diagonal of the self-attention families; the decoder is causal. Shapes (``L_e = L_d``,
heads, ``S``, ``T``, decoder rows, reported layers):

- Marian / T5-small: 6 layers, 8 heads, ``S = T = 32``, every row, last layer;
- BART-base: 6 layers, 12 heads, ``S = T = 48``, every row, last layer;
- BART-base: 6 layers, 12 heads, ``S = T = 48``, the last row, every layer;
- BART-base, long: ``S = T = 128``, every row (igraph takes minutes; ``--quick`` skips it).

How to run
----------
With attnflow built::

    python benchmarks/scripts/bench_encoder_decoder_flow.py            # all cases
    python benchmarks/scripts/bench_encoder_decoder_flow.py --quick    # the first three cases
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

import attnflow
import attnflow._encoder_decoder_flow as ed_flow

CASES: list[dict[str, Any]] = [
    {"name": "Marian/T5-small, all rows", "L": 6, "H": 8, "S": 32, "T": 32, "rows": None},
    {"name": "BART-base, all rows", "L": 6, "H": 12, "S": 48, "T": 48, "rows": None},
    {
        "name": "BART-base, last row, all layers",
        "L": 6,
        "H": 12,
        "S": 48,
        "T": 48,
        "rows": -1,
        "layers": "all",
    },
    {
        "name": "BART-base long, all rows",
        "L": 6,
        "H": 12,
        "S": 128,
        "T": 128,
        "rows": None,
    },
]


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.asarray(shifted / shifted.sum(axis=-1, keepdims=True))


def attention(case: dict[str, Any], seed: int = 0) -> tuple[np.ndarray, ...]:
    """Synthetic encoder, decoder and cross attention of one sequence (see the module doc)."""
    rng = np.random.default_rng(seed)
    n_layers, heads, n_src, n_tgt = case["L"], case["H"], case["S"], case["T"]

    def family(queries: int, keys: int, *, diagonal: bool, causal: bool) -> np.ndarray:
        logits = 3.0 * rng.normal(size=(n_layers, heads, queries, keys))
        logits[..., 0] += 3.0
        if diagonal:
            logits += 2.0 * np.eye(queries, keys)
        if causal:
            logits = np.where(np.tril(np.ones((queries, keys), bool)), logits, -np.inf)
        return _softmax(logits)

    encoder = family(n_src, n_src, diagonal=True, causal=False)
    decoder = family(n_tgt, n_tgt, diagonal=True, causal=True)
    cross = family(n_tgt, n_src, diagonal=False, causal=False)
    return encoder, decoder, cross


def igraph_engine(
    encoder: np.ndarray,
    decoder: np.ndarray,
    cross: np.ndarray,
    *,
    alpha: float,
    rows: list[int],
    reported: list[int],
) -> tuple[np.ndarray, np.ndarray]:
    """Raw flows ``(layers, rows, S)`` and ``(layers, rows, T)`` by the engine before 25.3.

    One igraph graph of the (not layered) encoder-decoder graph, zero capacities left
    out, and ``maxflow_value`` for every pair: the code of ``_SequenceGraph``, unmasked.
    """
    import igraph

    n_enc, n_src = encoder.shape[0], encoder.shape[-1]
    n_dec, n_tgt = decoder.shape[0], decoder.shape[-1]
    decoder_offset = (n_enc + 1) * n_src
    encoder_top = n_enc * n_src
    tails, heads, capacities = [], [], []

    def add(matrix: np.ndarray, tail_offset: int, head_offset: int) -> None:
        r, c = np.nonzero(matrix)
        tails.append(tail_offset + r)
        heads.append(head_offset + c)
        capacities.append(matrix[r, c])

    for k in range(n_enc):
        add((1.0 - alpha) * encoder[k] + alpha * np.eye(n_src), (k + 1) * n_src, k * n_src)
    for layer in range(n_dec):
        upper = decoder_offset + (layer + 1) * n_tgt
        add(alpha * ((1.0 - alpha) * decoder[layer] + alpha * np.eye(n_tgt)), upper, upper - n_tgt)
        add((1.0 - alpha) * cross[layer], upper, encoder_top)
    edges = np.stack([np.concatenate(tails), np.concatenate(heads)], axis=1)
    graph = igraph.Graph(
        n=decoder_offset + (n_dec + 1) * n_tgt, edges=edges.tolist(), directed=True
    )
    capacity = np.concatenate(capacities).tolist()
    source = np.zeros((len(reported), len(rows), n_src))
    target = np.zeros((len(reported), len(rows), n_tgt))
    for slot, layer in enumerate(reported):
        for position, row in enumerate(rows):
            node = decoder_offset + (layer + 1) * n_tgt + row
            for s in range(n_src):
                source[slot, position, s] = graph.maxflow_value(node, s, capacity=capacity)
            for u in range(n_tgt):
                target[slot, position, u] = graph.maxflow_value(
                    node, decoder_offset + u, capacity=capacity
                )
    return source, target


def _timed(function: Any) -> tuple[Any, float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = function()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def run(case: dict[str, Any]) -> None:
    arrays = attention(case)
    rows, layers = case["rows"], case.get("layers", "last")
    options = {"rows": rows, "layers": layers, "normalize": False, "max_seconds": None}
    new, new_cpu, new_wall = _timed(
        lambda: attnflow.encoder_decoder_flow(*arrays, n_jobs=1, **options)
    )
    _, _, two_wall = _timed(lambda: attnflow.encoder_decoder_flow(*arrays, n_jobs=2, **options))
    n_dec, n_tgt = case["L"], case["T"]
    wanted = list(range(n_tgt)) if rows is None else [rows % n_tgt]
    reported = list(range(n_dec)) if layers == "all" else [n_dec - 1]
    shape = ed_flow._Shape(case["L"], case["S"], n_tgt, case["H"])
    real_s, real_t = np.ones((case["S"],), bool), np.ones((n_tgt,), bool)
    estimate = ed_flow._cost(shape, reported, wanted, real_s, real_t)
    line = (
        f"{case['name']:<34} {estimate.max_flows:>7,} max-flows | new: CPU {new_cpu:7.3f} s, "
        f"wall {new_wall:7.3f} s, n_jobs=2 wall {two_wall:7.3f} s | estimate "
        f"{estimate.estimated_seconds:7.3f} s ({estimate.estimated_seconds / new_cpu:.2f}x)"
    )

    def before() -> tuple[np.ndarray, np.ndarray]:
        # Heads fused by the mean (no mask: the library's fusion), then the old engine;
        # the library's checks are not timed here, so the ratio favours the baseline.
        fused = [a.mean(axis=1) for a in arrays]
        return igraph_engine(*fused, alpha=0.5, rows=wanted, reported=reported)

    (old_s, old_t), old_cpu, old_wall = _timed(before)
    got_s, got_t = (np.asarray(x) for x in new)
    if layers != "all":
        old_s, old_t = old_s[0], old_t[0]
    if isinstance(rows, int):
        old_s, old_t = old_s[..., 0, :], old_t[..., 0, :]
    error = max(np.abs(got_s - old_s).max(), np.abs(got_t - old_t).max())
    line += (
        f" | igraph: CPU {old_cpu:7.3f} s, wall {old_wall:7.3f} s | CPU ratio "
        f"{old_cpu / new_cpu:6.1f}x | max |diff| {error:.1e}"
    )
    assert error <= 1e-12, error
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="the first three cases")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cores", flush=True)
    # One small call first: one-time costs (lazy imports, the first thread pool) are not
    # the engine's.
    small = {"name": "warm-up", "L": 3, "H": 2, "S": 6, "T": 5, "rows": None}
    attnflow.encoder_decoder_flow(*attention(small), n_jobs=2)
    igraph_engine(*(a.mean(axis=1) for a in attention(small)), alpha=0.5, rows=[0], reported=[2])
    for case in CASES[:3] if args.quick else CASES:
        run(case)
    print(f"load average {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
