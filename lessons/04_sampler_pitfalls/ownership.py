"""Which rank sees which item: DistributedSampler set up right and set up wrong.

Run it on 3 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 3 04_sampler_pitfalls/ownership.py

or from the notebook: launch("04_sampler_pitfalls/ownership.py", nproc=3).

The dataset's items are their own indices, so a batch says which items a rank got.
For each set-up in SETUPS every rank iterates its DataLoader for --epochs epochs and
reports, per epoch, the items it saw in order (report(setup=..., epoch=..., items=...)).
Then the two sampler options that change the shards' length, on 10 items: padding
(the default) and drop_last=True, and the error DataLoader raises for shuffle=True
together with a sampler.
"""

import argparse

import torch
from torch.utils.data import DataLoader, DistributedSampler

from labutils.dist import init, report

parser = argparse.ArgumentParser()
parser.add_argument("--items", type=int, default=12, help="dataset size for the shuffled set-ups")
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

rank, world_size, device = init()
torch.manual_seed(0)  # every rank seeds alike, as scripts do to build identical models


def loader(setup: str, dataset) -> tuple[DataLoader, DistributedSampler | None]:
    """The DataLoader of one set-up, and its sampler (None: no sampler)."""
    if setup == "no sampler":
        return DataLoader(dataset, batch_size=2, shuffle=True), None
    seed = rank if setup == "seed=rank" else 0
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)  # rank, world size from dist
    return DataLoader(dataset, batch_size=2, sampler=sampler), sampler


SETUPS = ["correct", "no sampler", "no set_epoch", "seed=rank"]
dataset = list(range(args.items))  # item i is the number i

for setup in SETUPS:
    data, sampler = loader(setup, dataset)
    for epoch in range(args.epochs):
        if sampler is not None and setup != "no set_epoch":
            sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
        items = [int(i) for batch in data for i in batch]
        report(setup=setup, epoch=epoch, items=items)

# ---------------------------------------------------------------- shard lengths, 10 items
ten = list(range(10))
for drop_last in (False, True):
    sampler = DistributedSampler(ten, shuffle=False, drop_last=drop_last)
    report(setup=f"10 items, drop_last={drop_last}", epoch=0, items=list(sampler),
           length=len(sampler))

# ---------------------------------------------------------------- shuffle and a sampler
try:
    DataLoader(ten, batch_size=2, shuffle=True, sampler=DistributedSampler(ten))
    outcome = "accepted"
except ValueError as exc:
    outcome = f"ValueError: {exc}"
if rank == 0:
    report(setup="shuffle=True and a sampler", outcome=outcome)
