"""Train a two-headed model with DistributedDataParallel: a classifier and an auxiliary head.

The auxiliary head predicts the sum of the features; its loss is added with
--aux-weight (0 by default, which trains the classifier alone). Run on 2 ranks:

    torchrun --nproc-per-node 2 train.py
    labutils launch -n 2 train.py -- --aux-weight 0

Each rank reports its loss every step: report(step=..., loss=...).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labutils.dist import init, print0, report

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--items", type=int, default=48, help="dataset size (one pass)")
parser.add_argument("--batch-size", type=int, default=4, help="per rank")
parser.add_argument("--aux-weight", type=float, default=0.0)
args = parser.parse_args()

rank, world_size, device = init()


class TwoHeadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.head = nn.Linear(32, 2)       # the class
        self.aux_head = nn.Linear(32, 1)   # the sum of the features, an auxiliary task

    def forward(self, x: torch.Tensor, with_aux: bool = False):
        h = self.body(x)
        if with_aux:
            return self.head(h), self.aux_head(h)
        return self.head(h)


g = torch.Generator().manual_seed(1234)
features = torch.randn(args.items, 8, generator=g)
labels = (features[:, :4].sum(dim=1) > features[:, 4:].sum(dim=1)).long()
dataset = TensorDataset(features, labels)
# No shuffling: batch k of rank r holds items r, r + W, r + 2W, ...; together the ranks'
# k-th batches are the items k*B .. (k+1)*B - 1 with B = W * batch size.
sampler = DistributedSampler(dataset, shuffle=False)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

torch.manual_seed(0)
model = DDP(TwoHeadNet().to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
use_aux = args.aux_weight > 0

for step, (x, y) in enumerate(loader):
    x, y = x.to(device), y.to(device)
    if use_aux:
        logits, aux = model(x, with_aux=True)
        loss = F.cross_entropy(logits, y) + args.aux_weight * F.mse_loss(aux, x.sum(1, keepdim=True))
    else:
        loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    report(step=step, loss=loss.item())
    print0(f"step {step}: loss {loss.item():.4f}")
