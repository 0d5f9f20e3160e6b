"""Write ``seq2seq_attentions.npz`` for the gallery's encoder-decoder figure (needs torch).

A tiny ``torch.nn.Transformer`` (2 encoder and 2 decoder layers, width 64, 4 heads,
learnt token and position embeddings, seed 0, CPU) is trained to *reverse* a sequence of
8 letters drawn from 10, a task whose alignment is known: output position ``t`` copies
source position ``S - 1 - t``. The decoder reads ``<s>`` and the reversed sequence so far
(teacher forcing, causal mask). After training, its greedy decoding is scored on 1000
fresh sequences (exact-sequence and per-symbol accuracy, printed and saved). For one
fresh example, the encoder, decoder and cross attentions of the teacher-forced pass over
the model's own output are captured with ``attnflow.adapters.torch.capture`` and saved.
The docs build installs no torch, so the arrays are computed here once and committed.
Run: ``python docs/_data/make_seq2seq_attentions.py``.
"""

import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from attnflow.adapters.torch import capture

SYMBOLS = list("ABCDEFGHIJ")
LENGTH = 8
BOS = len(SYMBOLS)


class Reverser(nn.Module):
    """Embeddings, an ``nn.Transformer`` and a linear read-out."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.source = nn.Embedding(len(SYMBOLS), width)
        self.target = nn.Embedding(len(SYMBOLS) + 1, width)
        self.position = nn.Embedding(LENGTH, width)
        self.transformer = nn.Transformer(
            d_model=width,
            nhead=4,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=128,
            dropout=0.0,
            batch_first=True,
        )
        self.out = nn.Linear(width, len(SYMBOLS))
        self.register_buffer("causal", torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        where = torch.arange(LENGTH)
        s = self.source(src) + self.position(where)
        t = self.target(tgt) + self.position(where)
        return self.out(self.transformer(s, t, tgt_mask=self.causal))


def decode(model: Reverser, src: torch.Tensor) -> torch.Tensor:
    """Greedy decoding, one position at a time."""
    tgt = torch.full_like(src, BOS)
    for t in range(LENGTH):
        step = model(src, tgt).argmax(-1)
        if t + 1 < LENGTH:
            tgt[:, t + 1] = step[:, t]
    return model(src, tgt).argmax(-1)


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = Reverser()
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    steps = 1500
    for _ in range(steps):
        src = torch.randint(len(SYMBOLS), (128, LENGTH))
        out = src.flip(-1)
        tgt = torch.cat([torch.full((128, 1), BOS), out[:, :-1]], dim=1)
        loss = nn.functional.cross_entropy(model(src, tgt).reshape(-1, len(SYMBOLS)), out.ravel())
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    seconds = time.perf_counter() - start
    model.eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        src = torch.randint(len(SYMBOLS), (1000, LENGTH), generator=generator)
        predicted = decode(model, src)
    right = predicted == src.flip(-1)
    sequence_accuracy = float(right.all(-1).float().mean())
    symbol_accuracy = float(right.float().mean())
    print(  # noqa: T201 - a script
        f"{steps} steps in {seconds:.0f} s, loss {float(loss.detach()):.4f}; greedy accuracy "
        f"{sequence_accuracy:.3f} (sequences), {symbol_accuracy:.4f} (symbols)"
    )

    src = torch.tensor([[SYMBOLS.index(c) for c in "DAJBHECG"]])
    with torch.no_grad():
        output = decode(model, src)
        tgt = torch.cat([torch.full((1, 1), BOS), output[:, :-1]], dim=1)
        with capture(model) as cap:
            model(src, tgt)
    here = Path(__file__).with_name("seq2seq_attentions.npz")
    np.savez_compressed(
        here,
        encoder=cap.encoder_attentions[0].numpy().astype(np.float32),  # (2, 4, 8, 8)
        decoder=cap.decoder_attentions[0].numpy().astype(np.float32),  # (2, 4, 8, 8)
        cross=cap.cross_attentions[0].numpy().astype(np.float32),  # (2, 4, 8, 8)
        source=np.array([SYMBOLS[i] for i in src[0]]),
        target_in=np.array(["<s>"] + [SYMBOLS[i] for i in tgt[0, 1:]]),
        output=np.array([SYMBOLS[i] for i in output[0]]),
        sequence_accuracy=np.float32(sequence_accuracy),
        symbol_accuracy=np.float32(symbol_accuracy),
        seconds=np.float32(seconds),
        steps=np.int64(steps),
    )
    print(here, here.stat().st_size, "bytes", "".join(SYMBOLS[i] for i in output[0]))  # noqa: T201


if __name__ == "__main__":
    main()
