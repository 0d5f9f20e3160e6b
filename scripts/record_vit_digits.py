"""Train a small vision transformer on scikit-learn's digits and record its attention.

Writes ``attnflow/data/vit_digits_sample.npz``, the image sample of ``attnflow demo``: the
attention of a real (if small) trained ViT, captured with attnflow's own PyTorch adapter,
so that the patch-overlay figure shows what a trained model looks at, offline.

The model: 8x8 grey digits cut into 2x2 patches (a 4 x 4 grid), a [CLS] token, learned
positions, 4 pre-norm ``nn.TransformerEncoder`` layers of 4 heads (width 32), and a
linear classifier on [CLS]. It trains on 80 % of the 1,797 digits (seeded) and is tested
on the rest; the accuracy is recorded in the file.

Requirements (none of them is a dependency of attnflow)::

    pip install torch==2.13.0 scikit-learn numpy
    pip install -e .   # attnflow itself, for its adapter

Usage, from the repository root::

    python scripts/record_vit_digits.py [--output attnflow/data/vit_digits_sample.npz]

Contents of the ``.npz`` file (loads with ``allow_pickle=False``): ``attentions`` float32
``(images, layers=4, heads=4, 17, 17)`` (token 0 is [CLS], then the patches row by row),
``images`` float32 ``(images, 8, 8)`` in [0, 1], ``labels`` and ``predictions`` int64,
``source`` str.
"""

from __future__ import annotations

import argparse
import datetime as dt
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from attnflow.adapters import torch as capture_torch

PATCH = 2
GRID = 8 // PATCH
WIDTH = 32


class TinyViT(nn.Module):
    """A vision transformer for 8x8 images: 2x2 patches, [CLS], 4 layers of 4 heads."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(PATCH * PATCH, WIDTH)
        self.cls = nn.Parameter(torch.zeros(1, 1, WIDTH))
        self.position = nn.Parameter(torch.randn(1, 1 + GRID * GRID, WIDTH) * 0.02)
        layer = nn.TransformerEncoderLayer(
            WIDTH, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits of 8x8 images ``(batch, 8, 8)``."""
        batch = images.shape[0]
        patches = images.reshape(batch, GRID, PATCH, GRID, PATCH).permute(0, 1, 3, 2, 4)
        tokens = self.embed(patches.reshape(batch, GRID * GRID, PATCH * PATCH))
        tokens = torch.cat([self.cls.expand(batch, -1, -1), tokens], dim=1) + self.position
        return self.head(self.encoder(tokens)[:, 0])  # type: ignore[no-any-return]


def main() -> None:
    """Train, capture the attention of six test digits, and write the sample."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="attnflow/data/vit_digits_sample.npz")
    parser.add_argument("--epochs", type=int, default=40)
    args = parser.parse_args()

    torch.manual_seed(0)
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    train_x, test_x, train_y, test_y = train_test_split(
        images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )
    model = TinyViT()
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    x, y = torch.from_numpy(train_x), torch.from_numpy(train_y)
    for _ in range(args.epochs):
        order = torch.randperm(len(x))
        for start in range(0, len(x), 64):
            batch = order[start : start + 64]
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    model.eval()
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(test_x)).argmax(1).numpy() == test_y).mean())

    # One test image of each of the first six classes.
    chosen = [int(np.flatnonzero(test_y == digit)[0]) for digit in range(6)]
    shown = torch.from_numpy(test_x[chosen])
    with torch.no_grad(), capture_torch.capture(model) as cap:
        predictions = model(shown).argmax(1).numpy()
    attentions = cap.attentions.numpy().astype(np.float32)

    source = (
        f"TinyViT (4 layers x 4 heads, width 32, 2x2 patches of 8x8 digits) trained "
        f"{args.epochs} epochs on scikit-learn's digits, test accuracy {accuracy:.3f}; "
        f"torch {torch.__version__}, scikit-learn {metadata.version('scikit-learn')}; "
        f"captured with attnflow.adapters.torch; recorded {dt.date.today().isoformat()} by "
        "scripts/record_vit_digits.py"
    )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.output,
        attentions=attentions,
        images=test_x[chosen],
        labels=test_y[chosen].astype(np.int64),
        predictions=predictions.astype(np.int64),
        source=np.array(source),
    )
    print(f"wrote {args.output}: attentions {attentions.shape}, test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
