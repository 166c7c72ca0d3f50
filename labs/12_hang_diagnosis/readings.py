"""The sensor readings of lab 12, one shard per rank (keep as is: the checks use it too).

Each rank has a sensor of its own and reads its readings only: own_shard() gives a
rank its shard and refuses another rank's. Whether another rank's readings hold a
corrupt one, a rank can learn only from that rank, through a collective.
"""

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

WEIGHTS = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])   # what the model should learn


def own_shard(rank: int, world_size: int, *, items: int = 96, corrupt: int = 2,
              seed: int = 0) -> TensorDataset:
    """This rank's readings (features, target): readings rank, rank + world_size, ... of
    the items readings of all the sensors, --corrupt of which have a NaN target.

    Args:
        rank: this process's rank (another rank's shard is refused).
        world_size: the number of ranks, each with a sensor of its own.
        items: the readings of all the sensors together; a multiple of world_size.
        corrupt: how many of them (over all the sensors) have a NaN target.
        seed: picks the readings and the corrupt ones.
    """
    if dist.is_initialized() and (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
        raise PermissionError(
            f"rank {dist.get_rank()} of {dist.get_world_size()} asked for the readings of rank "
            f"{rank} of {world_size}: each rank reads only its own sensor. Call "
            "own_shard(rank, world_size, ...) with this process's own rank and world size; what "
            "another rank holds, it can only tell you through a collective")
    if items % world_size:
        raise ValueError(f"items={items} readings on {world_size} sensors: expected a multiple "
                         f"of the world size, so that every rank takes as many steps; "
                         f"pass --items {items - items % world_size}")
    features, targets = _sensor_log(items, corrupt, seed)
    return TensorDataset(features[rank::world_size], targets[rank::world_size])


def _sensor_log(items: int, corrupt: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sensor's readings, interleaved (reading i comes from sensor i % world size),
    from a random stream of their own (the weights have theirs)."""
    g = torch.Generator().manual_seed(100 + seed)
    features = torch.randn(items, 4, generator=g)
    targets = features @ WEIGHTS + 0.1 * torch.randn(items, 1, generator=g)
    targets[torch.randperm(items, generator=g)[:corrupt]] = float("nan")
    return features, targets
