"""Rank 1 stops at breakpoint() (or torch.distributed.breakpoint with --torch); rank 0 waits."""
import sys

import torch
import torch.distributed as dist

from labutils.dist import init

rank, world_size, _ = init()
secret = 40 + rank
x = torch.ones(2)
if "--torch" in sys.argv:
    dist.breakpoint(rank=1)
elif rank == 1:
    breakpoint()
dist.all_reduce(x)
print(f"rank {rank}: secret {secret}, sum {x.sum().item():g}", flush=True)
dist.destroy_process_group()
