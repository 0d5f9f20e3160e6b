"""``attnflow explain``: a local Hugging Face model and a text in, a labelled explanation out."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ._cli import UsageError, _has_module

__all__ = ["configure_explain", "run_explain"]

_METHODS = ("raw", "rollout", "flow", "gradient_rollout")


def configure_explain(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``attnflow explain``."""
    parser.add_argument("text", help="the text to explain (one input)")
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
        "--row", type=int, default=0, help="the output position explained (default 0: [CLS])"
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
        help="write the HTML page here (.html; the method and layer are picked in the page)",
    )
    parser.add_argument(
        "--save", help="also write the explanation's data here (.npz, with its metadata as JSON)"
    )
    parser.add_argument("--force", action="store_true", help="replace existing outputs")


def run_explain(args: argparse.Namespace) -> int:
    """Load the model folder, explain the text, print the table, write what was asked."""
    methods = [m.strip() for m in str(args.method).split(",") if m.strip()]
    unknown = [m for m in methods if m not in _METHODS]
    if not methods or unknown:
        msg = f"--method must list some of {', '.join(_METHODS)}; got {args.method!r}"
        raise UsageError(msg)
    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        msg = (
            f"--model must be a local Hugging Face model folder holding config.json; got "
            f"{str(folder)!r}"
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
    for module in ("torch", "transformers"):
        if not _has_module(module):
            msg = f"attnflow explain needs {module}: pip install 'attnflow[torch]' transformers"
            raise UsageError(msg)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never reach a hub
    import transformers

    from attnflow.adapters import torch as capture_torch  # type: ignore[import-not-found,unused-ignore]

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
