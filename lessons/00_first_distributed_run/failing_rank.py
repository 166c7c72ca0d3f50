"""A small training loop in which one rank meets a corrupt batch and stops.

Run it on 3 ranks, from this folder (rank 1 fails at step 3):

    torchrun --standalone --nproc-per-node 3 failing_rank.py --bad-rank 1 --bad-step 3

or from a notebook cell:

    from labutils import launch
    result = launch("00_first_distributed_run/failing_rank.py", nproc=3,
                    args=["--bad-rank", "1", "--bad-step", "3"])
    result.failure        # the root cause: which rank, which exception, where

Each step every rank computes gradients on its own batch, then the ranks average
their gradients with all_reduce (what DistributedDataParallel does for you, lesson
01). One rank's batch contains a NaN, and that rank's loss check raises. The
other ranks are waiting inside all_reduce for it at that moment: they fail too,
with a connection error. They are victims, not the cause.
"""

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labutils.dist import init

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--bad-rank", type=int, default=1, help="the rank whose batch is corrupt")
parser.add_argument("--bad-step", type=int, default=3, help="the step at which it is corrupt")
args = parser.parse_args()

rank, world_size, device = init()
torch.manual_seed(0)  # the same initial weights on every rank ...
model = torch.nn.Linear(8, 4).to(device)
data = torch.Generator().manual_seed(1000 + rank)  # ... but each rank draws its own batches

for step in range(args.steps):
    x = torch.randn(16, 8, generator=data)
    y = torch.randint(0, 4, (16,), generator=data)
    if rank == args.bad_rank and step == args.bad_step:
        x[5, 2] = float("nan")  # a corrupt sample in this rank's part of the data
    x, y = x.to(device), y.to(device)

    loss = F.cross_entropy(model(x), y)
    if not math.isfinite(loss.item()):  # stop loudly rather than train on NaN
        raise FloatingPointError(f"loss is {loss.item()} at step {step} on rank {rank}")
    model.zero_grad()
    loss.backward()
    for p in model.parameters():  # average the gradients over all ranks
        dist.all_reduce(p.grad)
        p.grad /= world_size
    with torch.no_grad():  # plain SGD by hand: what torch.optim.SGD would do
        for p in model.parameters():
            p -= args.lr * p.grad
    print(f"step {step}: loss {loss.item():.4f}")

dist.destroy_process_group()
