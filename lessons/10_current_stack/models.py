"""The model and the data of lesson 10's scripts, identical in every rank that builds them.

- MLP: `depth` square Linear layers with ReLU, then a head. Every layer has the same
  size, which makes bucket and shard boundaries easy to read: at width 512 a layer is
  512 * 512 * 4 B + 512 * 4 B = 1,050,624 B, just over 1 MiB.
- regression_batch: inputs and targets of a small regression task (a fixed random
  "teacher" maps inputs to targets), different per rank and step, so the loss goes down
  and every rank trains on its own data.

Seed torch's global generator (the same seed on every rank) before building a model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int, depth: int, out: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def regression_batch(rank: int, step: int, *, width: int, out: int = 1, batch_size: int = 16
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for one rank and step: targets = sin(inputs @ teacher)."""
    teacher = torch.randn(width, out, generator=torch.Generator().manual_seed(1234)) / width ** 0.5
    x = torch.randn(batch_size, width, generator=torch.Generator().manual_seed(10_000 * step + rank))
    return x, torch.sin(3 * x @ teacher)


def mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in float32, whatever dtype the model computed in."""
    return F.mse_loss(prediction.float(), target)
