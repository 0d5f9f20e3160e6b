"""explain_image and `attnflow explain --image`: a vision transformer, its image processor
and a raw image in, a patch-grid explanation out, equal to capture + the methods run by hand
(small ViTs built from configs, offline)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="explain_image needs PyTorch")
transformers = pytest.importorskip("transformers", reason="explain_image needs transformers")
Image = pytest.importorskip("PIL.Image", reason="the image files are written with Pillow")

import attnflow
from attnflow._cli import EXIT_USAGE, main
from attnflow.adapters import torch as adapter
from attnflow.explanation import Explanation

LABELS = {0: "cat", 1: "dog", 2: "fox"}


def small_vit(image_size: int | list[int] = 32) -> object:
    config = transformers.ViTConfig(
        image_size=image_size,
        patch_size=8,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
        id2label=LABELS,
        label2id={v: k for k, v in LABELS.items()},
    )
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(config).eval()


def processor(height: int = 32, width: int = 32) -> object:
    return transformers.ViTImageProcessor(size={"height": height, "width": width})


@pytest.fixture(scope="module")
def picture() -> np.ndarray:
    # Not the model's size: the processor resizes it (40 x 56 -> 32 x 32).
    return np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def vit_folder(tmp_path_factory: pytest.TempPathFactory, picture: np.ndarray) -> Path:
    folder = tmp_path_factory.mktemp("vit")
    small_vit().save_pretrained(folder)
    processor().save_pretrained(folder)
    Image.fromarray(picture).save(folder / "picture.png")
    return folder


def by_hand(model: object, inputs: dict, *, row: int = 0) -> dict[str, np.ndarray]:
    with torch.no_grad(), adapter.capture(model) as cap:
        model(**inputs)
    options = {"rows": row, "layers": "all", "mask": cap.mask}
    return {
        "raw": attnflow.raw(cap.attentions, **options)[0].double().numpy(),
        "rollout": attnflow.rollout(cap.attentions, **options)[0].double().numpy(),
        "flow": attnflow.flow(cap.attentions, **options)[0].double().numpy(),
    }


def test_one_call_equals_capture_and_the_methods(picture: np.ndarray) -> None:
    model, images = small_vit(), processor()
    e = adapter.explain_image(model, images, picture, methods=["raw", "rollout", "flow"])
    inputs = images(images=picture, return_tensors="pt")
    expected = by_hand(model, inputs)
    assert list(e.scores) == ["raw", "rollout", "flow"]
    for name, values in expected.items():
        np.testing.assert_array_equal(e.scores[name], values)
        assert e.scores[name].shape == (3, 17)  # 3 layers; CLS + 4 x 4 patches
    assert e.grid == (4, 4)
    assert e.extra_tokens == 1
    assert e.tokens[:3] == ("[CLS]", "(0,0)", "(0,1)")
    assert e.tokens[-1] == "(3,3)"
    assert e.special.tolist() == [True] + [False] * 16
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    assert e.predicted == int(logits.argmax())
    np.testing.assert_allclose(e.probabilities, torch.softmax(logits.double(), -1).numpy())
    assert e.labels == ("cat", "dog", "fox")
    # The picture kept is the one the model saw: the processor's 32 x 32, un-normalised.
    assert e.image is not None
    assert e.image.shape == (32, 32, 3)
    assert e.image.dtype == np.uint8
    seen = (inputs["pixel_values"][0].permute(1, 2, 0).double() * 0.5 + 0.5) * 255
    assert np.abs(e.image.astype(float) - seen.numpy()).max() <= 0.5 + 1e-9
    # Its page draws that picture under the patch grid (tests/test_browser.py: as shown).
    from attnflow._png import png_data_url

    assert f"--attnflow-image: url('{png_data_url(e.image)}')" in e.to_html()


def test_another_row_and_gradient_rollout(picture: np.ndarray) -> None:
    model, images = small_vit(), processor()
    calls: list[bool] = []  # each model call, and whether autograd was on
    handle = model.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    e = adapter.explain_image(
        model, images, picture, methods=["rollout", "gradient_rollout"], rows=5, target=2
    )
    handle.remove()
    assert calls == [True]  # one run, with autograd, serves both methods
    inputs = images(images=picture, return_tensors="pt")
    np.testing.assert_array_equal(e.scores["rollout"], by_hand(model, inputs, row=5)["rollout"])
    gae = adapter.explain(
        model, inputs, method="gradient_rollout", rows=5, target=2, layers="all", exclude_self=True
    )  # shown without the explained patch's own relevance, as Chefer et al. do
    np.testing.assert_array_equal(e.scores["gradient_rollout"], gae[0].double().numpy())
    assert (e.scores["gradient_rollout"][:, 5] == 0).all()
    assert e.rows == 5
    assert e.target == 2


def test_one_run_serves_the_value_aware_methods_too(picture: np.ndarray) -> None:
    # Issue 38 item 5: the ViT blocks' token-mixing matrices come from the same forward.
    model, images = small_vit(), processor()
    methods = ["norm", "globenc", "alti", "gradient_rollout"]
    calls: list[bool] = []
    handle = model.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    e = adapter.explain_image(model, images, picture, methods=methods, target=1)
    handle.remove()
    assert calls == [True]
    inputs = images(images=picture, return_tensors="pt")
    for name in methods:  # bitwise equal to each method's own call
        options = {"exclude_self": True, "target": 1} if name == "gradient_rollout" else {}
        alone = adapter.explain(model, inputs, method=name, rows=0, layers="all", **options)
        np.testing.assert_array_equal(e.scores[name], alone[0].double().numpy(), err_msg=name)


def test_a_non_square_grid_is_laid_out_row_by_row() -> None:
    # 16 x 48 pixels in patches of 8: 2 rows of 6 patches.
    model = small_vit(image_size=[16, 48])
    picture = np.zeros((16, 48, 3), dtype=np.uint8)
    picture[:, 40:] = 255  # the last column of patches is bright
    e = adapter.explain_image(model, processor(16, 48), picture)
    assert e.grid == (2, 6)
    assert e.tokens[1:8] == ("(0,0)", "(0,1)", "(0,2)", "(0,3)", "(0,4)", "(0,5)", "(1,0)")
    assert e.image.shape == (16, 48, 3)
    assert (e.image[:, 40:] == 255).all()
    assert (e.image[:, :40] == 0).all()


def test_register_tokens_are_named_and_special() -> None:
    config = transformers.Dinov2WithRegistersConfig(
        image_size=32,
        patch_size=8,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        mlp_ratio=2,
        num_register_tokens=2,
    )
    torch.manual_seed(0)
    model = transformers.Dinov2WithRegistersModel(config).eval()
    picture = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    e = adapter.explain_image(model, processor(), picture, methods=["rollout"])
    assert e.tokens[:4] == ("[CLS]", "[REG1]", "[REG2]", "(0,0)")
    assert e.extra_tokens == 3
    assert e.special[:3].all()
    assert not e.special[3:].any()
    assert e.predicted is None  # a backbone: no class


def test_a_distillation_token_is_named_and_special() -> None:
    config = transformers.DeiTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = transformers.DeiTForImageClassificationWithTeacher(config).eval()
    picture = np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    e = adapter.explain_image(model, processor(), picture, methods=["rollout"])
    assert e.tokens[:3] == ("[CLS]", "[DIST]", "(0,0)")
    assert e.grid == (4, 4)
    assert e.special.tolist() == [True, True] + [False] * 16
    assert e.predicted is not None  # the mean of the class and distillation heads


def test_bad_arguments_are_refused_before_the_model_runs(picture: np.ndarray) -> None:
    model, images = small_vit(), processor()
    with pytest.raises(TypeError, match="one image; explain a list"):
        adapter.explain_image(model, images, [picture, picture])
    with pytest.raises(TypeError, match="not a path"):
        adapter.explain_image(model, images, "picture.png")
    with pytest.raises(TypeError, match=r"got shape \(2, 40, 56, 3\)"):
        adapter.explain_image(model, images, np.stack([picture, picture]))
    with pytest.raises(ValueError, match="`methods` must name some of"):
        adapter.explain_image(model, images, picture, methods=["attention"])
    with pytest.raises(ValueError, match="`rows` must index the 17 tokens"):
        adapter.explain_image(model, images, picture, rows=17)
    with pytest.raises(ValueError, match=r"grid 5 x 5 \(25 patches\) does not fit the 17"):
        adapter.explain_image(model, images, picture, grid=(5, 5))


def test_the_summary_the_figure_and_the_saved_file(picture: np.ndarray, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the figure")
    e = adapter.explain_image(small_vit(), processor(), picture)
    out = io.StringIO()
    e.show(file=out, top=3)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("row 0 ([CLS]), layer 3 of 3; predicted ")
    assert lines[0].endswith("; 4 x 4 patches after 1 other token")
    assert lines[1].split() == ["token", "raw", "rollout", "flow"]
    assert lines[2].split()[0] == "[CLS]"
    listed = [line.split()[0] for line in lines[3:6]]
    best = np.argsort(-e.scores["raw"][-1, 1:], kind="stable")[:3] + 1
    assert listed == [e.tokens[i] for i in best]
    assert lines[6].startswith("patches (darkest . to brightest @")
    assert lines[7].split() == ["raw", "rollout", "flow"]
    assert len(lines) == 8 + 4  # one line per patch row
    assert all(len(line.split()) == 3 and len(line.split()[0]) == 4 for line in lines[8:])
    assert "@" in lines[8] + lines[9] + lines[10] + lines[11]

    figure = e.plot(layer=1)
    panels = [axes for axes in figure.axes if axes.get_title()]
    assert [axes.get_title() for axes in panels] == ["raw", "rollout", "flow"]
    assert panels[0].images[1].get_array().shape == (32, 32)
    assert "layer 2 of 3" in figure._suptitle.get_text()

    path = e.save(tmp_path / "e.npz")
    again = Explanation.load(path)
    assert again.grid == (4, 4)
    np.testing.assert_array_equal(again.image, e.image)
    assert again.image.dtype == np.uint8
    np.testing.assert_array_equal(again.scores["flow"], e.scores["flow"])
    copy = Explanation.from_dict(e.to_dict())
    assert copy.grid == e.grid
    np.testing.assert_array_equal(copy.image, e.image)
    assert copy.image.dtype == np.uint8


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_command_refuses_bad_inputs_clearly(
    vit_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = str(vit_folder / "picture.png")
    code, out, err = run(["explain", "--model", str(vit_folder), "a text", "--image", png], capsys)
    assert code == EXIT_USAGE
    assert "give a text to explain or --image FILE, not both" in err
    assert out == ""
    code, _, err = run(["explain", "--model", str(vit_folder)], capsys)
    assert code == EXIT_USAGE
    assert "nothing to explain: give a text" in err
    missing = str(tmp_path / "missing.png")
    code, _, err = run(["explain", "--model", str(vit_folder), "--image", missing], capsys)
    assert code == EXIT_USAGE
    assert f"--image: no such file {missing!r}" in err
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a picture")
    code, _, err = run(["explain", "--model", str(vit_folder), "--image", str(broken)], capsys)
    assert code == EXIT_USAGE
    assert "cannot read" in err
    assert "as an image" in err
    # A text model (no image processor) with --image; an image model with a text.
    text_model = tmp_path / "bert"
    text_model.mkdir()
    transformers.BertConfig(
        vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(text_model)
    code, _, err = run(["explain", "--model", str(text_model), "--image", png], capsys)
    assert code == EXIT_USAGE
    assert "--image needs an image model" in err
    assert "no preprocessor_config.json" in err
    code, _, err = run(["explain", "--model", str(vit_folder), "some text"], capsys)
    assert code == EXIT_USAGE
    assert "is an image model" in err
    assert "pass --image FILE" in err


def test_the_command_prints_the_summary_and_writes_the_page(
    vit_folder: Path, picture: np.ndarray, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib", reason="the page's figure")
    page, data = tmp_path / "page.html", tmp_path / "e.npz"
    argv = [sys.executable, "-m", "attnflow", "explain", "--model", str(vit_folder)]
    argv += ["--image", str(vit_folder / "picture.png"), "-o", str(page), "--save", str(data)]
    argv += ["--method", "rollout,flow", "--top", "2"]
    env = {**os.environ, "PYTHONSAFEPATH": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("row 0 ([CLS]), layer 3 of 3; predicted ")
    assert "4 x 4 patches after 1 other token" in lines[0]
    assert lines[1].split() == ["token", "rollout", "flow"]
    assert lines[2].split()[0] == "[CLS]"
    assert lines[-2:] == [f"wrote {page}", f"wrote {data}"]
    html = page.read_text(encoding="utf-8")
    assert '<img src="data:image/png;base64,' in html
    assert "picture.png" in html
    saved = Explanation.load(data)
    model = transformers.AutoModelForImageClassification.from_pretrained(vit_folder).eval()
    images = transformers.AutoImageProcessor.from_pretrained(vit_folder)
    expected = adapter.explain_image(model, images, picture, methods=["rollout", "flow"])
    np.testing.assert_array_equal(saved.scores["rollout"], expected.scores["rollout"])
    np.testing.assert_array_equal(saved.scores["flow"], expected.scores["flow"])
    assert saved.grid == (4, 4)
    assert saved.labels == ("cat", "dog", "fox")
