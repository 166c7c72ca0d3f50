"""A collective that only rank 0 calls: the calls pair up wrongly, silently, then hang.

    torchrun --standalone --nproc-per-node 2 02_collectives/mismatch.py
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 02_collectives/mismatch.py

Rank 0 adds a "sanity check" all_reduce the other ranks never call. Collectives
match by order, not by name: rank 0's check pairs with the others' gradient
all_reduce, both return wrong numbers without an error, and then rank 0's
gradient all_reduce waits for a partner that never comes (30 minutes with gloo's
default timeout, 10 with NCCL's) while the others have moved on to the barrier.
"""

import torch
import torch.distributed as dist

from labutils.dist import init, report

rank, world_size, device = init()
grad = torch.full((4,), float(rank + 1), device=device)  # rank r's gradient: r + 1
expected = sum(range(1, world_size + 1))                  # what the sum should be

if rank == 0:
    check = torch.zeros(4, device=device)
    dist.all_reduce(check)  # only rank 0 calls this one
    report(step="check", value=check[0].item())
dist.all_reduce(grad)       # every rank calls this one
report(step="grad", value=grad[0].item(), expected=float(expected))
dist.barrier()              # end of the step
report(step="barrier passed")
dist.destroy_process_group()
