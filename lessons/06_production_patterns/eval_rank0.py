"""Evaluation on rank 0 only, through the DDP wrapper or through .module.

    torchrun --nproc-per-node 2 eval_rank0.py ddp|module

The model has BatchNorm, so it has buffers; DDP (forward_sync_buffers, on by default)
broadcasts rank 0's buffers at the start of every forward. A forward through `ddp`
on rank 0 alone is a collective that rank 1 never joins: rank 0 waits in the buffer
broadcast, rank 1 waits in the next collective it reaches. `ddp.module` is the plain
model, with no collectives in its forward.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init, print0, report

rank, world_size, device = init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)).to(device)
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
x, y = torch.randn(16, 8, device=device), torch.randn(16, 2, device=device)
for step in range(3):
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()

if rank == 0:
    evaluated = ddp if sys.argv[1] == "ddp" else ddp.module
    evaluated.eval()
    with torch.no_grad():
        val_loss = nn.functional.mse_loss(evaluated(x), y).item()
    evaluated.train()
    print0(f"rank 0 evaluated through {sys.argv[1]}: loss {val_loss:.4f}")
    report(val_loss=round(val_loss, 4))
total = torch.ones(1, device=device)
dist.all_reduce(total)  # the next collective of the training loop
print(f"rank {rank}: past the next all_reduce")
dist.destroy_process_group()
