"""An independent NumPy float64 oracle of the paper's formulas.

Written for clarity, not speed: explicit loops over batch items and layers, full matrix
products, masks applied by cropping the sequence and padding the result back. It shares
no code with attnflow. Abnar & Zuidema (2020), "Quantifying Attention Flow in
Transformers", §3; DESIGN.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "oracle_flow",
    "oracle_fuse",
    "oracle_gradient_rollout",
    "oracle_raw",
    "oracle_rollout",
    "softmax_attention",
]


def softmax_attention(
    rng: np.random.Generator, shape: tuple[int, ...], *, scale: float = 3.0
) -> np.ndarray:
    """Random row-stochastic attention: a softmax of Gaussian logits over the last axis."""
    logits = rng.normal(scale=scale, size=shape)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def _renormalise(matrix: np.ndarray) -> np.ndarray:
    out = np.zeros_like(matrix)
    for i in range(matrix.shape[0]):
        total = matrix[i].sum()
        out[i] = matrix[i] / total if total > 0 else np.eye(matrix.shape[0])[i]
    return out


def oracle_fuse(heads_of_layer: np.ndarray, heads: object) -> np.ndarray:
    """Fuse one layer's heads ``(H, n, n)`` into ``(n, n)``."""
    if heads is None:
        return heads_of_layer
    if isinstance(heads, str) and heads == "mean":
        return heads_of_layer.sum(axis=0) / heads_of_layer.shape[0]
    if isinstance(heads, str) and heads == "max":
        return _renormalise(heads_of_layer.max(axis=0))
    if isinstance(heads, str) and heads == "min":
        return _renormalise(heads_of_layer.min(axis=0))
    weights = np.asarray(heads, dtype=np.float64)
    fused = sum(w * h for w, h in zip(weights, heads_of_layer, strict=True))
    return fused / weights.sum()


def _layer_matrices(
    item: np.ndarray, heads: object, keep: np.ndarray, *, masked: bool
) -> list[np.ndarray]:
    """Per-layer fused attention of one cropped item."""
    matrices = []
    for layer_index, layer in enumerate(item):
        layer_heads = heads
        if heads is not None and not isinstance(heads, str):
            weights = np.asarray(heads, dtype=np.float64)
            layer_heads = weights[layer_index] if weights.ndim == 2 else weights
        cropped = layer[..., keep, :][..., keep]
        if masked:  # rows renormalised over the real keys of the cropped sequence
            if heads is None:
                cropped = _renormalise(cropped)
            else:
                cropped = np.stack([_renormalise(h) for h in cropped])
        matrices.append(oracle_fuse(cropped, layer_heads))
    return matrices


def _per_item(
    attentions: np.ndarray,
    mask: np.ndarray | None,
    fused_input: bool,
    compute: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> np.ndarray:
    """Apply `compute(item, keep)` -> ``(L, n_kept, n_kept)`` per batch item, pad back."""
    core = 3 if fused_input else 4
    batch_shape = attentions.shape[:-core]
    n_layers, n = attentions.shape[-core], attentions.shape[-1]
    out = np.zeros((*batch_shape, n_layers, n, n))
    for index in np.ndindex(*batch_shape):
        keep = np.ones(n, dtype=bool) if mask is None else mask[index]
        kept = np.flatnonzero(keep)
        per_layer = compute(attentions[index].astype(np.float64), keep)
        for layer in range(n_layers):
            out[(*index, layer, *np.ix_(kept, kept))] = per_layer[layer]
    return out


def _select(per_layer: np.ndarray, rows: int | Sequence[int] | None, layers: object) -> np.ndarray:
    if layers == "last":
        chosen = per_layer[..., -1, :, :]
    elif layers == "all":
        chosen = per_layer
    else:
        chosen = per_layer[..., layers, :, :]
    if rows is None:
        return chosen
    if isinstance(rows, int):
        return chosen[..., rows, :]
    return chosen[..., list(rows), :]


def oracle_rollout(
    attentions: np.ndarray,
    *,
    heads: object = "mean",
    residual: float = 0.5,
    rows: int | Sequence[int] | None = None,
    layers: object = "last",
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """Rollout ``R_l = Ã_l ... Ã_1`` with ``Ã = (1 - a) A + a I`` (full products)."""
    fused_input = heads is None

    def compute(item: np.ndarray, keep: np.ndarray) -> np.ndarray:
        matrices = _layer_matrices(item, heads, keep, masked=mask is not None)
        size = int(keep.sum())
        product = np.eye(size)
        products = []
        for matrix in matrices:
            mixed = (1 - residual) * matrix + residual * np.eye(size)
            product = mixed @ product
            products.append(product)
        return np.stack(products)

    per_layer = _per_item(attentions, mask, fused_input, compute)
    return _select(per_layer, rows, layers)


def oracle_raw(
    attentions: np.ndarray,
    *,
    heads: object = "mean",
    rows: int | Sequence[int] | None = None,
    layers: object = "last",
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """The fused attention of each layer."""
    per_layer = _per_item(
        attentions,
        mask,
        heads is None,
        lambda item, keep: np.stack(_layer_matrices(item, heads, keep, masked=mask is not None)),
    )
    return _select(per_layer, rows, layers)


def oracle_flow(
    attentions: np.ndarray,
    *,
    heads: object = "mean",
    residual: float = 0.5,
    rows: int | Sequence[int] | None = None,
    layers: object = "last",
    mask: np.ndarray | None = None,
    normalize: bool = True,
) -> np.ndarray:
    """Attention flow the paper's way: networkx Edmonds-Karp per pair on the full graph.

    The whole layered graph ((L+1)·n nodes, every layer and every input token) is built
    as the paper's code builds it, and one max-flow is run per (output node, input node).
    """
    import networkx as nx
    from networkx.algorithms.flow import edmonds_karp

    fused_input = heads is None

    def compute(item: np.ndarray, keep: np.ndarray) -> np.ndarray:
        matrices = _layer_matrices(item, heads, keep, masked=mask is not None)
        size = int(keep.sum())
        mixed = [(1 - residual) * a + residual * np.eye(size) for a in matrices]
        graph = nx.DiGraph()
        graph.add_nodes_from((layer, k) for layer in range(len(mixed) + 1) for k in range(size))
        for layer, matrix in enumerate(mixed, start=1):
            for k in range(size):
                for m in range(size):
                    if matrix[k, m] > 0:
                        graph.add_edge((layer, k), (layer - 1, m), capacity=matrix[k, m])
        out = np.zeros((len(mixed), size, size))
        n_layers = len(mixed)
        if layers == "all":
            wanted_layers = range(1, n_layers + 1)
        else:
            wanted_layers = [n_layers if layers == "last" else int(layers) % n_layers + 1]
        # Only the requested output rows (as positions of the cropped sequence) are solved.
        kept = np.flatnonzero(keep)
        wanted = (
            range(size)
            if rows is None
            else [
                int(np.searchsorted(kept, r % keep.size))
                for r in ([rows] if isinstance(rows, int) else rows)
                if keep[r % keep.size]
            ]
        )
        for layer in wanted_layers:
            for k in wanted:
                for m in range(size):
                    out[layer - 1, k, m] = nx.maximum_flow_value(
                        graph, (layer, k), (0, m), flow_func=edmonds_karp
                    )
                if normalize and out[layer - 1, k].sum() > 0:
                    out[layer - 1, k] /= out[layer - 1, k].sum()
        return out

    per_layer = _per_item(attentions, mask, fused_input, compute)
    return _select(per_layer, rows, layers)


def oracle_gradient_rollout(
    attentions: np.ndarray,
    gradients: np.ndarray,
    *,
    rule: str = "gae",
    normalize: bool = False,
    residual: float = 0.5,
    rows: int | Sequence[int] | None = None,
    layers: object = "last",
    mask: np.ndarray | None = None,
    exclude_self: bool = False,
) -> np.ndarray:
    """Gradient-weighted rollout, Chefer et al. (2021) self-attention rules, with explicit loops.

    Per layer ``Ā = (1/H) Σ_h max(G_h * A_h, 0)`` element by element. GAE: ``R = I``, then
    ``R = R + Ā @ R`` for each layer. "weighted": rows of ``Ā`` divided by their sum (an
    all-zero row becomes the identity row), then rollout with ``(1 - a) Â + a I``. Masks
    crop the sequence (attention rows renormalised over real keys) and pad back with zeros.
    """
    n_layers, n_heads, n = attentions.shape[-4], attentions.shape[-3], attentions.shape[-1]
    batch_shape = attentions.shape[:-4]
    out = np.zeros((*batch_shape, n_layers, n, n))
    for index in np.ndindex(*batch_shape):
        keep = np.ones(n, dtype=bool) if mask is None else mask[index]
        kept = np.flatnonzero(keep)
        size = kept.size
        relevance = np.eye(size)
        for layer in range(n_layers):
            weighted = np.zeros((size, size))
            for head in range(n_heads):
                a = attentions[(*index, layer, head)].astype(np.float64)[np.ix_(kept, kept)]
                g = gradients[(*index, layer, head)].astype(np.float64)[np.ix_(kept, kept)]
                if mask is not None:
                    a = _renormalise(a)
                for i in range(size):
                    for j in range(size):
                        weighted[i, j] += max(g[i, j] * a[i, j], 0.0) / n_heads
            if rule == "gae":
                relevance = relevance + weighted @ relevance
            else:
                mixed = (1 - residual) * _renormalise(weighted) + residual * np.eye(size)
                relevance = mixed @ relevance
            result = relevance.copy()
            if exclude_self:
                np.fill_diagonal(result, 0.0)
            if normalize:
                for i in range(size):
                    if result[i].sum() > 0:
                        result[i] = result[i] / result[i].sum()
            out[(*index, layer, *np.ix_(kept, kept))] = result
    return _select(out, rows, layers)
