"""capture(model, contributions=...) on small Keras 3 encoders, on the backend of KERAS_BACKEND.

The encoder mixes pre-LN and post-LN blocks (subclassed layers and a functional model).
A reference run calls the same layer instances step by step (attention with
``return_attention_scores=True``) and keeps each block's pieces and its actual
attention-block output. The matrices are compared with a NumPy oracle written here from
the papers' formulas (float64, attnflow's core not used), the rebuilt outputs with the
actual block outputs (completeness), and explain() with rollout over the matrices.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import pytest

keras = pytest.importorskip("keras", reason="the Keras adapter needs Keras 3")

import attnflow
from attnflow.adapters import keras as adapter

N, D, HEADS, KEY = 6, 8, 2, 4
METHODS = ("norm", "globenc", "alti")
BACKEND = keras.backend.backend()


def to_numpy(x):
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    return np.asarray(keras.ops.convert_to_numpy(x))


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


# -- blocks --------------------------------------------------------------------------------------
class PreBlock(keras.layers.Layer):
    """``h = x + MHA(LN1(x))``, then ``h + FFN(LN2(h))``."""

    pre = True

    def __init__(self, dtype="float32", scale=1.0, cross=False, **kwargs):
        super().__init__(dtype=dtype, **kwargs)
        self.scale, self.cross = scale, cross
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5, dtype=dtype)
        self.attention = keras.layers.MultiHeadAttention(HEADS, KEY, dropout=0.5, dtype=dtype)
        self.norm2 = keras.layers.LayerNormalization(dtype=dtype)
        self.ffn = keras.layers.Dense(D, activation="relu", dtype=dtype)

    def call(self, x, attention_mask=None, training=None):
        h = self.norm1(x)
        value = x if self.cross else h
        attended = self.attention(h, value, attention_mask=attention_mask, training=training)
        h = x + self.scale * attended
        return h + self.ffn(self.norm2(h))


class PostBlock(keras.layers.Layer):
    """``h = LN1(x + MHA(x))``, then ``LN2(h + FFN(h))`` (BERT)."""

    pre = False

    def __init__(self, dtype="float32", **kwargs):
        super().__init__(dtype=dtype, **kwargs)
        self.attention = keras.layers.MultiHeadAttention(HEADS, KEY, dtype=dtype)
        self.norm1 = keras.layers.LayerNormalization(dtype=dtype)
        self.ffn = keras.layers.Dense(D, activation="relu", dtype=dtype)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6, dtype=dtype)

    def call(self, x, attention_mask=None):
        h = self.norm1(x + self.attention(x, x, attention_mask=attention_mask))
        return self.norm2(h + self.ffn(h))


def functional_post_block(dtype):
    """A post-LN block as its own functional model (no FFN's second LayerNorm)."""
    x = keras.Input((N, D), dtype=dtype)
    attention = keras.layers.MultiHeadAttention(HEADS, KEY, dtype=dtype, name="f_attention")
    norm1 = keras.layers.LayerNormalization(dtype=dtype, name="f_norm1")
    h = norm1(keras.layers.Add(dtype=dtype)([x, attention(x, x)]))
    y = keras.layers.Dense(D, dtype=dtype)(h)
    model = keras.Model(x, keras.layers.Add(dtype=dtype)([h, y]), name="functional_block")
    model.parts = {"attention": attention, "norm1": norm1, "norm2": None}  # type: ignore[attr-defined]
    return model


def parts(block):
    if isinstance(block, keras.Model):
        return block.parts["attention"], block.parts["norm1"], None, False
    return block.attention, block.norm1, block.norm2, block.pre


def build(dtype="float32", masked=False):
    keras.utils.set_random_seed(0)
    blocks = [PreBlock(dtype), PostBlock(dtype), functional_post_block(dtype), PreBlock(dtype)]
    x = keras.Input((N, D), dtype=dtype)
    inputs = [x]
    mask = None
    if masked:
        pad = keras.Input((N,), dtype="bool")
        inputs.append(pad)
        mask = keras.ops.logical_and(keras.ops.expand_dims(pad, 1), keras.ops.expand_dims(pad, 2))
    h = x
    for block in blocks:
        h = block(h) if mask is None or isinstance(block, keras.Model) else block(h, mask)
    model = keras.Model(inputs if masked else x, h)
    for block in blocks:  # perturb the LayerNorms (all-ones gains would hide mistakes)
        for norm in parts(block)[1:3]:
            if norm is not None:
                rng = np.random.default_rng(len(norm.name))
                norm.gamma.assign(rng.uniform(0.5, 1.5, D).astype(dtype))
                norm.beta.assign(rng.normal(0, 0.1, D).astype(dtype))
    return model, blocks


def data(dtype="float32", masked=False):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, N, D)).astype(dtype)
    if not masked:
        return x
    pad = np.ones((2, N), dtype=bool)
    pad[1, 4:] = False
    return [x, pad]


def mask_of(inputs):
    if not isinstance(inputs, list):
        return None
    pad = keras.ops.convert_to_tensor(inputs[1])
    return keras.ops.logical_and(keras.ops.expand_dims(pad, 1), keras.ops.expand_dims(pad, 2))


def reference(blocks, inputs):
    """Run the blocks step by step; keep each block's pieces as float64 NumPy arrays."""
    mask = mask_of(inputs)
    x = keras.ops.convert_to_tensor(inputs[0] if isinstance(inputs, list) else inputs)
    pieces = []
    for block in blocks:
        attention, norm1, norm2, pre = parts(block)
        z = norm1(x) if pre else x
        kwargs = {} if isinstance(block, keras.Model) else {"attention_mask": mask}
        attended, scores = attention(z, z, return_attention_scores=True, **kwargs)
        stream = x + attended
        out = stream if pre else norm1(stream)  # the attention block's actual output
        nxt = block(x) if isinstance(block, keras.Model) else block(x, mask)
        second = None
        if not pre and norm2 is not None and not getattr(block, "ffn_input_norm", False):
            second = out + block.ffn(out)  # the input of LN2
        piece = {
            "x": x,
            "z": z,
            "alpha": scores,
            "out": out,
            "second": second,
            "pre": pre,
            "attention": attention,
            "norm1": norm1,
            "norm2": norm2,
        }
        pieces.append(
            {
                k: to_numpy(v).astype("float64") if keras.ops.is_tensor(v) else v
                for k, v in piece.items()
            }
        )
        x = nxt
    return pieces


# -- the oracle (NumPy, from the papers' formulas) ------------------------------------------------
def var(variable):
    """A Keras variable's values as float64 NumPy."""
    value = variable.value  # the backend's own variable or tensor
    if hasattr(value, "detach"):  # torch
        return value.detach().cpu().numpy().astype("float64")
    if hasattr(value, "numpy"):  # tf.Variable
        return np.asarray(value.numpy(), dtype="float64")
    return np.asarray(value, dtype="float64")


def layer_norm(u, norm):
    gamma, beta = var(norm.gamma), var(norm.beta)
    return (
        gamma * (u - u.mean(-1, keepdims=True)) / np.sqrt(u.var(-1, keepdims=True) + norm.epsilon)
        + beta
    )


def oracle(piece, method):
    """``(c, y, T)`` for one block: matrices (b, n, n), rebuilt output, terms (b, n, n, d)."""
    attention = piece["attention"]
    w_v = var(attention._value_dense.kernel)  # (d, H, dh)
    b_v = var(attention._value_dense.bias)  # (H, dh)
    w_o = var(attention._output_dense.kernel)  # (H, dh, d)
    b_o = var(attention._output_dense.bias)  # (d,)
    x, z, alpha = piece["x"], piece["z"], piece["alpha"]
    n = x.shape[1]
    # f^h(z_j) = (z_j W_V^h + b_V^h) W_O^h, (b, H, n, d)
    f = np.stack([(z @ w_v[:, h] + b_v[h]) @ w_o[h] for h in range(HEADS)], axis=1)
    mixed = np.einsum("bhij,bhjd->bijd", alpha, f)  # Σ_h α^h_ij f^h(z_j)
    t = mixed + np.eye(n)[None, :, :, None] * x[:, None, :, :]  # + δ_ij x_j
    if piece["pre"]:
        terms, offset = t, np.broadcast_to(b_o, x.shape)
        y = t.sum(2) + b_o
    else:
        u = t.sum(2) + b_o
        s = np.sqrt(u.var(-1, keepdims=True) + piece["norm1"].epsilon)  # (b, n, 1)
        norm = piece["norm1"]
        gamma = var(norm.gamma)
        beta = var(norm.beta)
        terms = gamma * (t - t.mean(-1, keepdims=True)) / s[:, :, None]
        offset = gamma * (b_o - b_o.mean()) / s + beta
        y = layer_norm(u, norm)
    assert np.allclose(terms.sum(2) + offset, y, atol=1e-10)  # the oracle is complete
    if method == "norm":
        c = np.linalg.norm(mixed, axis=-1)
    elif method == "globenc":
        shares = terms
        if piece["second"] is not None:
            second = piece["norm2"]
            s2 = np.sqrt(piece["second"].var(-1, keepdims=True) + second.epsilon)
            gamma2 = var(second.gamma)
            shares = gamma2 * (terms - terms.mean(-1, keepdims=True)) / s2[:, :, None]
        c = np.linalg.norm(shares, axis=-1)
    else:
        y_all = terms.sum(2) + offset
        total = np.abs(y_all).sum(-1)[:, :, None]
        rest = np.abs(y_all[:, :, None, :] - terms).sum(-1)
        c = np.maximum(0.0, total - rest)
        sums = c.sum(-1, keepdims=True)
        c = c / np.where(sums > 0, sums, 1.0)
    return c, y


def tolerance(dtype):
    if dtype == "float32":
        return {"rtol": 1e-4, "atol": 1e-5}
    if BACKEND in ("torch", "jax"):  # Keras' LayerNormalization: ~3e-7 off in float64
        return {"rtol": 1e-6, "atol": 1e-6}
    return {"rtol": 1e-9, "atol": 1e-11}


def complete(dtype):
    """Completeness: 1e-5 in float32 (the brief), else as tight as the backend allows."""
    if dtype == "float32":
        return {"rtol": 1e-5, "atol": 1e-5}
    if BACKEND in ("torch", "jax"):  # Keras' LayerNormalization: ~3e-7 off in float64
        return {"rtol": 1e-6, "atol": 1e-6}
    return {"rtol": 1e-12, "atol": 1e-12}


# -- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("masked", [False, True])
def test_matrices_match_the_oracle_and_outputs_are_complete(method, dtype, masked):
    model, blocks = build(dtype, masked)
    inputs = data(dtype, masked)
    plain = to_numpy(model(inputs))
    with adapter.capture(model, contributions=method) as cap:
        captured = to_numpy(model(inputs))
    np.testing.assert_array_equal(captured, plain)  # the model's outputs, bitwise
    matrices, outputs = to_numpy(cap.contributions), to_numpy(cap.outputs)
    assert matrices.shape == (2, len(blocks), N, N)
    assert outputs.shape == (2, len(blocks), N, D)
    assert str(matrices.dtype) == dtype
    real = np.ones((2, N), dtype=bool) if not masked else inputs[1]
    for layer, piece in enumerate(reference(blocks, inputs)):
        expected, rebuilt = oracle(piece, method)
        # Padded query rows (all keys masked) get uniform weights from Keras' fused kernel
        # in the model but zeros in the recorded scores; GlobEnc's second LayerNorm reads
        # the model's own stream there, so only real rows are compared.
        np.testing.assert_allclose(matrices[:, layer][real], expected[real], **tolerance(dtype))
        # Completeness: Σ_j T_i(x_j) + b_i is the block's actual output (padded query
        # rows, whose keys are all masked, follow Keras' fused kernel and are left out).
        np.testing.assert_allclose(outputs[:, layer][real], piece["out"][real], **complete(dtype))
        np.testing.assert_allclose(rebuilt[real], piece["out"][real], **complete(dtype))
    if masked:
        mask = to_numpy(cap.mask)
        np.testing.assert_array_equal(mask, inputs[1])
    assert cap._recorder is not None
    assert cap._recorder._running is None  # no per-head tensor kept
    assert_unwrapped(model)


@pytest.mark.parametrize("method", METHODS)
def test_explain_is_rollout_over_the_renormalised_matrices(method):
    model, _ = build(masked=True)
    inputs = data(masked=True)
    with adapter.capture(model, contributions=method) as cap:
        model(inputs)
    residual = 0.5 if method == "norm" else 0.0
    expected = attnflow.rollout(
        to_numpy(cap.contributions),
        heads=None,
        residual=residual,
        normalize_layers=True,
        rows=None,
        mask=inputs[1],
    )
    normalize_layers = {"normalize_layers": True} if method == "globenc" else {}
    found = adapter.explain(model, inputs, method=method, rows=None, **normalize_layers)
    np.testing.assert_allclose(to_numpy(found), expected, rtol=1e-5, atol=1e-6)
    if method == "globenc":  # issue 23: by default the authors' raw products, C_L ... C_1
        raw = to_numpy(adapter.explain(model, inputs, method=method, rows=None))
        matrices = to_numpy(cap.contributions).astype(np.float64)
        for b, real in enumerate(np.asarray(inputs[1], dtype=bool)):
            product = np.eye(int(real.sum()))
            for layer in matrices[b][:, real][:, :, real]:
                product = layer @ product
            np.testing.assert_allclose(raw[b][np.ix_(real, real)], product, rtol=1e-4)
            assert (raw[b][~real] == 0).all()
            assert (raw[b][:, ~real] == 0).all()
    first = adapter.explain(
        model, inputs, method=method, residual=0.2, mask=None, **normalize_layers
    )
    expected = attnflow.rollout(
        to_numpy(cap.contributions), heads=None, residual=0.2, normalize_layers=True, rows=0
    )
    np.testing.assert_allclose(to_numpy(first), expected, rtol=1e-5, atol=1e-6)


# -- refusals --------------------------------------------------------------------------------------
def assert_unwrapped(model):
    for layer in model._flatten_layers(include_self=True, recursive=True):
        assert "call" not in vars(layer)
        assert "_compute_attention" not in vars(layer)


def single(block):
    x = keras.Input((N, D))
    return keras.Model(x, block(x))


def test_bad_arguments_are_refused_before_any_work():
    model, _ = build()
    with pytest.raises(ValueError, match="`contributions` must be None"):
        adapter.capture(model, contributions="rollout")
    with pytest.raises(ValueError, match="drop `heads`"):
        adapter.capture(model, contributions="alti", heads="mean")
    with pytest.raises(ValueError, match="drop `heads`"):
        adapter.explain(model, data(), method="alti", heads="mean")
    with pytest.raises(ValueError, match="got 'attention'"):
        adapter.explain(model, data(), method="attention")


def test_attention_outside_a_block_is_refused():
    x = keras.Input((N, D))
    h = keras.layers.MultiHeadAttention(HEADS, KEY, name="loose")(x, x)
    h = keras.layers.MultiHeadAttention(HEADS, KEY, name="second")(h, h)
    two = keras.Model(x, keras.layers.LayerNormalization()(x + h))  # two attentions: no block
    x = keras.Input((N, D))
    bare = keras.Model(x, x + keras.layers.MultiHeadAttention(HEADS, KEY, name="loose")(x, x))
    for candidate in (keras.Model(x, PreBlock()(two(x))), bare):
        with (
            pytest.raises(ValueError, match=r"outside any recognised block: .*loose"),
            adapter.capture(candidate, contributions="norm"),
        ):
            pytest.fail("entered")  # pragma: no cover
        assert_unwrapped(candidate)


def test_cross_attention_is_refused():
    model = single(PreBlock(cross=True))
    with (
        pytest.raises(RuntimeError, match="cross-attention"),
        adapter.capture(model, contributions="alti"),
    ):
        model(data())
    assert_unwrapped(model)


def test_a_block_that_is_not_rebuilt_is_refused():
    model = single(PreBlock(scale=0.5))  # y = x + 0.5 MHA(LN(x))
    with (
        pytest.raises(RuntimeError, match="does not rebuild"),
        adapter.capture(model, contributions="globenc"),
    ):
        model(data())
    assert_unwrapped(model)


def test_dropout_active_is_refused():
    model = single(PreBlock())
    with (
        pytest.raises(RuntimeError, match="training=False"),
        adapter.capture(model, contributions="norm"),
    ):
        model(data(), training=True)


def test_half_precision_is_refused():
    model = single(PreBlock(dtype="float16"))
    with pytest.raises(ValueError, match="float32 or float64"):
        adapter.capture(model, contributions="norm").__enter__()
    assert_unwrapped(model)


def test_reading_the_wrong_result_is_refused():
    model, _ = build()
    with adapter.capture(model, contributions="norm") as cap:
        model(data())
    with pytest.raises(RuntimeError, match="read `contributions`"):
        cap.attentions  # noqa: B018
    with adapter.capture(model) as plain:
        model(data())
    with pytest.raises(RuntimeError, match='contributions="norm"'):
        plain.contributions  # noqa: B018
    with (
        pytest.raises(RuntimeError, match="ran eagerly"),
        adapter.capture(model, contributions="norm"),
    ):
        pass


def test_the_docs_example_runs():
    page = Path(__file__).resolve().parents[2] / "docs" / "adapters" / "keras.md"
    section = page.read_text(encoding="utf-8").split("## Value-aware contributions", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert code is not None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.group(1), str(page), "exec"), {"__name__": "docs_example"})  # noqa: S102
    assert printed.getvalue().split("\n")[:3] == ["(2, 2, 6, 6)", "(2, 2, 6, 8)", "True"]


class FfnInputNormBlock(PostBlock):
    """``h = LN1(x + MHA(x))``, then ``h + FFN(LN2(h))``: LN2 normalises the FFN's input."""

    ffn_input_norm = True

    def call(self, x, attention_mask=None):
        h = self.norm1(x + self.attention(x, x, attention_mask=attention_mask))
        return h + self.ffn(self.norm2(h))


def test_a_layer_norm_of_the_ffn_input_is_not_globencs_second_norm():
    keras.utils.set_random_seed(3)
    block = FfnInputNormBlock()
    model = single(block)
    with adapter.capture(model, contributions="globenc") as cap:
        model(data())
    (piece,) = reference([block], data())
    assert piece["second"] is None
    expected, _ = oracle(piece, "globenc")
    np.testing.assert_allclose(to_numpy(cap.contributions)[:, 0], expected, rtol=1e-4, atol=1e-5)


# Keras' predict() on torch converts its outputs with np.array(copy=False), which warns.
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_a_traced_call_is_refused():
    model, _ = build()
    if BACKEND == "torch":  # predict() runs eagerly on torch: the capture works
        with adapter.capture(model, contributions="norm") as cap:
            model.predict(data(), verbose=0)
        assert tuple(cap.contributions.shape) == (2, 4, N, N)
    else:
        with (
            pytest.raises(RuntimeError, match="symbolic attention scores"),
            adapter.capture(model, contributions="norm"),
        ):
            model.predict(data(), verbose=0)
    assert_unwrapped(model)
