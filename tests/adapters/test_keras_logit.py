"""explain(method="direct_logit" | "alti_logit" | "ifr") on a small Keras 3 GPT-2-style decoder.

The decoder (token and position embeddings, pre-LN blocks ``x + MHA(LN1(x))`` with
``use_causal_mask=True`` and ``+ MLP(LN2(x))``, a final LayerNormalization or
RMSNormalization, a Dense or tied unembedding) is built here with random weights, on the
backend of KERAS_BACKEND. A NumPy forward written from the formulas (float64, neither
Keras nor attnflow) gives every piece: each head's attention rows, values and output
projection, the MLP outputs, the final norm's input. The direct logit terms are compared
with a hand oracle from those pieces; their sum, with the other parts of the residual
stream read out on the same direction, with the model's own logit (the decomposition
identity); ALTI-Logit and IFR with the core fed with the NumPy pieces.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
from pathlib import Path

import numpy as np
import pytest

keras = pytest.importorskip("keras", reason="the Keras adapter needs Keras 3")

import attnflow
from attnflow._contributions import contributions as core_contributions
from attnflow._contributions import head_values
from attnflow._logit_attribution import alti_logit_terms, ifr_terms
from attnflow.adapters import keras as adapter

# The docs example's sizes: on JAX every operation is compiled once per shape, so the
# example reuses what the tests compiled.
N, D, HEADS, KEY, VOCAB, LAYERS, BATCH = 8, 16, 2, 8, 50, 2, 2
BACKEND = keras.backend.backend()


def float64_works() -> bool:
    """Whether the backend keeps float64 (JAX only with jax_enable_x64)."""
    if BACKEND == "jax":
        import jax

        return bool(jax.config.jax_enable_x64)
    tensor = keras.ops.convert_to_tensor(np.zeros(1), dtype="float64")
    return keras.backend.standardize_dtype(tensor.dtype) == "float64"


DTYPES = [
    "float32",
    pytest.param(
        "float64",
        marks=pytest.mark.skipif(
            not float64_works(), reason=f"the {BACKEND} backend computes in float32 here"
        ),
    ),
]
#: Agreement with the float64 oracle, by the model's dtype. Keras 3.15's LayerNormalization
#: on the torch backend is about 3e-7 off the exact formula in float64 (the terms here are
#: 1e-6 relative off); a misread piece is off by far more than either bound.
TOL = {"float32": 2e-4, "float64": 1e-5}


def to_numpy(x):
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy().astype("float64")
    return np.asarray(keras.ops.convert_to_numpy(x), dtype="float64")


def var(variable):
    """A Keras variable's values as float64 NumPy."""
    value = variable.value  # the backend's own variable or tensor
    if hasattr(value, "detach"):  # torch
        return value.detach().cpu().numpy().astype("float64")
    if hasattr(value, "numpy"):  # tf.Variable
        return np.asarray(value.numpy(), dtype="float64")
    return np.asarray(value, dtype="float64")


# -- the decoder ---------------------------------------------------------------------------------
class Block(keras.layers.Layer):
    """GPT-2's block: ``h = x + MHA(LN1(x))`` (causal), then ``h + MLP(LN2(h))``."""

    def __init__(self, dtype="float32", **kwargs):
        super().__init__(dtype=dtype, **kwargs)
        self.ln1 = keras.layers.LayerNormalization(epsilon=1e-5, dtype=dtype)
        self.attention = keras.layers.MultiHeadAttention(HEADS, KEY, dtype=dtype)
        self.ln2 = keras.layers.LayerNormalization(epsilon=1e-5, dtype=dtype)
        self.up = keras.layers.Dense(4 * D, activation="relu", dtype=dtype)
        self.down = keras.layers.Dense(D, dtype=dtype)

    def call(self, x, attention_mask=None):
        z = self.ln1(x)
        x = x + self.attention(z, z, attention_mask=attention_mask, use_causal_mask=True)
        return x + self.down(self.up(self.ln2(x)))


class Decoder(keras.Model):
    """A causal LM: ids ``(batch, n)`` (and a padding mask) to logits ``(batch, n, V)``."""

    def __init__(self, dtype="float32", final="layer", head="dense", scale=1.0, **kwargs):
        super().__init__(dtype=dtype, **kwargs)
        self.reversible = head.startswith("reversible")
        if self.reversible:  # "reversible" or "reversible-capped" (a soft cap of 5)
            cap = 5.0 if head.endswith("capped") else None
            self.tokens = keras.layers.ReversibleEmbedding(
                VOCAB, D, logit_soft_cap=cap, dtype=dtype
            )
        else:
            self.tokens = keras.layers.Embedding(VOCAB, D, dtype=dtype)
        self.places = keras.layers.Embedding(N, D, dtype=dtype)
        self.blocks = [Block(dtype) for _ in range(LAYERS)]
        if final == "layer":
            self.final = keras.layers.LayerNormalization(epsilon=1e-5, dtype=dtype)
        else:
            self.final = keras.layers.RMSNormalization(epsilon=1e-6, dtype=dtype)
        self.tied = head == "tied" or self.reversible
        self.head = None if self.tied else keras.layers.Dense(VOCAB, dtype=dtype)
        self.scale = scale
        self.calls = 0

    def call(self, inputs):
        self.calls += 1
        ids, padding = inputs if isinstance(inputs, list | tuple) else (inputs, None)
        n = ids.shape[1]
        x = self.tokens(ids) + self.places(keras.ops.arange(n))[None]
        mask = None
        if padding is not None:
            padding = keras.ops.cast(padding, "bool")
            mask = keras.ops.logical_and(padding[:, None, :], padding[:, :, None])
        for block in self.blocks:
            x = block(x, attention_mask=mask)
        h = self.final(x)
        if self.reversible:
            logits = self.tokens(h, reverse=True)
        elif self.tied:
            logits = keras.ops.matmul(h, keras.ops.transpose(self.tokens.embeddings))
        else:
            logits = self.head(h)
        return logits * self.scale if self.scale != 1.0 else logits


@functools.cache
def build(dtype="float32", **kwargs):
    """The decoder with random weights, built once per configuration (no test changes it)."""
    keras.utils.set_random_seed(0)
    model = Decoder(dtype, **kwargs)
    model(np.zeros((1, N), dtype="int32"))
    rng = np.random.default_rng(3)
    for weight in model.weights:  # random biases and gains: defaults would hide mistakes
        shape = tuple(weight.shape)
        name = weight.path
        if name.endswith(("gamma", "scale")):
            weight.assign(rng.uniform(0.5, 1.5, shape).astype(dtype))
        elif name.endswith(("beta", "bias")):
            weight.assign(rng.normal(0, 0.3, shape).astype(dtype))
        else:
            weight.assign(rng.normal(0, 0.5, shape).astype(dtype))
    return model


def ids():
    return np.random.default_rng(1).integers(0, VOCAB, size=(BATCH, N)).astype("int32")


# -- the NumPy forward (float64) -----------------------------------------------------------------
def layer_norm(x, gamma, beta, eps):
    centred = x - x.mean(-1, keepdims=True)
    return gamma * centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps) + beta


def rms_norm(x, scale, eps):
    return scale * x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def forward(model, tokens, padding=None):
    """Every piece of the decoder's forward, in float64 NumPy."""
    n = tokens.shape[1]
    x = var(model.tokens.embeddings)[tokens] + var(model.places.embeddings)[:n][None]
    allowed = np.tril(np.ones((n, n), dtype=bool))[None]
    if padding is not None:
        allowed = allowed & padding[:, None, :] & padding[:, :, None]
    pieces = {"embedding": x, "layers": []}
    for block in model.blocks:
        attention = block.attention
        z = layer_norm(x, var(block.ln1.gamma), var(block.ln1.beta), 1e-5)
        q, k, v = (
            np.einsum("bnd,dhk->bhnk", z, var(dense.kernel)) + var(dense.bias)[None, :, None]
            for dense in (attention._query_dense, attention._key_dense, attention._value_dense)
        )
        scores = np.einsum("bhqk,bhnk->bhqn", q / np.sqrt(KEY), k)
        scores = np.where(allowed[:, None], scores, -1e300)  # a padded row: all masked
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights = np.where(allowed[:, None], weights, 0.0)
        weights = weights / np.maximum(weights.sum(-1, keepdims=True), 1e-300)
        w_o = var(attention._output_dense.kernel)  # (H, dh, d)
        b_o = var(attention._output_dense.bias)
        attended = np.einsum("bhqn,bhnk,hkd->bqd", weights, v, w_o) + b_o
        residual = x
        x = x + attended
        hidden = layer_norm(x, var(block.ln2.gamma), var(block.ln2.beta), 1e-5)
        up = np.maximum(hidden @ var(block.up.kernel) + var(block.up.bias), 0.0)
        mlp = up @ var(block.down.kernel) + var(block.down.bias)
        x = x + mlp
        pieces["layers"].append(
            {
                "residual": residual,
                "z": z,
                "weights": weights,
                "values": v,
                "w_v": var(attention._value_dense.kernel),
                "b_v": var(attention._value_dense.bias),
                "w_o": w_o,
                "b_o": b_o,
                "mlp": mlp,
            }
        )
    pieces["final_input"] = x
    if isinstance(model.final, keras.layers.LayerNormalization):
        gamma, beta = var(model.final.gamma), var(model.final.beta)
        normed = layer_norm(x, gamma, beta, 1e-5)
    else:
        gamma, beta = var(model.final.scale), None
        normed = rms_norm(x, gamma, 1e-6)
    unembedding = var(model.tokens.embeddings).T if model.tied else var(model.head.kernel)
    head_bias = np.zeros(VOCAB) if model.tied else var(model.head.bias)
    pieces.update(gamma=gamma, beta=beta, unembedding=unembedding, head_bias=head_bias)
    pieces["logits"] = model.scale * (normed @ unembedding + head_bias)
    return pieces


def readout_of(pieces, position, target):
    """``(u, c)`` of one sample's row (batch axis first): the final norm linearised there."""
    x = pieces["final_input"][:, position]  # (B, d)
    w = pieces["unembedding"][:, target].T  # (B, d)
    direction = pieces["gamma"] * w
    if pieces["beta"] is None:  # RMSNorm
        return direction / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6), np.zeros(len(x))
    centred = x - x.mean(-1, keepdims=True)
    sigma = np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5)
    direction = direction - direction.mean(-1, keepdims=True)
    return direction / sigma, (w * pieces["beta"]).sum(-1)


def oracle_direct(pieces, positions, targets):
    """``(B, L, H, r, n)``: A[t, j] <(z_j W_V^h + b_V^h) W_O^h, u_t>, per head and layer."""
    out = []
    for layer in pieces["layers"]:
        per_row = []
        for r, position in enumerate(positions):
            u, _ = readout_of(pieces, position, targets[:, r])
            through = np.einsum("hkd,bd->bhk", layer["w_o"], u)  # W_O^h u
            projected = np.einsum("bhnk,bhk->bhn", layer["values"], through)
            per_row.append(layer["weights"][:, :, position] * projected)
        out.append(np.stack(per_row, axis=2))
    return np.stack(out, axis=1)


def argmax_targets(pieces, positions):
    return np.stack([pieces["logits"][:, p].argmax(-1) for p in positions], axis=-1)


# -- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("final", "head"), [("layer", "dense"), ("rms", "tied"), ("layer", "reversible")]
)
def test_direct_logit_equals_the_hand_oracle_per_head_and_layer(dtype, final, head):
    model, tokens = build(dtype, final=final, head=head), ids()
    pieces = forward(model, tokens)
    positions = [N - 1, 3]
    got = adapter.explain(
        model, tokens, method="direct_logit", rows=[-1, 3], heads="each", layers="all"
    )
    assert tuple(got.shape) == (BATCH, LAYERS, HEADS, 2, N)
    expected = oracle_direct(pieces, positions, argmax_targets(pieces, positions))
    np.testing.assert_allclose(to_numpy(got), expected, rtol=TOL[dtype], atol=TOL[dtype])
    # Causal: no token after the explained row gets a term.
    assert np.all(to_numpy(got)[..., 1, 4:] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_direct_logit_terms_and_the_other_parts_add_up_to_the_models_logit(dtype):
    model, tokens = build(dtype), ids()
    pieces = forward(model, tokens)
    target = np.array([2, 9])
    terms = to_numpy(adapter.explain(model, tokens, method="direct_logit", rows=-1, target=target))
    assert terms.shape == (BATCH, N)
    u, c = readout_of(pieces, N - 1, target)
    others = (pieces["embedding"][:, -1] * u).sum(-1) + c + pieces["head_bias"][target]
    for layer in pieces["layers"]:
        others += (layer["b_o"] * u).sum(-1) + (layer["mlp"][:, -1] * u).sum(-1)
    model_logits = to_numpy(model(tokens))[np.arange(BATCH), -1, target]
    np.testing.assert_allclose(
        pieces["logits"][np.arange(BATCH), -1, target],
        model_logits,
        rtol=TOL[dtype] * 10,
        atol=TOL[dtype] * 10,
    )
    np.testing.assert_allclose(
        terms.sum(-1) + others, model_logits, rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10
    )


def test_head_resolved_and_layer_forms_sum_to_the_summed_form():
    model, tokens = build(), ids()
    for method in ("direct_logit", "alti_logit", "ifr"):
        each = to_numpy(
            adapter.explain(model, tokens, method=method, rows=-1, heads="each", layers="all")
        )
        summed = to_numpy(adapter.explain(model, tokens, method=method, rows=-1))
        cumulative = to_numpy(
            adapter.explain(model, tokens, method=method, rows=-1, layers="cumulative")
        )
        assert each.shape == (BATCH, LAYERS, HEADS, N)
        assert summed.shape == (BATCH, N)
        np.testing.assert_allclose(each.sum(axis=(1, 2)), summed, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cumulative[:, -1], summed, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cumulative, np.cumsum(each.sum(2), axis=1), rtol=1e-5, atol=1e-5)


def test_a_foil_gives_the_target_minus_the_foil():
    model, tokens = build(), ids()
    both = adapter.explain(model, tokens, method="direct_logit", rows=-1, target=3, foil=5)
    one = adapter.explain(model, tokens, method="direct_logit", rows=-1, target=3)
    other = adapter.explain(model, tokens, method="direct_logit", rows=-1, target=5)
    np.testing.assert_allclose(to_numpy(both), to_numpy(one) - to_numpy(other), atol=1e-5)


def numpy_values(layer):
    """``f^h(z_j)`` (B, H, n, d) and the values (B, H, n, dh) from the NumPy pieces."""
    w_v = layer["w_v"].reshape(D, HEADS * KEY)
    w_o = layer["w_o"].reshape(HEADS * KEY, D)
    f = head_values(layer["z"], w_v, w_o, heads=HEADS, value_bias=layer["b_v"].reshape(-1))
    return f, layer["values"], w_o


@pytest.mark.parametrize("dtype", DTYPES)
def test_alti_logit_equals_the_core_fed_with_numpy_pieces(dtype):
    model, tokens = build(dtype), ids()
    pieces = forward(model, tokens)
    got = adapter.explain(model, tokens, method="alti_logit", rows=-1, heads="each", layers="all")
    direct = oracle_direct(pieces, [N - 1], argmax_targets(pieces, [N - 1]))
    matrices = []
    for layer in pieces["layers"]:
        f, _, _ = numpy_values(layer)
        matrices.append(
            core_contributions(
                layer["weights"], f, layer["residual"], method="alti", bias=layer["b_o"]
            )
        )
    stacked = np.stack(matrices, axis=1)  # (B, L, n, n)
    rolled = attnflow.rollout(
        stacked, heads=None, residual=0.0, normalize_layers=True, layers="all"
    )
    below = np.concatenate([np.broadcast_to(np.eye(N), (BATCH, 1, N, N)), rolled[:, :-1]], 1)
    expected = alti_logit_terms(direct, below)[..., 0, :]
    np.testing.assert_allclose(to_numpy(got), expected, rtol=TOL[dtype], atol=TOL[dtype])
    # ALTI-Logit's first layer is the direct logit's.
    np.testing.assert_allclose(
        to_numpy(got)[:, 0], direct[:, 0, :, 0], rtol=TOL[dtype], atol=TOL[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("span", [False, True])
def test_ifr_equals_the_core_fed_with_numpy_pieces(dtype, span):
    model, tokens = build(dtype), ids()
    pieces = forward(model, tokens)
    rows = [N - 2, N - 1]
    got = adapter.explain(model, tokens, method="ifr", rows=[-2, -1], span=span)
    expected = 0.0
    for layer in pieces["layers"]:
        _, values, w_o = numpy_values(layer)
        terms, _ = ifr_terms(
            layer["weights"][:, :, rows],
            values,
            w_o,
            layer["residual"][:, rows],
            output_bias=layer["b_o"],
            span=span,
        )
        expected = expected + terms.sum(1)
    expected = expected[:, 0] if span else expected
    np.testing.assert_allclose(to_numpy(got), expected, rtol=TOL[dtype], atol=TOL[dtype])
    assert np.all(to_numpy(got) >= 0)


def test_padded_rows_count_from_each_samples_real_end():
    model, tokens = build(), ids()
    padding = np.ones((BATCH, N), dtype=bool)
    padding[1, 5:] = False
    pieces = forward(model, tokens, padding)
    got = to_numpy(
        adapter.explain(
            model, [tokens, padding], method="direct_logit", rows=-1, heads="each", layers="all"
        )
    )
    for sample, position in ((0, N - 1), (1, 4)):
        target = pieces["logits"][:, position].argmax(-1)
        expected = oracle_direct(pieces, [position], target[:, None])[sample, ..., 0, :]
        np.testing.assert_allclose(got[sample], expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"method": "direct_logit", "target": VOCAB}, ValueError, r"target.*\[0, 50\)"),
        ({"method": "direct_logit", "target": 1.5}, TypeError, "vocabulary id"),
        ({"method": "direct_logit", "target": 1, "foil": -1}, ValueError, "foil"),
        ({"method": "direct_logit", "rows": N}, ValueError, "position 8"),
        ({"method": "direct_logit", "rows": True}, TypeError, "rows"),
        ({"method": "direct_logit", "rows": []}, ValueError, "rows"),
        ({"method": "alti_logit", "heads": "mean"}, ValueError, "heads"),
        ({"method": "direct_logit", "layers": "last"}, ValueError, "layers"),
        ({"method": "direct_logit", "span": True}, ValueError, "span"),
        ({"method": "ifr", "target": 3}, ValueError, "drop `target`"),
        ({"method": "ifr", "mask": np.ones((BATCH, N), bool)}, ValueError, "padding mask"),
        ({"method": "ifr", "target_score": "log_probability"}, ValueError, "target_score"),
    ],
)
def test_bad_options_are_refused_before_the_model_runs(options, error, match):
    model, tokens = build(), ids()
    calls = model.calls
    options.setdefault("rows", -1)
    with pytest.raises(error, match=match):
        adapter.explain(model, tokens, **options)
    assert model.calls == calls


@pytest.mark.parametrize("options", [{"scale": 2.0}, {"head": "reversible-capped"}])
def test_a_head_that_is_more_than_norm_and_linear_is_refused(options):
    model = build(**options)
    with pytest.raises(ValueError, match="does more than a norm and a linear map"):
        adapter.explain(model, ids(), method="direct_logit", rows=-1)


def test_two_candidate_unembeddings_are_refused_before_the_model_runs():
    tokens = keras.Input((N,), dtype="int32")
    x = keras.layers.Dense(D, name="mixer")(keras.layers.Embedding(VOCAB, D)(tokens))
    x = Block()(x)
    logits = keras.layers.Dense(VOCAB, name="unembed")(keras.layers.LayerNormalization()(x))
    model = keras.Model(tokens, logits)
    with pytest.raises(ValueError, match=r"several Dense layers.*'mixer', 'unembed'"):
        adapter.explain(model, ids(), method="direct_logit", rows=-1)


def test_post_ln_blocks_are_refused():
    class PostBlock(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.attention = keras.layers.MultiHeadAttention(HEADS, KEY)
            self.ln1 = keras.layers.LayerNormalization()

        def call(self, x):
            return self.ln1(x + self.attention(x, x, use_causal_mask=True))

    tokens = keras.Input((N,), dtype="int32")
    x = PostBlock()(keras.layers.Embedding(VOCAB, D)(tokens))
    logits = keras.layers.Dense(VOCAB)(keras.layers.LayerNormalization()(x))
    model = keras.Model(tokens, logits)
    with pytest.raises(ValueError, match="post-LN"):
        adapter.explain(model, ids(), method="direct_logit", rows=-1)


def test_the_docs_example_runs():
    page = Path(__file__).resolve().parents[2] / "docs" / "adapters" / "keras.md"
    section = page.read_text(encoding="utf-8").split("## Target-conditioned methods", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert code is not None
    printed = io.StringIO()
    namespace = {"__name__": "docs_example"}
    with contextlib.redirect_stdout(printed):
        exec(compile(code.group(1), str(page), "exec"), namespace)  # noqa: S102
    assert printed.getvalue().split("\n")[:3] == ["(2, 8)", "(2, 2, 2, 8)", "True"]
    routes = to_numpy(namespace["routes"])
    assert routes.shape == (2, 8)
    assert np.all(routes >= 0)
