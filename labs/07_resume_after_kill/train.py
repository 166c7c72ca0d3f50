"""Train with checkpoints, so that a run whose worker is killed resumes where it stopped.

Run it on 2 ranks with one restart allowed, and kill rank 1 at step 5 to try it:

    torchrun --nproc-per-node 2 --max-restarts 1 train.py --steps 10
    launch("train.py", nproc=2, max_restarts=1, fault={"rank": 1, "step": 5})

Rank 0 saves a checkpoint after every step (--ckpt, written atomically); a
restarted run loads it and carries on. Each rank reports every step
(report(step=..., loss=...)) and, at the end, a fingerprint of its final
weights (report(weights_sha256=...)).
"""

import argparse
import hashlib
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
args = parser.parse_args()

rank, world_size, device = init()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for a step: it depends on the step and the rank, nothing else."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(args.batch_size, 4, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).sin().to(device)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
start = 0
if os.path.exists(args.ckpt):
    checkpoint = torch.load(args.ckpt, map_location=device)
    model.load_state_dict(checkpoint["model"])
    start = checkpoint["step"]
    print(f"rank {rank}: resuming at step {start}")
model = DDP(model)

for step in range(start, args.steps):
    x, y = batch(step)
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if rank == 0:
        # write to a temporary file, then rename: a crash mid-write never leaves a
        # broken checkpoint behind
        torch.save({"model": model.module.state_dict(), "step": step}, args.ckpt + ".tmp")
        os.replace(args.ckpt + ".tmp", args.ckpt)
    dist.barrier()  # no rank moves on before this step's checkpoint is on disk
    report(step=step, loss=loss.item())

fingerprint = hashlib.sha256()
for param in model.parameters():
    fingerprint.update(param.detach().cpu().numpy().tobytes())
report(weights_sha256=fingerprint.hexdigest())
dist.destroy_process_group()
