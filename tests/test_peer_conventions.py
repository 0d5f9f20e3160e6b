"""Peers' conventions that change results, each beside the attnflow call that reproduces
the peer (issue 23, item 3; docs/maths.md, "Peers' conventions").

The peers' rules are re-implemented here from their published descriptions (NumPy, one
item, float64), not imported: vit-explain's ``rollout`` with ``discard_ratio``
(``jacobgil/vit-explain``, ``vit_rollout.py``) and Chefer et al.'s encoder-decoder rule as
their DETR / MM-Explainability code runs it (0/0 rows, then every NaN of the product set
to zero).
"""

from __future__ import annotations

import numpy as np
import pytest
from oracle import softmax_attention

import attnflow

L, H, N = 3, 4, 6


# -- vit-explain's discard_ratio ----------------------------------------------------------
def vit_explain_layers(
    attentions: np.ndarray, discard_ratio: float, fusion: str, *, keepdim: bool = False
) -> list[np.ndarray]:
    """vit-explain's per-layer matrices, batch of one, from its description.

    Fuse the heads (mean, max or min); rank all ``n*n`` entries of the fused matrix,
    take the ``int(n*n*discard_ratio)`` smallest and zero them, except the flat index 0
    (the entry (0, 0)); mix ``(A + I) / 2``; divide by ``a.sum(dim=-1)`` *without*
    keepdim, which for a ``(1, n, n)`` tensor divides column ``j`` by row ``j``'s sum
    (`keepdim=True` is the corrected division).
    """
    layers = []
    n = attentions.shape[-1]
    for layer in attentions:
        fused = {"mean": np.mean, "max": np.max, "min": np.min}[fusion](layer, axis=0)[None]
        flat = fused.reshape(1, -1)  # a view, as torch's .view
        k = int(flat.shape[-1] * discard_ratio)
        smallest = np.argsort(flat[0], kind="stable")[:k]
        flat[0, smallest[smallest != 0]] = 0.0
        mixed = (fused + np.eye(n)) / 2
        sums = mixed.sum(axis=-1, keepdims=keepdim)
        layers.append((mixed / sums)[0])
    return layers


def vit_explain(attentions: np.ndarray, discard_ratio: float, fusion: str) -> np.ndarray:
    """vit-explain's map: ``result[0, 1:]`` of the product, divided by its maximum."""
    result = np.eye(attentions.shape[-1])
    for layer in vit_explain_layers(attentions, discard_ratio, fusion):
        result = layer @ result
    with np.errstate(invalid="ignore", divide="ignore"):
        return result[0, 1:] / result[0, 1:].max()


@pytest.fixture(scope="module")
def vit_attention() -> np.ndarray:
    return softmax_attention(np.random.default_rng(23), (L, H, N, N), scale=2.0)


def test_vit_explain_without_discard_is_attnflow_rollout(vit_attention: np.ndarray) -> None:
    # Mean fusion, no discard: rows of (A + I) / 2 sum to one, so the missing keepdim
    # does no harm and vit-explain is the paper's rollout (attnflow's defaults).
    expected = vit_explain(vit_attention, 0.0, "mean")
    row = attnflow.rollout(vit_attention, heads="mean", residual=0.5, rows=0)
    np.testing.assert_allclose(row[1:] / row[1:].max(), expected, rtol=1e-12)


@pytest.mark.parametrize("fusion", ["mean", "max"])
def test_vit_explain_with_discard_is_rollout_of_its_own_layers(
    vit_attention: np.ndarray, fusion: str
) -> None:
    # Once entries are discarded (or heads are max-fused), vit-explain's layers are not
    # attnflow's: attnflow composes them exactly when given as they are, fused, with no
    # residual and no row-sum check (heads=None, residual=0, validate=False).
    layers = np.stack(vit_explain_layers(vit_attention, 0.5, fusion))
    row = attnflow.rollout(layers, heads=None, residual=0.0, validate=False, rows=0)
    np.testing.assert_allclose(row[1:] / row[1:].max(), vit_explain(vit_attention, 0.5, fusion))
    # Its rows do not sum to one (the missing keepdim divides columns) ...
    assert np.abs(layers.sum(-1) - 1).max() > 0.01
    # ... and the keepdim fix changes the mean-fusion map once discard > 0.
    fixed = np.stack(vit_explain_layers(vit_attention, 0.5, fusion, keepdim=True))
    np.testing.assert_allclose(fixed.sum(-1), 1.0, rtol=1e-12)
    fixed_row = attnflow.rollout(fixed, heads=None, residual=0.0, rows=0)
    assert np.abs(fixed_row[1:] / fixed_row[1:].max() - row[1:] / row[1:].max()).max() > 1e-3


def test_vit_explain_discards_the_cls_column_attnflow_never(vit_attention: np.ndarray) -> None:
    # vit-explain ranks all n^2 entries and spares only (0, 0); attnflow's discard never
    # touches column 0 (the [CLS] key) and renormalises the pruned rows before the mix.
    one = vit_attention[:1]
    peer = vit_explain_layers(one, 0.7, "mean")[0]
    dropped_cls_keys = [i for i in range(1, N) if peer[i, 0] == 0]
    assert dropped_cls_keys  # some token's weight on [CLS] is discarded by the peer
    ours = attnflow.rollout(one, heads="mean", residual=0.0, discard=0.7)
    assert (ours[:, 0] > 0).all()
    np.testing.assert_allclose(ours.sum(-1), 1.0, rtol=1e-12)


def test_vit_explain_returns_nan_maps_where_attnflow_returns_zeros() -> None:
    # The [CLS] query's weights on the patches are the smallest entries: at discard 0.9
    # vit-explain zeroes them all, the map is 0 / max(0) = NaN everywhere.
    fused = np.full((N, N), 1.0 / N)
    fused[0] = [1.0 - 0.002 * (N - 1)] + [0.002] * (N - 1)
    attentions = np.broadcast_to(fused, (2, H, N, N)).copy()
    assert np.isnan(vit_explain(attentions, 0.9, "mean")).all()
    row = attnflow.rollout(attentions, heads="mean", discard=0.9, rows=0)
    assert np.isfinite(row).all()
    np.testing.assert_allclose(row.sum(), 1.0)


# -- Chefer's encoder-decoder rule on a causal decoder ------------------------------------
S, T, L_E, L_D = 4, 5, 2, 2


def chefer_encoder_decoder(
    encoder: np.ndarray,
    decoder: np.ndarray,
    cross: np.ndarray,
    grads: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> np.ndarray:
    """Chefer et al.'s rules as their code runs them: ``R_ts`` of the last decoder layer.

    ``cam = mean_h((grad * A)^+)``; encoder ``R_ss += cam R_ss``; per decoder layer the
    self-attention rules ``R_tt += cam R_tt``, ``R_ts += cam R_ts``, then the cross rule
    ``R_ts += bar(R_tt)^T cam_ts bar(R_ss)`` with ``bar(R) = (R - I) / rowsum(R - I) + I``,
    a 0/0 giving NaN rows, and every NaN of the added product set to zero.
    """

    def cam(a: np.ndarray, g: np.ndarray) -> np.ndarray:
        return np.clip(g * a, 0, None).mean(axis=0)

    def handle_residual(r: np.ndarray) -> np.ndarray:
        hat = r - np.eye(len(r))
        with np.errstate(invalid="ignore", divide="ignore"):
            return hat / hat.sum(-1, keepdims=True) + np.eye(len(r))

    n_src, n_tgt = encoder.shape[-1], decoder.shape[-1]
    r_ss, r_tt, r_ts = np.eye(n_src), np.eye(n_tgt), np.zeros((n_tgt, n_src))
    for a, g in zip(encoder, grads[0], strict=True):
        r_ss = r_ss + cam(a, g) @ r_ss
    for a, g, c, gc in zip(decoder, grads[1], cross, grads[2], strict=True):
        self_cam = cam(a, g)
        r_tt, r_ts = r_tt + self_cam @ r_tt, r_ts + self_cam @ r_ts
        with np.errstate(invalid="ignore"):
            added = handle_residual(r_tt).T @ (cam(c, gc) @ handle_residual(r_ss))
        added[np.isnan(added)] = 0.0
        r_ts = r_ts + added
    return r_ts


@pytest.fixture(scope="module")
def causal_model() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(2311)
    encoder = softmax_attention(rng, (L_E, H, S, S), scale=2.0)
    logits = rng.normal(scale=2.0, size=(L_D, H, T, T))
    logits[..., np.triu(np.ones((T, T), bool), 1)] = -np.inf  # causal
    decoder = np.exp(logits - logits.max(-1, keepdims=True))
    decoder /= decoder.sum(-1, keepdims=True)
    cross = softmax_attention(rng, (L_D, H, T, S), scale=2.0)
    grads = tuple(rng.normal(size=x.shape) for x in (encoder, decoder, cross))
    return encoder, decoder, cross, *grads


def _explaining(position: int, grads: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """The gradients of position `position`'s output: in a causal decoder the later
    positions' attention (decoder and cross rows after it) does not reach it."""
    encoder_grad, decoder_grad, cross_grad = (g.copy() for g in grads)
    decoder_grad[..., position + 1 :, :] = 0.0
    cross_grad[..., position + 1 :, :] = 0.0
    return encoder_grad, decoder_grad, cross_grad


@pytest.mark.parametrize("position", [0, 2, T - 1])
def test_chefer_on_a_causal_decoder_is_zero_except_at_the_last_position(
    causal_model: tuple[np.ndarray, ...], position: int
) -> None:
    encoder, decoder, cross, *grads = causal_model
    given = _explaining(position, tuple(grads))
    peer = chefer_encoder_decoder(encoder, decoder, cross, given)
    source, _ = attnflow.encoder_decoder_rollout(
        encoder, decoder, cross, rule="gae", gradients=given, rows=position
    )
    if position < T - 1:
        # The later positions' rows of R_tt - I stay zero: 0/0, and the reference zeroes
        # the whole cross-attention term of every layer; nothing reaches the source.
        assert (peer[position] == 0).all()
        # attnflow keeps those rows as identity rows; its answer is the reference's on
        # the prefix that ends at `position`, where no row is empty (the peer reproduced
        # by cropping the target to positions 0..position).
        end = position + 1
        prefix = chefer_encoder_decoder(
            encoder,
            decoder[..., :end, :end],
            cross[..., :end, :],
            (given[0], given[1][..., :end, :end], given[2][..., :end, :]),
        )
        np.testing.assert_allclose(source, prefix[position], rtol=1e-10)
        assert np.abs(source).max() > 1e-3
    else:
        # At the last position no row is empty: attnflow equals the reference.
        np.testing.assert_allclose(source, peer[position], rtol=1e-10)
        assert np.abs(source).max() > 1e-3
