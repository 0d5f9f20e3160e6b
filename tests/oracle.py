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
    "oracle_flow_variant",
    "oracle_fuse",
    "oracle_mixed_layer",
    "oracle_raw",
    "oracle_rollout",
    "oracle_rollout_variant",
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


def pick_rows(
    chosen: np.ndarray, rows: int | Sequence[int] | None, mask: np.ndarray | None
) -> np.ndarray:
    """Rows of ``chosen`` ``(*batch, ..., n, n)``; negative ones from each item's real end."""
    if rows is None:
        return chosen
    listed = [rows] if isinstance(rows, int) else list(rows)
    if mask is None or all(r >= 0 for r in listed):
        return chosen[..., rows, :] if isinstance(rows, int) else chosen[..., listed, :]
    mask = np.asarray(mask, dtype=bool)
    picked = []
    for index in np.ndindex(mask.shape[:-1]):
        last = int(np.flatnonzero(mask[index])[-1])  # the item's last real token
        positions = [last + 1 + r if r < 0 else r for r in listed]
        item = chosen[index]
        picked.append(
            item[..., positions[0], :] if isinstance(rows, int) else item[..., positions, :]
        )
    return np.stack(picked).reshape(*mask.shape[:-1], *picked[0].shape)


def _real_position(row: int, keep: np.ndarray) -> int:
    """A row of the padded length as a position; negative from the last real token."""
    return int(np.flatnonzero(keep)[-1]) + 1 + row if row < 0 else row


def _select(
    per_layer: np.ndarray,
    rows: int | Sequence[int] | None,
    layers: object,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    if layers == "last":
        chosen = per_layer[..., -1, :, :]
    elif layers == "all":
        chosen = per_layer
    else:
        chosen = per_layer[..., layers, :, :]
    return pick_rows(chosen, rows, mask)


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
    return _select(per_layer, rows, layers, mask)


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
    return _select(per_layer, rows, layers, mask)


def oracle_flow(
    attentions: np.ndarray,
    *,
    heads: object = "mean",
    residual: float = 0.5,
    rows: int | Sequence[int] | None = None,
    layers: object = "last",
    mask: np.ndarray | None = None,
    normalize_result: bool = True,
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
                int(np.searchsorted(kept, _real_position(r, keep)))
                for r in ([rows] if isinstance(rows, int) else rows)
                if keep[_real_position(r, keep)]
            ]
        )
        for layer in wanted_layers:
            for k in wanted:
                for m in range(size):
                    out[layer - 1, k, m] = nx.maximum_flow_value(
                        graph, (layer, k), (0, m), flow_func=edmonds_karp
                    )
                if normalize_result and out[layer - 1, k].sum() > 0:
                    out[layer - 1, k] /= out[layer - 1, k].sum()
        return out

    per_layer = _per_item(attentions, mask, fused_input, compute)
    return _select(per_layer, rows, layers, mask)


# -- variants: pruned / top-k layers and head-specific maps (issue 9, items 2 and 3) ------


def oracle_mixed_layer(
    attention: np.ndarray,
    *,
    residual: float,
    threshold: float | None = None,
    top_k: int | None = None,
    discard: float | None = None,
    first_is_real: bool = True,
) -> np.ndarray:
    """``Ã`` of one cropped layer ``(n, n)``, pruned the documented way, rows renormalised.

    threshold and discard act on the attention before the identity is mixed in; top-k on
    the mixed matrix. Ties at a cut-off are kept. Plain Python sorting, entry by entry.
    """
    n = attention.shape[0]
    a = np.array(attention, dtype=np.float64)
    if threshold is not None:
        for i in range(n):
            for j in range(n):
                if a[i, j] < threshold:
                    a[i, j] = 0.0
        a = _renormalise(a)
    if discard is not None:
        # Eligible: every entry of the (real, cropped) matrix except the first column, when
        # that column is the sequence's position 0.
        eligible = [(i, j) for i in range(n) for j in range(n) if not (first_is_real and j == 0)]
        count = int(np.floor(discard * len(eligible)))
        if count > 0:
            ordered = sorted(a[i, j] for i, j in eligible)
            cutoff = ordered[count]  # the (count+1)-th smallest survives, with its ties
            for i, j in eligible:
                if a[i, j] < cutoff:
                    a[i, j] = 0.0
            a = _renormalise(a)
    mixed = (1 - residual) * a + residual * np.eye(n)
    if top_k is not None:
        for i in range(n):
            ordered = sorted(mixed[i], reverse=True)
            cutoff = ordered[min(top_k, n) - 1]
            mixed[i] = [v if v >= cutoff else 0.0 for v in mixed[i]]
        mixed = _renormalise(mixed)
    return mixed


def _variant_layers(
    item: np.ndarray, keep: np.ndarray, *, masked: bool, fused_input: bool, each: bool
) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """Cropped mean-fused layers of one item, and each layer's cropped heads (if `each`)."""
    fused = _layer_matrices(item, None if fused_input else "mean", keep, masked=masked)
    heads: list[list[np.ndarray]] = []
    if each:
        for layer in item:
            cropped = [h[np.ix_(keep, keep)] for h in layer]
            heads.append([_renormalise(h) if masked else h for h in cropped])
    return fused, heads


def _pad_heads(
    attentions: np.ndarray,
    mask: np.ndarray | None,
    compute: Callable[[np.ndarray, np.ndarray], np.ndarray],
    *,
    fused_input: bool,
    n_heads: int | None,
) -> np.ndarray:
    """``compute(item, keep)`` -> ``(L, [H,] k, k)`` per item, padded back to ``n``."""
    core = 3 if fused_input else 4
    batch_shape = attentions.shape[:-core]
    n_layers, n = attentions.shape[-core], attentions.shape[-1]
    head_shape = () if n_heads is None else (n_heads,)
    out = np.zeros((*batch_shape, n_layers, *head_shape, n, n))
    for index in np.ndindex(*batch_shape):
        keep = np.ones(n, dtype=bool) if mask is None else mask[index]
        kept = np.flatnonzero(keep)
        result = compute(attentions[index].astype(np.float64), keep)
        for position in np.ndindex(n_layers, *head_shape):
            out[(*index, *position, *np.ix_(kept, kept))] = result[position]
    return out


def _select_variant(
    per_layer: np.ndarray,
    rows: int | Sequence[int] | None,
    layers: object,
    *,
    each: bool,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """Select layers (axis -4 with heads, -3 without) and rows of the oracle's output."""
    if not each:
        return _select(per_layer, rows, layers, mask)
    if layers == "last":
        chosen = per_layer[..., -1, :, :, :]
    elif layers == "all":
        chosen = per_layer
    else:
        chosen = per_layer[..., layers, :, :, :]
    return pick_rows(chosen, rows, mask)


def oracle_rollout_variant(
    attentions: np.ndarray,
    *,
    heads: object = "mean",
    residual: float = 0.5,
    rows: int | Sequence[int] | None = None,
    layers: object = "last",
    mask: np.ndarray | None = None,
    threshold: float | None = None,
    top_k: int | None = None,
    discard: float | None = None,
) -> np.ndarray:
    """Pruned and/or head-specific rollout, full products per cropped item.

    ``heads="each"``: head k at layer i is ``Ã_{i,k} R̄_{i-1}`` with ``R̄`` the rollout of
    the mean-fused layers below (Abnar & Zuidema 2020, Appendix A.1); otherwise ``heads``
    is "mean" or None (fused input).
    """
    each = heads == "each"
    fused_input = heads is None
    pruning = {"threshold": threshold, "top_k": top_k, "discard": discard}

    def compute(item: np.ndarray, keep: np.ndarray) -> np.ndarray:
        fused, per_head = _variant_layers(
            item, keep, masked=mask is not None, fused_input=fused_input, each=each
        )
        size = int(keep.sum())

        def mixed(matrix: np.ndarray) -> np.ndarray:
            return oracle_mixed_layer(
                matrix, residual=residual, first_is_real=bool(keep[0]), **pruning
            )

        below = np.eye(size)
        results = []
        for layer, matrix in enumerate(fused):
            if each:
                results.append(np.stack([mixed(h) @ below for h in per_head[layer]]))
            below = mixed(matrix) @ below
            if not each:
                results.append(below)
        return np.stack(results)

    n_heads = attentions.shape[-3] if each else None
    per_layer = _pad_heads(attentions, mask, compute, fused_input=fused_input, n_heads=n_heads)
    return _select_variant(per_layer, rows, layers, each=each, mask=mask)


def oracle_flow_variant(
    attentions: np.ndarray,
    *,
    heads: object = "mean",
    residual: float = 0.5,
    rows: int | Sequence[int] | None = None,
    layers: object = "last",
    mask: np.ndarray | None = None,
    normalize_result: bool = True,
    threshold: float | None = None,
    top_k: int | None = None,
    discard: float | None = None,
) -> np.ndarray:
    """Pruned and/or head-specific flow: networkx Edmonds-Karp on the paper's full graph.

    With ``heads="each"`` the graph of head k at layer i has the mean-fused (pruned) layers
    1 .. i-1 and head k's (pruned) matrix at layer i.
    """
    import networkx as nx
    from networkx.algorithms.flow import edmonds_karp

    each = heads == "each"
    fused_input = heads is None
    pruning = {"threshold": threshold, "top_k": top_k, "discard": discard}

    def max_flows(stack: list[np.ndarray], wanted: Sequence[int]) -> np.ndarray:
        size = stack[0].shape[0]
        graph = nx.DiGraph()
        graph.add_nodes_from((layer, k) for layer in range(len(stack) + 1) for k in range(size))
        for layer, matrix in enumerate(stack, start=1):
            for k in range(size):
                for m in range(size):
                    if matrix[k, m] > 0:
                        graph.add_edge((layer, k), (layer - 1, m), capacity=matrix[k, m])
        top = len(stack)
        out = np.zeros((size, size))
        for k in wanted:
            for m in range(size):
                out[k, m] = nx.maximum_flow_value(graph, (top, k), (0, m), flow_func=edmonds_karp)
            if normalize_result and out[k].sum() > 0:
                out[k] /= out[k].sum()
        return out

    def compute(item: np.ndarray, keep: np.ndarray) -> np.ndarray:
        fused, per_head = _variant_layers(
            item, keep, masked=mask is not None, fused_input=fused_input, each=each
        )
        size = int(keep.sum())

        def mixed(matrix: np.ndarray) -> np.ndarray:
            return oracle_mixed_layer(
                matrix, residual=residual, first_is_real=bool(keep[0]), **pruning
            )

        n_layers = len(fused)
        if layers == "all":
            reported = list(range(n_layers))
        else:
            reported = [n_layers - 1 if layers == "last" else int(layers) % n_layers]
        kept = np.flatnonzero(keep)
        wanted = (
            range(size)
            if rows is None
            else [
                int(np.searchsorted(kept, _real_position(r, keep)))
                for r in ([rows] if isinstance(rows, int) else rows)
                if keep[_real_position(r, keep)]
            ]
        )
        below = [mixed(matrix) for matrix in fused]
        shape = (n_layers, len(per_head[0])) if each else (n_layers,)
        out = np.zeros((*shape, size, size))
        for layer in reported:
            if each:
                for head, matrix in enumerate(per_head[layer]):
                    stack = [*below[:layer], mixed(matrix)]
                    out[layer, head] = max_flows(stack, wanted)
            else:
                out[layer] = max_flows(below[: layer + 1], wanted)
        return out

    n_heads = attentions.shape[-3] if each else None
    per_layer = _pad_heads(attentions, mask, compute, fused_input=fused_input, n_heads=n_heads)
    return _select_variant(per_layer, rows, layers, each=each, mask=mask)


# -- Decoders: receptive-field normalisation and attention sinks (issue 9, item 5) ---------
# Self-contained: the definitions written out with loops; the method on the uniform
# causal baseline is the method's own oracle above, applied to a hand-built input.


def oracle_uniform_causal(shape: tuple[int, ...]) -> np.ndarray:
    """Uniform causal attention of `shape` ``(..., n, n)``: row i is 1/(i+1) on keys 0..i.

    With a padding mask the method oracles renormalise every row over the real keys, which
    makes it uniform over the real keys ``j <= i``: the receptive field of a real query.
    """
    n = shape[-1]
    single = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1):
            single[i, j] = 1.0 / (i + 1)
    return np.broadcast_to(single, shape).copy()


def oracle_decoder_normalise(
    attribution: np.ndarray, baseline: np.ndarray | None, exclude: Sequence[int] = ()
) -> np.ndarray:
    """``R / B`` (0 where B = 0), excluded columns 0, rows (last axis) renormalised."""
    out = np.zeros_like(attribution, dtype=np.float64)
    n = attribution.shape[-1]
    dropped = {e % n for e in exclude}
    for index in np.ndindex(*attribution.shape[:-1]):
        row = np.zeros(n)
        for j in range(n):
            if j in dropped:
                continue
            if baseline is None:
                row[j] = attribution[index][j]
            elif baseline[index][j] > 0:
                row[j] = attribution[index][j] / baseline[index][j]
        total = row.sum()
        out[index] = row / total if total > 0 else 0.0
    return out


def oracle_decoder(
    method: str,
    attentions: np.ndarray,
    *,
    receptive_field: bool = False,
    exclude: int | Sequence[int] | None = None,
    **options: object,
) -> np.ndarray:
    """Rollout or flow with `receptive_field` and `exclude`, from the definitions."""
    compute = oracle_rollout_variant if method == "rollout" else oracle_flow_variant
    result = compute(attentions, **options)  # type: ignore[arg-type]
    baseline = None
    if receptive_field:
        baseline = compute(oracle_uniform_causal(attentions.shape), **options)  # type: ignore[arg-type]
    dropped = [] if exclude is None else [exclude] if isinstance(exclude, int) else list(exclude)
    return oracle_decoder_normalise(result, baseline, dropped)


# -- Encoder-decoder composition (issue 9, item 4) -----------------------------------------
# Self-contained: plain float64 loops over batch items, layers, rows and columns, written
# from the formulas in docs/maths-decoders.md ("Encoder-decoder models"), sharing nothing above.


def _ed_rows_renormalised(
    matrix: np.ndarray, rows_real: np.ndarray, keys_real: np.ndarray
) -> np.ndarray:
    """Zero padded rows/keys; divide each real row by its sum over real keys (0 stays 0,
    except a square matrix, whose empty real row becomes its own unit row)."""
    out = np.zeros(matrix.shape)
    for i in range(matrix.shape[0]):
        if not rows_real[i]:
            continue
        total = 0.0
        for j in range(matrix.shape[1]):
            if keys_real[j]:
                total += float(matrix[i, j])
        for j in range(matrix.shape[1]):
            if keys_real[j]:
                out[i, j] = matrix[i, j] / total if total > 0 else 0.0
        if total == 0 and matrix.shape[0] == matrix.shape[1]:
            out[i, i] = 1.0
    return out


def _ed_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.zeros((a.shape[0], b.shape[1]))
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            total = 0.0
            for k in range(a.shape[1]):
                total += float(a[i, k]) * float(b[k, j])
            out[i, j] = total
    return out


def _ed_unit(real: np.ndarray) -> np.ndarray:
    out = np.zeros((real.size, real.size))
    for i in range(real.size):
        out[i, i] = 1.0 if real[i] else 0.0
    return out


def oracle_encoder_decoder(
    encoder: np.ndarray,
    decoder: np.ndarray,
    cross: np.ndarray,
    *,
    rule: str = "rollout",
    gradients: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    residual: float = 0.5,
    rows: int | Sequence[int] | None = None,
    layers: object = "last",
    source_mask: np.ndarray | None = None,
    target_mask: np.ndarray | None = None,
    normalize_result: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Encoder-decoder rollout (rule "rollout") or Chefer's GAE rules (rule "gae").

    Inputs per head ``(*batch, L, H, q, k)``; heads fused by the mean (rollout) or by
    ``mean_h((g * a)^+)`` (gae). Returns ``(source, target)`` as the library does.
    """
    a = 1.0 - residual
    batch = encoder.shape[:-4]
    n_dec, n_src, n_tgt = decoder.shape[-4], encoder.shape[-1], decoder.shape[-1]
    out_s = np.zeros((*batch, n_dec, n_tgt, n_src))
    out_t = np.zeros((*batch, n_dec, n_tgt, n_tgt))
    for index in np.ndindex(*batch):
        src = np.ones(n_src, bool) if source_mask is None else source_mask[index]
        tgt = np.ones(n_tgt, bool) if target_mask is None else target_mask[index]

        def fused(
            stack: np.ndarray, grads: np.ndarray | None, q: np.ndarray, k: np.ndarray
        ) -> list[np.ndarray]:
            layers_out = []
            for layer in range(stack.shape[0]):
                heads = stack.shape[1]
                total = np.zeros(stack.shape[-2:])
                for h in range(heads):
                    w = _ed_rows_renormalised(stack[layer, h].astype(np.float64), q, k)
                    if grads is not None:
                        g = grads[layer, h].astype(np.float64)
                        for i in range(w.shape[0]):
                            for j in range(w.shape[1]):
                                value = g[i, j] * w[i, j] if (q[i] and k[j]) else 0.0
                                w[i, j] = value if value > 0 else 0.0
                    total = total + w
                layers_out.append(total / heads)
            return layers_out

        g = (None, None, None) if gradients is None else tuple(x[index] for x in gradients)
        enc = fused(encoder[index], g[0], src, src)
        dec = fused(decoder[index], g[1], tgt, tgt)
        crs = fused(cross[index], g[2], tgt, src)
        eye_s, eye_t = _ed_unit(src), _ed_unit(tgt)
        if rule == "rollout":
            r_enc = eye_s.copy()
            for e in enc:
                r_enc = _ed_matmul(a * e + residual * eye_s, r_enc)
            xs, xt = np.zeros((n_tgt, n_src)), eye_t.copy()
            for layer in range(n_dec):
                mixed = a * dec[layer] + residual * eye_t
                ys, yt = _ed_matmul(mixed, xs), _ed_matmul(mixed, xt)
                xs = residual * ys + a * _ed_matmul(crs[layer], r_enc)
                xt = residual * yt
                out_s[(*index, layer)], out_t[(*index, layer)] = xs, xt
        else:

            def bar(r: np.ndarray, eye: np.ndarray) -> np.ndarray:
                hat = r - eye
                out = eye.copy()
                for i in range(hat.shape[0]):
                    total = hat[i].sum()
                    if total != 0:
                        out[i] += hat[i] / total
                return out

            r_ss = eye_s.copy()
            for e in enc:
                r_ss = r_ss + _ed_matmul(e, r_ss)
            r_tt, r_ts = eye_t.copy(), np.zeros((n_tgt, n_src))
            for layer in range(n_dec):
                r_tt, r_ts = (
                    r_tt + _ed_matmul(dec[layer], r_tt),
                    r_ts + _ed_matmul(dec[layer], r_ts),
                )
                r_ts = r_ts + _ed_matmul(
                    bar(r_tt, eye_t).T, _ed_matmul(crs[layer], bar(r_ss, eye_s))
                )
                out_s[(*index, layer)], out_t[(*index, layer)] = r_ts, r_tt
    if normalize_result:
        total = out_s.sum(-1, keepdims=True) + out_t.sum(-1, keepdims=True)
        total[total == 0] = 1.0
        out_s, out_t = out_s / total, out_t / total
    picked = []
    for per_layer in (out_s, out_t):
        if layers == "last":
            chosen = per_layer[..., -1, :, :]
        elif layers == "all":
            chosen = per_layer
        else:
            chosen = per_layer[..., int(layers), :, :]  # type: ignore[call-overload]
        picked.append(pick_rows(chosen, rows, target_mask))
    return picked[0], picked[1]


__all__ += ["oracle_encoder_decoder"]


def oracle_gradient_rollout(
    attentions: np.ndarray,
    gradients: np.ndarray,
    *,
    rule: str = "gae",
    normalize_result: bool = False,
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
            if normalize_result:
                for i in range(size):
                    if result[i].sum() > 0:
                        result[i] = result[i] / result[i].sum()
            out[(*index, layer, *np.ix_(kept, kept))] = result
    return _select(out, rows, layers, mask)


__all__ += ["oracle_gradient_rollout", "pick_rows"]


def oracle_encoder_decoder_flow(
    encoder: np.ndarray,
    decoder: np.ndarray,
    cross: np.ndarray,
    *,
    residual: float = 0.5,
    rows: int | Sequence[int] | None = None,
    layers: object = "last",
    source_mask: np.ndarray | None = None,
    target_mask: np.ndarray | None = None,
    normalize_result: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Encoder-decoder flow the paper's way: networkx Edmonds-Karp per pair.

    Heads fused by the mean over real keys; one networkx graph per sequence with a node
    per (family, layer, token) and the edges of docs/maths-decoders.md ("Encoder-decoder flow"),
    written from the formulas with plain loops.
    """
    import networkx as nx
    from networkx.algorithms.flow import edmonds_karp

    a = 1.0 - residual
    batch = encoder.shape[:-4]
    n_enc, n_dec = encoder.shape[-4], decoder.shape[-4]
    n_src, n_tgt = encoder.shape[-1], decoder.shape[-1]
    out_s = np.zeros((*batch, n_dec, n_tgt, n_src))
    out_t = np.zeros((*batch, n_dec, n_tgt, n_tgt))
    for index in np.ndindex(*batch):
        src = np.ones(n_src, bool) if source_mask is None else source_mask[index]
        tgt = np.ones(n_tgt, bool) if target_mask is None else target_mask[index]

        def fused(stack: np.ndarray, q: np.ndarray, k: np.ndarray) -> list[np.ndarray]:
            return [
                sum(
                    _ed_rows_renormalised(stack[layer, h].astype(np.float64), q, k)
                    for h in range(stack.shape[1])
                )
                / stack.shape[1]
                for layer in range(stack.shape[0])
            ]

        enc = fused(encoder[index], src, src)
        dec = fused(decoder[index], tgt, tgt)
        crs = fused(cross[index], tgt, src)
        graph = nx.DiGraph()
        for layer in range(n_enc + 1):
            graph.add_nodes_from(("e", layer, s) for s in range(n_src))
        for layer in range(n_dec + 1):
            graph.add_nodes_from(("x", layer, t) for t in range(n_tgt))

        def edge(
            graph: nx.DiGraph, tail: tuple[object, ...], head: tuple[object, ...], cap: float
        ) -> None:
            if cap > 0:
                graph.add_edge(tail, head, capacity=cap)

        for layer in range(1, n_enc + 1):
            for i in range(n_src):
                for j in range(n_src):
                    unit = 1.0 if (i == j and src[i]) else 0.0
                    edge(
                        graph,
                        ("e", layer, i),
                        ("e", layer - 1, j),
                        a * enc[layer - 1][i, j] + residual * unit,
                    )
        for layer in range(1, n_dec + 1):
            for t in range(n_tgt):
                for u in range(n_tgt):
                    unit = 1.0 if (t == u and tgt[t]) else 0.0
                    mixed = a * dec[layer - 1][t, u] + residual * unit
                    edge(graph, ("x", layer, t), ("x", layer - 1, u), residual * mixed)
                for s in range(n_src):
                    edge(graph, ("x", layer, t), ("e", n_enc, s), a * crs[layer - 1][t, s])
        for layer in range(1, n_dec + 1):
            for t in range(n_tgt):
                if not tgt[t]:
                    continue
                top = ("x", layer, t)
                for s in range(n_src):
                    if src[s]:
                        out_s[(*index, layer - 1, t, s)] = nx.maximum_flow_value(
                            graph, top, ("e", 0, s), flow_func=edmonds_karp
                        )
                for u in range(n_tgt):
                    if tgt[u]:
                        out_t[(*index, layer - 1, t, u)] = nx.maximum_flow_value(
                            graph, top, ("x", 0, u), flow_func=edmonds_karp
                        )
    if normalize_result:
        total = out_s.sum(-1, keepdims=True) + out_t.sum(-1, keepdims=True)
        total[total == 0] = 1.0
        out_s, out_t = out_s / total, out_t / total
    picked = []
    for per_layer in (out_s, out_t):
        if layers == "last":
            chosen = per_layer[..., -1, :, :]
        elif layers == "all":
            chosen = per_layer
        else:
            chosen = per_layer[..., int(layers), :, :]  # type: ignore[call-overload]
        picked.append(pick_rows(chosen, rows, target_mask))
    return picked[0], picked[1]


__all__ += ["oracle_encoder_decoder_flow"]


# -- value-aware token mixing (issue 12): norm-based, GlobEnc, ALTI ------------------------
# Written from the papers' formulas with plain loops over positions; nothing is shared with
# attnflow._contributions. Kobayashi et al. 2020 (eq. 5-6), Kobayashi et al. 2021 (LN as a
# sum of per-token vectors), Modarressi et al. 2022 (GlobEnc, N_Enc), Ferrando et al. 2022
# (ALTI, eq. 6-10).


def _oracle_layer_norm(vector: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float):
    mean = sum(vector) / len(vector)
    var = sum((v - mean) ** 2 for v in vector) / len(vector)
    return gamma * (vector - mean) / np.sqrt(var + eps) + beta


def oracle_head_values(
    z: np.ndarray, w_v: np.ndarray, b_v: np.ndarray, w_o: np.ndarray, heads: int
) -> np.ndarray:
    """f^h(z_j) = (z_j W_V^h + b_V^h) W_O^h of one sequence: ``(H, n, d)``."""
    n = z.shape[0]
    width = w_v.shape[1] // heads
    out = np.zeros((heads, n, w_o.shape[1]))
    for h in range(heads):
        cols = slice(h * width, (h + 1) * width)
        for j in range(n):
            value = z[j] @ w_v[:, cols] + b_v[cols]
            out[h, j] = value @ w_o[cols, :]
    return out


def oracle_block_output(
    alpha: np.ndarray,
    z: np.ndarray,
    x: np.ndarray,
    w_v: np.ndarray,
    b_v: np.ndarray,
    w_o: np.ndarray,
    b_o: np.ndarray,
    norm: tuple[np.ndarray, np.ndarray, float] | None,
) -> np.ndarray:
    """The block's forward pass for one sequence: concat_h(α^h V^h) W_O + b_O, + x, LN."""
    heads, n = alpha.shape[0], alpha.shape[1]
    width = w_v.shape[1] // heads
    y = np.zeros_like(x)
    for i in range(n):
        context = np.zeros(w_v.shape[1])
        for h in range(heads):
            cols = slice(h * width, (h + 1) * width)
            for j in range(n):
                context[cols] += alpha[h, i, j] * (z[j] @ w_v[:, cols] + b_v[cols])
        u = x[i] + context @ w_o + b_o
        y[i] = u if norm is None else _oracle_layer_norm(u, *norm)
    return y


def oracle_terms(
    alpha: np.ndarray,
    f: np.ndarray,
    x: np.ndarray,
    b_o: np.ndarray,
    norm: tuple[np.ndarray, np.ndarray, float] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """T_i(x_j), b_i and the attention parts Σ_h α^h_ij f^h(x_j) of one sequence."""
    heads, n, d = f.shape
    attention = np.zeros((n, n, d))
    terms = np.zeros((n, n, d))
    offset = np.zeros((n, d))
    for i in range(n):
        t = np.zeros((n, d))
        for j in range(n):
            for h in range(heads):
                attention[i, j] += alpha[h, i, j] * f[h, j]
            t[j] = attention[i, j] + (x[j] if i == j else 0.0)
        if norm is None:
            terms[i], offset[i] = t, b_o
            continue
        gamma, beta, eps = norm
        u = t.sum(axis=0) + b_o  # the vector the LayerNorm sees
        s = np.sqrt(np.mean((u - u.mean()) ** 2) + eps)
        for j in range(n):
            terms[i, j] = gamma * (t[j] - t[j].mean()) / s
        offset[i] = gamma * (b_o - b_o.mean()) / s + beta
    return terms, offset, attention


def oracle_contributions(
    alpha: np.ndarray,
    f: np.ndarray,
    x: np.ndarray,
    b_o: np.ndarray,
    norm: tuple[np.ndarray, np.ndarray, float] | None,
    method: str,
    second: tuple[np.ndarray, float, np.ndarray] | None = None,
) -> np.ndarray:
    """The ``(n, n)`` norm / GlobEnc / ALTI matrix of one sequence.

    `second` is GlobEnc's second LayerNorm as (gamma2, eps2, its actual input (n, d)).
    """
    terms, offset, attention = oracle_terms(alpha, f, x, b_o, norm)
    n = x.shape[0]
    out = np.zeros((n, n))
    for i in range(n):
        y = terms[i].sum(axis=0) + offset[i]
        for j in range(n):
            if method == "norm":
                out[i, j] = np.sqrt(np.sum(attention[i, j] ** 2))
            elif method == "globenc":
                vector = terms[i, j]
                if second is not None:
                    gamma2, eps2, v = second
                    s2 = np.sqrt(np.mean((v[i] - v[i].mean()) ** 2) + eps2)
                    vector = gamma2 * (vector - vector.mean()) / s2
                out[i, j] = np.sqrt(np.sum(vector**2))
            else:
                out[i, j] = max(0.0, np.abs(y).sum() - np.abs(y - terms[i, j]).sum())
        if method == "alti" and out[i].sum() > 0:
            out[i] = out[i] / out[i].sum()
    return out


__all__ += [
    "oracle_block_output",
    "oracle_contributions",
    "oracle_head_values",
    "oracle_terms",
]
