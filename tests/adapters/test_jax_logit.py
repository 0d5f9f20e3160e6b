"""explain_linen / explain_nnx with the target-conditioned methods, on small Flax decoders.

A GPT-2-style decoder (learned positions, pre-LN blocks with a causal and padding mask,
a GELU MLP, a final LayerNorm or RMSNorm, a Dense head or the embedding's ``attend``) is
built here in linen and in NNX with random weights and biases. The reference is a
forward pass of the same model written in NumPy from its parameters (checked against the
model's logits), and the direct logit attribution written from the formula: per layer,
head and token, the attention row at the explained position times the value through the
output projection, dotted with the target's unembedding row through the final norm
linearised at that row. ALTI-Logit and IFR are checked against the core's rules fed with
pieces computed in NumPy (the ALTI matrices by the loop oracle of ``tests/oracle.py``).
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("flax", reason="the JAX adapter needs flax (and jax)")

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from attnflow._logit_attribution import alti_logit_terms, ifr_terms
from attnflow.adapters import jax as adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import oracle_contributions, oracle_head_values

jax.config.update("jax_enable_x64", False)
x64 = jax.enable_x64

V, N, D, H, LAYERS = 13, 6, 8, 2, 2
IDS = np.array([[1, 5, 2, 7, 3, 9], [4, 4, 11, 6, 0, 0]])
PAD = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=bool)
LAST = np.array([5, 3])  # each sample's last real token
#: Concrete forward passes of the test models (an abstract trace is not one).
RAN: list[int] = []


def _note(logits: Any) -> Any:
    if not isinstance(logits, jax.core.Tracer):
        RAN.append(1)
    return logits


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


# -- the models ----------------------------------------------------------------------------------
class LinenBlock(nn.Module):
    dtype: Any

    @nn.compact
    def __call__(self, x: Any, mask: Any) -> Any:
        kw = {"dtype": self.dtype, "param_dtype": self.dtype}
        attention = nn.MultiHeadDotProductAttention(num_heads=H, name="attn", **kw)
        h = x + attention(nn.LayerNorm(name="ln1", **kw)(x), mask=mask)
        inner = nn.gelu(nn.Dense(2 * D, name="fc1", **kw)(nn.LayerNorm(name="ln2", **kw)(h)))
        return h + nn.Dense(D, name="fc2", **kw)(inner)


class LinenPostBlock(nn.Module):
    """BERT-like, refused: h = LN(x + Attn(x))."""

    dtype: Any

    @nn.compact
    def __call__(self, x: Any, mask: Any) -> Any:
        kw = {"dtype": self.dtype, "param_dtype": self.dtype}
        attention = nn.MultiHeadDotProductAttention(num_heads=H, name="attn", **kw)
        return nn.LayerNorm(name="ln", **kw)(x + attention(x, mask=mask))


class LinenGPT(nn.Module):
    dtype: Any
    tied: bool = False
    head: str = "plain"  # "plain", "scaled" (logits * 2) or "shifted" (Dense(2 * LN(h)))
    post_ln: bool = False

    @nn.compact
    def __call__(self, ids: Any, pad: Any) -> Any:
        kw = {"dtype": self.dtype, "param_dtype": self.dtype}
        embed = nn.Embed(V, D, name="embed", **kw)
        positions = self.param("pos", nn.initializers.normal(0.5), (N, D), self.dtype)
        x = embed(ids) + positions
        mask = nn.combine_masks(nn.make_causal_mask(ids), nn.make_attention_mask(pad, pad))
        for i in range(LAYERS):
            block = LinenPostBlock if self.post_ln else LinenBlock
            x = block(self.dtype, name=f"block{i}")(x, mask)
        final = nn.LayerNorm(name="ln_f", **kw)(x)
        if self.head == "shifted":
            final = 2.0 * final
        logits = embed.attend(final) if self.tied else nn.Dense(V, name="lm_head", **kw)(final)
        return _note(2.0 * logits if self.head == "scaled" else logits)


class NNXBlock(nnx.Module):
    def __init__(self, dtype: Any, rngs: nnx.Rngs) -> None:
        kw = {"dtype": dtype, "param_dtype": dtype, "rngs": rngs}
        self.ln1 = nnx.LayerNorm(D, **kw)
        self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, **kw)
        self.ln2 = nnx.LayerNorm(D, **kw)
        self.fc1 = nnx.Linear(D, 2 * D, **kw)
        self.fc2 = nnx.Linear(2 * D, D, **kw)

    def __call__(self, x: Any, mask: Any) -> Any:
        h = x + self.attn(self.ln1(x), mask=mask)
        return h + self.fc2(nnx.gelu(self.fc1(self.ln2(h))))


class NNXGPT(nnx.Module):
    def __init__(self, dtype: Any, *, tied: bool = False, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        kw = {"dtype": dtype, "param_dtype": dtype, "rngs": rngs}
        self.embed = nnx.Embed(V, D, **kw)
        self.pos = nnx.Param(jnp.zeros((N, D), dtype))
        self.blocks = nnx.List([NNXBlock(dtype, rngs) for _ in range(LAYERS)])
        self.ln_f = nnx.RMSNorm(D, **kw)
        self.lm_head = nnx.Linear(D, V, **kw)
        self.tied = tied

    def __call__(self, ids: Any, pad: Any) -> Any:
        x = self.embed(ids) + self.pos[...]
        mask = nnx.combine_masks(nnx.make_causal_mask(ids), nnx.make_attention_mask(pad, pad))
        for block in self.blocks:
            x = block(x, mask)
        final = self.ln_f(x)
        return _note(self.embed.attend(final) if self.tied else self.lm_head(final))


def _random_parameters(shapes: Any, seed: int) -> Any:
    """Random values for abstract parameters: every bias and norm shift non-zero.

    Drawn in NumPy from the shapes of an abstract init (no XLA program is compiled).
    """
    rng = np.random.default_rng(seed)

    def draw(path: Any, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        names = [getattr(k, "key", None) for k in path]
        name = next(n for n in reversed(names) if isinstance(n, str))
        noise = rng.normal(size=leaf.shape)
        if name == "scale":
            noise = 1.0 + 0.3 * noise
        elif name == "kernel":
            noise = noise / np.sqrt(leaf.shape[0])
        elif name != "embedding":
            noise = 0.3 * noise  # biases, positions
        return jnp.asarray(noise, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@functools.cache
def _linen_variables(dtype: Any, tied: bool, post_ln: bool) -> Any:
    model = LinenGPT(dtype, tied=tied, post_ln=post_ln)
    shapes = jax.eval_shape(model.init, jax.random.key(0), IDS, PAD)
    return {"params": _random_parameters(shapes["params"], 1)}


def linen_setup(dtype: Any, **options: Any) -> tuple[Any, Any, Any]:
    """A linen decoder (built once per dtype and parameter layout) and its explain."""
    model = LinenGPT(dtype, **options)
    variables = _linen_variables(dtype, model.tied, model.post_ln)
    call = lambda **kw: adapter.explain_linen(model, variables, IDS, PAD, **kw)
    return model, variables, call


@functools.cache
def nnx_setup(dtype: Any, **options: Any) -> tuple[Any, Any]:
    """An NNX decoder (built once per dtype and head) and its explain."""
    model = nnx.eval_shape(lambda: NNXGPT(dtype, **options))
    nnx.update(model, _random_parameters(nnx.state(model, nnx.Param), 2))
    call = lambda **kw: adapter.explain_nnx(model, IDS, PAD, **kw)
    return model, call


# -- the NumPy reference -------------------------------------------------------------------------
def _linen_parameters(variables: Any, tied: bool) -> dict[str, Any]:
    p = jax.tree.map(np.asarray, variables["params"])
    blocks = []
    for i in range(LAYERS):
        b = p[f"block{i}"]
        blocks.append(
            {
                "ln1": (b["ln1"]["scale"], b["ln1"]["bias"]),
                "ln2": (b["ln2"]["scale"], b["ln2"]["bias"]),
                **{
                    k: (b["attn"][k]["kernel"], b["attn"][k]["bias"])
                    for k in ("query", "key", "value", "out")
                },
                "fc1": (b["fc1"]["kernel"], b["fc1"]["bias"]),
                "fc2": (b["fc2"]["kernel"], b["fc2"]["bias"]),
            }
        )
    embed = p["embed"]["embedding"]
    head = (embed.T, None) if tied else (p["lm_head"]["kernel"], p["lm_head"]["bias"])
    final = ("layer", p["ln_f"]["scale"], p["ln_f"]["bias"])
    return {"embed": embed, "pos": p["pos"], "blocks": blocks, "final": final, "head": head}


def _nnx_parameters(model: NNXGPT) -> dict[str, Any]:
    def a(variable: Any) -> np.ndarray:
        return np.asarray(variable[...])

    blocks = []
    for b in model.blocks:
        attention = {
            k: (a(getattr(b.attn, k).kernel), a(getattr(b.attn, k).bias))
            for k in ("query", "key", "value", "out")
        }
        blocks.append(
            {
                "ln1": (a(b.ln1.scale), a(b.ln1.bias)),
                "ln2": (a(b.ln2.scale), a(b.ln2.bias)),
                **attention,
                "fc1": (a(b.fc1.kernel), a(b.fc1.bias)),
                "fc2": (a(b.fc2.kernel), a(b.fc2.bias)),
            }
        )
    embed = a(model.embed.embedding)
    head = (embed.T, None) if model.tied else (a(model.lm_head.kernel), a(model.lm_head.bias))
    final = ("rms", a(model.ln_f.scale), None)
    return {"embed": embed, "pos": a(model.pos), "blocks": blocks, "final": final, "head": head}


def _layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    centred = x - x.mean(-1, keepdims=True)
    return scale * centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-6) + bias


def reference(p: dict[str, Any]) -> dict[str, Any]:
    """The decoder's forward in NumPy (float64), keeping what the methods read, per sample."""
    f64 = lambda t: jax.tree.map(lambda v: None if v is None else np.asarray(v, np.float64), t)
    p = {k: (v if k == "final" else f64(v)) for k, v in p.items()}
    x = p["embed"][IDS] + p["pos"]  # (B, n, d)
    allowed = np.tril(np.ones((N, N), dtype=bool))[None] & PAD[:, None, :] & PAD[:, :, None]
    layers = []
    for blk in p["blocks"]:
        z = _layer_norm(x, *blk["ln1"])
        q, k, v = (
            np.einsum("bnd,dhe->bhne", z, blk[n][0]) + blk[n][1][:, None]
            for n in ("query", "key", "value")
        )
        scores = np.einsum("bhie,bhje->bhij", q / np.sqrt(q.shape[-1]), k)
        scores = np.where(allowed[:, None], scores, -1e30)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        w_v = blk["value"][0].reshape(D, -1)
        b_v = blk["value"][1].reshape(-1)
        w_o = blk["out"][0].reshape(-1, D)
        b_o = blk["out"][1]
        f = np.stack([oracle_head_values(z[b], w_v, b_v, w_o, H) for b in range(len(IDS))])
        h = x + np.einsum("bhij,bhjd->bid", weights, f) + b_o
        mlp = _gelu(_layer_norm(h, *blk["ln2"]) @ blk["fc1"][0] + blk["fc1"][1]) @ blk["fc2"][0]
        mlp = mlp + blk["fc2"][1]
        layers.append(
            {"x": x, "weights": weights, "values": v, "f": f, "w_o": w_o, "b_o": b_o, "mlp": mlp}
        )
        x = h + mlp
    kind, scale, shift = p["final"]
    scale = np.asarray(scale, np.float64)
    centred = x - x.mean(-1, keepdims=True) if kind == "layer" else x
    sigma = np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-6)
    normed = scale * centred / sigma + (0.0 if shift is None else np.asarray(shift, np.float64))
    weight, bias = p["head"]
    logits = normed @ weight + (0.0 if bias is None else bias)
    return {
        "embedded": p["embed"][IDS] + p["pos"],
        "layers": layers,
        "final": x,
        "sigma": sigma[..., 0],
        "kind": kind,
        "scale": scale,
        "shift": shift,
        "weight": weight,
        "bias": bias,
        "logits": logits,
    }


def share(ref: dict[str, Any], piece: np.ndarray, b: int, t: int, w: int) -> float:
    """What `piece` (a vector added to the residual stream) adds to logit `w` at row `t`."""
    if ref["kind"] == "layer":
        piece = piece - piece.mean(-1, keepdims=True)
    return float((ref["scale"] * piece / ref["sigma"][b, t]) @ ref["weight"][:, w])


def hand_direct_logit(ref: dict[str, Any], rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``(B, L, H, r, n)``: A^{l,h}_{tj} times f^{l,h}(x_j) through the linearised final norm."""
    out = np.zeros((len(IDS), LAYERS, H, rows.shape[1], N))
    for b in range(len(IDS)):
        for r, t in enumerate(rows[b]):
            for l, layer in enumerate(ref["layers"]):
                for h in range(H):
                    for j in range(N):
                        term = share(ref, layer["f"][b, h, j], b, t, targets[b, r])
                        out[b, l, h, r, j] = layer["weights"][b, h, t, j] * term
    return out


@functools.cache
def _models(dtype: Any, tied: bool) -> list[tuple[str, Any, dict[str, Any], np.ndarray]]:
    """``(frontend, explain, parameters, the model's own logits)`` of both decoders."""
    linen_model, variables, linen_call = linen_setup(dtype, tied=tied)
    nnx_model, nnx_call = nnx_setup(dtype, tied=tied)
    return [
        (
            "linen",
            linen_call,
            _linen_parameters(variables, tied),
            np.asarray(linen_model.apply(variables, IDS, PAD)),
        ),
        ("nnx", nnx_call, _nnx_parameters(nnx_model), np.asarray(nnx_model(IDS, PAD))),
    ]


#: How close the adapter comes to the NumPy reference in float64. NNX's default attention
#: runs jax.nn.dot_product_attention, which on the CPU computes float64 inputs at about
#: float32 precision (its logits are ~1e-7 from a float64 forward): the adapter reads what
#: the model computed, so its terms are that far from the reference too.
TOLERANCE = {"linen": {"rtol": 1e-9, "atol": 1e-11}, "nnx": {"rtol": 1e-5, "atol": 1e-8}}


# -- the direct logit against the hand oracle ------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True], ids=["dense", "tied"])
def test_direct_logit_equals_the_hand_oracle_and_adds_up_to_the_logit_float64(tied):
    with x64(True):
        for frontend, call, parameters, logits in _models(jnp.float64, tied):
            ref = reference(parameters)
            got_logits = call(
                method="direct_logit", rows=-1, heads="each", options={"layers": "all"}
            )
            rows = LAST[:, None]
            targets = ref["logits"][np.arange(2), LAST].argmax(-1)
            expected = hand_direct_logit(ref, rows, targets[:, None])[..., 0, :]
            assert got_logits.dtype == jnp.float64, frontend
            tolerance = TOLERANCE[frontend]
            np.testing.assert_allclose(got_logits, expected, **tolerance, err_msg=frontend)
            # The summed form is the head-resolved form summed; padding gets nothing.
            summed = call(method="direct_logit", rows=-1)
            np.testing.assert_allclose(summed, np.asarray(got_logits).sum((1, 2)), rtol=1e-12)
            assert np.all(np.asarray(summed)[1, 4:] == 0)
            # The decomposition identity: the attention terms (adapter) + the output biases,
            # the MLPs, the embedding and the norm's constant (NumPy) = the model's logit.
            for b, t in enumerate(LAST):
                w = int(targets[b])
                rest = share(ref, ref["embedded"][b, t], b, t, w)
                for layer in ref["layers"]:
                    rest += share(ref, layer["b_o"], b, t, w) + share(
                        ref, layer["mlp"][b, t], b, t, w
                    )
                if ref["shift"] is not None:
                    rest += float(np.asarray(ref["shift"], np.float64) @ ref["weight"][:, w])
                if ref["bias"] is not None:
                    rest += float(ref["bias"][w])
                model_logit = float(logits[b, t, w])  # the model's own, not the reference's
                total = float(summed[b].sum()) + rest
                np.testing.assert_allclose(total, model_logit, **TOLERANCE[frontend])


def test_the_reference_is_the_model():
    with x64(True):
        for frontend, _, parameters, logits in _models(jnp.float64, tied=False):
            ref = reference(parameters)
            np.testing.assert_allclose(logits[PAD], ref["logits"][PAD], **TOLERANCE[frontend])


def test_rows_targets_foils_and_layers_float32():
    for frontend, call, parameters, _ in _models(jnp.float32, tied=False):
        ref = reference(parameters)
        rows = np.array([[1, 5], [1, 3]])
        targets = np.array([[3, 8], [12, 0]])
        foils = np.array([2, 6])
        got = call(
            method="direct_logit",
            rows=[1, -1],
            target=targets,
            foil=foils,
            heads="each",
            options={"layers": "all"},
        )
        assert got.shape == (2, LAYERS, H, 2, N)
        assert got.dtype == jnp.float32
        expected = hand_direct_logit(ref, rows, targets) - hand_direct_logit(
            ref, rows, np.broadcast_to(foils[:, None], (2, 2))
        )
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-5, err_msg=frontend)
        cumulative = call(
            method="direct_logit", rows=[1, -1], target=targets, options={"layers": "cumulative"}
        )
        np.testing.assert_allclose(
            cumulative,
            np.cumsum(hand_direct_logit(ref, rows, targets).sum(2), 1),
            rtol=2e-4,
            atol=2e-5,
        )


# -- ALTI-Logit and IFR against the core fed with NumPy pieces ---------------------------------------
@pytest.mark.parametrize("tied", [False, True], ids=["dense", "tied"])
def test_alti_logit_and_ifr_equal_the_core_on_numpy_pieces_float64(tied):
    with x64(True):
        for frontend, call, parameters, logits in _models(jnp.float64, tied):
            ref = reference(parameters)
            targets = logits[np.arange(2), LAST].argmax(-1)  # the default: the model's argmax
            direct = hand_direct_logit(ref, LAST[:, None], targets[:, None])  # (B, L, H, 1, n)
            # The ALTI rollout below each layer, by hand from the loop oracle's matrices.
            below = np.zeros((2, LAYERS, N, N))
            for b in range(2):
                rolled = np.eye(N)
                for l, layer in enumerate(ref["layers"]):
                    below[b, l] = rolled
                    alti = oracle_contributions(
                        layer["weights"][b],
                        layer["f"][b],
                        layer["x"][b],
                        layer["b_o"],
                        None,
                        "alti",
                    )
                    rolled = alti @ rolled  # the oracle's rows sum to one (or are all zero)
            expected = np.asarray(alti_logit_terms(direct, below)).sum((1, 2))[:, 0]
            got = call(method="alti_logit", rows=-1)
            np.testing.assert_allclose(got, expected, **TOLERANCE[frontend], err_msg=frontend)
            # IFR: the core's proximities fed with the NumPy attention rows, values and stream.
            shares = []
            for layer in ref["layers"]:
                rows = np.stack([layer["weights"][b, :, LAST[b]][:, None] for b in range(2)])
                residual = np.stack([layer["x"][b, LAST[b]][None] for b in range(2)])
                values = layer["values"]  # (B, H, n, dh), bias included
                shares.append(
                    ifr_terms(rows, values, layer["w_o"], residual, output_bias=layer["b_o"])[0]
                )
            expected = np.stack(shares, 1)  # (B, L, H, 1, n)
            got = call(method="ifr", rows=-1, heads="each", options={"layers": "all"})
            np.testing.assert_allclose(
                got, expected[..., 0, :], **TOLERANCE[frontend], err_msg=frontend
            )
            assert np.all(np.asarray(got) >= 0)
            assert np.all(np.asarray(got).sum((-1, -2)) <= 1 + 1e-12)  # the residual keeps the rest


def test_ifr_span_sums_the_rows_before_the_proximities_float32():
    _, call, parameters, _ = _models(jnp.float32, tied=False)[0]
    ref = reference(parameters)
    span = [2, 3]
    got = call(method="ifr", rows=span, options={"span": True})
    assert got.shape == (2, N)
    assert got.dtype == jnp.float32
    expected = 0.0
    for layer in ref["layers"]:
        rows = layer["weights"][:, :, span]  # (B, H, 2, n)
        terms, _ = ifr_terms(
            rows,
            layer["values"],
            layer["w_o"],
            layer["x"][:, span],
            output_bias=layer["b_o"],
            span=True,
        )
        expected = expected + terms.sum(1)[:, 0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    assert not np.allclose(got, call(method="ifr", rows=span).sum(1))  # one target, not two


# -- refusals, before the model runs ------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"target": V}, ValueError, r"`target` must be vocabulary ids in \[0, 13\); got 13"),
        ({"target": -1}, ValueError, r"`target` must be vocabulary ids"),
        ({"target": 1.5}, TypeError, r"`target` must be a vocabulary id \(int\)"),
        ({"target": [1, 2, 3]}, ValueError, r"one per sample \(2\).*got shape \(3,\)"),
        ({"foil": 99}, ValueError, r"`foil` must be vocabulary ids in \[0, 13\)"),
        (
            {"rows": 4, "target": 1},
            ValueError,
            r"position 4 of sample 1, which is not one of its 4 real",
        ),
        ({"rows": 6}, ValueError, r"position 6 of sample 0"),
        ({"rows": "last"}, TypeError, r"`rows` of a target-conditioned method must be an int"),
        (
            {"heads": "mean"},
            ValueError,
            r'`heads` of method="direct_logit" must be "sum" or "each"',
        ),
        ({"options": {"layers": "last"}}, ValueError, r"`layers` of method=\"direct_logit\""),
        (
            {"options": {"mask": None}},
            ValueError,
            r'takes the options "layers" and "span" only.*padding mask',
        ),
        ({"options": {"span": True}}, ValueError, r"`span` aggregates IFR"),
        ({"target_score": "log_probability"}, ValueError, r"`target_score` chooses what"),
    ],
)
def test_bad_arguments_are_refused_before_the_model_runs(options, error, match):
    _, _, linen_call = linen_setup(jnp.float32)
    _, nnx_call = nnx_setup(jnp.float32)
    for call in (linen_call, nnx_call):
        RAN.clear()
        with pytest.raises(error, match=match):
            call(**{"method": "direct_logit", "rows": -1, **options})
        assert RAN == []


def test_a_traced_call_is_refused_with_what_to_do():
    _, variables, _ = linen_setup(jnp.float32)
    model, _ = nnx_setup(jnp.float32)
    calls = [
        lambda ids: adapter.explain_linen(LinenGPT(jnp.float32), variables, ids, PAD, method="ifr"),
        lambda ids: adapter.explain_nnx(model, ids, PAD, method="direct_logit"),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"reads concrete values.*outside jax.jit"):
            jax.jit(call)(IDS)


def test_ifr_refuses_a_target_and_other_methods_a_foil():
    _, _, call = linen_setup(jnp.float32)
    with pytest.raises(ValueError, match=r'method="ifr" is conditioned on the explained rows'):
        call(method="ifr", target=1)
    with pytest.raises(ValueError, match=r"`foil` contrasts.*method=\"rollout\" does not read it"):
        call(method="rollout", foil=1)


@pytest.mark.parametrize(
    ("head", "match"),
    [
        ("scaled", r"logits are the output of no module call.*not of a Dense.*no scaling"),
        (
            "shifted",
            r"unembedding 'lm_head' reads the output of no module call, not of a LayerNorm",
        ),
    ],
)
def test_a_head_that_is_not_norm_and_linear_is_refused_before_the_model_runs(head, match):
    _, _, call = linen_setup(jnp.float32, head=head)
    RAN.clear()
    with pytest.raises(ValueError, match=match):
        call(method="direct_logit", rows=-1)
    assert RAN == []


def test_post_ln_blocks_are_refused_naming_the_block_shapes_read():
    _, _, call = linen_setup(jnp.float32, post_ln=True)
    RAN.clear()
    with pytest.raises(
        ValueError, match=r"'block0/attn' of block 'block0' reads the block's input itself.*pre-LN"
    ):
        call(method="alti_logit", rows=-1)
    assert RAN == []


def test_the_readout_check_catches_a_misread_norm(monkeypatch):
    # A norm read with the wrong epsilon gives logits that are not the model's.
    from attnflow.adapters import _jax_logit

    original = _jax_logit._norm

    def misread(tracker: Any, call: Any) -> Any:
        kind, scale, bias, _ = original(tracker, call)
        return kind, scale, bias, 10.0

    monkeypatch.setattr(_jax_logit, "_norm", misread)
    _, _, call = linen_setup(jnp.float32)
    with pytest.raises(ValueError, match=r"give the model's logits at the explained rows within"):
        call(method="direct_logit", rows=-1)


def test_the_docs_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The example of docs/adapters/jax.md runs as written and prints what it says."""
    page = Path(__file__).resolve().parents[2] / "docs" / "adapters" / "jax.md"
    text = page.read_text(encoding="utf-8")
    pattern = r"## Target-conditioned methods.*?```python\n(.*?)```"
    (example,) = re.findall(pattern, text, re.DOTALL)
    exec(compile(example, str(page), "exec"), {"__name__": "docs_example"})  # noqa: S102
    assert capsys.readouterr().out.split("\n")[:2] == ["(2, 6) (2, 2, 2, 6)", "True"]
