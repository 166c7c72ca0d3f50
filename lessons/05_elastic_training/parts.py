"""The model, the data and the sampler train_resumable.py uses (small, CPU-friendly).

ResumableSampler is torch's DistributedSampler plus a position: the number of
samples of the current epoch the whole job has already consumed. With strided
sharding, rank r takes items r, r+W, r+2W, ... of the epoch's permutation, so after
k batches on every rank the job has consumed exactly the first k*W*b items of that
permutation, whatever W is. That makes the position a property of the job, not of
the world size, which is what lets a run resume with a different number of ranks.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

N_SAMPLES, N_FEATURES, N_CLASSES = 512, 32, 4


def make_dataset(seed: int = 1234) -> TensorDataset:
    """Inputs and labels of a random linear teacher; the same on every rank and run."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
    teacher = torch.randn(N_FEATURES, N_CLASSES, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1), torch.arange(N_SAMPLES))


def make_model() -> nn.Module:
    """An MLP with dropout, so that the torch RNG matters for every step."""
    return nn.Sequential(
        nn.Linear(N_FEATURES, 64), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(64, N_CLASSES),
    )


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch at a position (samples already used)."""

    def __init__(self, dataset, *, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True,
                         seed=seed, drop_last=False)
        self.position = 0

    def set_position(self, position: int) -> None:
        """Skip the first `position` samples of this epoch's permutation (all ranks')."""
        if position % self.num_replicas:
            raise ValueError(f"position {position} is not a multiple of the world size "
                             f"{self.num_replicas}")
        self.position = position

    def __iter__(self):
        mine = list(super().__iter__())
        return iter(mine[self.position // self.num_replicas:])

    def __len__(self) -> int:
        return self.num_samples - self.position // self.num_replicas


def params_sha256(model: nn.Module) -> str:
    """A fingerprint of every parameter and buffer, bit for bit."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
