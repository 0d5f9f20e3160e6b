"""Write ``gpt2_attentions.npz`` for the gallery's decoder figure (needs torch, transformers).

No causal language model ships with the packages attnflow tests against, and the docs
build installs neither torch nor transformers, so the attention weights are computed here
once and committed. The model is GPT-2's architecture built from a ``GPT2Config``
(6 layers, 4 heads, width 64) with a seeded random initialisation, not pretrained weights.
An attention sink is injected the way trained decoders grow one: the first position's
embedding is made large along one direction, and every layer's query bias points at the
key that this direction produces, so every query puts extra weight on position 0 (BOS).
Run: ``python docs/_data/make_gpt2_attentions.py``.
"""

from pathlib import Path

import numpy as np
import torch
from transformers import GPT2Config, GPT2Model

TOKENS = ["<|endoftext|>", "The", " author", " talked", " to", " Sara", " about", " her",
          " new", " book", " last", " week"]  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    n = len(TOKENS)
    config = GPT2Config(
        vocab_size=n,
        n_positions=n,
        n_embd=64,
        n_layer=6,
        n_head=4,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    model = GPT2Model(config).eval()
    with torch.no_grad():
        direction = torch.randn(config.n_embd)
        direction /= direction.norm()
        model.wpe.weight[0] = 8.0 * direction  # the BOS position dominates its residual stream
        for block in model.h:
            width = config.n_embd
            weight = block.attn.c_attn.weight  # (width, 3 width): query, key, value
            key = direction @ weight[:, width : 2 * width]  # key of the sink, per head
            query_bias = block.attn.c_attn.bias[:width]
            head = width // config.n_head
            for h in range(config.n_head):
                part = key[h * head : (h + 1) * head]
                query_bias[h * head : (h + 1) * head] = 1.5 * part / part.norm()
        ids = torch.arange(n)[None]
        out = model(input_ids=ids, output_attentions=True)
    attentions = torch.stack(out.attentions, dim=1)[0].numpy().astype(np.float32)
    here = Path(__file__).with_name("gpt2_attentions.npz")
    np.savez_compressed(here, attentions=attentions, tokens=np.array(TOKENS))
    print(here, attentions.shape, attentions[..., 1:, 0].mean())  # noqa: T201 - a script


if __name__ == "__main__":
    main()
