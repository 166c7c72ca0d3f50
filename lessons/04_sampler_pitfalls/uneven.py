"""Ranks with different numbers of batches: a hang at the end, and Join.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 04_sampler_pitfalls/uneven.py
    torchrun --standalone --nproc-per-node 2 04_sampler_pitfalls/uneven.py --join

or from the notebook: launch("04_sampler_pitfalls/uneven.py", nproc=2, ...).

Rank r trains on 3 + r batches, as with data split by files of different sizes (a
DistributedSampler never does this: it pads). After training, every rank waits at a
barrier before rank 0 saves the checkpoint.

Without --join, rank 0 runs out of batches first and enters the barrier while rank 1
is still in a training step, whose backward waits for rank 0's part of the gradient
all-reduce: each waits for the other. With --join, the training loop runs inside
ddp.join(): a rank that has run out of batches shadows the others' all-reduces
(contributing zeros) until every rank is done. Every rank then reports its weights.
"""

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init, report

parser = argparse.ArgumentParser()
parser.add_argument("--join", action="store_true", help="train inside ddp.join()")
args = parser.parse_args()

rank, world_size, device = init()
torch.manual_seed(0)
ddp = DDP(torch.nn.Linear(4, 1).to(device))
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
data = torch.Generator().manual_seed(rank)
batches = [torch.randn(8, 4, generator=data) for _ in range(3 + rank)]  # rank r: 3 + r batches

with ddp.join() if args.join else nullcontext():
    for step, x in enumerate(batches):
        loss = ddp(x.to(device)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} done", flush=True)

dist.barrier()  # everyone done before rank 0 saves the checkpoint
weights = torch.cat([p.detach().flatten() for p in ddp.parameters()])
everyone = [torch.empty_like(weights) for _ in range(world_size)]
dist.all_gather(everyone, weights)
report(batches=len(batches), weights=weights.tolist(),
       same_on_all_ranks=all(torch.equal(everyone[0], w) for w in everyone))
dist.destroy_process_group()
