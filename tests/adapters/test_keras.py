"""attnflow.adapters.keras on small Keras 3 models, on the backend of ``KERAS_BACKEND``.

The reference is always the layer's own ``return_attention_scores=True`` output, obtained
by calling the same layer instances (same weights) with scores requested.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras", reason="the Keras adapter needs Keras 3")

import attnflow
from attnflow.adapters import keras as adapter

N, D, HEADS = 6, 8, 2
BACKEND = keras.backend.backend()


def to_numpy(x):
    if hasattr(x, "detach"):  # torch: Keras' convert_to_numpy warns with torch 2.13 + NumPy 2
        return x.detach().cpu().numpy()
    return np.asarray(keras.ops.convert_to_numpy(x))


def assert_restored(model):
    for layer in adapter._attention_layers(model):
        assert "_compute_attention" not in vars(layer)
        assert "_masked_softmax" not in vars(layer)
        assert layer._flash_attention is None  # the Keras default ("auto")


# -- models ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def functional():
    """Two MultiHeadAttention layers with a padding mask, plus a reference that calls the
    same layers eagerly with ``return_attention_scores=True``."""
    keras.utils.set_random_seed(0)
    x = keras.Input((N, D), name="x")
    pad = keras.Input((N,), dtype="bool", name="pad")
    mask = keras.ops.logical_and(keras.ops.expand_dims(pad, 1), keras.ops.expand_dims(pad, 2))
    mha0 = keras.layers.MultiHeadAttention(HEADS, 4, name="mha0")
    mha1 = keras.layers.MultiHeadAttention(HEADS, 4, name="mha1")
    norm = keras.layers.LayerNormalization(name="norm")
    h = norm(x + mha0(x, x, attention_mask=mask))
    y = mha1(h, h, attention_mask=mask)
    model = keras.Model([x, pad], y)

    def reference(inputs):
        x, pad = (keras.ops.convert_to_tensor(t) for t in inputs)
        mask = keras.ops.logical_and(keras.ops.expand_dims(pad, 1), keras.ops.expand_dims(pad, 2))
        h, s0 = mha0(x, x, attention_mask=mask, return_attention_scores=True)
        h = norm(x + h)
        y, s1 = mha1(h, h, attention_mask=mask, return_attention_scores=True)
        return y, s0, s1

    return model, reference


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, N, D)).astype("float32")
    pad = np.ones((2, N), dtype=bool)
    pad[1, 4:] = False  # the second sequence has two padding tokens
    return [x, pad]


class Block(keras.layers.Layer):
    """A pre-norm self-attention block holding its MultiHeadAttention (nested layer)."""

    def __init__(self, causal=False, **kwargs):
        super().__init__(**kwargs)
        self.causal = causal
        self.norm = keras.layers.LayerNormalization()
        self.attention = keras.layers.MultiHeadAttention(HEADS, 4)

    def call(self, x, return_scores=False):
        h = self.norm(x)
        out = self.attention(
            h, h, use_causal_mask=self.causal, return_attention_scores=return_scores
        )
        if return_scores:
            return x + out[0], out[1]
        return x + out


def make_sequential():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((N, D)), Block(), Block(causal=True)])


@pytest.fixture(scope="module")
def sequential():
    return make_sequential()


# -- functional model ------------------------------------------------------------------------
def test_functional_scores_equal_layer_output(functional, batch):
    model, reference = functional
    expected_y, s0, s1 = reference(batch)
    with adapter.capture(model) as cap:
        y = model(batch)
    attentions = cap.attentions
    assert tuple(attentions.shape) == (2, 2, HEADS, N, N)
    expected = np.stack([to_numpy(s0), to_numpy(s1)], axis=1)
    np.testing.assert_allclose(to_numpy(attentions), expected, rtol=1e-5, atol=1e-6)
    assert len(cap.records) == 2
    # The outputs are those of an ordinary call, and of the reference.
    np.testing.assert_allclose(to_numpy(y), to_numpy(model(batch)), rtol=1e-5, atol=1e-6)
    # Real query rows agree with the scores path too (fully masked rows are left to Keras).
    real = batch[1][:, :, None]
    np.testing.assert_allclose(
        to_numpy(y) * real, to_numpy(expected_y) * real, rtol=1e-5, atol=1e-6
    )
    assert_restored(model)


def test_functional_padding(functional, batch):
    model, _ = functional
    with adapter.capture(model) as cap:
        model(batch)
    mask = cap.mask
    assert mask is not None
    assert to_numpy(mask).dtype == bool
    np.testing.assert_array_equal(to_numpy(mask), batch[1])
    weights = to_numpy(cap.attentions)
    assert np.all(weights[1, :, :, :, 4:] == 0)  # padded keys get nothing
    assert np.all(weights[1, :, :, 4:, :] == 0)  # Keras: fully masked rows are all zero


def test_caller_still_gets_its_scores(sequential, batch):
    block = sequential.layers[0]
    expected = [to_numpy(t) for t in block(batch[0], return_scores=True)]
    with adapter.capture(block) as cap:
        got = [to_numpy(t) for t in block(batch[0], return_scores=True)]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(to_numpy(cap.attentions), expected[1][:, None], rtol=1e-5, atol=1e-6)
    assert_restored(block)


def test_heads_fused_while_capturing(functional, batch):
    model, _ = functional
    with adapter.capture(model) as full:
        model(batch)
    with adapter.capture(model, heads="mean") as fused:
        model(batch)
    assert tuple(fused.attentions.shape) == (2, 2, N, N)
    np.testing.assert_allclose(
        to_numpy(fused.attentions), to_numpy(full.attentions).mean(axis=2), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(to_numpy(fused.mask), batch[1])


def test_rollout_end_to_end(functional, batch):
    model, _ = functional
    with adapter.capture(model) as cap:
        model(batch)
    result = attnflow.rollout(cap.attentions, rows=0, mask=cap.mask)
    assert keras.ops.is_tensor(result)
    assert type(result).__module__.split(".")[0] == type(cap.attentions).__module__.split(".")[0]
    assert tuple(result.shape) == (2, N)
    expected = attnflow.rollout(to_numpy(cap.attentions), rows=0, mask=batch[1])
    np.testing.assert_allclose(to_numpy(result), expected, rtol=1e-5, atol=1e-6)
    assert np.all(to_numpy(result)[1, 4:] == 0)
    via_explain = adapter.explain(model, batch)
    np.testing.assert_allclose(to_numpy(via_explain), expected, rtol=1e-5, atol=1e-6)


def test_restored_when_the_block_raises(functional, batch):
    model, _ = functional
    with pytest.raises(ZeroDivisionError), adapter.capture(model):  # noqa: PT012
        model(batch)
        _ = 1 / 0
    assert_restored(model)
    bad = [batch[0][:, :, :3], batch[1]]  # wrong feature size: the model call raises
    with pytest.raises(Exception), adapter.capture(model):  # noqa: B017, PT011
        model(bad)
    assert_restored(model)


# -- sequential model of subclassed blocks, causal attention ---------------------------------
def test_sequential_nested_and_causal(sequential, batch):
    x = batch[0]
    first, second = sequential.layers
    h, s0 = first(x, return_scores=True)
    y_ref, s1 = second(h, return_scores=True)
    with adapter.capture(sequential) as cap:
        y = sequential(x)
    np.testing.assert_allclose(to_numpy(y), to_numpy(y_ref), rtol=1e-5, atol=1e-6)
    expected = np.stack([to_numpy(s0), to_numpy(s1)], axis=1)
    np.testing.assert_allclose(to_numpy(cap.attentions), expected, rtol=1e-5, atol=1e-6)
    causal = to_numpy(cap.attentions)[:, 1]
    assert np.all(np.triu(causal, k=1) == 0)
    assert cap.mask is None or np.all(to_numpy(cap.mask))
    assert_restored(sequential)


# -- gradients with respect to the attention weights -------------------------------------------
def real_rows_target(y):
    """A scalar of the outputs of real tokens only (the second sequence pads rows 4 and 5)."""
    return keras.ops.sum(keras.ops.sin(3.0 * y[:, :4]))


def target_with_deltas(model, inputs, target, deltas):
    """``target(model(inputs))`` with `deltas` added to the attention weights, as a float."""
    layers = list(adapter._attention_layers(model))
    with adapter._deltas_installed(layers) as state:
        state.deltas = [keras.ops.convert_to_tensor(d) for d in deltas]
        value = target(model(inputs))
    assert len(state.records) == len(deltas)
    return float(to_numpy(value))


def test_attention_gradients_match_finite_differences(functional, batch):
    model, _ = functional
    attentions, gradients = adapter.attention_gradients(model, batch, target=real_rows_target)
    assert keras.ops.is_tensor(gradients)
    assert type(gradients).__module__.split(".")[0] == type(attentions).__module__.split(".")[0]
    assert tuple(attentions.shape) == tuple(gradients.shape) == (2, 2, HEADS, N, N)
    with adapter.capture(model) as cap:
        y = model(batch)
    np.testing.assert_allclose(to_numpy(attentions), to_numpy(cap.attentions), rtol=1e-5, atol=1e-6)
    assert_restored(model)

    grads = to_numpy(gradients)
    assert np.all(np.isfinite(grads))
    assert np.abs(grads[:, 0]).max() > 0
    assert np.abs(grads[:, 1]).max() > 0
    zeros = [np.zeros((2, HEADS, N, N), "float32") for _ in range(2)]
    # Zero deltas leave the outputs of real tokens unchanged.
    base = target_with_deltas(model, batch, real_rows_target, zeros)
    assert base == pytest.approx(float(to_numpy(real_rows_target(y))), rel=1e-5, abs=1e-5)

    eps = 3e-3
    scale = float(np.abs(grads).max())

    def central(direction):
        plus = [z + eps * d for z, d in zip(zeros, direction, strict=True)]
        minus = [z - eps * d for z, d in zip(zeros, direction, strict=True)]
        high = target_with_deltas(model, batch, real_rows_target, plus)
        low = target_with_deltas(model, batch, real_rows_target, minus)
        return (high - low) / (2 * eps)

    # Single entries of both layers (a padded key column and a padded query row included).
    entries = [(0, 0, 0, 0, 2), (0, 1, 1, 3, 5), (1, 0, 1, 2, 1), (1, 1, 0, 5, 4)]
    entries += [(1, 1, 1, 1, 5), (1, 0, 0, 4, 0)]
    for b, layer, head, i, j in entries:
        direction = [np.zeros_like(z) for z in zeros]
        direction[layer][b, head, i, j] = 1.0
        expected = central(direction)
        assert grads[b, layer, head, i, j] == pytest.approx(expected, rel=1e-2, abs=1e-3 * scale)
    # A random direction through every entry of both layers at once.
    rng = np.random.default_rng(1)
    direction = [rng.normal(size=z.shape).astype("float32") for z in zeros]
    analytic = sum(float(np.sum(grads[:, k] * direction[k])) for k in range(2))
    assert analytic == pytest.approx(central(direction), rel=1e-2, abs=1e-3 * scale)


def test_attention_gradients_of_one_layer(sequential, batch):
    """The target reads the first block's output only: the second layer gets zeros."""
    first = sequential.layers[0]
    attentions, gradients = adapter.attention_gradients(
        first, batch[0], target=lambda y: keras.ops.sum(y[:, 0])
    )
    assert tuple(attentions.shape) == tuple(gradients.shape) == (2, 1, HEADS, N, N)
    assert np.abs(to_numpy(gradients)).max() > 0
    _, gradients = adapter.attention_gradients(
        sequential, batch[0], target=lambda y: keras.ops.sum(y[:, 0])
    )
    grads = to_numpy(gradients)
    assert grads.shape == (2, 2, HEADS, N, N)
    # Causal second layer: query 0 attends to key 0 only, but the gradient says how the
    # output would move if it attended elsewhere, so it is not masked.
    assert np.abs(grads[:, 1, :, 0, 1:]).max() > 0
    assert_restored(sequential)


def test_attention_gradients_errors(sequential, batch):
    with pytest.raises(ValueError, match="scalar"):
        adapter.attention_gradients(sequential, batch[0], target=lambda y: y)
    assert_restored(sequential)
    with pytest.raises(TypeError, match="Keras model"):
        adapter.attention_gradients(object(), batch[0], target=keras.ops.sum)
    with pytest.raises(TypeError, match="callable"):
        adapter.attention_gradients(sequential, batch[0], target=None)
    dense = keras.Sequential([keras.Input((N, D)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"no keras\.layers\.MultiHeadAttention"):
        adapter.attention_gradients(dense, batch[0], target=keras.ops.sum)
    with (  # noqa: PT012
        pytest.raises(RuntimeError, match="already being captured"),
        adapter.capture(sequential),
    ):
        sequential(batch[0])
        adapter.attention_gradients(sequential, batch[0], target=keras.ops.sum)
    assert_restored(sequential)


# -- errors ----------------------------------------------------------------------------------
def test_no_attention_layer_is_an_error():
    model = keras.Sequential([keras.Input((N, D)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"no keras\.layers\.MultiHeadAttention"):
        adapter.capture(model).__enter__()


def test_nothing_captured_is_an_error(sequential):
    with pytest.raises(RuntimeError, match="No attention scores were captured"):  # noqa: SIM117
        with adapter.capture(sequential):
            pass
    assert_restored(sequential)


@pytest.mark.skipif(BACKEND == "torch", reason="predict() runs eagerly on the torch backend")
def test_traced_call_is_an_error(batch):
    model = make_sequential()  # an aborted predict() leaves Keras' traced function half-built
    with pytest.raises(RuntimeError, match="symbolic"), adapter.capture(model):
        model.predict(batch[0], verbose=0)
    assert_restored(model)


def test_bad_arguments(sequential):
    with pytest.raises(TypeError, match="Keras model"):
        adapter.capture(object())
    with pytest.raises(ValueError, match="heads"):
        adapter.capture(sequential, heads="median")
    with pytest.raises(ValueError, match="method"):
        adapter.explain(sequential, np.zeros((1, N, D), "float32"), method="graph")
    cap = adapter.capture(sequential)
    with cap:
        sequential(np.zeros((1, N, D), "float32"))
    with pytest.raises(RuntimeError, match="one `with` block"), cap:
        pass
