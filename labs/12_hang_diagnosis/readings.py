"""The sensor readings of lab 12, one shard per rank (keep as is: the checks use it too).

Each rank has a sensor of its own and reads its readings only: own_shard() gives a
rank its shard and refuses another rank's, and so does the private _sensor_log(), which
gives one process the whole log. Whether another rank's readings hold a corrupt one, a
rank can learn only from that rank, through a collective.
"""

import os

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
    _refuse_another_sensor(rank, world_size)
    if items % world_size:
        raise ValueError(f"items={items} readings on {world_size} sensors: expected a multiple "
                         f"of the world size, so that every rank takes as many steps; "
                         f"pass --items {items - items % world_size}")
    features, targets = _sensor_log(items, corrupt, seed, rank=rank, world_size=world_size)
    return TensorDataset(features, targets)


def _this_process() -> tuple[int, int] | None:
    """(rank, world size) of this process in a distributed run, None outside one: from
    the process group once it is up, from torchrun's environment before."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    return None


def _refuse_another_sensor(rank: int, world_size: int) -> None:
    me = _this_process()
    if me is not None and (rank, world_size) != me:
        raise PermissionError(
            f"rank {me[0]} of {me[1]} asked for the readings of rank {rank} of {world_size}"
            f"{' (every sensor: the whole log)' if (rank, world_size) == (0, 1) else ''}: each "
            "rank reads only its own sensor. Call own_shard(rank, world_size, ...) with this "
            "process's own rank and world size; what another rank holds, it can only tell you "
            "through a collective")


def _sensor_log(items: int, corrupt: int, seed: int, *, rank: int = 0,
                world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The readings of sensor `rank` of world_size (reading i of the log comes from sensor
    i % world size), from a random stream of their own (the weights have theirs); with
    the defaults, every sensor's: the whole log, for one process. In a distributed run
    only this process's own sensor, as own_shard."""
    _refuse_another_sensor(rank, world_size)
    g = torch.Generator().manual_seed(100 + seed)
    features = torch.randn(items, 4, generator=g)
    targets = features @ WEIGHTS + 0.1 * torch.randn(items, 1, generator=g)
    targets[torch.randperm(items, generator=g)[:corrupt]] = float("nan")
    return features[rank::world_size], targets[rank::world_size]
