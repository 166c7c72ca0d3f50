"""The data, the model and a one-process reference for lab 09 (keep as is: the checks
use this file too).

Each rank reads its own shard only: while the process group is up, shard_batch() and
global_batch() refuse another rank's items; what the other ranks' items are, a rank can
learn only through a collective. held_out() is the same on every rank.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

FEATURES, HIDDEN = 6, 8


def shard_batch(step: int, *, rank: int, size: int,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch at `step`, from its own shard of the data. The shards differ:
    rank r's features are scaled by 1 + r and shifted by 2r (think of one shard per
    country, sensor or day). In a distributed run, only this process's own rank."""
    return _shard(step, rank=rank, size=size, seed=seed)


HELD_OUT_STEP = 10_000   # held_out()'s items, which every rank may read


def _shard(step: int, *, rank: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if dist.is_initialized() and rank != dist.get_rank() and step != HELD_OUT_STEP:
        raise PermissionError(
            f"rank {dist.get_rank()} asked for the shard of rank {rank}: each rank reads only "
            "its own shard. Call shard_batch(step, rank=rank, ...) with this process's own "
            "rank; what the other ranks' items are, it can learn only through a collective")
    g = torch.Generator().manual_seed(1_000_003 * seed + 1000 * step + rank)
    x = torch.randn(size, FEATURES, generator=g) * (1 + rank) + 2 * rank
    y = (x[:, :3].sum(dim=1, keepdim=True) - x[:, 3:].sum(dim=1, keepdim=True)).tanh()
    return x, y


def global_batch(step: int, *, world_size: int, size: int,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch at `step`, together: rank 0's items, then rank 1's, ... For
    one process (the reference); a rank of a distributed run may not read them all."""
    parts = [shard_batch(step, rank=rank, size=size, seed=seed) for rank in range(world_size)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def held_out(world_size: int, *, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out items from every shard, the same on every rank."""
    parts = [_shard(HELD_OUT_STEP, rank=rank, size=size, seed=0) for rank in range(world_size)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def make_model(seed: int = 0, *, norm: type[nn.Module] = nn.BatchNorm1d) -> nn.Sequential:
    """The model, with the same initial weights for the same seed; norm(HIDDEN) is its
    normalisation layer, model[1]."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), norm(HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, 1))


def reference_model(*, world_size: int, steps: int, batch_size: int, lr: float,
                    seed: int = 0) -> nn.Sequential:
    """One process, plain BatchNorm, plain SGD: step k trains on every rank's batch of
    step k together, as one batch of world_size x batch_size items."""
    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = global_batch(step, world_size=world_size, size=batch_size, seed=seed)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model
