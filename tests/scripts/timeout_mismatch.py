"""Rank 0 calls a second all_reduce that rank 1 never calls; a 3 s process-group timeout."""
import datetime

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
x = torch.ones(4)
dist.all_reduce(x)
if dist.get_rank() == 0:
    dist.all_reduce(x)  # only rank 0 calls this one
dist.barrier()
dist.destroy_process_group()
