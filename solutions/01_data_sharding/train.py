"""Train a small classifier on a toy dataset with DistributedDataParallel.

Run it on 2 ranks (3 or 4 work too):

    torchrun --nproc-per-node 2 train.py --epochs 3
    labutils launch -n 2 train.py -- --epochs 3

Every dataset item carries its index, and at the end of each epoch each rank
reports which items it trained on: report(epoch=..., indices=[...]).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labutils.dist import init, print0, report

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--items", type=int, default=24, help="dataset size")
parser.add_argument("--batch-size", type=int, default=4, help="per rank")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

rank, world_size, device = init()

# The same toy dataset on every rank; item i is (features, label, i).
g = torch.Generator().manual_seed(1234)
features = torch.randn(args.items, 8, generator=g)
labels = (features.sum(dim=1) > 0).long()
dataset = TensorDataset(features, labels, torch.arange(args.items))

# The seed must be the same on every rank: the sampler shuffles the whole dataset
# with it and each rank takes its own slice of that one permutation.
sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

torch.manual_seed(args.seed)  # identical initial weights (DDP broadcasts rank 0's anyway)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
    seen, total_loss = [], 0.0
    for x, y, index in loader:
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += index.tolist()
        total_loss += loss.item()
    report(epoch=epoch, indices=seen, loss=total_loss / len(loader))
    print0(f"epoch {epoch}: mean loss {total_loss / len(loader):.4f}")
