r"""The encoder-decoder flow graph as layered graphs, for the max-flow engine of `flow`.

The graph of :func:`attnflow.encoder_decoder_flow` (docs/maths.md, "Encoder-decoder flow")
has the encoder layers :math:`e_0 .. e_{L_e}` (``S`` tokens each) and the decoder layers
:math:`x_0 .. x_{L_d}` (``T`` positions each), with the edges

- :math:`e_k[i] \to e_{k-1}[j]`: :math:`(1-\alpha) E_k[i, j] + \alpha [i = j]`,
- :math:`x_l[t] \to x_{l-1}[u]`: :math:`\alpha \tilde D_l[t, u]`, with
  :math:`\tilde D_l = (1-\alpha) D_l + \alpha I`,
- :math:`x_l[t] \to e_{L_e}[s]`: :math:`(1-\alpha) C_l[t, s]`.

Its paths have different lengths (a cross edge jumps from any decoder layer to the top
encoder layer), so it is not layered. Two layered graphs give every max-flow of it:

- **Target tokens.** No edge leads from the encoder back to the decoder, so every path
  from :math:`x_l[t]` to :math:`x_0[u]` stays in the decoder: the max-flow is that of the
  layered graph of :math:`\alpha \tilde D_1 .. \alpha \tilde D_l`, which is :math:`\alpha`
  times that of :math:`\tilde D_1 .. \tilde D_l` (scaling every capacity scales every
  flow): the graph of :func:`attnflow.flow` on the decoder (`decoder_capacities`).
- **Source tokens.** `source_capacities` lays the graph out on ``L_e + L_d`` matrices of
  ``S + T`` tokens (the first ``S`` the source slots, the last ``T`` the target slots):
  layer ``k <= L_e`` holds :math:`e_k` in its source slots, layer ``L_e + l`` holds
  :math:`x_l` in its target slots and a copy of :math:`e_{L_e}` in its source slots. A copy
  passes everything it receives one layer down, along an edge of capacity ``P`` (the
  *pass-through*) to the same slot, so that a cross edge of :math:`x_l` enters the copy
  of :math:`e_{L_e}` one layer below it and reaches :math:`e_{L_e}` itself through
  ``l - 1`` pass-through edges. Contracting every chain of copies gives the original
  graph back (without :math:`x_0`, which no path to a source token enters), and a flow of
  one source, split into paths (the graph has no cycle), puts at most its value on any
  edge. That value is at most the capacity out of the source, at most the largest row
  sum of the capacities; ``P`` is at least that (and at least 1), so no pass-through edge
  limits a flow.
"""

from __future__ import annotations

import numpy as np

__all__ = ["decoder_capacities", "source_capacities"]


def source_capacities(
    encoder: np.ndarray,
    decoder: np.ndarray,
    cross: np.ndarray,
    source_real: np.ndarray,
    target_real: np.ndarray,
    *,
    alpha: float,
) -> np.ndarray:
    r"""Capacities of the layered graph of the source tokens, ``(*batch, L_e + L_d, S + T, S + T)``.

    Parameters
    ----------
    encoder, decoder, cross : ndarray
        Head-fused attention on the host, float64: ``(*batch, L_e, S, S)``,
        ``(*batch, L_d, T, T)`` and ``(*batch, L_d, T, S)``; padded rows and columns are
        zero.
    source_real, target_real : ndarray of bool
        ``(*batch, S)`` and ``(*batch, T)``: True for real tokens (padded ones get no
        residual and no pass-through).
    alpha : float
        The residual weight :math:`\alpha` of every sub-layer.

    Returns
    -------
    ndarray
        Matrix ``i`` holds the edges from layer ``i + 1`` down to layer ``i`` (``Ã_{i+1}``
        of attention flow): a source node :math:`x_l[t]` is row ``S + t`` of layer
        ``L_e + l``; the sink :math:`e_0[s]` is token ``s`` of layer 0.

    Examples
    --------
    >>> import numpy as np
    >>> enc = np.array([[[0.5, 0.5], [0.0, 1.0]]])   # L_e = 1, S = 2
    >>> dec = np.array([[[1.0]]])                     # L_d = 1, T = 1
    >>> crs = np.array([[[0.25, 0.75]]])
    >>> real = np.ones(2, dtype=bool), np.ones(1, dtype=bool)
    >>> source_capacities(enc, dec, crs, *real, alpha=0.5)
    array([[[0.75 , 0.25 , 0.   ],
            [0.   , 1.   , 0.   ],
            [0.   , 0.   , 0.   ]],
    <BLANKLINE>
           [[1.   , 0.   , 0.   ],
            [0.   , 1.   , 0.   ],
            [0.125, 0.375, 0.5  ]]])
    """
    *batch, n_enc, n_src, _ = encoder.shape
    n_dec, n_tgt = decoder.shape[-3], decoder.shape[-1]
    n = n_src + n_tgt
    src, tgt = slice(0, n_src), slice(n_src, n)
    out = np.zeros((*batch, n_enc + n_dec, n, n))
    source_unit = source_real.astype(np.float64)[..., None, :]  # (*batch, 1, S)
    target_unit = target_real.astype(np.float64)[..., None, :]

    low, high = out[..., :n_enc, :, :], out[..., n_enc:, :, :]
    np.multiply(encoder, 1.0 - alpha, out=low[..., src, src])
    np.multiply(decoder, alpha * (1.0 - alpha), out=high[..., tgt, tgt])
    np.multiply(cross, 1.0 - alpha, out=high[..., tgt, src])
    _diagonal(low[..., src, src])[...] += alpha * source_unit
    _diagonal(high[..., tgt, tgt])[...] += alpha * alpha * target_unit
    with np.errstate(invalid="ignore"):  # NaN capacities (validate=False) stay NaN
        rows = out.sum(axis=-1)
    finite = rows[np.isfinite(rows)]
    passing = max(1.0, float(finite.max(initial=0.0)))
    _diagonal(high[..., src, src])[...] = passing * source_unit  # copies of e_{L_e}
    return out


def decoder_capacities(decoder: np.ndarray, target_real: np.ndarray, *, alpha: float) -> np.ndarray:
    r"""Return the decoder's graph :math:`\tilde D_l = (1-\alpha) D_l + \alpha I`, layered.

    ``(*batch, L_d, T, T)``. The target part of the encoder-decoder graph is
    :math:`\alpha` times this graph's capacities, so its max-flows are :math:`\alpha`
    times this graph's.

    Parameters
    ----------
    decoder : ndarray
        Head-fused decoder self-attention on the host, float64, ``(*batch, L_d, T, T)``;
        padded rows and columns are zero.
    target_real : ndarray of bool
        ``(*batch, T)``: True for real positions (padded ones get no residual).
    alpha : float
        The residual weight :math:`\alpha`.

    Returns
    -------
    ndarray
        Matrix ``l - 1`` holds the edges from :math:`x_l` down to :math:`x_{l-1}`.

    Examples
    --------
    >>> import numpy as np
    >>> dec = np.array([[[1.0, 0.0], [0.5, 0.5]]])  # L_d = 1, T = 2
    >>> decoder_capacities(dec, np.ones(2, dtype=bool), alpha=0.5)
    array([[[1.  , 0.  ],
            [0.25, 0.75]]])
    """
    mixed = (1.0 - alpha) * decoder
    _diagonal(mixed)[...] += alpha * target_real.astype(np.float64)[..., None, :]
    return mixed


def _diagonal(blocks: np.ndarray) -> np.ndarray:
    """Return a writeable view of the diagonal of each square block, ``(..., k)``."""
    diagonal: np.ndarray = np.einsum("...ii->...i", blocks)
    return diagonal
