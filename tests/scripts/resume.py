"""Counts to 6 with a checkpoint per step, resuming after a restart (fault injection test)."""
import os
import sys

import torch
import torch.distributed as dist

from labutils.dist import init, report

rank, world_size, device = init()
ckpt = sys.argv[1]
start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
total = torch.zeros(1)
for step in range(start, 6):
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 0:
        with open(ckpt + ".tmp", "w") as f:
            f.write(str(step + 1))
        os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
    report(step=step, restart=int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
dist.destroy_process_group()
