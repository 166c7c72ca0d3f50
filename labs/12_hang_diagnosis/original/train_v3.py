"""Train a regression model on sensor readings with DistributedDataParallel, skipping corrupt ones.

Each rank reads its own sensor, and no other rank's. A few readings are corrupt: the
sensor glitched and left a NaN target. One NaN in a batch turns the loss into NaN,
and after the optimizer step every weight, so a step whose readings (on any rank)
hold a corrupt one is skipped, on every rank: the ranks must take the same steps, or
their weights part ways.

An earlier version: the rank that finds a corrupt reading calls a helper that waits
until every rank has heard of it.

    labutils launch -n 2 original/train_v3.py -- --batch-size 6

Each rank reports every step, trained on or skipped: report(step=..., skipped=...).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from labutils.dist import init, print0, report
from readings import own_shard

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--items", type=int, default=96, help="dataset size (one pass)")
parser.add_argument("--batch-size", type=int, default=6, help="per rank")
parser.add_argument("--corrupt", type=int, default=2, help="corrupt readings in the dataset")
parser.add_argument("--seed", type=int, default=0, help="picks the readings and the corrupt ones")
args = parser.parse_args()

rank, world_size, device = init()

# This rank's shard of the readings, from its own sensor: readings rank, rank + W,
# rank + 2W, ... (W = world size) of all the sensors' readings together, --corrupt of
# which have a NaN target. A rank cannot read another rank's shard: what another rank
# holds, it learns from that rank or not at all.
shard = own_shard(rank, world_size, items=args.items, corrupt=args.corrupt, seed=args.seed)
# In order, no shuffling: together the ranks' k-th batches hold the readings
# k*B .. (k+1)*B - 1, with B = world size x batch size (the batches DistributedSampler
# with shuffle=False would cut).
loader = DataLoader(shard, batch_size=args.batch_size, drop_last=True)


def hold_everyone(step: int) -> None:
    """A corrupt reading in this step: make every rank stop here before going on."""
    print(f"rank {rank}: step {step}: a corrupt reading, holding every rank")
    dist.barrier()


torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

for step, (x, y) in enumerate(loader):
    x, y = x.to(device), y.to(device)
    if torch.isnan(y).any():
        hold_everyone(step)  # so that no rank trains on this step
        report(step=step, skipped=True)
        continue
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    report(step=step, skipped=False, loss=loss.item())
    print0(f"step {step}: loss {loss.item():.4f}")

dist.destroy_process_group()
