"""Time a DDP training step for several bucket_cap_mb values and model sizes, and time
plain all_reduce calls for the alpha-beta model that explains the curve.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 03_bucketing_and_overlap/sweep.py

or from the notebook: launch("03_bucketing_and_overlap/sweep.py", nproc=2).

- all_reduce of float32 arrays from 4 KiB to 16 MiB: seconds per call (each call after
  a barrier; the slowest rank's time; the fastest of 5), reported as part="alpha_beta".
- per model (--models) and cap (--caps, MiB): 2 warm-up steps (the first one uses a
  single bucket, the second rebuilds), then --steps rounds in which every setting takes
  one timed step (forward, backward, SGD step). Reported: the fastest and the median of
  the slowest rank's step times, and the bucket sizes DDP used. The same model under
  no_sync() gives the step time without communication.

On a machine shared with other work, the fastest of several tries is the measurement
least disturbed by it; that is why minima are reported.
"""

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # models.py sits next to this file
from models import batch, make_mlp  # noqa: E402

from labutils.ddp_probes import reducer_buckets  # noqa: E402
from labutils.dist import init, report  # noqa: E402
from labutils.timing import median, time_calls  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--models", default="deep128,deep256", help="model sizes from models.WIDTHS")
parser.add_argument("--caps", default="0.0625,0.25,1,4,16", help="bucket_cap_mb values")
parser.add_argument("--steps", type=int, default=9, help="timed rounds (one step of every setting each)")
args = parser.parse_args()

rank, world_size, device = init()


def finish() -> None:
    """Wait for the device: on GPUs the timed work must be done, not just queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: list[float]) -> list[float]:
    """Per call, the time of the slowest rank: a step is only as fast as the last rank."""
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ---------------------------------------------------------------- all_reduce: alpha and beta
sizes, times = [], []
for nbytes in [2**k for k in range(12, 25, 2)]:  # 4 KiB .. 16 MiB
    x = torch.ones(nbytes // 4, device=device)
    sizes.append(nbytes)
    times.append(min(slowest(time_calls(lambda: (dist.all_reduce(x), finish()), iters=5, sync=dist.barrier))))
if rank == 0:
    report(part="alpha_beta", nbytes=sizes, seconds=times)


# ---------------------------------------------------------------- step time per cap
def make_step(ddp, opt, size: str, *, sync: bool):
    """One training step of this model; without any all-reduce when sync is False."""
    step = 0

    def one_step():
        nonlocal step
        x, y = batch(rank, step, size=size)
        step += 1
        with ddp.no_sync() if not sync else contextlib.nullcontext():
            loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        finish()

    return one_step


caps = [None, *(float(c) for c in args.caps.split(","))]  # None: no communication (no_sync)
for size in args.models.split(","):
    models = []
    for cap in caps:
        ddp = DDP(make_mlp(size).to(device), bucket_cap_mb=cap if cap is not None else 1024)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        step = make_step(ddp, opt, size, sync=cap is not None)
        for _ in range(2):  # the first step uses one bucket; the second rebuilds them
            step()
        models.append((cap, ddp, step))
    # Interleave: round after round, one step of every setting, so that a busy moment of
    # the machine slows all settings alike instead of ruining one of them.
    step_times = {cap: [] for cap in caps}
    for _ in range(args.steps):
        for cap, _, step in models:
            step_times[cap] += slowest(time_calls(step, iters=1, warmup=0, sync=dist.barrier))
    for cap, ddp, _ in models:
        info = reducer_buckets(ddp)
        if rank == 0:
            report(part="sweep", model=size, cap_mb=cap, seconds=min(step_times[cap]),
                   median_seconds=median(step_times[cap]),
                   bucket_sizes=info["rebuilt_sizes"] or info["initial_sizes"],
                   param_bytes=info["total_parameter_size_bytes"])
    del models

dist.destroy_process_group()
