"""attnflow.adapters.keras on small Keras 3 models, on the backend of ``KERAS_BACKEND``.

The reference is always the layer's own ``return_attention_scores=True`` output, obtained
by calling the same layer instances (same weights) with scores requested.
"""

from __future__ import annotations

from contextlib import contextmanager

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


@pytest.mark.parametrize("method", ["rollout", "raw"])
def test_explain_negative_rows_count_from_the_real_tokens(functional, batch, method):
    # Issue 40: the second sequence is right-padded after 4 tokens; rows=-1 is its last
    # real token (3), never the padding position 5.
    model, _ = functional
    got = to_numpy(adapter.explain(model, batch, method=method, rows=-1))
    with adapter.capture(model) as cap:
        model(batch)
    weights, mask = to_numpy(cap.attentions), to_numpy(cap.mask)
    function = getattr(attnflow, method)
    expected = [function(weights, rows=row, mask=mask)[b] for b, row in ((0, N - 1), (1, 3))]
    np.testing.assert_allclose(got, np.stack(expected), atol=1e-6)
    assert np.abs(got[1]).sum() > 0.5  # the padding row would be all zeros


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
    assert tuple(fused.attentions.shape) == (2, 2, 1, N, N)  # one fused head, axis kept
    np.testing.assert_allclose(
        to_numpy(fused.attentions),
        to_numpy(full.attentions).mean(axis=2, keepdims=True),
        rtol=1e-5,
        atol=1e-6,
    )
    # Read with rollout's default heads="mean", it is the unfused capture's rollout.
    np.testing.assert_allclose(
        to_numpy(attnflow.rollout(fused.attentions, rows=0, layers="all", mask=fused.mask)),
        to_numpy(attnflow.rollout(full.attentions, rows=0, layers="all", mask=full.mask)),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_array_equal(to_numpy(fused.mask), batch[1])


def test_capture_heads_each_is_the_default_and_none_is_deprecated(functional, batch):
    # heads="each" keeps every head; capture(heads=None) meant the same until 0.1.
    model, _ = functional
    with adapter.capture(model) as default:
        model(batch)
    with adapter.capture(model, heads="each") as each:
        model(batch)
    with pytest.warns(DeprecationWarning, match=r'capture\(heads=None\)`.*heads="each"'):
        old = adapter.capture(model, heads=None)
    with old:
        model(batch)
    assert default.heads == each.heads == old.heads == "each"
    assert tuple(default.attentions.shape)[:3] == (2, 2, 2)
    np.testing.assert_array_equal(to_numpy(each.attentions), to_numpy(default.attentions))
    np.testing.assert_array_equal(to_numpy(old.attentions), to_numpy(default.attentions))


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


# -- input gradients -------------------------------------------------------------------------
VOCAB, CLASSES = 20, 3
TOKENS = np.array([[1, 5, 7, 2, 9, 4], [3, 8, 8, 6, 11, 2]], dtype="int32")
REDUCTIONS = ("l2", "sum_abs", "x_input")


@contextmanager
def float64():
    """Build and run in float64 (for finite differences), with 64-bit types on in JAX."""
    previous = keras.config.floatx(), keras.config.dtype_policy()
    # The global dtype policy, once read, no longer follows floatx: set both.
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        if BACKEND == "jax":
            import jax

            with jax.enable_x64(True):
                yield
        else:
            yield
    finally:
        keras.config.set_dtype_policy(previous[1])
        keras.config.set_floatx(previous[0])


def make_classifier(seed=0):
    """Token ids -> Embedding -> two attention layers -> first token -> linear logits.

    ``body`` is everything after the embedding, for finite differences. Its layers keep
    float64 exact on every backend (Keras 3.15 computes ``Dense``'s matmul in float32 on
    torch, and ``tanh`` / ``sin`` lose float64 precision on JAX: too coarse for finite
    differences with eps = 1e-6), hence EinsumDense, sigmoid and requested scores.
    """
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((N,), dtype="int32", name="tokens")
    embed = keras.layers.Embedding(VOCAB, D, name="embed")
    hidden = keras.Input((N, D), name="hidden")
    x = hidden
    for i in range(2):
        # Scores requested: Keras' explicit softmax path. The fused kernel it takes otherwise
        # (jax.nn.dot_product_attention, torch SDPA) loses float64 precision as well.
        attended, _ = keras.layers.MultiHeadAttention(HEADS, 4, name=f"attention{i}")(
            x, x, return_attention_scores=True
        )
        mix = keras.layers.EinsumDense(
            "bnd,de->bne", (N, D), bias_axes="e", activation="sigmoid", name=f"mix{i}"
        )
        x = x + mix(attended)
    head = keras.layers.EinsumDense("bd,dc->bc", (CLASSES,), bias_axes="c", name="head")
    body = keras.Model(hidden, head(x[:, 0]), name="body")
    model = keras.Model(tokens, body(embed(tokens)), name="classifier")
    return model, body, embed


@pytest.fixture(scope="module")
def classifier():
    """A float64 classifier and central finite differences of all its scores.

    Each embedding coordinate is moved in every sample at once (samples do not
    interact); one pass gives the derivative of every class's logit and probability.
    """
    with float64():
        model, body, embed = make_classifier()
        embedded = to_numpy(embed(TOKENS))
        assert embedded.dtype == np.float64
        eps = 1e-6
        jacobians = {
            "logit": np.zeros((2, CLASSES, N, D)),
            "probability": np.zeros((2, CLASSES, N, D)),
        }
        for i in range(N):
            for k in range(D):
                step = np.zeros_like(embedded)
                step[:, i, k] = eps
                high = to_numpy(body(embedded + step))
                low = to_numpy(body(embedded - step))
                jacobians["logit"][:, :, i, k] = (high - low) / (2 * eps)
                high = to_numpy(keras.ops.softmax(high))
                low = to_numpy(keras.ops.softmax(low))
                jacobians["probability"][:, :, i, k] = (high - low) / (2 * eps)
        logits = to_numpy(model(TOKENS))
    return model, embed, embedded, logits, jacobians


@pytest.fixture
def in_float64():
    with float64():
        yield


def reduce_reference(grads, embedded, reduce):
    if reduce == "l2":
        return np.linalg.norm(grads, axis=-1)
    if reduce == "sum_abs":
        return np.abs(grads.sum(-1))
    return np.abs((grads * embedded).sum(-1))


TARGETS = {
    "predicted": lambda: None,
    "int": lambda: 2,
    "list": lambda: [1, 0],
    "numpy": lambda: np.array([0, 2]),
    "tensor": lambda: keras.ops.convert_to_tensor([2, 1], dtype="int32"),
}


@pytest.mark.parametrize("output", ["probability", "logit"])
@pytest.mark.parametrize("target_kind", list(TARGETS))
def test_input_gradients_match_finite_differences(classifier, in_float64, output, target_kind):
    model, embed, embedded, logits, jacobians = classifier
    target = TARGETS[target_kind]()
    if target is None:
        classes = logits.argmax(-1)
    else:
        classes = np.broadcast_to(
            np.asarray(to_numpy(target) if keras.ops.is_tensor(target) else target), (2,)
        )
    numeric = jacobians[output][np.arange(2), classes]  # (batch, n, d)
    assert np.abs(numeric).max() > 1e-3
    for reduce in REDUCTIONS:
        got = adapter.input_gradients(model, TOKENS, target=target, reduce=reduce, output=output)
        assert keras.ops.is_tensor(got)
        assert type(got).__module__.split(".")[0] == type(model(TOKENS)).__module__.split(".")[0]
        assert keras.backend.standardize_dtype(got.dtype) == "float64"
        assert tuple(got.shape) == (2, N)
        expected = reduce_reference(numeric, embedded, reduce)
        np.testing.assert_allclose(to_numpy(got), expected, rtol=1e-6, atol=1e-9)
    assert "call" not in vars(embed)
    np.testing.assert_array_equal(to_numpy(model(TOKENS)), logits)  # the model is unchanged


def test_input_gradients_of_a_softmax_model(classifier, in_float64):
    """A model ending with a softmax: output="logit" differentiates its probabilities."""
    model, embed, *_ = classifier
    probabilities = keras.Model(model.inputs[0], keras.layers.Softmax()(model.outputs[0]))
    expected = to_numpy(adapter.input_gradients(model, TOKENS, output="probability"))
    got = to_numpy(adapter.input_gradients(probabilities, TOKENS, output="logit"))
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-14)
    with pytest.warns(UserWarning, match='look like probabilities.*output="logit"'):
        adapter.input_gradients(probabilities, TOKENS)
    assert "call" not in vars(embed)


def test_input_gradients_float32():
    model, _, embed = make_classifier(seed=3)
    got = adapter.input_gradients(model, TOKENS, reduce="x_input")
    assert keras.backend.standardize_dtype(got.dtype) == "float32"
    assert tuple(got.shape) == (2, N)
    assert np.all(np.isfinite(to_numpy(got)))
    assert "call" not in vars(embed)


def test_input_gradients_errors(classifier, in_float64):
    model, embed, *_ = classifier
    for kwargs, error, match in [
        ({"reduce": "abs"}, ValueError, "`reduce`"),
        ({"output": "log_probability"}, ValueError, "`output`"),
        ({"target": 1.5}, TypeError, "`target`"),
        ({"target": True}, TypeError, "`target`"),
        ({"target": np.array([0.0, 1.0])}, TypeError, "`target`"),
        ({"target": np.array([[0, 1]])}, TypeError, "`target`"),
        ({"embeddings": "embed"}, TypeError, "`embeddings`"),
        ({"embeddings": keras.layers.Embedding(VOCAB, D)}, ValueError, "not a layer of"),
        ({"target": 3}, ValueError, r"\[0, 3\).*\[3, 3\]"),
        ({"target": -1}, ValueError, r"\[0, 3\)"),
        ({"target": [0, 5]}, ValueError, r"\[5\]"),
        ({"target": [0]}, ValueError, "1 classes for a batch of 2"),
        ({"target": np.array([0, 1, 2])}, ValueError, "3 classes for a batch of 2"),
        ({"embeddings": model.get_layer("body").get_layer("head")}, ValueError, "batch, n, d"),
    ]:
        with pytest.raises(error, match=match):
            adapter.input_gradients(model, TOKENS, **kwargs)
        assert "call" not in vars(embed)
    with pytest.raises(TypeError, match="Keras model"):
        adapter.input_gradients(object(), TOKENS)
    # Not a classifier: the states of every token.
    states = keras.Model(model.inputs[0], embed(model.inputs[0]))
    with pytest.raises(TypeError, match=r"\(batch, classes\).*\(2, 6, 8\)"):
        adapter.input_gradients(states, TOKENS)
    no_embedding = keras.Sequential([keras.Input((N, D)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"no keras\.layers\.Embedding"):
        adapter.input_gradients(no_embedding, np.zeros((2, N, D)))
    tokens = keras.Input((N,), dtype="int32")
    two = keras.layers.Embedding(VOCAB, D, name="words")(tokens) + keras.layers.Embedding(
        VOCAB, D, name="tags"
    )(tokens)
    two = keras.Model(tokens, keras.layers.Dense(CLASSES)(two[:, 0]))
    with pytest.raises(ValueError, match=r"several keras\.layers\.Embedding.*'words', 'tags'"):
        adapter.input_gradients(two, TOKENS)
    assert tuple(adapter.input_gradients(two, TOKENS, embeddings=two.get_layer("tags")).shape) == (
        2,
        N,
    )

    # A layer that does not run.
    class WithSpare(keras.Model):
        def __init__(self):
            super().__init__()
            self.classifier = model
            self.spare = keras.layers.Embedding(VOCAB, D)
            self.spare.build((None, N))

        def call(self, tokens):
            return self.classifier(tokens)

    with_spare = WithSpare()
    with pytest.raises(RuntimeError, match="ran 0 times"):
        adapter.input_gradients(with_spare, TOKENS, embeddings=with_spare.spare)
    # Embedded twice (a shared layer): which call to differentiate is ambiguous.
    twice = keras.Model(tokens, model.get_layer("body")(embed(tokens) + embed(tokens)))
    with pytest.raises(RuntimeError, match="ran 2 times"):
        adapter.input_gradients(twice, TOKENS, embeddings=embed)
    assert "call" not in vars(embed)


# -- gradient-weighted rollout (Chefer et al. 2021, GAE) -----------------------------------------
def explicit_score(classes, target_score):
    """Each sample's logit (or log-softmax) at its class, summed over the batch."""

    def score(y):
        values = keras.ops.log_softmax(y, axis=-1) if target_score == "log_probability" else y
        return keras.ops.sum(values * keras.ops.one_hot(classes, CLASSES, dtype=y.dtype))

    return score


@pytest.mark.parametrize("target_score", ["logit", "log_probability"])
@pytest.mark.parametrize("target", [None, 1])
def test_explain_gradient_rollout_equals_chefer_loop(in_float64, target, target_score):
    # Reference: the backend's autodiff (attention_gradients) of the explicit expression.
    model, _, _ = make_classifier(seed=3)
    logits = to_numpy(model(TOKENS))
    classes = logits.argmax(-1) if target is None else np.full(2, target)
    attentions, gradients = adapter.attention_gradients(
        model, TOKENS, target=explicit_score(classes, target_score)
    )
    weights, grads = to_numpy(attentions), to_numpy(gradients)
    assert np.abs(grads).max() > 1e-6
    expected = []
    for sample in range(2):  # Chefer's loop: R = I; R += mean_h((G * A)^+) @ R per layer
        relevance = np.eye(N)
        for layer in range(weights.shape[1]):
            cam = np.clip(grads[sample, layer] * weights[sample, layer], 0, None).mean(0)
            relevance = relevance + cam @ relevance
        expected.append(relevance)
    options = {"method": "gradient_rollout", "target": target}
    got = adapter.explain(model, TOKENS, target_score=target_score, rows=None, **options)
    assert keras.ops.is_tensor(got) or isinstance(got, np.ndarray)
    np.testing.assert_allclose(to_numpy(got), np.stack(expected), rtol=1e-10, atol=1e-10)
    if target_score == "logit":  # the default: unchanged
        cls = adapter.explain(model, TOKENS, exclude_self=True, **options)
        np.testing.assert_allclose(to_numpy(cls)[:, 1:], np.stack(expected)[:, 0, 1:], rtol=1e-10)
        assert np.all(to_numpy(cls)[:, 0] == 0)
    else:  # another score than the logit's
        logit = adapter.explain(model, TOKENS, rows=None, **options)
        assert not np.allclose(to_numpy(logit), to_numpy(got), rtol=1e-6, atol=1e-6)


def test_explain_gradient_rollout_errors(functional, batch):
    model, _ = functional
    # `target_score` is checked before the model runs (not a model at all here).
    with pytest.raises(
        ValueError,
        match=r'`target_score` must be "logit" .* or "log_probability" .*; got \'probability\'',
    ):
        adapter.explain(object(), batch, method="gradient_rollout", target_score="probability")
    with pytest.raises(ValueError, match=r"rollout does not use gradients.*Drop `target_score`"):
        adapter.explain(object(), batch, target_score="log_probability")
    with pytest.raises(ValueError, match="`target` selects the class"):
        adapter.explain(model, batch, target=1)
    with pytest.raises(TypeError, match="needs a classifier"):
        adapter.explain(model, batch, method="gradient_rollout")
