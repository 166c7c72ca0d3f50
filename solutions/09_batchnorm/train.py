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
import torch.nn as nn
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


class AllReduceSum(torch.autograd.Function):
    """dist.all_reduce (a sum over the ranks) that autograd can go through: the
    gradient of a sum over the ranks is the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        dist.all_reduce(total)
        return total


class SyncBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d whose batch statistics are those of every rank's batch together.

    nn.SyncBatchNorm does this on GPUs; on CPU it raises. In training, one all_reduce
    adds up each channel's sum and sum of squares, and the item count, over the ranks:
    every rank normalises with the mean and variance of the global batch and updates
    its running statistics with the same numbers, so they stay identical everywhere.
    The all_reduce is differentiable, so the gradients are those of the global batch
    too: each rank's loss depends on every rank's items through the statistics.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)  # evaluation: the running statistics
        count = torch.full((1,), float(x.shape[0]), dtype=x.dtype, device=x.device)
        total = AllReduceSum.apply(torch.cat([x.sum(0), (x * x).sum(0), count]))
        n = total[-1]
        mean = total[:self.num_features] / n
        var = total[self.num_features:-1] / n - mean * mean  # biased, as normalisation uses
        with torch.no_grad():
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)  # unbiased, as torch keeps
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


model = make_model(args.seed, norm=SyncBatchNorm1d).to(device)
# The running statistics are now the same on every rank, so DDP's broadcast of rank 0's
# buffers at each forward would change nothing: leaving it off saves a collective.
NO_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
           else "broadcast_buffers")   # the flag's name before torch 2.13
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
