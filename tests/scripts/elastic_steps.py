"""Counts steps with one all_reduce each and resumes from rank 0's checkpoint file.

Each step's checkpoint is written to a temporary file, reported with
report(step=..., phase="save") while only half written, then renamed into place:
a fault with "phase": "save" kills rank 0 in the middle of a write. Usage:
    elastic_steps.py CKPT STEPS
"""
import os
import sys

import torch
import torch.distributed as dist

from labutils.dist import init, report

rank, world_size, device = init()
ckpt, steps = sys.argv[1], int(sys.argv[2])
start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
report(resumed_at=start, restart=restart)
for step in range(start, steps):
    total = torch.ones(1)
    dist.all_reduce(total)
    if rank == 0:
        with open(ckpt + ".tmp", "w") as f:
            f.write(str(step + 1)[:1])
            f.flush()
            report(step=step, phase="save")
            f.write(str(step + 1)[1:])
        os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
    report(step=step, world_size=world_size, total=total.item(), restart=restart,
           group_rank=int(os.environ["GROUP_RANK"]), agent=os.environ.get("LABUTILS_AGENT_INDEX"))
print(f"rank {rank} of {world_size} finished at step {steps}")
dist.destroy_process_group()
