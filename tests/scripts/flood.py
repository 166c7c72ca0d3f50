"""Rank 0 prints N lines (argv[1]); rank 1 only waits at the barrier."""
import sys

import torch.distributed as dist

from labutils.dist import init

rank, world_size, device = init()
if rank == 0:
    for i in range(int(sys.argv[1])):
        print(f"flood line {i}")
dist.barrier()
dist.destroy_process_group()
