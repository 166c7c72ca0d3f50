"""Train with a checkpoint after every step, so that a killed run resumes where it stopped.

Run it on 2 ranks with one restart allowed, and kill rank 0 while it writes the
checkpoint of step 5:

    torchrun --nproc-per-node 2 --max-restarts 1 train.py --steps 10
    launch("train.py", nproc=2, max_restarts=1,
           fault={"rank": 0, "step": 5, "phase": "saving"})

The checkpoint (--ckpt) holds the model, the optimizer and the last step done; a
restarted run loads it and carries on with the next step. A real checkpoint is
gigabytes written to network storage, so writing it takes a while: here it is
written in chunks (--chunk-bytes), and each chunk written is reported
(report(step=..., phase="saving", written=...)). That is where a fault with
"phase": "saving" kills a rank, halfway through the file. Each rank also reports
every step (report(step=..., loss=...)) and, at the end, a fingerprint of its weights.
"""

import argparse
import hashlib
import io
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init, report

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=8, help="per rank")
parser.add_argument("--ckpt", default="checkpoint.pt", help="checkpoint file")
parser.add_argument("--chunk-bytes", type=int, default=2048, help="write size of the checkpoint")
args = parser.parse_args()

rank, world_size, device = init()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for a step: it depends on the step and the rank, nothing else."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(args.batch_size, 4, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).sin().to(device)


def write_checkpoint(state: dict, path: str, step: int) -> None:
    """Write state to path, one chunk at a time, reporting after each chunk.

    Keep the chunks and the report() after each: a fault with "phase": "saving" kills
    the writing rank inside that report, halfway through the file, and so do the
    checks (a plain torch.save(state, path) is never killed, and fails them).

    The chunks go to a temporary file, which replaces path only once it is complete:
    os.replace is atomic, so path holds the previous checkpoint or the new one, whole,
    never part of one, whenever the writer is killed.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    partial = path + ".partial"
    with open(partial, "wb") as f:
        for start in range(0, len(data), args.chunk_bytes):
            f.write(data[start:start + args.chunk_bytes])
            f.flush()
            report(step=step, phase="saving", written=f.tell(), size=len(data))
        os.fsync(f.fileno())  # on disk before it takes the checkpoint's name
    os.replace(partial, path)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
start = 0
if os.path.exists(args.ckpt):
    # Each rank loads onto its own device: without map_location, tensors go back to the
    # device they were saved from (cuda:0, rank 0's GPU) on every rank.
    checkpoint = torch.load(args.ckpt, map_location=device)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    start = checkpoint["step"] + 1  # the checkpoint is written after its step is done
    print(f"rank {rank}: resuming at step {start}")
model = DDP(model)

for step in range(start, args.steps):
    x, y = batch(step)
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if rank == 0:  # the ranks hold identical state: one writer, no race on the file
        write_checkpoint({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                          "step": step}, args.ckpt, step)
    dist.barrier()  # no rank moves on before this step's checkpoint is on disk
    report(step=step, loss=loss.item())

fingerprint = hashlib.sha256()
for param in model.parameters():
    fingerprint.update(param.detach().cpu().numpy().tobytes())
report(weights_sha256=fingerprint.hexdigest())
dist.destroy_process_group()
