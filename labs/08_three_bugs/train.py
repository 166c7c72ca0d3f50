"""Train a small regression model with DistributedDataParallel, then save it.

Run it on 2 ranks (3 or 4 work too):

    torchrun --nproc-per-node 2 train.py --epochs 3
    labutils launch -n 2 train.py -- --epochs 3

Every dataset item carries its index. At each step each rank reports the items of
its batch and its loss: report(epoch=..., step=..., indices=[...], loss=...). At the
end rank 0 saves the trained weights to --ckpt, for programs without DDP (evaluation,
serving) to load into the plain model.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from labutils.dist import init, print0, report
from regression import make_dataset, make_model

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--items", type=int, default=24, help="dataset size")
parser.add_argument("--batch-size", type=int, default=4, help="per rank")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--ckpt", default="model.pt", help="where rank 0 saves the trained weights")
args = parser.parse_args()

rank, world_size, device = init()

dataset = make_dataset(args.items)  # the same items on every rank: (features, target, index)
loader = DataLoader(dataset, batch_size=args.batch_size)

model = DDP(make_model(args.seed).to(device))  # same seed, same initial weights everywhere
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

step = 0
for epoch in range(args.epochs):
    total_loss = 0.0
    for x, y, index in loader:
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        report(epoch=epoch, step=step, indices=index.tolist(), loss=loss.item())
        total_loss += loss.item()
        step += 1
    print0(f"epoch {epoch}: mean loss {total_loss / len(loader):.4f}")

if rank == 0:  # one copy of the weights is enough: every rank holds the same
    os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
    torch.save(model.state_dict(), args.ckpt)
dist.destroy_process_group()
