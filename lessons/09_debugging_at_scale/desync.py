"""Only rank 0 evaluates, and the evaluation averages over all ranks: a collective
that one rank calls and the others never do.

    torchrun --standalone --nproc-per-node 2 desync.py
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 desync.py
    TORCH_FR_BUFFER_SIZE=100 TORCH_FR_DUMP_TEMP_FILE=/tmp/fr/rank_ \
        torchrun --standalone --nproc-per-node 2 desync.py

A small training loop averages its gradients with one all_reduce per parameter. After
the last step, rank 0 alone runs evaluate(), written for every rank to call: it
averages the validation loss with all_reduce. Meanwhile the other ranks wait in the
barrier before the checkpoint. Neither call can complete. The process group's timeout
(--timeout-s, 3 s here; the default is 30 minutes for gloo and 10 for NCCL) ends the
wait on every rank.

torch's flight recorder keeps the last collectives of each rank (2000 by default in
torch 2.13; TORCH_FR_BUFFER_SIZE says how many, 0 turns it off). NCCL can write
them to <TORCH_FR_DUMP_TEMP_FILE><rank> by itself when a collective times out
(TORCH_NCCL_DUMP_ON_TIMEOUT); gloo does not, so when TORCH_FR_DUMP_TEMP_FILE is set
the except block at the end writes the same file.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labutils.dist import init, report

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--timeout-s", type=float, default=3.0, help="the process group's timeout")
parser.add_argument("--backend", default="gloo", help="nccl (a GPU per rank) shows NCCL's watchdog instead")
args = parser.parse_args()

rank, world_size, device = init(args.backend, timeout_s=args.timeout_s)  # gloo: what this lesson measures
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Linear(8, 4).to(device)
data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches


def batch():
    x, y = torch.randn(16, 8, generator=data), torch.randint(0, 4, (16,), generator=data)
    return x.to(device), y.to(device)


def evaluate() -> float:
    """The validation loss averaged over the ranks: every rank must call it."""
    with torch.no_grad():
        x, y = batch()
        loss = F.cross_entropy(model(x), y)
    dist.all_reduce(loss)
    return loss.item() / world_size


def train() -> None:
    for step in range(args.steps):
        x, y = batch()
        loss = F.cross_entropy(model(x), y)
        model.zero_grad()
        loss.backward()
        for p in model.parameters():  # average the gradients over all ranks
            dist.all_reduce(p.grad)
            p.grad /= world_size
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    if rank == 0:  # the bug: evaluate() has a collective, and only rank 0 calls it
        print(f"validation loss {evaluate():.4f}")
    dist.barrier()  # everyone waits here before rank 0 saves a checkpoint


def dump_flight_recorder() -> None:
    """This rank's flight recorder, pickled, at <TORCH_FR_DUMP_TEMP_FILE><rank>, unless
    torch wrote it there already (NCCL can, at a timeout)."""
    prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
    path = f"{prefix}{rank}"
    if os.path.exists(path):
        report(fr_dump_by="torch")
    else:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(f"{path}.part", "wb") as f:  # complete, or not there: renamed when written
            f.write(torch._C._distributed_c10d._dump_fr_trace())  # what NCCL's dump holds
        os.replace(f"{path}.part", path)
        report(fr_dump_by="this script")
    # torchrun stops every rank as soon as one fails: wait a little for the others' dumps
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(os.path.exists(f"{prefix}{r}") for r in range(world_size)):
        time.sleep(0.05)


try:
    train()
except RuntimeError:  # a collective timed out: keep the record, then fail as before
    if os.environ.get("TORCH_FR_DUMP_TEMP_FILE"):
        dump_flight_recorder()
    raise
dist.destroy_process_group()
