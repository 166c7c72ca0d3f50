"""Distributed evaluation: a padded sampler counts some items twice; a correct one does not.

Run it on 4 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 4 04_sampler_pitfalls/evaluate.py

or from the notebook: launch("04_sampler_pitfalls/evaluate.py", nproc=4).

A fixed classifier (the same weights on every rank) is evaluated on 10 items:

- single process (each rank can do it alone): the reference accuracy;
- "padded": DistributedSampler(shuffle=False), then all_reduce the counts of correct
  predictions and of predictions. 10 items on 4 ranks: every rank gets 3, items 0 and
  1 twice, 12 predictions;
- "exact": every rank takes items rank, rank + 4, ... (no padding, shards of 3, 3, 2, 2)
  and the counts are all-reduced: 10 predictions, the single-process accuracy.
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from labutils.dist import init, report

parser = argparse.ArgumentParser()
parser.add_argument("--items", type=int, default=10)
args = parser.parse_args()

rank, world_size, device = init()

data = torch.Generator().manual_seed(1)
features = torch.randn(args.items, 8, generator=data)
labels = torch.randint(0, 2, (args.items,), generator=data)
dataset = TensorDataset(features, labels)
torch.manual_seed(0)
model = torch.nn.Linear(8, 2).to(device)  # the same weights on every rank: no training needed


@torch.no_grad()
def count(loader) -> tuple[int, int, list[int]]:
    """(correct predictions, predictions, indices seen) over a loader of (x, y, index)."""
    correct = total = 0
    seen = []
    for x, y, index in loader:
        correct += (model(x.to(device)).argmax(dim=1) == y.to(device)).sum().item()
        total += len(y)
        seen += index.tolist()
    return correct, total, seen


class Indexed(torch.utils.data.Dataset):
    """The dataset, with each item's index appended, so we can see who evaluated what."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        return (*self.base[i], i)


indexed = Indexed(dataset)
if rank == 0:
    correct, total, _ = count(DataLoader(indexed, batch_size=4))
    report(way="single process", correct=correct, predictions=total, accuracy=correct / total)


def evaluate(way: str, loader) -> None:
    correct, total, seen = count(loader)
    sums = torch.tensor([correct, total], device=device)
    dist.all_reduce(sums)  # every rank's counts added up
    report(way=way, shard=seen, correct=int(sums[0]), predictions=int(sums[1]),
           accuracy=int(sums[0]) / int(sums[1]))  # counts are exact integers: so is the ratio


evaluate("padded: DistributedSampler",
         DataLoader(indexed, batch_size=4, sampler=DistributedSampler(indexed, shuffle=False)))
evaluate("exact: strided shards, no padding",
         DataLoader(Subset(indexed, range(rank, len(indexed), world_size)), batch_size=4))
dist.destroy_process_group()
