"""``attnflow diagnose --model FOLDER``: a model report of a causal LM, as text and HTML."""

from __future__ import annotations

import argparse
import os

from ._cli_common import UsageError, has_module, output_path

__all__ = ["configure_diagnose", "run_diagnose"]


def configure_diagnose(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``attnflow diagnose``."""
    parser.add_argument(
        "--model",
        required=True,
        help="a local Hugging Face causal LM folder (config.json, weights, tokenizer)",
    )
    parser.add_argument(
        "-o", "--output", default=None, help="write the report as an HTML page (.html)"
    )
    parser.add_argument(
        "--items", type=int, default=6, help="copying items of the probe (default 6)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the probe's seed (default 0)")
    parser.add_argument("--force", action="store_true", help="replace the page if it exists")


def run_diagnose(args: argparse.Namespace) -> int:
    """Load the model, diagnose it, print the summary, write the page if asked."""
    from ._cli_explain import _load_tokenizer, _model_folder

    folder = _model_folder(args.model)
    if not (folder / "config.json").is_file():
        msg = f"--model must be a local Hugging Face model folder holding config.json; got {str(folder)!r}"
        raise UsageError(msg)
    if not 1 <= args.items <= 200:
        msg = f"--items must be from 1 to 200; got {args.items}"
        raise UsageError(msg)
    output = (
        None if args.output is None else output_path("-o", args.output, ".html", force=args.force)
    )
    needed = ["torch", "transformers", *(["matplotlib"] if output is not None else [])]
    for module in needed:
        if not has_module(module):
            msg = (
                f"attnflow diagnose needs {module}: pip install 'attnflow[torch,plot]' transformers"
            )
            raise UsageError(msg)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never reach a hub
    import transformers

    from attnflow.adapters import torch as adapter  # type: ignore[import-not-found,unused-ignore]

    tokenizer = _load_tokenizer(transformers, folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.eval()  # type: ignore[no-untyped-call,unused-ignore]
    try:
        report = adapter.diagnose(
            model, tokenizer, items=args.items, seed=args.seed, name=folder.name
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    report.show()
    if output is not None:
        print(f"wrote {report.to_html(output, overwrite=args.force)}")
    return 0
