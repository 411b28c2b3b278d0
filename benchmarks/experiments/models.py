"""The experiments' models: LeNet-5 for CIFAR-10 and a one-block causal transformer LM.

Every layer has an exact ``grabkit.stats`` rule (Linear, Conv2d, Embedding, LayerNorm), so hook
mode GraB and the per-example noise scale run on them without the torch.func fallback.
"""

from __future__ import annotations

import torch
from torch import nn


class LeNet(nn.Module):
    """LeNet-5 for 32 x 32 RGB: conv 6@5x5, pool, conv 16@5x5, pool, 120, 84, 10 (ReLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 32, 32) -> (B, 10)
        return self.classifier(self.features(x))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention from Linear layers (every weight has an exact rule)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TinyLM(nn.Module):
    """Token + position embeddings, one pre-norm transformer block, a final norm and head."""

    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, context: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, vocab)
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(self.ln_f(x))
