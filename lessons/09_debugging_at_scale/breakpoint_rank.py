"""Stop rank 1 in the debugger in the middle of a training loop; the other ranks wait.

    torchrun --standalone --nproc-per-node 2 breakpoint_rank.py

torch.distributed.breakpoint(rank=1) opens pdb on rank 1 only, reading commands from
/dev/stdin, while every other rank waits in a barrier (it sets every process group's
timeout to an hour first, so the wait does not time out while you debug). From a
terminal, torchrun's ranks share that terminal, and you type into it. From a notebook
a rank has no terminal; under labutils.launch() the rank's pane gets a pdb prompt
instead, and `labutils debug RUN_FOLDER --rank 1` attaches from any terminal.
Try: `up` (to this script's frame), `p step, loss.item()`, `p x.shape`, then `c`.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init

rank, world_size, device = init()
print(f"rank {rank}: /dev/stdin is a terminal: {os.isatty(0)}")  # where torch's pdb reads from
torch.manual_seed(0)  # the same initial weights on every rank
model = DDP(torch.nn.Linear(8, 4).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches

for step in range(3):
    x = torch.randn(16, 8, generator=data).to(device)
    y = torch.randint(0, 4, (16,), generator=data).to(device)
    loss = F.cross_entropy(model(x), y)
    if step == 1:
        dist.breakpoint(rank=1)  # rank 1 stops here; the others wait for it
    optimizer.zero_grad()
    loss.backward()  # DDP averages the gradients over the ranks
    optimizer.step()
    print(f"step {step}: loss {loss.item():.4f}")

dist.destroy_process_group()
