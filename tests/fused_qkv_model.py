"""A small pre-LayerNorm encoder with a fused query-key-value layer, built from sizes.

The block layout of nanoGPT, timm and the lab's agreement model: ``ln_1``, ``attn``
(``qkv`` then ``F.scaled_dot_product_attention`` then ``proj``), ``ln_2``, ``mlp``;
the adapter's value-aware capture must find its parts without a model-specific rule.
Imports PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        batch, n, width = x.shape
        q, k, v = (
            part.view(batch, n, self.n_heads, width // self.n_heads).transpose(1, 2)
            for part in self.qkv(x).split(width, dim=-1)
        )
        # Looked up at call time, so that the adapter can capture the weights.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.proj(out.transpose(1, 2).reshape(batch, n, width))  # type: ignore[no-any-return]


class _Block(nn.Module):
    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = _SelfAttention(hidden, n_heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * hidden, hidden),
        )

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), keep)
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class FusedQKVEncoder(nn.Module):
    """Token and position embeddings, pre-LN blocks, a final LayerNorm, a [CLS] classifier."""

    def __init__(
        self, vocab_size: int, n_positions: int, n_layers: int, n_heads: int, hidden: int
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden)
        self.position_embedding = nn.Embedding(n_positions, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.classifier = nn.Linear(hidden, 2)
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.token_embedding

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        keep = None
        if attention_mask is not None:
            keep = attention_mask.to(dtype=torch.bool)[:, None, None, :]
        for block in self.blocks:
            x = block(x, keep)
        return self.classifier(self.ln_f(x[:, 0]))  # type: ignore[no-any-return]
