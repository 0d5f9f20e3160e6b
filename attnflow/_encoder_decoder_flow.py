"""Encoder-decoder attention flow: max-flow on the graph of the encoder-decoder rollout model."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from ._encoder_decoder import EncoderDecoderAttribution, prepare_encoder_decoder
from ._flow import (
    DEFAULT_MAX_WORK,
    _check_flow_options,
    _format_seconds,
    _progress_bar,
)
from ._host import from_host, to_host
from ._typing import Array, HeadFusion, LayerSelection, Namespace, RowSelection

__all__ = ["encoder_decoder_flow"]

IGRAPH_SECONDS_PER_EDGE_VISIT = 1.0e-7
"""Cost of one edge in one igraph max-flow (measured on a 2-core x86-64 machine): these
graphs are not the dense layered graphs of the compiled solver, igraph solves them."""


def encoder_decoder_flow(
    encoder: Array,
    decoder: Array,
    cross: Array,
    /,
    *,
    heads: HeadFusion = "mean",
    residual: float = 0.5,
    rows: RowSelection = None,
    layers: LayerSelection = "last",
    source_mask: Any | None = None,
    target_mask: Any | None = None,
    normalize: bool = True,
    progress: bool = False,
    max_work: float | None = DEFAULT_MAX_WORK,
    validate: bool | Literal["heads"] = True,
    xp: Namespace | None = None,
) -> EncoderDecoderAttribution:
    r"""Attention flow through an encoder-decoder transformer, to source and target tokens.

    The graph is the one whose path products :func:`encoder_decoder_rollout` sums (the
    rollout model: heads fused, a residual of weight :math:`\alpha` in every sub-layer),
    and each value is a maximum flow on it, as :func:`flow` is to :func:`rollout`
    (Abnar & Zuidema 2020, §3). With :math:`E_k`, :math:`D_l`, :math:`C_l` the head-fused
    encoder self-, decoder self- and cross-attention, the nodes are the encoder layers
    :math:`e_0 .. e_{L_e}` (``S`` tokens each; :math:`e_0` the source tokens) and the
    decoder layers :math:`x_0 .. x_{L_d}` (``T`` positions each; :math:`x_0` the target
    prefix). The edges and their capacities are the rows of the rollout model's
    per-layer matrices:

    .. math::

        e_k[i] &\to e_{k-1}[j]: \quad (1-\alpha) E_k[i, j] + \alpha [i = j], \\
        x_l[t] &\to x_{l-1}[u]: \quad \alpha \bigl((1-\alpha) D_l[t, u]
            + \alpha [t = u]\bigr), \\
        x_l[t] &\to e_{L_e}[s]: \quad (1-\alpha) \, C_l[t, s],

    so every node's capacities out sum to one, and multiplying them along paths gives
    :func:`encoder_decoder_rollout`'s :math:`X_l = [\alpha \tilde D_l \mid (1-\alpha)
    C_l] \, [X_{l-1} ; R_\text{enc}]`. Every cross-attention layer reads the same top
    encoder layer. The flow of decoder position :math:`t` at layer :math:`l` is

    .. math::

        F^s_l[t, s] = \operatorname{maxflow}(x_l[t] \to e_0[s]), \qquad
        F^t_l[t, u] = \operatorname{maxflow}(x_l[t] \to x_0[u]),

    and with ``normalize=True`` (the paper's code) each row of :math:`[F^s \mid F^t]` is
    divided by its sum.

    Parameters
    ----------
    encoder, decoder, cross : array
        The three attention families, ``(*batch, L_e, heads, S, S)``,
        ``(*batch, L_d, heads, T, T)`` and ``(*batch, L_d, heads, T, S)`` (no heads axis
        with ``heads=None``), as for :func:`encoder_decoder_rollout`.
    heads : {"mean", "max", "min"}, callable, array_like or None, default "mean"
        Head fusion, the same for the three families (weights of shape ``(heads,)``).
    residual : float, default 0.5
        :math:`\alpha` of every sub-layer.
    rows : int, sequence of int or None, default None
        Decoder positions to explain. Each costs one max-flow per source and target
        token and reported layer.
    layers : {"last", "all"} or int, default "last"
        The decoder layer(s) whose flow is reported. Decoder layers above are never built.
    source_mask, target_mask : bool array, optional
        ``(*batch, S)`` and ``(*batch, T)``, True for real tokens: padded tokens leave the
        graph and get exactly zero flow; padded decoder rows are zero.
    normalize : bool, default True
        Divide each output row of ``[source | target]`` by its sum. False returns the raw
        max-flow values, each at most 1.
    progress : bool, default False
        Show a progress bar (tqdm) over the max-flows.
    max_work : float or None, default 2.5e10
        Refuse to start when the work (max-flows x edges of the graph) exceeds this;
        None lifts the limit.
    validate : bool or "heads", default True
        Check the attention values first, as for :func:`encoder_decoder_rollout`.
    xp : namespace, optional
        The array namespace; inferred from the inputs by default.

    Returns
    -------
    EncoderDecoderAttribution
        ``(source, target)``: ``(*batch, [layers,] T, S)`` and ``(*batch, [layers,] T,
        T)`` for ``rows=None`` (the ``T`` axis is dropped for an int row, ``r`` for a
        sequence of ``r``), in the library, dtype and device of `encoder`.

    Raises
    ------
    ValueError
        On inconsistent shapes, a bad option, bad values (with `validate`), or work above
        `max_work`.
    TypeError
        On a non-floating dtype, mixed libraries, a non-boolean mask, or inputs traced by
        ``jax.jit`` (max-flow runs on the host).
    IndexError
        If `rows` or `layers` is out of range.

    See Also
    --------
    encoder_decoder_rollout : The same graph, path products summed.
    flow : Attention flow of one self-attention stack.

    Notes
    -----
    The max-flows are solved serially with igraph on the host (float64), one graph per
    sequence; a ``T``-position decoder over ``S`` source tokens costs
    ``T (S + T)`` max-flows per reported layer on a graph of
    ``L_e S^2 + L_d (T^2 + T S)`` edges.

    Under the rollout model the source share is fixed (:math:`1 - \alpha^l` after
    :math:`l` decoder layers); flow has no such constraint: its source and target parts
    compete for the capacity out of :math:`x_l[t]`, and a bottleneck in the encoder
    lowers the source part alone.

    References
    ----------
    .. [1] S. Abnar and W. Zuidema, "Quantifying Attention Flow in Transformers",
       ACL 2020, https://arxiv.org/abs/2005.00928

    Examples
    --------
    One encoder layer, one decoder layer, one head, S = T = 2:

    >>> import numpy as np
    >>> import attnflow
    >>> enc = np.array([[[[0.5, 0.5], [0.0, 1.0]]]])   # (L_e, H, S, S)
    >>> dec = np.array([[[[1.0, 0.0], [0.5, 0.5]]]])   # (L_d, H, T, T), causal
    >>> crs = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])   # (L_d, H, T, S)
    >>> source, target = attnflow.encoder_decoder_flow(enc, dec, crs, normalize=False)
    >>> source  # x_1[t] -> e_1[s] (capacity 0.5 C) -> e_0 (capacity 0.5 E + 0.5 I)
    array([[0.5 , 0.25],
           [0.  , 0.5 ]])
    >>> target  # x_1[t] -> x_0[u], capacity 0.5 (0.5 D + 0.5 I)
    array([[0.5  , 0.   ],
           [0.125, 0.375]])
    """
    _check_flow_options(None, None, progress, normalize, max_work)
    prepared = prepare_encoder_decoder(
        encoder,
        decoder,
        cross,
        rule="rollout",
        gradients=None,
        heads=heads,
        residual=residual,
        rows=rows,
        layers=layers,
        source_mask=source_mask,
        target_mask=target_mask,
        normalize=normalize,
        validate=validate,
        xp=xp,
    )
    enc, dec, crs = prepared.fused
    batch = tuple(int(d) for d in enc.shape[:-3])
    n_enc, n_dec = int(enc.shape[-3]), int(dec.shape[-3])
    n_src, n_tgt = int(enc.shape[-1]), int(dec.shape[-1])
    reported = list(range(n_dec)) if prepared.all_layers else [n_dec - 1]
    if prepared.rows is None:
        wanted = list(range(n_tgt))
    elif isinstance(prepared.rows, int):
        wanted = [prepared.rows]
    else:
        wanted = list(prepared.rows)
    n_sequences = int(np.prod(batch, dtype=np.int64))
    max_flows = n_sequences * len(reported) * len(wanted) * (n_src + n_tgt)
    edges = n_enc * n_src * n_src + n_dec * (n_tgt * n_tgt + n_tgt * n_src)
    work = float(max_flows) * float(edges)
    if max_work is not None and work > max_work:
        seconds = _format_seconds(work * IGRAPH_SECONDS_PER_EDGE_VISIT)
        msg = (
            f"this encoder-decoder flow would take {max_flows:,} max-flows on graphs of up "
            f"to {edges:,} edges ({work:.3g} edge visits, roughly {seconds} on one core), "
            f"above `max_work`={max_work:.3g}. Explain fewer decoder positions (`rows=`), "
            "stop at a lower decoder layer (`layers=`), or pass `max_work=None` to run it "
            "anyway."
        )
        raise ValueError(msg)

    # The one host hop: fused attention to float64 NumPy; results back at the end.
    host = [
        to_host(a, name=name)
        for a, name in zip((enc, dec, crs), ("encoder", "decoder", "cross"), strict=True)
    ]
    masks = [
        np.ones((*batch, n), dtype=bool) if m is None else to_host(m, name=name, keep_dtype=True)
        for m, n, name in (
            (prepared.source_mask, n_src, "source_mask"),
            (prepared.target_mask, n_tgt, "target_mask"),
        )
    ]
    source = np.zeros((*batch, len(reported), len(wanted), n_src))
    target = np.zeros((*batch, len(reported), len(wanted), n_tgt))
    bar = _progress_bar(progress, max_flows)
    try:
        for index in np.ndindex(*batch):
            graph = _SequenceGraph(
                *(h[index] for h in host), *(m[index] for m in masks), alpha=prepared.alpha
            )
            for slot, layer in enumerate(reported):
                for position, row in enumerate(wanted):
                    source[(*index, slot, position)], target[(*index, slot, position)] = (
                        graph.flows_from(layer + 1, row)
                    )
                    if bar is not None:
                        bar.update(n_src + n_tgt)
    finally:
        if bar is not None:
            bar.close()
    if normalize:
        totals = source.sum(axis=-1, keepdims=True) + target.sum(axis=-1, keepdims=True)
        scale = np.where(totals > 0, totals, 1.0)  # empty rows stay zero, NaN stays NaN
        source, target = source / scale, target / scale
    if not prepared.all_layers:
        source, target = source[..., 0, :, :], target[..., 0, :, :]
    if isinstance(prepared.rows, int):
        source, target = source[..., 0, :], target[..., 0, :]
    like, namespace, boundary = enc, prepared.xp, prepared.boundary
    return EncoderDecoderAttribution(
        boundary.restore(from_host(source, like=like, xp=namespace)),
        boundary.restore(from_host(target, like=like, xp=namespace)),
    )


class _SequenceGraph:
    """The encoder-decoder flow graph of one sequence, built once, solved per pair.

    Node ids: encoder layer ``k`` token ``s`` is ``k S + s``; decoder layer ``l``
    position ``t`` is ``(L_e + 1) S + l T + t``. Zero capacities are left out.
    """

    def __init__(
        self,
        encoder: np.ndarray,
        decoder: np.ndarray,
        cross: np.ndarray,
        source_real: np.ndarray,
        target_real: np.ndarray,
        *,
        alpha: float,
    ) -> None:
        import igraph

        n_enc, n_src = encoder.shape[0], encoder.shape[-1]
        n_dec, n_tgt = decoder.shape[0], decoder.shape[-1]
        self.n_src, self.n_tgt = n_src, n_tgt
        self.source_real, self.target_real = source_real, target_real
        self.decoder_offset = (n_enc + 1) * n_src
        self.encoder_top = n_enc * n_src
        eye_s = np.diag(source_real.astype(np.float64))
        eye_t = np.diag(target_real.astype(np.float64))
        tails: list[np.ndarray] = []
        heads: list[np.ndarray] = []
        capacities: list[np.ndarray] = []

        def add(matrix: np.ndarray, tail_offset: int, head_offset: int) -> None:
            rows, columns = np.nonzero(matrix)
            tails.append(tail_offset + rows)
            heads.append(head_offset + columns)
            capacities.append(matrix[rows, columns])

        for k in range(n_enc):
            mixed = (1.0 - alpha) * encoder[k] + alpha * eye_s
            add(mixed, (k + 1) * n_src, k * n_src)
        for layer in range(n_dec):
            upper = self.decoder_offset + (layer + 1) * n_tgt
            add(alpha * ((1.0 - alpha) * decoder[layer] + alpha * eye_t), upper, upper - n_tgt)
            add((1.0 - alpha) * cross[layer], upper, self.encoder_top)
        capacity = np.concatenate(capacities)
        # validate=False lets NaN through: the whole sequence is then NaN, never a guess.
        self.undefined = not bool(np.all(np.isfinite(capacity)))
        edges = np.stack([np.concatenate(tails), np.concatenate(heads)], axis=1)
        self.graph = igraph.Graph(
            n=self.decoder_offset + (n_dec + 1) * n_tgt, edges=edges.tolist(), directed=True
        )
        self.capacity = capacity.tolist()

    def flows_from(self, layer: int, position: int) -> tuple[np.ndarray, np.ndarray]:
        """Max-flows from decoder node ``x_layer[position]`` to every source and target token."""
        source = np.zeros(self.n_src)
        target = np.zeros(self.n_tgt)
        if self.undefined:
            return source + np.nan, target + np.nan
        if not self.target_real[position]:
            return source, target  # a padded decoder row sends nothing
        node = self.decoder_offset + layer * self.n_tgt + position
        for s in np.flatnonzero(self.source_real):
            source[s] = self.graph.maxflow_value(node, int(s), capacity=self.capacity)
        for u in np.flatnonzero(self.target_real):
            target[u] = self.graph.maxflow_value(
                node, self.decoder_offset + int(u), capacity=self.capacity
            )
        return source, target
