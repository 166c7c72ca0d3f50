"""Time a DDP training step for several bucket_cap_mb values, against two predictions
built from parts measured alone; and time plain all_reduce calls for alpha-beta.

Run it with one rank on each of 2 hosts (the lesson runs it on a virtual cluster whose
links are capped, see labutils.cluster), or on one machine:

    torchrun --standalone --nproc-per-node 2 03_bucketing_and_overlap/sweep.py

or from the notebook: cluster.launch("03_bucketing_and_overlap/sweep.py", nproc=1).

- per model (--models) and cap (SWEEPS below, MiB): 3 warm-up steps (the first one uses a
  single bucket, the second rebuilds), then --rounds rounds in which every setting takes
  one timed step (forward, backward, SGD step); then, in every round, each bucket size
  DDP made is all-reduced alone with a plain dist.all_reduce (TRIES_SMALL times under
  SMALL bytes, once from there). The same model under no_sync() (no communication at
  all), twice per round, gives the compute: forward, backward and optimizer step timed
  apart. Reported per cap (part="sweep"): the slowest rank's step in each round
  (round_s) and the fastest of them (seconds), the bucket sizes, and the fastest
  all-reduce time of each bucket alone; per model (part="compute"): the phases of the
  fastest step without communication, and the share of those steps that the ranks
  spent waiting for a core that other programs held (waited_share, the mean over the
  steps on the rank that waited most; labutils.course.timing.waited_for_a_core).
- before the steps and again after them, all_reduce of float32 arrays from 4 KiB to
  4 MiB: seconds per call (each call after a barrier; the slowest rank's time; the
  fastest of 3 x TRIES_SMALL tries under SMALL bytes, of 5 from there, in each pass),
  reported as part="alpha_beta".

On a machine shared with other work, the fastest of several tries is the measurement
least disturbed by it; that is why minima are reported, and why the rounds interleave
the settings: a busy moment slows one round of every setting, not every try of one,
and two settings can be compared round by round. A small all_reduce needs many tries:
on a 2-core machine about a third of them take 2 to 8 ms instead of about 0.4 (with or
without a capped link, and under plain torchrun on loopback too), so that the fastest of
7 tries can still be a slow one.
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

from labutils.course.ddp_probes import reducer_buckets  # noqa: E402
from labutils.dist import init, report  # noqa: E402
from labutils.course.timing import time_calls, waited_for_a_core  # noqa: E402

# model: (items per rank and step, bucket_cap_mb values). The batches make backward
# take about as long as the all-reduces on a 400 Mbit/s link, so that overlap matters.
SWEEPS = {
    # 48 tensors of 1 or 256 KiB: from 24 buckets (a layer each) to one.
    "deep256": (3072, [0.25, 1, 4, 16]),
    # 192 tensors of 256 B or 16 KiB: down to one bucket per tensor.
    "deep96x64": (2048, [2**-12, 0.0625, 0.25, 1, 4]),
}

parser = argparse.ArgumentParser()
parser.add_argument("--models", default="deep256,deep96x64", help=f"among {', '.join(SWEEPS)}")
parser.add_argument("--rounds", type=int, default=7, help="timed rounds (one step of every setting each)")
args = parser.parse_args()

rank, world_size, device = init()
torch.set_num_threads(1)  # one core per rank, whatever MKL_NUM_THREADS says (torch reads it first)


def finish() -> None:
    """Wait for the device: on GPUs the timed work must be done, not just queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: list[float]) -> list[float]:
    """Per entry, the time of the slowest rank: a step is only as fast as the last rank."""
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def slowest_rank(phases: list[float]) -> list[float]:
    """The phases of the rank whose total is the largest (every rank gets the same)."""
    rows = torch.zeros(world_size, len(phases), dtype=torch.float64)
    rows[rank] = torch.tensor(phases, dtype=torch.float64)
    dist.all_reduce(rows)  # each rank filled its own row: the sum holds every row
    return rows[rows.sum(dim=1).argmax()].tolist()


SMALL = 1 << 20  # an all_reduce of fewer bytes than this is timed TRIES_SMALL times
TRIES_SMALL = 5  # per round (and 3x as often for alpha-beta) instead of once


def all_reduce_alone(nbytes: int) -> float:
    """One plain all_reduce of nbytes of float32 after a barrier: seconds, slowest rank."""
    x = torch.ones(nbytes // 4, device=device)
    return slowest(time_calls(lambda: (dist.all_reduce(x), finish()), iters=1, warmup=0,
                              sync=dist.barrier))[0]


# ---------------------------------------------------------------- all_reduce: alpha and beta
AB_SIZES = [2**k for k in range(12, 23, 2)]  # 4 KiB .. 4 MiB
AB_TRIES: dict[int, list[float]] = {n: [] for n in AB_SIZES}


def time_alpha_beta_sizes() -> None:
    """Each size's tries back to back, from the smallest. Done twice, before and after
    the steps: the tries of one pass can all fall into one slow moment (in one run all
    15 tries of 4 KiB took over 2 ms), two passes half a minute apart hardly ever do."""
    for n in AB_SIZES:
        all_reduce_alone(n)  # warm-up
        AB_TRIES[n].extend(all_reduce_alone(n) for _ in range(3 * TRIES_SMALL if n < SMALL else 5))


time_alpha_beta_sizes()


# ---------------------------------------------------------------- step time per cap
class Setting:
    """One DDP model of the sweep; cap None: the same model under no_sync()."""

    def __init__(self, size: str, cap: float | None) -> None:
        self.size, self.cap, self.step_count = size, cap, 0
        self.batch = SWEEPS[size][0]
        self.ddp = DDP(make_mlp(size).to(device), bucket_cap_mb=cap if cap is not None else 1024)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=0.01)
        self.phases: list[list[float]] = []  # per timed step: forward, backward, optimizer
        self.waited: list[float] = []  # per timed step: the share of it spent waiting for a core
        # the first step uses one bucket, the second rebuilds them, and DDP's logging
        # data shows the rebuilt buckets from the third on
        for _ in range(3):
            self.step()
        self.phases.clear()
        self.waited.clear()
        info = reducer_buckets(self.ddp)
        self.buckets = (info["rebuilt_sizes"] or info["initial_sizes"]) if cap is not None else []

    def step(self) -> None:
        x, y = batch(rank, self.step_count, size=self.size, n=self.batch)
        self.step_count += 1
        sync = self.cap is not None
        t0, waited = time.perf_counter(), waited_for_a_core()
        with self.ddp.no_sync() if not sync else contextlib.nullcontext():
            loss = F.cross_entropy(self.ddp(x.to(device)), y.to(device))
            finish()
            t1 = time.perf_counter()
            loss.backward()  # with sync: returns once every bucket is all-reduced
            finish()
            t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        finish()
        waited_after = waited_for_a_core()
        self.phases.append([t1 - t0, t2 - t1, time.perf_counter() - t2])
        if waited is not None and waited_after is not None:
            self.waited.append((waited_after - waited) / sum(self.phases[-1]))


for size in args.models.split(","):
    settings = [Setting(size, cap) for cap in [None, *SWEEPS[size][1]]]
    alone: dict[int, list[float]] = {n: [] for s in settings for n in s.buckets}
    for _ in range(args.rounds):
        for s in settings:
            for _ in range(2 if s.cap is None else 1):  # the compute alone is cheap: twice
                dist.barrier()
                s.step()
        for nbytes, seconds in alone.items():  # each bucket size in every round
            seconds.extend(all_reduce_alone(nbytes) for _ in range(TRIES_SMALL if nbytes < SMALL else 1))
    for s in settings:
        # per step the slowest rank's phases; the step with the smallest total counts
        steps = [slowest_rank(p) for p in s.phases]
        if s.cap is None:  # the compute alone: its mean share waiting for a core, on the slowest rank
            waited = slowest([sum(s.waited) / len(s.waited) if s.waited else 0.0])[0]
        fastest = min(steps, key=sum)
        if rank != 0:
            continue
        if s.cap is None:
            report(part="compute", model=size, batch=s.batch, forward_s=fastest[0],
                   backward_s=fastest[1], optimizer_s=fastest[2], waited_share=waited,
                   param_bytes=reducer_buckets(s.ddp)["total_parameter_size_bytes"])
        else:
            report(part="sweep", model=size, cap_mb=s.cap, seconds=sum(fastest),
                   round_s=[sum(p) for p in steps], bucket_sizes=s.buckets,
                   alone_s=[min(alone[n]) for n in s.buckets])
    del settings

time_alpha_beta_sizes()  # the second pass of alpha-beta's sizes
if rank == 0:
    report(part="alpha_beta", nbytes=AB_SIZES, seconds=[min(AB_TRIES[n]) for n in AB_SIZES])

dist.destroy_process_group()
