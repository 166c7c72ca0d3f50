"""The model and the held-out set of lab 06 (keep as is: the checks use this file too)."""

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset


def trained_model() -> nn.Module:
    """A small classifier with fixed weights, standing in for a trained checkpoint."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=g))
    return model.eval()


def held_out_set(items: int = 11) -> TensorDataset:
    """items examples (features, class), the same on every rank and in every run."""
    g = torch.Generator().manual_seed(99)
    return TensorDataset(torch.randn(items, 4, generator=g), torch.randint(0, 3, (items,), generator=g))


def single_process_accuracy(items: int = 11) -> tuple[int, int]:
    """(correct, items): the metric as one process computes it, for the checks."""
    model, data = trained_model(), held_out_set(items)
    with torch.no_grad():
        correct = (model(data.tensors[0]).argmax(dim=1) == data.tensors[1]).sum().item()
    return correct, items
