"""A first collective: every rank adds its number into one sum that every rank receives.

Run it on 4 ranks, from this folder:

    torchrun --standalone --nproc-per-node 4 first_allreduce.py

or from a notebook cell:

    from labutils import launch
    result = launch("00_first_distributed_run/first_allreduce.py", nproc=4)
    result.records        # before / after values of every rank

all_reduce is a collective: every rank must call it, and each call returns only
once all ranks have made theirs. It replaces the tensor, in place, on every rank
with the reduction (here the sum) over all ranks. Dividing by the world size
gives the mean: exactly how data-parallel training averages gradients.
"""

import torch
import torch.distributed as dist

from labutils.dist import init, report

rank, world_size, device = init()  # init_process_group(): gloo on CPU, nccl with a GPU per rank

value = torch.tensor([rank + 1.0], device=device)  # rank 0 holds 1, rank 1 holds 2, ...
before = value.item()

dist.all_reduce(value, op=dist.ReduceOp.SUM)  # blocks until every rank has called it
after = value.item()
mean = after / world_size

print(f"before {before:g}  after all_reduce(SUM) {after:g}  mean {mean:g}")
report(before=before, after=after, mean=mean)
dist.destroy_process_group()
