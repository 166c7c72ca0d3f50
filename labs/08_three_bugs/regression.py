"""The data, the model and a one-process reference for lab 08 (keep as is: the checks
use this file too)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

FEATURES = 4


def make_dataset(items: int = 24) -> TensorDataset:
    """items examples (features, target, index): the same on every rank and in every run."""
    g = torch.Generator().manual_seed(1234)
    features = torch.randn(items, FEATURES, generator=g)
    target = features.sum(dim=1, keepdim=True).sin()
    return TensorDataset(features, target, torch.arange(items))


def make_model(seed: int = 0) -> nn.Module:
    """The plain model (no DDP), with the same initial weights for the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def reference_model(batches: list[list[int]], *, items: int, lr: float, seed: int) -> nn.Module:
    """What one process makes of the same steps: step k trains on the items of
    batches[k] as one batch (the items every rank took at step k), with plain SGD."""
    features, target, _ = make_dataset(items).tensors
    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        optimizer.zero_grad()
        F.mse_loss(model(features[batch]), target[batch]).backward()
        optimizer.step()
    return model
