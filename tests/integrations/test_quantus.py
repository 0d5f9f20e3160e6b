"""attnflow.integrations.quantus.explain_func: pixel maps, and a Quantus metric end to end."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnflow
from attnflow.adapters.torch import capture
from attnflow.integrations.quantus import explain_func

ATOL = 1e-6


@pytest.mark.parametrize("method", ["rollout", "flow"])
def test_maps_are_the_cls_row_over_patches(digits_vit: Any, method: str) -> None:
    model, images, labels = digits_vit
    x = images[:3].numpy()
    maps = explain_func(model, x, labels[:3].numpy(), method=method)
    assert maps.shape == (3, 1, 8, 8)
    assert maps.dtype == np.float32
    with torch.no_grad(), capture(model) as cap:
        model(images[:3])
    tokens = getattr(attnflow, method)(cap.attentions, rows=0).numpy()  # (3, 1 + 16)
    grid = tokens[:, 1:].reshape(3, 4, 4)  # patches row by row; [CLS] column left out
    expected = np.repeat(np.repeat(grid, 2, axis=1), 2, axis=2)[:, None]
    np.testing.assert_allclose(maps, expected, atol=ATOL, rtol=0)


def test_registers_and_grey_images(vit_class: Any) -> None:
    torch.manual_seed(3)
    model = vit_class(height=8, width=12, registers=2).eval()
    images = torch.rand(2, 1, 8, 12)
    maps = explain_func(model, images.numpy(), np.zeros(2), method="rollout")
    with torch.no_grad(), capture(model) as cap:
        model(images)
    tokens = attnflow.rollout(cap.attentions, rows=0).numpy()
    expected = np.repeat(np.repeat(tokens[:, 3:].reshape(2, 4, 6), 2, 1), 2, 2)[:, None]
    np.testing.assert_allclose(maps, expected, atol=ATOL, rtol=0)
    # Told explicitly, the prefix decides which columns are patches.
    with pytest.raises(ValueError, match="tile no grid"):
        explain_func(model, images.numpy(), np.zeros(2), prefix_tokens=1)


def test_gradient_rollout_uses_the_targets(digits_vit: Any) -> None:
    model, images, labels = digits_vit
    x = images[:2].numpy()
    chosen = explain_func(model, x, labels[:2].numpy(), method="gradient_rollout")
    other = explain_func(model, x, (labels[:2].numpy() + 1) % 10, method="gradient_rollout")
    assert chosen.shape == (2, 1, 8, 8)
    assert not np.allclose(chosen, other)


def test_bad_options_fail_first(digits_vit: Any) -> None:
    model, images, labels = digits_vit
    with pytest.raises(ValueError, match="`method` must be"):
        explain_func(model, images[:1].numpy(), labels[:1].numpy(), method="attention")
    with pytest.raises(ValueError, match="`inputs` must be images"):
        explain_func(model, np.zeros((2, 64)), labels[:2].numpy())


def test_quantus_metrics_run_end_to_end(digits_vit: Any) -> None:
    quantus = pytest.importorskip("quantus")
    model, images, labels = digits_vit
    x, y = images[:6].numpy(), labels[:6].numpy()
    sensitivity = quantus.MaxSensitivity(nr_samples=3, disable_warnings=True)(
        model=model,
        x_batch=x,
        y_batch=y,
        device="cpu",
        explain_func=explain_func,
        explain_func_kwargs={"method": "rollout"},
    )
    assert len(sensitivity) == 6
    assert np.isfinite(sensitivity).all()
    flipping = quantus.PixelFlipping(features_in_step=16, disable_warnings=True)(
        model=model,
        x_batch=x,
        y_batch=y,
        device="cpu",
        explain_func=explain_func,
        explain_func_kwargs={"method": "rollout"},
    )
    assert len(flipping) == 6
    assert all(len(curve) == 64 // 16 for curve in flipping)
