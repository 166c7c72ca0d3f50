"""Train a small regression model with DistributedDataParallel and log the global loss.

Run it on 2 ranks (3 or 4 work too):

    torchrun --nproc-per-node 2 train.py --steps 12 --log-every 4
    labutils launch -n 2 train.py -- --steps 12 --log-every 4

Every step each rank reports its own loss (report(step=..., loss=...)); every
--log-every steps the log line shows the loss averaged over all ranks, and that
value is reported too (report(log_step=..., global_loss=...)).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init, report

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--log-every", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=8, help="per rank")
args = parser.parse_args()

rank, world_size, device = init()
master_process = rank == 0  # only one rank writes the log


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for a step: different on every rank, the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(args.batch_size, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(args.batch_size, 1, generator=g)
    return x.to(device), y.to(device)


torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

for step in range(args.steps):
    x, y = batch(step)
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    report(step=step, loss=loss.item())

    if step % args.log_every == 0:
        # the log shows the loss averaged over every rank, not just rank 0's: a collective,
        # so every rank must call it; only the printing is rank 0's job
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world_size
        if master_process:
            print(f"step {step}: loss {global_loss.item():.4f} (mean over {world_size} ranks)")
            report(log_step=step, global_loss=global_loss.item())

dist.destroy_process_group()
