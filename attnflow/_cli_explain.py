"""``attnflow explain``: a local Hugging Face model and a text in, a labelled explanation out.

With ``--image FILE`` and a local vision transformer folder (config, weights and
``preprocessor_config.json``), an image instead: the file is read with Pillow (PNG, JPEG
and the rest of Pillow's formats; Pillow comes with matplotlib, ``attnflow[plot]``), the
table summarises the patch scores, and ``-o page.html`` writes a self-contained page with
the patch scores drawn over the image (needs matplotlib).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ._cli import UsageError, _has_module

__all__ = ["configure_explain", "run_explain"]

_METHODS = ("raw", "rollout", "flow", "gradient_rollout")


def configure_explain(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``attnflow explain``."""
    parser.add_argument(
        "text", nargs="?", default=None, help="the text to explain (one input); or --image"
    )
    parser.add_argument(
        "--image",
        help="explain this image (PNG, JPEG...; read with Pillow) with a vision transformer "
        "folder instead of a text",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="a local Hugging Face model folder (config, weights, tokenizer); nothing is "
        "downloaded",
    )
    parser.add_argument(
        "--method",
        default="raw,rollout,flow",
        help="comma-separated methods among raw, rollout, flow, gradient_rollout "
        "(default raw,rollout,flow; gradient_rollout needs a classifier)",
    )
    parser.add_argument(
        "--target", type=int, default=None, help="gradient_rollout: the class (default: predicted)"
    )
    parser.add_argument(
        "--rows",
        "--row",
        dest="row",
        metavar="N",
        type=_one_row,
        default=0,
        help="the output position explained, one integer (default 0: [CLS]); --row is the "
        "same option",
    )
    parser.add_argument(
        "--top",
        type=int,
        default=8,
        help="--image: the patches listed in the table, by the first method (default 8)",
    )
    parser.add_argument(
        "--layer",
        type=int,
        default=-1,
        help="the layer shown in the table and first on the page (default: the last)",
    )
    parser.add_argument(
        "-o",
        "--output",
        help="write the HTML page here (.html; for a text the method and layer are picked in "
        "the page)",
    )
    parser.add_argument(
        "--save", help="also write the explanation's data here (.npz, with its metadata as JSON)"
    )
    parser.add_argument("--force", action="store_true", help="replace existing outputs")


def _one_row(text: str) -> int:
    """``--rows`` of ``explain``: one output position (an explanation is of one row)."""
    try:
        return int(text)
    except ValueError:
        msg = (
            f"explain explains one output position: --rows takes one integer, got {text!r}; "
            "for several rows at once use attnflow rollout/flow --rows 0,4"
        )
        raise argparse.ArgumentTypeError(msg) from None


def run_explain(args: argparse.Namespace) -> int:
    """Load the model folder, explain the text, print the table, write what was asked."""
    methods = [m.strip() for m in str(args.method).split(",") if m.strip()]
    unknown = [m for m in methods if m not in _METHODS]
    if not methods or unknown:
        msg = f"--method must list some of {', '.join(_METHODS)}; got {args.method!r}"
        raise UsageError(msg)
    if (args.text is None) == (args.image is None):
        msg = (
            "give a text to explain or --image FILE, not both"
            if args.text is not None
            else 'nothing to explain: give a text (attnflow explain --model PATH "some '
            'text") or --image FILE'
        )
        raise UsageError(msg)
    if args.top < 0:
        msg = f"--top must be >= 0; got {args.top}"
        raise UsageError(msg)
    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        msg = (
            f"--model must be a local Hugging Face model folder holding config.json; got "
            f"{str(folder)!r}"
        )
        raise UsageError(msg)
    image = None
    if args.image is not None:
        if not (folder / "preprocessor_config.json").is_file():
            msg = (
                f"--image needs an image model: {str(folder)!r} has no "
                "preprocessor_config.json (the image processor of a vision transformer); "
                "is it a text model? Explain a text with it instead"
            )
            raise UsageError(msg)
        image = _read_image(Path(args.image))
    elif (folder / "preprocessor_config.json").is_file() and not _has_tokenizer(folder):
        msg = (
            f"{str(folder)!r} is an image model (preprocessor_config.json, no tokenizer): "
            "pass --image FILE instead of a text"
        )
        raise UsageError(msg)
    outputs = []
    for flag, value, suffix in (("-o", args.output, ".html"), ("--save", args.save, ".npz")):
        if value is None:
            continue
        path = Path(value)
        if path.suffix.lower() != suffix:
            msg = f"{flag} must end in {suffix}; got {path.name!r}"
            raise UsageError(msg)
        if os.path.lexists(path) and not args.force:
            msg = f"{path} exists; pass --force to replace it"
            raise UsageError(msg)
        outputs.append(path)
    if image is not None and args.output is not None and not _has_module("matplotlib"):
        msg = "-o with --image draws the figure: it needs matplotlib, pip install 'attnflow[plot]'"
        raise UsageError(msg)
    for module in ("torch", "transformers"):
        if not _has_module(module):
            msg = f"attnflow explain needs {module}: pip install 'attnflow[torch]' transformers"
            raise UsageError(msg)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never reach a hub
    import transformers

    from attnflow.adapters import torch as capture_torch  # type: ignore[import-not-found,unused-ignore]

    if image is not None:
        return _run_image(args, folder, image, methods)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    architectures = getattr(config, "architectures", None) or []
    loader = (
        transformers.AutoModelForSequenceClassification
        if any(name.endswith("ForSequenceClassification") for name in architectures)
        else transformers.AutoModel
    )
    model = loader.from_pretrained(folder).eval()
    try:
        explanation = capture_torch.explain_text(
            model, tokenizer, args.text, methods=methods, row=args.row, target=args.target
        )
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None
    explanation.show(args.layer)
    if args.output is not None:
        explanation.to_html(args.output, layer=args.layer, overwrite=args.force)
        print(f"wrote {args.output}")
    if args.save is not None:
        explanation.save(args.save, overwrite=args.force)
        print(f"wrote {args.save}")
    return 0


def _has_tokenizer(folder: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model")
    return any((folder / name).is_file() for name in names)


def _read_image(path: Path) -> Any:
    """Read an image file as a uint8 array (H, W, 3) with Pillow; refusals are usage errors."""
    import numpy as np

    if not path.is_file():
        msg = f"--image: no such file {str(path)!r}"
        raise UsageError(msg)
    if not _has_module("PIL"):
        msg = (
            "--image reads PNG and JPEG files with Pillow: pip install pillow (it comes with "
            "matplotlib, attnflow[plot])"
        )
        raise UsageError(msg)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as opened:
            return np.asarray(opened.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError) as error:
        msg = f"--image: cannot read {str(path)!r} as an image ({error})"
        raise UsageError(msg) from None


def _run_image(args: argparse.Namespace, folder: Path, image: Any, methods: list[str]) -> int:
    """``attnflow explain --image``: the vision transformer, the summary, the page."""
    import transformers

    from attnflow.adapters import torch as capture_torch  # type: ignore[import-not-found,unused-ignore]

    processor = transformers.AutoImageProcessor.from_pretrained(folder)  # type: ignore[no-untyped-call,unused-ignore]
    config = transformers.AutoConfig.from_pretrained(folder)
    architectures = getattr(config, "architectures", None) or []
    loader = (
        transformers.AutoModelForImageClassification
        if any(name.endswith("ForImageClassification") for name in architectures)
        else transformers.AutoModel
    )
    model = loader.from_pretrained(folder).eval()
    try:
        explanation = capture_torch.explain_image(
            model, processor, image, methods=methods, row=args.row, target=args.target
        )
    except (TypeError, ValueError) as error:
        raise UsageError(str(error)) from None
    explanation.show(args.layer, top=args.top)
    if args.output is not None:
        page = _image_page(explanation, layer=args.layer, top=args.top, source=args.image)
        _write(Path(args.output), page.encode("utf-8"), force=args.force)
        print(f"wrote {args.output}")
    if args.save is not None:
        explanation.save(args.save, overwrite=args.force)
        print(f"wrote {args.save}")
    return 0


def _image_page(explanation: Any, *, layer: int, top: int, source: str) -> str:
    """Lay out a self-contained page: the patch scores over the image, the summary."""
    import base64
    import html
    import io

    from .html import _page

    figure = explanation.plot(layer=layer)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    picture = base64.b64encode(buffer.getvalue()).decode("ascii")
    summary = io.StringIO()
    explanation.show(layer, file=summary, top=top)
    title = f"attnflow explain: {Path(source).name}"
    return _page(
        title,
        "",
        f"<h1>{html.escape(title)}</h1>\n"
        f'<p><img src="data:image/png;base64,{picture}" alt="patch scores over '
        f'{html.escape(Path(source).name)}" style="max-width: 100%"></p>\n'
        f"<pre>{html.escape(summary.getvalue())}</pre>",
    )


def _write(path: Path, data: bytes, *, force: bool) -> None:
    from ._arrayio import ArrayFileError, write_atomically

    try:
        write_atomically(path, lambda file: file.write(data), force=force)
    except ArrayFileError as error:
        raise UsageError(str(error)) from None
