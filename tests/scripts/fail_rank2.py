"""Rank 2 raises after the first all_reduce; its peers die in the next one."""
import torch
import torch.distributed as dist

from labutils.dist import init

rank, world_size, device = init()
t = torch.ones(1)
dist.all_reduce(t)
if rank == 2:
    raise ValueError("bad batch shape on rank 2")
dist.all_reduce(t)
dist.destroy_process_group()
