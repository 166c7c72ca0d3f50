"""The models lesson 03's scripts train: plain MLPs with named layers fc1, fc2, ...

Layer names matter here: the bucket tables and timelines print them.
"""

from collections import OrderedDict

import torch
from torch import nn

WIDTHS = {
    # The main model: 2.9 M parameters, 11 MiB of float32 gradients in 10 tensors
    # (layers of 1 to 4 MiB), so a few MiB of bucket cap splits it into several buckets.
    "mlp": (256, 1024, 1024, 1024, 512, 10),
    # A small model: 0.1 M parameters, 0.4 MiB, one bucket under the default cap.
    "small": (128, 256, 256, 10),
    # Deep and narrow, for the bucket-cap sweep: 24 layers, 48 tensors, so small caps
    # really make many small buckets. 0.4 M parameters (1.5 MiB) and 1.6 M (6 MiB).
    "deep128": (128,) * 25,
    "deep256": (256,) * 25,
    # Many small tensors: 96 layers of width 64, 192 tensors (16 KiB weights, 256 B
    # biases), 0.4 M parameters (1.5 MiB), so that tiny caps make many tiny all-reduces.
    "deep96x64": (64,) * 97,
}


def make_mlp(size: str = "mlp", *, seed: int = 0) -> nn.Sequential:
    """An MLP fc1 -> relu1 -> fc2 -> ... -> fcN, the same weights for the same seed."""
    widths = WIDTHS[size]
    torch.manual_seed(seed)  # every rank builds identical weights (DDP would broadcast them anyway)
    layers: "OrderedDict[str, nn.Module]" = OrderedDict()
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:]), start=1):
        layers[f"fc{i}"] = nn.Linear(n_in, n_out)
        if len(widths) > 30:  # keep activations from vanishing: tiny (denormal) floats compute slowly
            nn.init.kaiming_normal_(layers[f"fc{i}"].weight, nonlinearity="relu")
        if i < len(widths) - 1:
            layers[f"relu{i}"] = nn.ReLU()
    return nn.Sequential(layers)


def linear_layers(model: nn.Module) -> dict:
    """{name: module} of the model's Linear layers, in forward order."""
    return {name: m for name, m in model.named_children() if isinstance(m, nn.Linear)}


def batch(rank: int, step: int, *, size: str = "mlp", n: int = 32):
    """Rank `rank`'s batch for step `step`: random inputs and class labels, reproducible."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    widths = WIDTHS[size]
    return torch.randn(n, widths[0], generator=g), torch.randint(0, widths[-1], (n,), generator=g)


class BranchNet(nn.Module):
    """fc_in -> (branch, when use_branch) -> head: a model whose branch can go unused."""

    def __init__(self, width: int = 64, *, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc_in = nn.Linear(width, width)
        self.branch = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.relu(self.fc_in(x))
        if use_branch:
            h = torch.relu(self.branch(h))
        return self.head(h)
