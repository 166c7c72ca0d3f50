"""Rank 1 sleeps before the second all_reduce; the others wait there: a hang."""
import time

import torch
import torch.distributed as dist

from labutils.dist import init, report

rank, world_size, device = init()
t = torch.ones(1)
dist.all_reduce(t)
report(silent_from=time.time())
if rank == 1:
    time.sleep(600)
dist.all_reduce(t)
