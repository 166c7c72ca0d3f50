"""Train a small model with a BatchNorm layer on sharded data, with DistributedDataParallel.

Each rank reads its own shard of the data, and the shards differ (see shards.py). Run
it on 2 ranks (3 or 4 work too):

    torchrun --nproc-per-node 2 train.py --steps 6
    labutils launch -n 2 train.py -- --steps 6

Each rank reports its loss at every step: report(step=..., loss=...). At the end
each rank evaluates the model on the same held-out items, and reports that loss and
its BatchNorm layer's running statistics: report(val_loss=..., running_mean=[...],
running_var=[...]).
"""

import argparse
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init, report
from shards import held_out, make_model, shard_batch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=8, help="per rank")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

rank, world_size, device = init()

model = make_model(args.seed).to(device)
# BatchNorm's running statistics are buffers, and by default DDP broadcasts rank 0's
# buffers at the start of every forward: one more collective per step, for numbers
# that training does not even use. Turn it off. (The flag is forward_sync_buffers from
# torch 2.13 on; torch 2.11 and 2.12 call it broadcast_buffers.)
NO_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
           else "broadcast_buffers")
model = DDP(model, **{NO_SYNC: False})
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

for step in range(args.steps):
    x, y = shard_batch(step, rank=rank, size=args.batch_size, seed=args.seed)
    loss = F.mse_loss(model(x.to(device)), y.to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    report(step=step, loss=loss.item())

# Evaluation: in eval mode BatchNorm normalises with its running statistics.
plain = model.module.eval()
x, y = held_out(world_size)
with torch.no_grad():
    val_loss = F.mse_loss(plain(x.to(device)), y.to(device)).item()
norm = plain[1]
report(val_loss=val_loss, running_mean=norm.running_mean, running_var=norm.running_var)
print(f"rank {rank}: held-out loss {val_loss:.4f}")
dist.destroy_process_group()
