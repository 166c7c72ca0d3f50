"""Every rank joins, all-reduces its rank, prints and reports. torchrun --nproc-per-node 4 hello.py"""
import os

import torch
import torch.distributed as dist

from labutils.dist import init, print0, report

rank, world_size, device = init()
t = torch.tensor([float(rank)], device=device)
dist.all_reduce(t)
print(f"hello from rank {rank} of {world_size}, sum={t.item():g}")
print0("only rank 0 says this")
report(step=0, sum=t.item(), restart=int(os.environ["TORCHELASTIC_RESTART_COUNT"]))
dist.destroy_process_group()
