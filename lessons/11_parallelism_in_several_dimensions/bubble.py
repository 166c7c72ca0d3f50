"""The pipeline's bubble, measured: how much of a step each rank sits idle.

Run it on 2 ranks, one core each, from the lessons folder:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 11_parallelism_in_several_dimensions/bubble.py

or from the notebook: launch("11_parallelism_in_several_dimensions/bubble.py", nproc=2,
env={"OMP_NUM_THREADS": "1"}).

A model of 8 Linear(1024, 1024) layers with ReLU, 4 on each rank, runs one training step
of m micro-batches of 64 rows under GPipe and under 1F1B, for m in --micro-batches. Each
rank's busy time is the time its stage spends in forward_one_chunk and backward_one_chunk,
the two methods the schedule calls to compute one micro-batch once what it needs has
arrived; the bubble is the rest of the step: 1 - busy / wall. Each setting runs once to
warm up; then the settings take turns, one step each, for --repeats rounds; the report
gives the median step time and bubble per schedule and m.
"""

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from labutils.dist import init, report

parser = argparse.ArgumentParser()
parser.add_argument("--micro-batches", default="2,8", help="the numbers of micro-batches, comma-separated")
parser.add_argument("--repeats", type=int, default=5, help="timed steps per setting, after one warm-up")
args = parser.parse_args()

WIDTH, LAYERS, MICRO = 1024, 8, 64
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}

rank, world_size, device = init()
torch.set_num_threads(1)  # one core per rank, whatever MKL_NUM_THREADS says (torch reads it first)
if world_size != 2:
    raise SystemExit(f"bubble.py is a pipeline of 2 ranks, not {world_size}")
torch.manual_seed(0)
layers = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])
per_rank = LAYERS // world_size


class Busy:
    """Seconds the stage spends computing: the schedule calls its forward_one_chunk and
    backward_one_chunk for each micro-batch, after waiting for what it receives."""

    def __init__(self, stage: PipelineStage) -> None:
        self.seconds = 0.0
        for name in ("forward_one_chunk", "backward_one_chunk"):
            setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def one_step(schedule, stage, busy: Busy, m: int) -> tuple[float, float]:
    """Wall seconds of one schedule.step(), and the stage's busy seconds in it."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m * MICRO, WIDTH, generator=g).to(device)
    y = torch.randn(m * MICRO, WIDTH, generator=g).to(device)
    busy.seconds = 0.0
    wall = time.perf_counter()
    if stage.is_first:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=[])
    return time.perf_counter() - wall, busy.seconds


settings = []  # (schedule's name, m, schedule, stage, busy)
for name, cls in SCHEDULES.items():
    for m in (int(v) for v in args.micro_batches.split(",")):
        module = copy.deepcopy(layers[rank * per_rank:(rank + 1) * per_rank]).to(device)
        stage = PipelineStage(module, rank, world_size, device)
        schedule = cls(stage, n_microbatches=m, loss_fn=F.mse_loss)
        busy = Busy(stage)
        one_step(schedule, stage, busy, m)  # the first step also learns the shapes between stages
        settings.append((name, m, schedule, stage, busy))

# The settings take turns, one step each per round: whatever else the machine runs meanwhile
# falls on all of them alike, not on whichever setting happened to run at that moment.
walls: dict = {(name, m): [] for name, m, *_ in settings}
bubbles: dict = {(name, m): [] for name, m, *_ in settings}
for _ in range(args.repeats):
    for name, m, schedule, stage, busy in settings:
        wall, computing = one_step(schedule, stage, busy, m)
        walls[name, m].append(wall)
        bubbles[name, m].append(1 - computing / wall)
for name, m, *_ in settings:
    report(part="bubble", schedule=name, micro_batches=m, step_s=statistics.median(walls[name, m]),
           bubble=statistics.median(bubbles[name, m]), stages=world_size)
