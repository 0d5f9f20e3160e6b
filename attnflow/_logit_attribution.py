r"""Target-conditioned attributions of decoder LLMs: direct logit, ALTI-Logit, IFR.

Rollout and flow multiply head-averaged attention through every layer; on a causal LM
that product drifts to the first tokens and washes out the few heads that copy. The
methods here localise instead (see docs/llms.md): they read each head's *value-aware*
contribution at the explained row, condition it on the *target* token, and *sum* the
layers instead of multiplying them.

One attention layer :math:`l` at the explained row :math:`t` writes

.. math::

    y_t = x_t + \sum_h \sum_j A^{l,h}_{tj}\, f^{l,h}(x_j) + b_O ,
    \qquad f^{l,h}(x_j) = (\mathrm{norm}(x_j) W_V^h + b_V^h)\, W_O^h ,

into the residual stream. The final norm is linearised at the explained row's last
hidden state :math:`x^L_t` (its scale fixed, as ALTI-Logit does): the target's logit is
:math:`\langle x^L_t, u\rangle + c` with the *readout* :math:`u` (:func:`readout`), so each
term's share of the logit is a dot product with :math:`u`:

* **direct logit** :math:`D^{l,h}_{j} = A^{l,h}_{tj} \langle f^{l,h}(x_j), u\rangle`
  (:func:`direct_logit_terms`); summed over heads, tokens and layers, together with
  the biases, the MLPs and the embedding of :math:`t`, it is the logit exactly;
* **ALTI-Logit** (Ferrando et al. 2023) carries each :math:`D^{l,h}_k` down to the input
  tokens through the ALTI rollout of the layers below, :math:`\sum_k D^{l,h}_k R^{l-1}_{kj}`
  (:func:`alti_logit_terms`);
* **information flow routes** (Ferrando & Voita 2024), as FlashTrace sums them over
  layers: each part :math:`z = A^{l,h}_{tj} f^{l,h}(x_j)` and the residual :math:`x_t`
  compete for the layer's output by their proximity
  :math:`\max(\lVert y_t\rVert_1 - \lVert y_t - z\rVert_1, 0)`, normalised over all parts
  (:func:`ifr_terms`). Not target-conditioned through the logit, but through the row.

Everything is written once against the array API standard; the adapters only gather the
pieces (the attention rows at the target, the values, the projections, the unembedding
row, the final norm).
"""

from __future__ import annotations

from typing import Any, Literal

from . import _ifr_fused
from ._namespace import array_device, enter_boundary, resolve_namespace
from ._rollout import rollout
from ._typing import Namespace

__all__ = [
    "FinalNorm",
    "alti_logit_terms",
    "direct_logit_terms",
    "ifr_terms",
    "readout",
    "rollouts_below",
    "sum_terms",
]

#: The final norm of the model: RMSNorm (Llama, Mistral, Qwen2) or LayerNorm (GPT-2).
FinalNorm = Literal["rms", "layer"]

#: Elements of one block of IFR's parts ``(*batch, heads, rows, keys, d)``: 16 MiB in float32.
_CHUNK_ELEMENTS = 1 << 22


def readout(
    final_hidden: Any,
    unembedding: Any,
    /,
    *,
    norm: FinalNorm,
    weight: Any | None,
    bias: Any | None = None,
    eps: float,
    xp: Namespace | None = None,
) -> tuple[Any, Any]:
    r"""Return the readout direction of a target logit, the final norm linearised at the row.

    For an RMSNorm :math:`\gamma \odot x / \sqrt{\overline{x^2} + \epsilon}` and the target's
    unembedding row :math:`w`,

    .. math::

        u = \frac{\gamma \odot w}{\sqrt{\overline{(x^L)^2} + \epsilon}}, \qquad c = 0 ;

    for a LayerNorm :math:`\gamma \odot (x - \bar x)/\sigma + \beta`,

    .. math::

        u = \frac{P(\gamma \odot w)}{\sqrt{\operatorname{var}(x^L) + \epsilon}}, \qquad
        c = \langle \beta, w\rangle ,

    with :math:`P` the centring (the mean over the hidden axis removed). Then
    :math:`\mathrm{logit} = \langle x^L, u\rangle + c` exactly at :math:`x^L`, and every
    additive piece of the residual stream gets the share :math:`\langle \cdot, u\rangle`.

    Parameters
    ----------
    final_hidden : array ``(..., d)``
        The last hidden state at each explained row, before the final norm.
    unembedding : array ``(..., d)``
        The target's unembedding row at each explained row (for a contrast, the target's
        row minus the foil's).
    norm : {"rms", "layer"}
        The kind of final norm.
    weight, bias : array ``(d,)`` or None
        The norm's gain and (LayerNorm) bias.
    eps : float
        The norm's epsilon.

    Returns
    -------
    (u, c) : arrays ``(..., d)`` and ``(...)``

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._logit_attribution import readout
    >>> x, w, g = np.array([1.0, -2.0, 3.0]), np.array([0.5, 1.0, -1.0]), np.array([2.0, 1.0, 1.0])
    >>> u, c = readout(x, w, norm="rms", weight=g, eps=0.0)
    >>> logit = float((g * x / np.sqrt(np.mean(x**2))) @ w)
    >>> bool(np.isclose(x @ u + c, logit))
    True
    """
    if norm not in ("rms", "layer"):
        msg = f'`norm` must be "rms" or "layer"; got {norm!r}.'
        raise ValueError(msg)
    names = ("final_hidden", "unembedding", "weight", "bias")
    converted, boundary = enter_boundary([final_hidden, unembedding, weight, bias], names)
    final_hidden, unembedding, weight, bias = converted
    xp = resolve_namespace(final_hidden, unembedding, weight, bias, xp=xp, names=names)
    direction, constant = _readout(final_hidden, unembedding, norm, weight, bias, eps, xp)
    return boundary.restore(direction), boundary.restore(constant)


def _readout(
    final_hidden: Any,
    unembedding: Any,
    norm: FinalNorm,
    weight: Any | None,
    bias: Any | None,
    eps: float,
    xp: Namespace,
) -> tuple[Any, Any]:
    direction = unembedding if weight is None else unembedding * weight
    if norm == "rms":
        scale = xp.sqrt(xp.mean(final_hidden * final_hidden, axis=-1, keepdims=True) + eps)
        return direction / scale, xp.zeros(
            final_hidden.shape[:-1], dtype=final_hidden.dtype, device=array_device(final_hidden)
        )
    centred = final_hidden - xp.mean(final_hidden, axis=-1, keepdims=True)
    scale = xp.sqrt(xp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    direction = direction - xp.mean(direction, axis=-1, keepdims=True)
    constant = (
        xp.zeros(
            final_hidden.shape[:-1], dtype=final_hidden.dtype, device=array_device(final_hidden)
        )
        if bias is None
        else xp.sum(unembedding * bias, axis=-1)
    )
    return direction / scale, constant


def _by_query_head(values: Any, heads: int, xp: Namespace) -> Any:
    """``(*batch, Hv, n, dh)`` values for every query head ``(*batch, H, n, dh)`` (GQA)."""
    value_heads = values.shape[-3]
    if value_heads == heads:
        return values
    if heads % value_heads:
        msg = (
            f"{heads} query heads cannot share {value_heads} value heads: the number of "
            "query heads must be a multiple of the number of value heads."
        )
        raise ValueError(msg)
    group = heads // value_heads
    expanded = xp.expand_dims(values, axis=-3)  # (*batch, Hv, 1, n, dh)
    shape = (*values.shape[:-3], value_heads, group, *values.shape[-2:])
    return xp.reshape(
        xp.broadcast_to(expanded, shape), (*values.shape[:-3], heads, *values.shape[-2:])
    )


def direct_logit_terms(
    weights: Any,
    values: Any,
    output_weight: Any,
    readout_direction: Any,
    /,
    *,
    xp: Namespace | None = None,
) -> Any:
    r"""Each head's direct contribution of each token to the target logit, at one layer.

    .. math::

        D^{h}_{rj} = A^{h}_{rj}\, \langle v^{h}_j,\; W_O^{h} u_r \rangle ,

    with :math:`v^h_j = \mathrm{norm}(x_j) W_V^h + b_V^h` (the value bias included: its
    share over the row is :math:`\langle b_V^h W_O^h, u\rangle` since the row sums to one) and
    :math:`u_r` the readout of row :math:`r` (:func:`readout`). Summed over heads and tokens,
    plus :math:`\langle b_O, u\rangle`, it is the attention block's output at the row read
    out on :math:`u` (the decomposition identity, tested).

    Parameters
    ----------
    weights : array ``(*batch, H, r, n)``
        The attention rows of the explained positions (queries), per head.
    values : array ``(*batch, Hv, n, dh)``
        The value vectors of every token per value head, bias included; ``H`` must be a
        multiple of ``Hv`` (grouped-query attention: head ``h`` reads value head
        ``h // (H // Hv)``).
    output_weight : array ``(H * dh, d)``
        The output projection, applied as ``context @ W_O``.
    readout_direction : array ``(*batch, r, d)``
        The readout :math:`u` of each explained row.

    Returns
    -------
    array ``(*batch, H, r, n)``
        Signed: a token can push the target's logit down.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._logit_attribution import direct_logit_terms
    >>> rng = np.random.default_rng(0)
    >>> A = rng.dirichlet(np.ones(4), size=(1, 2, 1))           # (batch, H, r, n)
    >>> v = rng.normal(size=(1, 2, 4, 3))                       # (batch, H, n, dh)
    >>> W_O, u = rng.normal(size=(6, 5)), rng.normal(size=(1, 1, 5))
    >>> terms = direct_logit_terms(A, v, W_O, u)
    >>> context = np.concatenate([A[0, h] @ v[0, h] for h in range(2)], axis=-1)  # (r, H*dh)
    >>> bool(np.isclose(terms.sum(), (context @ W_O) @ u[0, 0]))
    True
    """
    names = ("weights", "values", "output_weight", "readout_direction")
    arrays, boundary = enter_boundary([weights, values, output_weight, readout_direction], names)
    weights, values, output_weight, readout_direction = arrays
    xp = resolve_namespace(*arrays, xp=xp, names=names)
    heads = weights.shape[-3]
    width, d = output_weight.shape
    per_head = xp.reshape(output_weight, (heads, width // heads, d))  # (H, dh, d)
    # W_O^h u_r for every head and row: (*batch, H, r, dh); then <v_j, .> for every key.
    readout_heads = xp.matmul(
        xp.expand_dims(readout_direction, axis=-3), xp.matrix_transpose(per_head)
    )
    keyed = _by_query_head(values, heads, xp)  # (*batch, H, n, dh)
    projected = xp.matmul(readout_heads, xp.matrix_transpose(keyed))  # (*batch, H, r, n)
    return boundary.restore(weights * projected)


def ifr_terms(
    weights: Any,
    values: Any,
    output_weight: Any,
    residual: Any,
    /,
    *,
    output_bias: Any | None = None,
    span: bool = False,
    threads: int | None = None,
    xp: Namespace | None = None,
) -> tuple[Any, Any]:
    r"""Information flow routes at the explained rows of one attention layer.

    The layer's output at row :math:`r` is split into parts, the residual :math:`x_r` and
    one vector per head and token, :math:`z^h_{rj} = A^h_{rj} v^h_j W_O^h`:
    :math:`y_r = x_r + \sum_{h,j} z^h_{rj} + b_O`. Each part's proximity to the whole
    (Ferrando & Voita 2024, "Information Flow Routes"),

    .. math::

        p(z) = \max\bigl(\lVert y_r\rVert_1 - \lVert y_r - z\rVert_1,\; 0\bigr) ,

    is divided by the sum of all parts' proximities (the residual's included), so the
    head-token shares and the residual's sum to one (all zero proximities give zeros).

    Parameters
    ----------
    weights : array ``(*batch, H, r, n)``
    values : array ``(*batch, Hv, n, dh)``
        As in :func:`direct_logit_terms`.
    output_weight : array ``(H * dh, d)``
    residual : array ``(*batch, r, d)``
        The block's input (the residual stream) at the explained rows.
    output_bias : array ``(d,)`` or None
        The output projection's bias: part of the whole, not a part.
    span : bool, default False
        Treat the ``r`` rows as one target span, as FlashTrace's sentence aggregate does:
        the wholes, the residuals and the attention rows are summed over the span before
        the proximities, :math:`y_S = \sum_{t \in S} y_t`, :math:`x_S = \sum_{t\in S} x_t`,
        :math:`z^h_j = (\sum_{t \in S} A^h_{tj}) f^h(x_j)`. The row axis is then of length 1.
    threads : int, optional
        Threads that share the rows on host memory (NumPy, PyTorch CPU, eager JAX on the
        CPU), where a compiled kernel forms each part in registers and skips the keys
        without weight; by default the CPUs this process may run on. The result does not
        depend on it. Elsewhere (a GPU, a lazy array) the array-API path forms the parts a
        block of keys at a time.

    Returns
    -------
    (terms, residual_share) : arrays ``(*batch, H, r, n)`` and ``(*batch, r)``

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._logit_attribution import ifr_terms
    >>> rng = np.random.default_rng(1)
    >>> A = rng.dirichlet(np.ones(4), size=(1, 2, 1))
    >>> v, W_O, x = rng.normal(size=(1, 2, 4, 3)), rng.normal(size=(6, 5)), rng.normal(size=(1, 1, 5))
    >>> terms, kept = ifr_terms(A, v, W_O, x)
    >>> bool(np.isclose(terms.sum() + kept.sum(), 1.0)), bool((terms >= 0).all())
    (True, True)
    """
    names = ("weights", "values", "output_weight", "residual", "output_bias")
    arrays, boundary = enter_boundary(
        [weights, values, output_weight, residual, output_bias], names
    )
    weights, values, output_weight, residual, output_bias = arrays
    xp = resolve_namespace(*arrays, xp=xp, names=names)
    heads = weights.shape[-3]
    width, d = output_weight.shape
    per_head = xp.reshape(output_weight, (heads, width // heads, d))
    keyed = _by_query_head(values, heads, xp)  # (*batch, H, n, dh)
    # f^h(x_j) = v^h_j W_O^h: (*batch, H, n, d)
    transformed = xp.matmul(keyed, per_head)
    rows = weights.shape[-2]
    if span:
        weights = xp.sum(weights, axis=-2, keepdims=True)
        residual = xp.sum(residual, axis=-2, keepdims=True)
    # (*batch, r, d): x_r + sum_h A^h_r f^h (+ b_O once per row of the span)
    whole = residual + xp.sum(xp.matmul(weights, transformed), axis=-3)
    if output_bias is not None:
        whole = whole + (rows if span else 1) * output_bias
    whole_norm = xp.sum(xp.abs(whole), axis=-1)  # (*batch, r)
    proximity = _ifr_fused.proximities(
        weights, transformed, whole, xp, threads=threads
    )  # host memory: the compiled kernel, each part formed in registers
    if proximity is None:
        proximity = _proximities(weights, transformed, whole, whole_norm, xp)
    kept = xp.clip(whole_norm - xp.sum(xp.abs(whole - residual), axis=-1), min=0.0)
    total = xp.sum(xp.sum(proximity, axis=-1), axis=-2) + kept  # (*batch, r)
    safe = xp.where(total > 0, total, xp.ones_like(total))
    shares = proximity / xp.expand_dims(xp.expand_dims(safe, axis=-2), axis=-1)
    return boundary.restore(shares), boundary.restore(kept / safe)


def _proximities(weights: Any, transformed: Any, whole: Any, whole_norm: Any, xp: Namespace) -> Any:
    r"""Return the proximities :math:`\max(\lVert y_r\rVert_1 - \lVert y_r - z\rVert_1, 0)`.

    One per part :math:`z = A^h_{rj} f^h_j`, ``(*batch, H, r, n)``.

    The array-API path: the parts ``(*batch, H, r, k, d)`` formed a block of keys at a
    time (about :data:`_CHUNK_ELEMENTS` elements); no data-dependent branch, so that it
    also traces (``jax.jit``).
    """
    heads, rows, n = weights.shape[-3:]
    d = transformed.shape[-1]
    batch = weights.shape[:-3]
    size = 1
    for extent in (*batch, heads, rows, d):
        size *= int(extent)
    step = max(1, _CHUNK_ELEMENTS // max(1, size))
    reference = xp.expand_dims(xp.expand_dims(whole_norm, axis=-2), axis=-1)  # (*b,1,r,1)
    target = xp.expand_dims(xp.expand_dims(whole, axis=-3), axis=-2)  # (*b,1,r,1,d)
    blocks = []
    for start in range(0, n, step):
        stop = min(n, start + step)
        block = weights[..., start:stop]
        # parts (*batch, H, r, k, d) = A[..., k, None] * f[..., None, k, :]
        parts = xp.expand_dims(block, axis=-1) * xp.expand_dims(
            transformed[..., start:stop, :], axis=-3
        )
        distance = xp.sum(xp.abs(target - parts), axis=-1)
        blocks.append(xp.clip(reference - distance, min=0.0))
    return blocks[0] if len(blocks) == 1 else xp.concat(blocks, axis=-1)


def alti_logit_terms(terms: Any, rollouts: Any, /, *, xp: Namespace | None = None) -> Any:
    r"""Carry each layer's direct logit terms down to the input tokens (ALTI-Logit).

    .. math::

        \mathrm{ALTI\text{-}Logit}^{l,h}_{rj} = \sum_k D^{l,h}_{rk}\, R^{l-1}_{kj} ,

    with :math:`R^{l-1}` the ALTI rollout of the layers below layer :math:`l` (the
    identity below the first), which splits token :math:`k`'s representation entering
    layer :math:`l` into the input tokens (Ferrando et al. 2023, "Explaining How
    Transformers Use Context to Build Predictions").

    Parameters
    ----------
    terms : array ``(*batch, L, H, r, n)``
        The direct logit terms of every layer (:func:`direct_logit_terms`).
    rollouts : array ``(*batch, L, n, n)``
        :math:`R^{l-1}` for each layer :math:`l` (the first is the identity).

    Returns
    -------
    array ``(*batch, L, H, r, n)``
    """
    names = ("terms", "rollouts")
    (terms, rollouts), boundary = enter_boundary([terms, rollouts], names)
    xp = resolve_namespace(terms, rollouts, xp=xp, names=names)
    return boundary.restore(xp.matmul(terms, xp.expand_dims(rollouts, axis=-3)))


def rollouts_below(matrices: Any, /, *, xp: Namespace | None = None) -> Any:
    r"""Return the ALTI rollout of the layers below each layer, the identity below the first.

    .. math::

        R^{0} = I, \qquad R^{l} = \hat C^{l} \cdots \hat C^{1} ,

    with :math:`\hat C^{l}` layer :math:`l`'s ALTI matrix, its rows renormalised to sum to
    one (:func:`attnflow.rollout` with ``residual=0, normalize_layers=True``): what
    :func:`alti_logit_terms` carries each layer's direct logit terms through.

    Parameters
    ----------
    matrices : array ``(*batch, L, n, n)``
        Every layer's ALTI matrix, rows the receiving tokens.
    xp : namespace, optional
        The array namespace (default: that of `matrices`).

    Returns
    -------
    array ``(*batch, L, n, n)``
        :math:`R^{l-1}` at layer :math:`l`.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow._logit_attribution import rollouts_below
    >>> c = np.tril(np.ones((2, 3, 3)))
    >>> below = rollouts_below(c / c.sum(-1, keepdims=True))
    >>> first = c[0] / c[0].sum(-1, keepdims=True)
    >>> bool(np.allclose(below[0], np.eye(3))), bool(np.allclose(below[1], first))
    (True, True)
    """
    (matrices,), boundary = enter_boundary([matrices], ("matrices",))
    xp = resolve_namespace(matrices, xp=xp, names=("matrices",))
    rolled = rollout(matrices, heads=None, residual=0.0, normalize_layers=True, layers="all")
    n = matrices.shape[-1]
    eye = xp.eye(n, dtype=rolled.dtype, device=array_device(rolled))
    first = xp.broadcast_to(eye, (*matrices.shape[:-3], 1, n, n))
    return boundary.restore(xp.concat([first, rolled[..., :-1, :, :]], axis=-3))


def sum_terms(
    terms: Any,
    /,
    *,
    heads: Literal["sum", "each"] = "sum",
    layers: Literal["sum", "all", "cumulative"] = "sum",
    xp: Namespace | None = None,
) -> Any:
    """Sum ``(*batch, L, H, r, n)`` terms over heads and layers, or keep them.

    ``heads="each"`` keeps the head axis, ``layers="all"`` the layer axis;
    ``layers="cumulative"`` keeps it as running sums, layer ``l`` holding the layers up to
    it (the last is the whole method, as rollout's last layer is).
    """
    (terms,), boundary = enter_boundary([terms], ("terms",))
    xp = resolve_namespace(terms, xp=xp, names=("terms",))
    if heads == "sum":
        terms = xp.sum(terms, axis=-3)
    axis = -4 if heads == "each" else -3
    if layers == "sum":
        terms = xp.sum(terms, axis=axis)
    elif layers == "cumulative":
        terms = xp.cumulative_sum(terms, axis=axis)
    return boundary.restore(terms)
