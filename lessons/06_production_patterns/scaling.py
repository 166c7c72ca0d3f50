"""Time per training step at this world size, for strong and weak scaling.

    torchrun --nproc-per-node N scaling.py        # N = 1, 2, 4

strong: the global batch stays 256 samples, split over the ranks (256/N each);
weak:   every rank keeps 64 samples, so the global batch grows with N.
Each rank uses one thread, so N ranks ask for N cores. Reported: the median step time
over 8 timed steps (after 2 warm-up steps) for each mode, and the cores this
process may run on.
"""

import os
import statistics
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init, report

rank, world_size, device = init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 10)).to(device)
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)


def median_step_seconds(per_rank_batch: int, timed_steps: int = 8, warmup: int = 2) -> float:
    x = torch.randn(per_rank_batch, 512, device=device)
    y = torch.randint(0, 10, (per_rank_batch,), device=device)
    times = []
    for i in range(warmup + timed_steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


strong = median_step_seconds(256 // world_size)
weak = median_step_seconds(64)
report(strong_s=strong, weak_s=weak, cores=len(os.sched_getaffinity(0)))
torch.distributed.destroy_process_group()
