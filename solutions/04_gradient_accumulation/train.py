"""Train with gradient accumulation: --accum micro-batches per optimizer step.

The effective batch of one optimizer step is world_size x accum x batch_size
items. Run it on 2 ranks:

    torchrun --nproc-per-node 2 train.py --accum 4 --batch-size 3
    labutils launch -n 2 train.py -- --accum 4 --batch-size 3

Each rank reports the loss of every optimizer step: report(step=..., loss=...).
"""

import argparse
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labutils.dist import init, print0, report

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--items", type=int, default=96, help="dataset size (one pass)")
parser.add_argument("--batch-size", type=int, default=3, help="micro-batch per rank")
parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
args = parser.parse_args()

rank, world_size, device = init()

g = torch.Generator().manual_seed(1234)
features = torch.randn(args.items, 6, generator=g)
targets = features @ torch.linspace(-1, 1, 6).unsqueeze(1) + 0.1 * torch.randn(args.items, 1, generator=g)
# No shuffling: together, the ranks' micro-batches of one optimizer step are the
# items step*B .. (step+1)*B - 1, with B = world_size * accum * batch_size.
sampler = DistributedSampler(TensorDataset(features, targets), shuffle=False)
loader = DataLoader(TensorDataset(features, targets), batch_size=args.batch_size,
                    sampler=sampler, drop_last=True)

torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1)).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

micro_batches = iter(loader)
for step in range(len(loader) // args.accum):
    step_loss = 0.0
    for micro in range(args.accum):
        x, y = next(micro_batches)
        # Only the last micro-batch synchronises. no_sync must cover the forward as
        # well as the backward: DDP decides in forward whether backward all-reduces.
        sync = micro == args.accum - 1
        with nullcontext() if sync else model.no_sync():
            # the mean over the micro-batches, not their sum: divide by accum
            loss = F.mse_loss(model(x.to(device)), y.to(device)) / args.accum
            loss.backward()  # gradients add up in .grad until the optimizer step
        step_loss += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    report(step=step, loss=step_loss)
    print0(f"step {step}: loss {step_loss:.4f}")
