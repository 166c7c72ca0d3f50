"""Evaluate a classifier on a held-out set, each rank scoring its share of the items.

Run it on 3 ranks (2 and 4 work too):

    torchrun --nproc-per-node 3 evaluate.py
    labutils launch -n 3 evaluate.py

Rank 0 reports the accuracy over the whole set and the number of predictions
that went into it: report(accuracy=..., predictions=...).
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from evalset import held_out_set, trained_model
from labutils.dist import init, print0, report

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--items", type=int, default=11, help="size of the held-out set")
parser.add_argument("--batch-size", type=int, default=4)
args = parser.parse_args()

rank, world_size, device = init()
model = trained_model().to(device)
dataset = held_out_set(args.items)
# Every rank takes every world_size-th item, and nothing more. DistributedSampler would
# pad the shares to equal length by repeating items from the start (11 items on 3
# ranks become 12), and the repeated items would count twice in the metric.
loader = DataLoader(Subset(dataset, range(rank, len(dataset), world_size)),
                    batch_size=args.batch_size)

correct = torch.zeros((), dtype=torch.long, device=device)
counted = torch.zeros((), dtype=torch.long, device=device)
with torch.no_grad():
    for x, y in loader:
        predictions = model(x.to(device)).argmax(dim=1)
        correct += (predictions == y.to(device)).sum()
        counted += len(y)

dist.all_reduce(correct)  # sums over the ranks
dist.all_reduce(counted)
accuracy = correct.item() / counted.item()
if rank == 0:
    report(accuracy=accuracy, predictions=counted.item())
print0(f"accuracy {accuracy:.4f} ({correct.item()} of {counted.item()} predictions)")
dist.destroy_process_group()
