"""``attnflow convert``: a GGUF file to a model folder that transformers and the CLI load.

``attnflow convert MODEL.gguf FOLDER`` reads the GGUF's metadata first and refuses a file
that is not a causal language model transformers can read (its ``general.architecture``),
then loads it with transformers (``from_pretrained(..., gguf_file=...)``, dequantised to
float32, or ``--dtype``) and writes ``FOLDER``: ``model.safetensors``, the tokenizer's
files, ``generation_config.json`` and ``config.json`` (without the GGUF's quantisation
entry, with the architecture's class), the same files ``save_pretrained`` writes. The
folder is written under a temporary name beside it and renamed into place when complete: a
failed or interrupted conversion leaves nothing, and an existing ``FOLDER`` is replaced
only with ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ._cli_common import UsageError, has_module

__all__ = ["CAUSAL_ARCHITECTURES", "configure_convert", "convert_gguf", "run_convert"]

#: GGUF ``general.architecture`` values that transformers reads as causal language models.
CAUSAL_ARCHITECTURES = frozenset(
    {
        "llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "falcon", "phi3",
        "bloom", "stablelm", "gpt2", "starcoder2", "nemotron", "gemma2", "gemma3", "deci",
        "gpt_oss", "lfm2", "minimax_m2", "mamba",
    }
)  # fmt: skip
_MAGIC = b"GGUF"


def configure_convert(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``attnflow convert``."""
    parser.add_argument("gguf", help="the GGUF file of a causal language model")
    parser.add_argument("folder", help="the model folder to write (config, weights, tokenizer)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the weights' dtype in the folder (default float32; GGUF is dequantised)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing folder")


def gguf_architecture(path: Path) -> str:
    """Read ``general.architecture`` from a GGUF file's metadata (the tensors are not read)."""
    with path.open("rb") as file:
        magic = file.read(4)
    if magic != _MAGIC:
        msg = f"{str(path)!r} is not a GGUF file (it does not start with b'GGUF')"
        raise UsageError(msg)
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (KeyError, ValueError, IndexError) as error:
        msg = f"{str(path)!r}: its GGUF metadata has no readable general.architecture ({error})"
        raise UsageError(msg) from None


def _check(args: argparse.Namespace) -> tuple[Path, Path]:
    """Every refusal before any work: the input, the output, the modules."""
    source, target = Path(args.gguf), Path(args.folder)
    if not source.is_file():
        msg = f"no such GGUF file: {str(source)!r}"
        raise UsageError(msg)
    if os.path.lexists(target):
        if not args.force:
            msg = f"{target} exists; pass --force to replace it"
            raise UsageError(msg)
        if not target.is_dir() or target.is_symlink():
            msg = f"{target} exists and is not a folder; remove it or choose another name"
            raise UsageError(msg)
    if not target.parent.is_dir():
        msg = f"folder {target.parent} does not exist; create it first"
        raise UsageError(msg)
    for module, install in (
        ("gguf", "gguf"),
        ("torch", "'attnflow[torch]'"),
        ("transformers", "'attnflow[llm]'"),
        ("safetensors", "'attnflow[llm]'"),
    ):
        if not has_module(module):
            msg = f"attnflow convert needs {module}: pip install {install}"
            raise UsageError(msg)
    architecture = gguf_architecture(source)
    if architecture not in CAUSAL_ARCHITECTURES:
        msg = (
            f"{str(source)!r} is a {architecture!r} model, not a causal language model "
            f"transformers reads from GGUF ({', '.join(sorted(CAUSAL_ARCHITECTURES))})"
        )
        raise UsageError(msg)
    return source, target


def convert_gguf(source: Path, staging: Path, *, dtype: str = "float32") -> None:
    """Write the model folder of GGUF file `source` into the empty folder `staging`."""
    import safetensors.torch
    import torch
    import transformers

    folder, name = source.parent, source.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, dtype)
    )
    safetensors.torch.save_model(model, str(staging / "model.safetensors"))
    tokenizer.save_pretrained(staging)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)
    config: dict[str, Any] = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are dequantised
    config["architectures"] = [type(model).__name__]
    config["dtype"] = dtype
    # config.json last: its presence marks a complete folder.
    (staging / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")


def _ordinary_modes(folder: Path) -> None:
    """Give the folder and its files the modes a plain mkdir and open would (umask)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def run_convert(args: argparse.Namespace) -> int:
    """Convert, staged beside the target and renamed into place when complete."""
    source, target = _check(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    old = None
    try:
        convert_gguf(source, staging, dtype=args.dtype)
        _ordinary_modes(staging)
        if os.path.lexists(target):  # --force, checked: a folder
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            target.rename(old / "folder")
        staging.rename(target)
    except BaseException:
        if old is not None and not os.path.lexists(target):
            (old / "folder").rename(target)  # put the user's folder back
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    print(f"wrote {target} (load it with from_pretrained or attnflow explain --model)")
    return 0
