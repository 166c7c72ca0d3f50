"""The small transformer of lesson 11, the same in every rank that builds it.

One decoder block between an embedding and a head:

    ids -> embed -> block -> norm -> head -> logits over the vocabulary
    block(x) = x + attention(attention_norm(x)), then + ffn(ffn_norm(x))

The attention has separate q, k and v projections and `heads` heads of `dim // heads`
features each; it reads the number of heads from its input (`-1` in the view), so that
a rank holding some of the heads' columns computes those heads without knowing the
others exist. The module names are those the tensor-parallel plans of tp_block.py
refer to.

Seed torch's global generator (the same seed on every rank) before building one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.ffn = nn.LayerNorm(dim), FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = Block(dim, heads)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(ids))))


def token_batch(batch: int, seq: int, vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets) of shape (batch, seq): the same on every rank (tensor parallelism
    splits the model, not the data)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)
