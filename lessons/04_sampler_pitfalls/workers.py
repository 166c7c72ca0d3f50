"""DataLoader workers: where their random numbers come from, on every rank.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 04_sampler_pitfalls/workers.py

or from the notebook: launch("04_sampler_pitfalls/workers.py", nproc=2).

Each item gets a random "augmentation" (a torch and a numpy random number) drawn in
the DataLoader worker that loads it (2 workers per rank). Every rank seeds torch with
the same seed, as scripts do to build identical models. For each loader in LOADERS,
every rank reports, per epoch, the items it loaded, the worker that loaded each, and
the numbers drawn, and which worker processes loaded them (their pids and seeds) and
how long the epoch's first batch took to come; then, per loader, how long the first batch
took in each of five epochs. The third loader keeps its workers
between epochs (persistent_workers=True). Then: what pin_memory=True says on a machine
without GPU.
"""

import os
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

from labutils.dist import init, report

rank, world_size, device = init()
torch.manual_seed(0)  # the same seed on every rank (identical models)


class Augmented(Dataset):
    """Item i, with the worker that loaded it and two random numbers drawn there, and
    that worker's process id and seed (as text: a seed is up to 64 bits)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        worker = get_worker_info()
        return (i, worker.id if worker else -1, torch.rand(1).item(), float(np.random.rand()),
                str(os.getpid()), str(worker.seed if worker else -1))


def make_loader(kind: str) -> DataLoader:
    dataset = Augmented()
    sampler = DistributedSampler(dataset, shuffle=False)
    if kind == "same seed on every rank":
        return DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2)
    # The fix: the workers' seeds derive from this generator; give each rank its own.
    generator = torch.Generator().manual_seed(1000 + rank)
    return DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2, generator=generator,
                      persistent_workers=kind == "persistent workers")


LOADERS = ["same seed on every rank", "generator seeded with the rank", "persistent workers"]
# Epochs 0 and 1 are reported item by item; epochs 2-4 are only timed, so that the time to
# the first batch after epoch 0 is a median of four, which one slow moment cannot change.
REPORTED_EPOCHS, TIMED_EPOCHS = 2, 5
for kind in LOADERS:
    loader = make_loader(kind)
    first_batches_ms = []
    for epoch in range(TIMED_EPOCHS):
        started = time.perf_counter()
        batches = iter(loader)   # starts the workers, unless they persist
        first = next(batches)
        first_batch_ms = (time.perf_counter() - started) * 1000
        first_batches_ms.append(round(first_batch_ms, 2))
        if epoch >= REPORTED_EPOCHS:
            for _ in batches:   # the epoch goes to its end, as training's would
                pass
            continue
        rows, workers = [], {}
        for items, ids, t_draws, n_draws, pids, seeds in [first, *batches]:
            for i, w, t, n, pid, seed in zip(items, ids, t_draws.tolist(), n_draws.tolist(), pids, seeds):
                rows.append((int(i), int(w), round(t, 4), round(n, 4)))
                workers[int(w)] = {"pid": int(pid), "seed": seed}
        report(loader=kind, epoch=epoch, rows=rows, workers=workers,
               first_batch_ms=round(first_batch_ms, 2))
    report(timed_loader=kind, first_batches_ms=first_batches_ms)
    # Persistent workers live as long as their loader: end them here, or they are still
    # running when the script ends and are killed without cleaning up after themselves.
    del batches, loader

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    next(iter(DataLoader(Augmented(), batch_size=2, pin_memory=True)))
if rank == 0:
    report(pin_memory_warnings=[str(w.message) for w in caught])
dist.destroy_process_group()
