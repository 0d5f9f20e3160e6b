"""attnflow.adapters.jax against small Flax linen and NNX models."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="the JAX adapter needs flax (and jax)")

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import attention as nnx_attention

import attnflow
from attnflow.adapters import jax as adapter

jax.config.update("jax_enable_x64", False)

B, N, D, H = 2, 5, 8, 2
VALID = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


def target(y):
    return (y[:, 0] * jnp.arange(1.0, D + 1)).sum()


# -- a small linen encoder -----------------------------------------------------------------------
class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        x = x + nn.MultiHeadDotProductAttention(num_heads=H, name="attn")(x, mask=mask)
        return x + nn.Dense(D)(jnp.tanh(nn.LayerNorm()(x)))


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        for i in range(2):
            x = Block(name=f"block{i}")(x, mask)
        return x


@pytest.fixture(scope="module")
def linen_setup():
    x = jax.random.normal(jax.random.key(1), (B, N, D))
    mask = nn.make_attention_mask(VALID, VALID)
    model = Encoder()
    variables = model.init(jax.random.key(0), x, mask)
    return model, variables, x, mask


def manual_linen(params, x, mask):
    """Recompute softmax(QK^T/sqrt(d)) layer by layer from the parameters."""
    maps = []
    for i in range(2):
        p = params[f"block{i}"]["attn"]
        q = jnp.einsum("bnd,dhk->bnhk", x, p["query"]["kernel"]) + p["query"]["bias"]
        k = jnp.einsum("bnd,dhk->bnhk", x, p["key"]["kernel"]) + p["key"]["bias"]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        maps.append(jax.nn.softmax(logits, axis=-1))
        x = Block().apply({"params": params[f"block{i}"]}, x, mask)
    return jnp.stack(maps, axis=1)


def test_linen_weights_outputs_mask(linen_setup):
    model, variables, x, mask = linen_setup
    y, cap = adapter.capture_linen(model, variables, x, mask)
    np.testing.assert_allclose(y, model.apply(variables, x, mask), rtol=1e-6, atol=1e-6)
    assert cap.attentions.shape == (B, 2, H, N, N)
    expected = manual_linen(variables["params"], x, mask)
    np.testing.assert_allclose(cap.attentions, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cap.mask, VALID.astype(bool))
    assert cap.gradients is None


def test_linen_jit_and_heads(linen_setup):
    model, variables, x, mask = linen_setup
    eager = adapter.capture_linen(model, variables, x, mask)[1]
    jitted = jax.jit(lambda v, x, m: adapter.capture_linen(model, v, x, m))
    _, cap = jitted(variables, x, mask)
    np.testing.assert_allclose(cap.attentions, eager.attentions, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cap.mask, eager.mask)
    _, fused = adapter.capture_linen(model, variables, x, mask, heads="mean")
    assert fused.attentions.shape == (B, 2, 1, N, N)  # one fused head, axis kept
    np.testing.assert_allclose(
        fused.attentions, eager.attentions.mean(axis=2, keepdims=True), rtol=1e-6
    )
    np.testing.assert_allclose(
        attnflow.rollout(fused.attentions, rows=0, layers="all"),
        attnflow.rollout(eager.attentions, rows=0, layers="all"),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("method", ["rollout", "raw", "flow"])
def test_explain_linen_negative_rows_count_from_the_real_tokens(linen_setup, method):
    # Issue 40: VALID is right-padded; rows=-1 is each sequence's last real token
    # (4 and 2), never the padding position 4 of the shorter one.
    model, variables, x, mask = linen_setup
    got = adapter.explain_linen(model, variables, x, mask, method=method, rows=-1)
    _, cap = adapter.capture_linen(model, variables, x, mask)
    function = getattr(attnflow, method)
    expected = [function(cap.attentions, rows=row, mask=cap.mask)[b] for b, row in ((0, 4), (1, 2))]
    np.testing.assert_allclose(got, jnp.stack(expected), atol=1e-6)
    assert float(jnp.abs(got[1]).sum()) > 0.5  # the padding row would be all zeros


def test_linen_rollout_end_to_end(linen_setup):
    model, variables, x, mask = linen_setup
    _, cap = adapter.capture_linen(model, variables, x, mask)
    scores = attnflow.rollout(cap.attentions, rows=0, mask=cap.mask)
    assert isinstance(scores, jax.Array)
    assert scores.shape == (B, N)
    np.testing.assert_allclose(scores.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(scores[1, 3:], 0.0)


def test_linen_gradients_match_finite_differences(linen_setup):
    model, variables, x, mask = linen_setup
    attentions, gradients = jax.jit(
        lambda v, x, m: adapter.attention_gradients_linen(model, v, x, m, target=target)
    )(variables, x, mask)
    _, cap = adapter.capture_linen(model, variables, x, mask)
    np.testing.assert_allclose(attentions, cap.attentions, rtol=1e-6, atol=1e-6)
    assert gradients.shape == attentions.shape == (B, 2, H, N, N)
    assert not (variables.keys() - {"params"})  # the caller's variables are untouched

    # Central finite differences through an explicit additive perturbation of one entry.
    def perturbed_output(layer, index, eps):
        def patched(*args, **kwargs):
            w = original(*args, **kwargs)
            module = kwargs.get("module", args[10] if len(args) > 10 else None)
            if module is not None and module.scope.path[0] == f"block{layer}":
                w = w.at[index].add(eps)
            return w

        def force(next_fun, args, kwargs, context):
            if isinstance(context.module, nn.MultiHeadDotProductAttention):
                kwargs = {**kwargs, "sow_weights": True}
            return next_fun(*args, **kwargs)

        original = nn.attention.dot_product_attention_weights
        nn.attention.dot_product_attention_weights = patched
        try:
            with nn.intercept_methods(force):
                y, _ = model.apply(variables, x, mask, mutable=["intermediates"])
        finally:
            nn.attention.dot_product_attention_weights = original
        return float(target(y))

    eps = 1e-2
    for layer, index in [(0, (0, 1, 0, 2)), (1, (1, 0, 0, 1)), (1, (0, 1, 3, 4))]:
        fd = (perturbed_output(layer, index, eps) - perturbed_output(layer, index, -eps)) / (
            2 * eps
        )
        np.testing.assert_allclose(
            gradients[(index[0], layer, *index[1:])], fd, rtol=2e-2, atol=2e-3
        )


def test_capture_heads_each_is_the_default_and_none_is_deprecated(linen_setup, nnx_setup):
    # heads="each" keeps every head; capture_*(heads=None) meant the same until 0.1.
    model, variables, x, mask = linen_setup
    default = adapter.capture_linen(model, variables, x, mask)[1]
    each = adapter.capture_linen(model, variables, x, mask, heads="each")[1]
    with pytest.warns(DeprecationWarning, match=r'capture_linen\(heads=None\)`.*heads="each"'):
        old = adapter.capture_linen(model, variables, x, mask, heads=None)[1]
    assert default.attentions.shape == (B, 2, H, N, N)
    np.testing.assert_array_equal(each.attentions, default.attentions)
    np.testing.assert_array_equal(old.attentions, default.attentions)
    module, x, mask = nnx_setup
    default = adapter.capture_nnx(module, x, mask=mask)[1]
    with pytest.warns(DeprecationWarning, match=r"capture_nnx\(heads=None\)"):
        old = adapter.capture_nnx(module, x, mask=mask, heads=None)[1]
    np.testing.assert_array_equal(old.attentions, default.attentions)


def test_linen_nothing_captured():
    model = nn.Dense(3)
    x = jnp.ones((1, 4))
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(RuntimeError, match="No attention weights were captured"):
        adapter.capture_linen(model, variables, x)
    with pytest.raises(ValueError, match="heads"):
        adapter.capture_linen(model, variables, x, heads="median")


# -- a small NNX encoder -------------------------------------------------------------------------
class NNXEncoder(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [
                nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, rngs=rngs)
                for _ in range(2)
            ]
        )

    def __call__(self, x, mask=None):
        for layer in self.layers:
            x = x + layer(x, mask=mask)
        return x


@pytest.fixture(scope="module")
def nnx_setup():
    model = NNXEncoder(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (B, N, D))
    return model, x, nn.make_attention_mask(VALID, VALID)


def manual_nnx(model, x, mask):
    maps = []
    for layer in model.layers:
        q, k = layer.query(x), layer.key(x)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        maps.append(jax.nn.softmax(logits, axis=-1))
        x = x + layer(x, mask=mask)
    return jnp.stack(maps, axis=1)


def test_nnx_weights_outputs_mask_jit(nnx_setup):
    model, x, mask = nnx_setup
    reference = model(x, mask=mask)
    y, cap = adapter.capture_nnx(model, x, mask=mask)
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cap.attentions, manual_nnx(model, x, mask), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cap.mask, VALID.astype(bool))
    assert all(layer.attention_fn is nnx.dot_product_attention for layer in model.layers)
    _, jitted = jax.jit(lambda x, m: adapter.capture_nnx(model, x, mask=m))(x, mask)
    np.testing.assert_allclose(jitted.attentions, cap.attentions, rtol=1e-6, atol=1e-6)
    _, viannx = nnx.jit(lambda m, x, k: adapter.capture_nnx(m, x, mask=k, heads="max"))(
        model, x, mask
    )
    assert viannx.attentions.shape == (B, 2, 1, N, N)
    scores = attnflow.rollout(cap.attentions, rows=0, mask=cap.mask)
    assert isinstance(scores, jax.Array)
    np.testing.assert_array_equal(scores[1, 3:], 0.0)


def test_nnx_gradients_match_finite_differences(nnx_setup):
    model, x, mask = nnx_setup
    _, gradients = jax.jit(
        lambda x, m: adapter.attention_gradients_nnx(model, x, mask=m, target=target)
    )(x, mask)
    assert gradients.shape == (B, 2, H, N, N)

    def output_with(deltas):
        recorder = adapter._NNXRecorder(deltas)
        return float(target(adapter._run_nnx(recorder, model, (x,), {"mask": mask})))

    zeros = [jnp.zeros((B, H, N, N)) for _ in range(2)]
    eps = 1e-2
    for layer, index in [(0, (0, 0, 1, 2)), (1, (1, 1, 0, 1))]:
        plus = [z.at[index].add(eps) if i == layer else z for i, z in enumerate(zeros)]
        minus = [z.at[index].add(-eps) if i == layer else z for i, z in enumerate(zeros)]
        fd = (output_with(plus) - output_with(minus)) / (2 * eps)
        got = gradients[(index[0], layer, *index[1:])]
        np.testing.assert_allclose(got, fd, rtol=2e-2, atol=2e-3)


def test_deprecated_gradients_verbs_equal_attention_gradients(linen_setup, nnx_setup):
    # gradients_linen / gradients_nnx: the second gradients verb, kept until 0.2.
    assert "gradients_linen" not in adapter.__all__
    assert "gradients_nnx" not in adapter.__all__
    model, variables, x, mask = linen_setup
    with pytest.warns(DeprecationWarning, match="`attnflow.adapters.jax.gradients_linen` is dep"):
        y, cap = adapter.gradients_linen(model, variables, x, mask, target=target)
    attentions, gradients = adapter.attention_gradients_linen(
        model, variables, x, mask, target=target
    )
    np.testing.assert_allclose(y, model.apply(variables, x, mask), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(attentions, cap.attentions)
    np.testing.assert_array_equal(gradients, cap.gradients)
    np.testing.assert_array_equal(
        cap.mask, adapter.capture_linen(model, variables, x, mask)[1].mask
    )

    module, x, mask = nnx_setup
    with pytest.warns(DeprecationWarning, match="call attention_gradients_nnx"):
        _, cap = adapter.gradients_nnx(module, x, mask=mask, target=target)
    attentions, gradients = adapter.attention_gradients_nnx(module, x, mask=mask, target=target)
    np.testing.assert_array_equal(attentions, cap.attentions)
    np.testing.assert_array_equal(gradients, cap.gradients)


def test_nnx_nothing_captured():
    model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    with pytest.raises(RuntimeError, match="No attention weights were captured"):
        adapter.capture_nnx(model, jnp.ones((1, 3)))


def test_explain_in_one_call_equals_capture_then_rollout() -> None:
    from attnflow.adapters.jax import capture_nnx, explain_linen, explain_nnx

    attention = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(3), (2, 5, 8))
    _, cap = capture_nnx(attention, x)
    expected = attnflow.rollout(cap.attentions, rows=0)
    np.testing.assert_allclose(explain_nnx(attention, x), expected, atol=1e-6)
    assert explain_nnx(attention, x, method="flow", rows=None).shape == (2, 5, 5)
    with pytest.raises(ValueError, match="`method`"):
        explain_nnx(attention, x, method="gradients")  # type: ignore[arg-type]

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, inputs: jax.Array) -> jax.Array:
            return inputs + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(inputs)

    variables = Encoder().init(jax.random.key(1), x)
    assert explain_linen(Encoder(), variables, x, options={"residual": 0.0}).shape == (2, 5)


# -- input gradients -----------------------------------------------------------------------------
VOCAB, CLASSES = 20, 3
IDS = jnp.array([[1, 5, 7, 2, 9], [3, 8, 8, 0, 0]])
REDUCTIONS = ("l2", "sum_abs", "x_input")
x64 = jax.enable_x64  # float64 for finite differences (this module runs in float32 otherwise)


class LinenClassifier(nn.Module):
    """Token ids -> nn.Embed -> two attention layers -> first token -> Dense logits.

    ``classify`` is everything after the embedding, for finite differences.
    """

    def setup(self):
        self.embed = nn.Embed(VOCAB, D)
        self.position = self.param("position", nn.initializers.normal(0.5), (N, D))
        self.attention = [nn.MultiHeadDotProductAttention(num_heads=H) for _ in range(2)]
        self.mix = [nn.Dense(D) for _ in range(2)]
        self.head = nn.Dense(CLASSES)

    def __call__(self, ids, mask=None):
        return self.classify(self.embed(ids), mask)

    def classify(self, embedded, mask=None):
        x = embedded + self.position[: embedded.shape[1]]
        for attention, mix in zip(self.attention, self.mix, strict=True):
            x = x + jnp.tanh(mix(attention(x, mask=mask)))
        return self.head(x[:, 0])


def explicit_attention(query, key, value, bias=None, mask=None, **kwargs):
    """softmax(QK^T/sqrt(d)) V in the inputs' dtype.

    NNX's default goes through jax.nn.dot_product_attention, whose softmax runs in float32
    even for float64 inputs: too coarse for finite differences with eps = 1e-6.
    """
    weights = nnx_attention.dot_product_attention_weights(query, key, bias, mask)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value)


class NNXClassifier(nnx.Module):
    """As LinenClassifier, in NNX."""

    def __init__(self, rngs, dtype=jnp.float64):
        self.embed = nnx.Embed(VOCAB, D, param_dtype=dtype, rngs=rngs)
        self.position = nnx.Param(0.5 * jax.random.normal(rngs.params(), (N, D), dtype))
        self.attention = nnx.List(
            [
                nnx.MultiHeadAttention(
                    num_heads=H,
                    in_features=D,
                    decode=False,
                    param_dtype=dtype,
                    attention_fn=explicit_attention,
                    rngs=rngs,
                )
                for _ in range(2)
            ]
        )
        self.mix = nnx.List([nnx.Linear(D, D, param_dtype=dtype, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(D, CLASSES, param_dtype=dtype, rngs=rngs)

    def __call__(self, ids, mask=None):
        return self.classify(self.embed(ids), mask)

    def classify(self, embedded, mask=None):
        x = embedded + self.position[...][: embedded.shape[1]]
        for attention, mix in zip(self.attention, self.mix, strict=True):
            x = x + jnp.tanh(mix(attention(x, mask=mask)))
        return self.head(x[:, 0])


@pytest.fixture(scope="module")
def linen_classifier():
    with x64(True):
        mask = nn.make_attention_mask(VALID, VALID)
        model = LinenClassifier()
        variables = model.init(jax.random.key(0), IDS, mask)
        variables = jax.tree.map(lambda p: p.astype(jnp.float64), variables)
    return model, variables, mask


@pytest.fixture(scope="module")
def nnx_classifier():
    with x64(True):
        return NNXClassifier(nnx.Rngs(3)), nn.make_attention_mask(VALID, VALID)


@pytest.fixture
def in_x64():
    """Run the test with 64-bit types on (the classifiers above are float64)."""
    with x64(True):
        yield


def class_scores(logits, classes, output):
    scores = jax.nn.softmax(logits, axis=-1) if output == "probability" else logits
    return scores[jnp.arange(logits.shape[0]), classes]


def finite_difference_gradients(classify, embedded, classes, output, eps=1e-6):
    """Central differences of each sample's score w.r.t. each coordinate of `embedded`.

    The same coordinate moves in every sample at once: samples do not interact.
    """
    scores = jax.jit(lambda e: class_scores(classify(e), classes, output))
    grads = np.zeros(embedded.shape)
    for i in range(embedded.shape[1]):
        for k in range(embedded.shape[2]):
            step = jnp.zeros_like(embedded).at[:, i, k].set(eps)
            high, low = scores(embedded + step), scores(embedded - step)
            grads[:, i, k] = (np.asarray(high) - np.asarray(low)) / (2 * eps)
    return grads


def reduce_reference(grads, embedded, reduce):
    if reduce == "l2":
        return np.linalg.norm(grads, axis=-1)
    if reduce == "sum_abs":
        return np.abs(grads.sum(-1))
    return np.abs((grads * np.asarray(embedded)).sum(-1))


TARGETS = {
    "predicted": None,
    "int": 2,
    "list": [1, 0],
    "array": np.array([0, 2]),
}


def resolve(target, logits):
    if target is None:
        return jnp.argmax(logits, axis=-1)
    return jnp.broadcast_to(jnp.asarray(target), (logits.shape[0],))


@pytest.mark.parametrize("output", ["probability", "logit"])
@pytest.mark.parametrize("target_kind", list(TARGETS))
def test_input_gradients_linen_match_finite_differences(linen_classifier, output, target_kind):
    model, variables, mask = linen_classifier
    target = TARGETS[target_kind]
    with x64(True):
        logits = model.apply(variables, IDS, mask)
        embedded = model.apply(variables, IDS, method=lambda m, ids: m.embed(ids))
        assert embedded.dtype == jnp.float64
        numeric = finite_difference_gradients(
            lambda e: model.apply(variables, e, mask, method=LinenClassifier.classify),
            embedded,
            resolve(target, logits),
            output,
        )
        assert np.abs(numeric).max() > 1e-3
        for reduce in REDUCTIONS:
            got = adapter.input_gradients_linen(
                model, variables, IDS, mask, target=target, reduce=reduce, output=output
            )
            assert got.shape == (B, N)
            assert got.dtype == jnp.float64
            expected = reduce_reference(numeric, embedded, reduce)
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9)
        jitted = jax.jit(
            lambda v, ids, m: adapter.input_gradients_linen(
                model, v, ids, m, target=target, reduce="x_input", output=output
            )
        )(variables, IDS, mask)
        np.testing.assert_allclose(jitted, got, rtol=1e-12)
    assert not (variables.keys() - {"params"})  # the caller's variables are untouched


@pytest.mark.parametrize("output", ["probability", "logit"])
@pytest.mark.parametrize("target_kind", list(TARGETS))
def test_input_gradients_nnx_match_finite_differences(nnx_classifier, output, target_kind):
    model, mask = nnx_classifier
    target = TARGETS[target_kind]
    original_call = nnx.Embed.__dict__["__call__"]
    with x64(True):
        logits = model(IDS, mask)
        embedded = model.embed(IDS)
        assert embedded.dtype == jnp.float64
        numeric = finite_difference_gradients(
            lambda e: model.classify(e, mask), embedded, resolve(target, logits), output
        )
        assert np.abs(numeric).max() > 1e-3
        for reduce in REDUCTIONS:
            got = adapter.input_gradients_nnx(
                model, IDS, mask, target=target, reduce=reduce, output=output
            )
            assert got.shape == (B, N)
            assert got.dtype == jnp.float64
            expected = reduce_reference(numeric, embedded, reduce)
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9)
        jitted = jax.jit(
            lambda ids, m: adapter.input_gradients_nnx(
                model, ids, m, target=target, reduce="x_input", output=output
            )
        )(IDS, mask)
        np.testing.assert_allclose(jitted, got, rtol=1e-12)
        via_nnx_jit = nnx.jit(
            lambda model, ids, m: adapter.input_gradients_nnx(
                model, ids, m, target=target, reduce="x_input", output=output
            )
        )(model, IDS, mask)
        np.testing.assert_allclose(via_nnx_jit, got, rtol=1e-12)
    assert nnx.Embed.__dict__["__call__"] is original_call  # restored


def test_input_gradients_float32_and_keywords(linen_classifier):
    model, variables, mask = linen_classifier
    single = jax.tree.map(lambda p: p.astype(jnp.float32), variables)
    got = adapter.input_gradients_linen(model, single, IDS, mask=mask)
    assert got.dtype == jnp.float32
    with x64(True):
        expected = adapter.input_gradients_linen(model, variables, IDS, mask=mask)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7)
    single = adapter.input_gradients_nnx(NNXClassifier(nnx.Rngs(3), jnp.float32), IDS, mask=mask)
    assert single.dtype == jnp.float32
    assert single.shape == (B, N)
    assert np.all(np.isfinite(single))


class TwoEmbeddings(nn.Module):
    """Token and position embeddings, both nn.Embed."""

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D, name="tokens")(ids) + nn.Embed(N, D, name="positions")(
            jnp.arange(ids.shape[1])
        )
        x = x + nn.MultiHeadDotProductAttention(num_heads=H)(x)
        return nn.Dense(CLASSES)(x[:, 0])


def test_input_gradients_linen_named_site_and_errors(linen_classifier, in_x64):
    model, variables, mask = linen_classifier
    two = TwoEmbeddings()
    two_variables = two.init(jax.random.key(0), IDS)
    with pytest.raises(ValueError, match=r"several flax\.linen\.Embed.*'positions', 'tokens'"):
        adapter.input_gradients_linen(two, two_variables, IDS)
    by_name = adapter.input_gradients_linen(two, two_variables, IDS, embeddings="tokens")
    assert by_name.shape == (B, N)
    with pytest.raises(ValueError, match=r"No submodule at 'token'.*'tokens'"):
        adapter.input_gradients_linen(two, two_variables, IDS, embeddings="token")
    dense = nn.Dense(CLASSES)
    x = jnp.ones((B, N))
    with pytest.raises(ValueError, match=r"no flax\.linen\.Embed"):
        adapter.input_gradients_linen(dense, dense.init(jax.random.key(0), x), x)

    def call(**kwargs):
        return adapter.input_gradients_linen(model, variables, IDS, mask, **kwargs)

    for kwargs, error, match in [
        ({"reduce": "abs"}, ValueError, "`reduce`"),
        ({"output": "log_probability"}, ValueError, "`output`"),
        ({"target": 1.5}, TypeError, "`target`"),
        ({"target": True}, TypeError, "`target`"),
        ({"target": jnp.array([0.0, 1.0])}, TypeError, "`target`"),
        ({"target": jnp.array([[0, 1]])}, TypeError, "`target`"),
        ({"embeddings": ("embed",)}, TypeError, "`embeddings`"),
        ({"embeddings": "encoder//embed"}, TypeError, "`embeddings`"),
        ({"mutable": ["intermediates"]}, ValueError, "mutable"),
        ({"target": 3}, ValueError, r"\[0, 3\)"),
        ({"target": -1}, ValueError, r"\[0, 3\)"),
        ({"target": [0, 5]}, ValueError, r"\[5\]"),
        ({"target": np.array([0, 7])}, ValueError, r"\[7\]"),
        ({"target": [0]}, ValueError, "1 classes for a batch of 2"),
        ({"target": jnp.array([0, 1, 2])}, ValueError, "3 classes for a batch of 2"),
        ({"embeddings": "head"}, ValueError, r"\(batch, n, d\)"),
    ]:
        with pytest.raises(error, match=match):
            call(**kwargs)
    with pytest.raises(TypeError, match=r"flax\.linen\.Module"):
        adapter.input_gradients_linen(lambda x: x, variables, IDS)
    # Not a classifier: the hidden states of every token.
    with pytest.raises(TypeError, match=r"\(batch, classes\).*\(2, 5, 8\)"):
        adapter.input_gradients_linen(
            model, variables, IDS, method=lambda m, ids: m.embed(ids) + 0.0
        )
    # Under jit a traced target cannot be checked: its out-of-range samples give NaN rows.
    result = jax.jit(
        lambda t: adapter.input_gradients_linen(
            model, jax.tree.map(lambda p: p.astype(jnp.float32), variables), IDS, mask, target=t
        )
    )(jnp.array([1, 9]))
    assert np.all(np.isfinite(result[0]))
    assert np.all(np.isnan(result[1]))


def test_input_gradients_nnx_errors(nnx_classifier):
    model, mask = nnx_classifier
    original_call = nnx.Embed.__dict__["__call__"]

    class Twice(nnx.Module):
        def __init__(self, inner):
            self.inner = inner
            self.position = nnx.Embed(N, D, rngs=nnx.Rngs(0))

        def __call__(self, ids, mask=None):
            embedded = self.inner.embed(ids) + self.inner.embed(ids)
            return self.inner.classify(embedded, mask)

    twice = Twice(model)
    with pytest.raises(ValueError, match=r"several flax\.nnx\.Embed.*'inner/embed', 'position'"):
        adapter.input_gradients_nnx(twice, IDS)
    with x64(True), pytest.raises(RuntimeError, match="ran 2 times"):
        adapter.input_gradients_nnx(twice, IDS, embeddings=model.embed)
    assert nnx.Embed.__dict__["__call__"] is original_call  # restored after raising
    with pytest.raises(ValueError, match="not a submodule"):
        adapter.input_gradients_nnx(model, IDS, embeddings=nnx.Embed(3, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match="`embeddings`"):
        adapter.input_gradients_nnx(model, IDS, embeddings="embed")
    with pytest.raises(ValueError, match=r"no flax\.nnx\.Embed"):
        adapter.input_gradients_nnx(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), jnp.ones((1, 3)))
    with pytest.raises(TypeError, match=r"flax\.nnx\.Module"):
        adapter.input_gradients_nnx(lambda x: x, IDS)
    with x64(True):
        for kwargs, error, match in [
            ({"reduce": "abs"}, ValueError, "`reduce`"),
            ({"output": "log_probability"}, ValueError, "`output`"),
            ({"target": [0.5, 1]}, TypeError, "`target`"),
            ({"target": 3}, ValueError, r"\[0, 3\)"),
            ({"target": [0, 1, 2]}, ValueError, "3 classes for a batch of 2"),
        ]:
            with pytest.raises(error, match=match):
                adapter.input_gradients_nnx(model, IDS, mask, **kwargs)
        with pytest.raises(TypeError, match=r"\(batch, classes\).*\(2, 5, 8\)"):
            adapter.input_gradients_nnx(model.embed, IDS)
    assert nnx.Embed.__dict__["__call__"] is original_call


# -- gradient-weighted rollout (Chefer et al. 2021, GAE) -----------------------------------------
def chefer_loop(weights, grads):
    """Chefer's loop per sample: R = I; R += mean_h((G * A)^+) @ R, layer by layer."""
    weights, grads = np.asarray(weights, np.float64), np.asarray(grads, np.float64)
    out = []
    for sample in range(weights.shape[0]):
        relevance = np.eye(weights.shape[-1])
        for layer in range(weights.shape[1]):
            cam = np.clip(grads[sample, layer] * weights[sample, layer], 0, None).mean(0)
            relevance = relevance + cam @ relevance
        out.append(relevance)
    return np.stack(out)


@pytest.mark.parametrize("target", [None, 1])
def test_explain_gradient_rollout_linen_equals_chefer_loop(linen_classifier, in_x64, target):
    model, variables, mask = linen_classifier
    logits = model.apply(variables, IDS, mask)
    classes = resolve(target, logits)
    attentions, gradients = adapter.attention_gradients_linen(
        model,
        variables,
        IDS,
        mask,
        target=lambda y: jnp.sum(y * jax.nn.one_hot(classes, CLASSES, dtype=y.dtype)),
    )
    expected = chefer_loop(attentions, gradients)
    assert np.abs(np.asarray(gradients)).max() > 1e-6
    got = adapter.explain_linen(
        model,
        variables,
        IDS,
        mask,
        method="gradient_rollout",
        target=target,
        rows=None,
        options={"mask": None},
    )
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10)
    # The [CLS] row without [CLS], under jit, with the captured padding mask.
    cls = jax.jit(
        lambda v: adapter.explain_linen(
            model,
            v,
            IDS,
            mask,
            method="gradient_rollout",
            target=target,
            options={"exclude_self": True},
        )
    )(variables)
    real = np.asarray(VALID, bool)
    np.testing.assert_allclose(
        np.where(real, cls, 0.0)[:, 1:], np.where(real, expected[:, 0], 0.0)[:, 1:], rtol=1e-10
    )
    assert np.all(np.asarray(cls)[:, 0] == 0)
    assert np.all(np.asarray(cls)[~real] == 0)


def test_explain_gradient_rollout_nnx_equals_chefer_loop(nnx_classifier):
    _, mask = nnx_classifier
    model = NNXClassifier(nnx.Rngs(3), dtype=jnp.float32)
    for attention in model.attention:  # the default attention, which the adapter sees
        attention.attention_fn = nnx.dot_product_attention
    logits = model(IDS, mask)
    classes = jnp.argmax(logits, axis=-1)
    attentions, gradients = adapter.attention_gradients_nnx(
        model,
        IDS,
        mask,
        target=lambda y: jnp.sum(y * jax.nn.one_hot(classes, CLASSES, dtype=y.dtype)),
    )
    expected = chefer_loop(attentions, gradients)
    got = adapter.explain_nnx(
        model, IDS, mask, method="gradient_rollout", rows=None, options={"mask": None}
    )
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="`target` selects the class"):
        adapter.explain_nnx(model, IDS, mask, target=1)
    with pytest.raises(ValueError, match=r"`target` classes must lie in \[0, 3\)"):
        adapter.explain_nnx(model, IDS, mask, method="gradient_rollout", target=7)


def log_probability_of(classes):
    """The explicit score: each sample's log-softmax at its class, summed over the batch."""
    return lambda y: jnp.sum(jax.nn.log_softmax(y, axis=-1)[jnp.arange(y.shape[0]), classes])


@pytest.mark.parametrize("target", [None, 1])
def test_explain_linen_log_probability_is_gae_of_the_log_softmax(linen_classifier, in_x64, target):
    # Reference: jax.grad (through attention_gradients_linen) of the explicit expression
    # log_softmax(z)[class], then Chefer's loop; float64.
    model, variables, mask = linen_classifier
    classes = resolve(target, model.apply(variables, IDS, mask))
    attentions, gradients = adapter.attention_gradients_linen(
        model, variables, IDS, mask, target=log_probability_of(classes)
    )
    expected = chefer_loop(attentions, gradients)
    options = {"method": "gradient_rollout", "target": target, "rows": None}
    options["options"] = {"mask": None}  # padded rows as Chefer's loop leaves them
    got = adapter.explain_linen(
        model, variables, IDS, mask, target_score="log_probability", **options
    )
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10)
    # "logit" is the default, unchanged, and a different score.
    logit = adapter.explain_linen(model, variables, IDS, mask, target_score="logit", **options)
    np.testing.assert_array_equal(
        logit, adapter.explain_linen(model, variables, IDS, mask, **options)
    )
    assert not np.allclose(logit, got, rtol=1e-6, atol=1e-6)


def test_explain_nnx_log_probability_is_gae_of_the_log_softmax():
    # float32, NNX's default attention kernel.
    mask = nn.make_attention_mask(VALID, VALID)
    model = NNXClassifier(nnx.Rngs(3), dtype=jnp.float32)
    for attention in model.attention:
        attention.attention_fn = nnx.dot_product_attention
    attentions, gradients = adapter.attention_gradients_nnx(
        model, IDS, mask, target=log_probability_of(jnp.array([2, 2]))
    )
    expected = chefer_loop(attentions, gradients)
    got = adapter.explain_nnx(
        model,
        IDS,
        mask,
        method="gradient_rollout",
        target=2,
        target_score="log_probability",
        rows=None,
        options={"mask": None},
    )
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_explain_target_score_is_checked_before_the_model_runs():
    # Not a model at all: the check must come first.
    for explain in [
        lambda **kw: adapter.explain_linen(object(), {}, IDS, **kw),
        lambda **kw: adapter.explain_nnx(object(), IDS, **kw),
    ]:
        with pytest.raises(
            ValueError,
            match=r'`target_score` must be "logit" .* or "log_probability" .*; got \'probability\'',
        ):
            explain(method="gradient_rollout", target_score="probability")
        with pytest.raises(ValueError, match=r"flow does not use gradients.*Drop `target_score`"):
            explain(method="flow", target_score="log_probability")
