"""The models and the data every part of lesson 01 shares.

Small classifiers on synthetic data. Everything is a function of explicit seeds,
so the DDP ranks, the single-process reference and the DataParallel re-creation
all see exactly the same numbers.
"""

from __future__ import annotations

import torch
from torch import nn

# PROOF is tiny: the equivalence proof reports all its parameters. The two timing
# models do the same job with opposite shapes:
# - MANY_SMALL_OPS: 128 hidden layers 16 wide. Each operation takes microseconds, so a
#   step is mostly Python and dispatcher overhead per operation, which holds the GIL.
# - FEW_BIG_OPS: 2 hidden layers 1024 wide. A step is a few large matrix products,
#   inside which torch releases the GIL.
PROOF = {"inputs": 32, "hidden": 64, "classes": 10}
MANY_SMALL_OPS = {"inputs": 16, "hidden": 16, "classes": 10, "depth": 128}
FEW_BIG_OPS = {"inputs": 512, "hidden": 1024, "classes": 10}


def make_model(*, inputs: int, hidden: int, classes: int, depth: int = 1, seed: int = 0) -> nn.Sequential:
    """Linear-ReLU, then ``depth`` x (Linear-ReLU) hidden to hidden, then Linear; from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(inputs, hidden), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, classes))


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


def param_bytes(model: nn.Module) -> int:
    """Bytes of all parameters (and so of all gradients)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def flat_grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flattened into one vector (in parameter order)."""
    return torch.cat([p.grad.detach().reshape(-1).cpu() for p in model.parameters()])


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter, flattened into one vector (in parameter order)."""
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
