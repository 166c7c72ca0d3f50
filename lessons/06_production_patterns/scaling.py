"""Strong and weak scaling at this world size: the time of a DDP step with and without
its all-reduce, and the time of the all-reduce alone.

    torchrun --nproc-per-node 1 --nnodes N ... scaling.py [BATCH]   # one rank per host

strong: the global batch stays BATCH samples (default 2048), split over the ranks;
weak:   every rank keeps BATCH samples (the 1-rank problem), so the global batch
        grows with the ranks. At 1 rank the two are the same problem.

DDP gets one bucket for all 4 MiB of gradients (bucket_cap_mb above the model's size):
its single all-reduce starts when backward has finished, nothing overlaps, and a step
is compute + all-reduce. Steps alternate between a normal DDP step and the same step
inside ddp.no_sync() (no all-reduce: the compute alone), and between the strong and the
weak batch, so all four see the same load; the medians are reported. At 1 rank the two
modes are one measurement, the baseline of both efficiencies. Then the all-reduce alone:
one float (the cost of a call, bytes aside) and the gradients' size, the fastest of
several calls each: the wire and the software set a floor, and anything else on the
machine can only add to it. Each rank uses one thread.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init, report

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
STEPS, WARMUP = 8, 2

rank, world_size, device = init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                      nn.Linear(512, 10)).to(device)
grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
ddp = DDP(model, bucket_cap_mb=2 * grad_bytes / 2**20)  # one bucket: no overlap
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)


def step(x, y) -> None:
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(batches: dict[str, int]) -> dict[str, tuple[float, float]]:
    """Per mode, the median seconds of a DDP step and of the same step under no_sync
    (compute only). Each round runs all of them in turn, so a moment of load on the
    machine lands on every mode alike."""
    data = {mode: (torch.randn(b, 512, device=device), torch.randint(0, 10, (b,), device=device))
            for mode, b in batches.items()}
    times = {(mode, sync): [] for mode in batches for sync in (True, False)}
    for i in range(WARMUP + STEPS):
        for (mode, sync), seconds in times.items():
            x, y = data[mode]
            dist.barrier()
            t0 = time.perf_counter()
            if sync:
                step(x, y)
            else:
                with ddp.no_sync():  # forward and backward inside: no all-reduce
                    step(x, y)
            if i >= WARMUP:
                seconds.append(time.perf_counter() - t0)
    return {mode: (statistics.median(times[mode, True]), statistics.median(times[mode, False]))
            for mode in batches}


def allreduce_seconds(numel: int, calls: int) -> float:
    """The fastest of ``calls`` all_reduce calls of numel float32 values, each after a
    barrier (and one warm-up call before them)."""
    t, times = torch.zeros(numel, device=device), []
    for i in range(calls + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


if world_size == 1:  # one problem: both modes share one measurement, so one baseline
    measured = measure({"strong": BATCH})
    measured["weak"] = measured["strong"]
else:
    measured = measure({"strong": BATCH // world_size, "weak": BATCH})
(strong_step, strong_compute), (weak_step, weak_compute) = measured["strong"], measured["weak"]
report(strong_step_s=strong_step, strong_compute_s=strong_compute, weak_step_s=weak_step,
       weak_compute_s=weak_compute,
       tiny_allreduce_s=allreduce_seconds(1, calls=20),  # the per-call cost, bytes aside
       grad_allreduce_s=allreduce_seconds(grad_bytes // 4, calls=8),  # the gradients alone
       grad_bytes=grad_bytes, batch=BATCH, cores=len(os.sched_getaffinity(0)))
dist.destroy_process_group()
