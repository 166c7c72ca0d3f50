"""Lesson 12's model: a stack of MLP blocks, each Linear(DIM, 4 DIM) -> GELU -> Linear(4 DIM, DIM),
with a residual connection; the same weights for the same seed on every rank."""

import torch
from torch import nn

DIM, BLOCKS = 256, 4


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def make_mlp(dim: int = DIM, blocks: int = BLOCKS, *, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(Block(dim) for _ in range(blocks)))


def batch(index: int, *, rows: int, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch `index`: inputs and regression targets, reproducible."""
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)
