"""Where a DDP step's time goes: torch.profiler on every rank, plus a no-communication run.

    torchrun --nproc-per-node 2 profile_ddp.py TRACE_DIR

A 4-layer MLP (3.2 M parameters, 12.6 MB of gradients) in buckets of 4 MB, so that
all-reduces can start while backward is still running. Three measurements:

- the profiler over 5 steps: time in forward, backward, optimizer (record_function
  labels) and in gloo's all_reduce events, which run on gloo's own thread;
- the step time with communication (a normal DDP step);
- the step time without it (the same step inside ddp.no_sync(): no all-reduce).

The difference of the last two is the communication the step really waits for (not
hidden behind backward). Rank 0 writes a Chrome trace (open it in chrome://tracing or
https://ui.perfetto.dev) to TRACE_DIR.
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from labutils.dist import init, report

rank, world_size, device = init()
torch.set_num_threads(1)  # one core per rank: the comparison is about ranks, not threads
torch.manual_seed(0)
WIDTH, BATCH = 1024, 64
model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())],
                      nn.Linear(WIDTH, 10)).to(device)
ddp = DDP(model, bucket_cap_mb=4)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
x = torch.randn(BATCH, WIDTH, device=device)
y = torch.randint(0, 10, (BATCH,), device=device)


def step(sync: bool = True) -> None:
    with record_function("forward"):
        loss = nn.functional.cross_entropy(ddp(x), y)
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)


TIMED = 8


def timed(sync: bool, n: int = TIMED) -> float:
    times = []
    for _ in range(n):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        if sync:
            step()
        else:
            with ddp.no_sync():  # forward and backward inside: no all-reduce at all
                step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


for _ in range(3):
    step()  # warm-up; DDP rebuilds its buckets after the first step
PROFILED = 5
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(PROFILED):
        step()
totals: dict[str, float] = {}
calls: dict[str, int] = {}
for ev in prof.key_averages():
    if ev.key in ("forward", "backward", "optimizer") or ev.key.startswith("gloo:"):
        totals[ev.key] = ev.cpu_time_total / 1e3 / PROFILED  # ms per step
        calls[ev.key] = ev.count // PROFILED
if rank == 0:
    trace_dir = Path(sys.argv[1])
    trace_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_dir / "ddp_step_rank0.json"))
with_comm = timed(sync=True)
without_comm = timed(sync=False)
report(**{f"{k}_ms": round(v, 2) for k, v in totals.items()},
       allreduce_calls=calls.get("gloo:all_reduce", 0), step_ms=round(with_comm * 1e3, 2),
       no_comm_step_ms=round(without_comm * 1e3, 2),
       grad_mb=round(sum(p.numel() for p in model.parameters()) * 4 / 2**20, 1),
       profiled_steps=PROFILED, timed_steps=TIMED)
torch.distributed.destroy_process_group()
