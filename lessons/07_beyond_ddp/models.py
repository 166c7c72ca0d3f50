"""The models of lesson 07 and their data, identical in every rank that builds them.

- TinyTransformer: a decoder-only transformer small enough for CPU (4 blocks of
  width 128, 0.93 M parameters), big enough to have the parts whose memory lesson 07
  measures: embeddings, attention, MLP, LayerNorm, a vocabulary head.
- token_batch: a learnable next-token task (each sequence counts up by a fixed stride,
  modulo the vocabulary), different per rank and step, so the loss goes down quickly.
- make_mlp and make_stack: the two-layer MLP that tensor parallelism splits, and the
  stack of layers that pipeline parallelism cuts into stages.

Every builder draws its weights from torch's global generator: seed it (the same seed
on every rank) before building, as lesson 06 taught.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 512
    width: int = 128
    heads: int = 4
    blocks: int = 4
    seq_len: int = 64


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, both residual."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc1 = nn.Linear(cfg.width, 4 * cfg.width)
        self.fc2 = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, cfg: Config = Config()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.blocks))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-token logits (batch, seq, vocab) against targets."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_batch(rank: int, step: int, *, batch_size: int = 8, cfg: Config = Config()
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of shape (batch_size, seq_len): sequences start + stride * t
    (mod vocab), with start and stride drawn per rank and step."""
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    start = torch.randint(cfg.vocab, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 8, (batch_size, 1), generator=gen)
    seq = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab
    return seq[:, :-1], seq[:, 1:]


def make_mlp(width: int = 64, hidden: int = 256) -> nn.Sequential:
    """fc1 (width -> hidden), GELU, fc2 (hidden -> width): the MLP of a transformer block."""
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def make_stack(width: int = 512, layers: int = 8) -> nn.Sequential:
    """layers x (Linear, ReLU): cut into equal stages for pipeline parallelism."""
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
