"""Gradient accumulation with DDP: count the all-reduces, compare with the big batch.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 03_bucketing_and_overlap/accumulation.py

or from the notebook: launch("03_bucketing_and_overlap/accumulation.py", nproc=2).

Each rank trains the small model for --steps optimizer steps of --micro micro-batches
of --batch items. Four ways to write the micro-step loop (WAYS below); for each, a
BucketRecorder (the communication hook) counts the all-reduces per optimizer step,
and every rank compares its final weights with the reference: one process taking
the same steps on the whole batch (all ranks' micro-batches together), assert_close.
The small model fits in one bucket, so one all-reduce = one synchronised backward.
"""

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # models.py sits next to this file
from models import batch, make_mlp  # noqa: E402

from labutils.course.ddp_probes import BucketRecorder  # noqa: E402
from labutils.dist import init, report  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
parser.add_argument("--micro", type=int, default=4, help="micro-batches per optimizer step")
parser.add_argument("--batch", type=int, default=8, help="items per micro-batch and rank")
args = parser.parse_args()

rank, world_size, device = init()
LR = 0.1


def micro_batch(r: int, step: int, m: int):
    """Rank r's m-th micro-batch of optimizer step `step` (any rank can build any rank's)."""
    x, y = batch(r, step * args.micro + m, size="small", n=args.batch)
    return x.to(device), y.to(device)


def reference() -> torch.Tensor:
    """One process, no DDP: each step on the whole batch (every rank's micro-batches)."""
    model = make_mlp("small").to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(args.steps):
        xs, ys = zip(*(micro_batch(r, step, m) for r in range(world_size) for m in range(args.micro)))
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()  # mean over all items
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def micro_step(ddp, x, y, *, way: str, last: bool) -> None:
    """One micro-step, written one of four ways. Loss / micro: the sum of micro-steps
    is then the mean over the whole batch, as in the reference."""
    skip = ddp.no_sync() if not last else nullcontext()
    if way == "sync every micro-step":  # correct result, micro x the all-reduces
        loss = F.cross_entropy(ddp(x), y) / args.micro
        loss.backward()
    elif way == "no_sync around forward and backward":  # the right way
        with skip:
            loss = F.cross_entropy(ddp(x), y) / args.micro
            loss.backward()
    elif way == "forward outside no_sync":  # the trap: no_sync only around backward
        loss = F.cross_entropy(ddp(x), y) / args.micro
        with skip:
            loss.backward()
    elif way == "forward of last micro-step inside no_sync":  # the other trap
        with ddp.no_sync():
            loss = F.cross_entropy(ddp(x), y) / args.micro
        loss.backward()
    else:
        raise ValueError(way)


WAYS = ["sync every micro-step", "no_sync around forward and backward",
        "forward outside no_sync", "forward of last micro-step inside no_sync"]

expected = reference()
for way in WAYS:
    ddp = DDP(make_mlp("small").to(device))
    recorder = BucketRecorder(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    per_step = []
    for step in range(args.steps):
        before = len(recorder.calls)
        for m in range(args.micro):
            x, y = micro_batch(rank, step, m)
            micro_step(ddp, x, y, way=way, last=m == args.micro - 1)
        opt.step()
        opt.zero_grad()
        per_step.append(len(recorder.calls) - before)
    weights = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    everyone = [torch.empty_like(weights) for _ in range(world_size)]
    dist.all_gather(everyone, weights)
    try:
        torch.testing.assert_close(weights, expected)  # float tolerances: sums in another order
        equal = True
    except AssertionError:
        equal = False
    report(part="accumulation", way=way, all_reduces_per_step=per_step, equal_to_reference=equal,
           max_abs_diff=(weights - expected).abs().max().item(),
           same_on_all_ranks=all(torch.equal(everyone[0], w) for w in everyone))

dist.destroy_process_group()
