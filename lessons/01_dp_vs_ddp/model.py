"""The model and the data every part of lesson 01 shares.

A small MLP classifier on synthetic data. Everything is a function of explicit
seeds, so the DDP ranks, the single-process reference and the DataParallel
re-creation all see exactly the same numbers.
"""

from __future__ import annotations

import torch
from torch import nn

# Two sizes: a tiny one for the equivalence proof (reported in full), a larger one
# for timing (enough arithmetic per step that threads and processes can differ).
PROOF = {"inputs": 32, "hidden": 64, "classes": 10}
TIMING = {"inputs": 512, "hidden": 1024, "classes": 10}


def make_model(*, inputs: int, hidden: int, classes: int, seed: int = 0) -> nn.Sequential:
    """Linear-ReLU-Linear-ReLU-Linear, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def make_batch(step: int, batch: int, *, inputs: int, classes: int, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: (batch x inputs) features and class labels."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch, inputs, generator=gen)
    y = torch.randint(0, classes, (batch,), generator=gen)
    return x, y


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of a global batch (equal slices)."""
    per_rank = tensor.shape[0] // world_size
    return tensor[rank * per_rank:(rank + 1) * per_rank]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: optimizer state that must stay identical on every rank."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def flat_grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flattened into one vector (in parameter order)."""
    return torch.cat([p.grad.detach().reshape(-1).cpu() for p in model.parameters()])


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter, flattened into one vector (in parameter order)."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
