"""Every collective primitive of torch.distributed, once, on small tensors.

Run it on 4 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 4 02_collectives/primitives.py

or from the notebook, where each rank's before/after values arrive in result.records:

    result = launch("02_collectives/primitives.py", nproc=4)

Rank r starts from tensors built from r (10*r + position), so every value in the
tables can be traced back to the rank it came from. Each call is reported as
report(op=..., before=..., after=...). Works on gloo (CPU) and on NCCL (GPUs):
tensors live on the device init() picked.
"""

import time

import torch
import torch.distributed as dist

from labutils.dist import init, report

rank, world_size, device = init()
n = world_size


def mine(length: int = 2) -> torch.Tensor:
    """This rank's data: [10r, 10r+1, ...], so a value names the rank it came from."""
    return torch.arange(length, dtype=torch.float32, device=device) + 10 * rank


def show(t):
    """Tensors and lists of tensors as plain lists for the notebook's tables."""
    if isinstance(t, (list, tuple)):
        return [show(x) for x in t]
    return t.tolist() if isinstance(t, torch.Tensor) else t  # None, or a note


def record(op: str, before, after) -> None:
    report(op=op, before=show(before), after=show(after))


# broadcast: rank 0's tensor overwrites everyone's.
t = mine(); before = t.clone()
dist.broadcast(t, src=0)
record("broadcast(src=0)", before, t)

# reduce: the sum arrives on rank 0 only; other ranks' buffers are scratch space
# afterwards (gloo may leave partial sums there), so only rank 0's result counts.
t = mine(); before = t.clone()
dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
record("reduce(dst=0, SUM)", before, t if rank == 0 else None)

# all_reduce with several operations: every rank ends with the same result.
for name in ("SUM", "MAX", "MIN", "PRODUCT", "AVG"):
    t = mine() + 1; before = t.clone()
    dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
    record(f"all_reduce({name})", before, t)

# all_gather: everyone gets every rank's tensor, in rank order.
t = mine(); out = [torch.empty_like(t) for _ in range(n)]
dist.all_gather(out, t)
record("all_gather", t, out)

# gather: the same, but only the destination receives (others pass no list).
t = mine(); out = [torch.empty_like(t) for _ in range(n)] if rank == 0 else None
dist.gather(t, gather_list=out, dst=0)
record("gather(dst=0)", t, out)

# scatter: rank 0 hands piece i of its list to rank i.
pieces = [torch.full((2,), 100.0 + i, device=device) for i in range(n)] if rank == 0 else None
t = torch.zeros(2, device=device)
dist.scatter(t, scatter_list=pieces, src=0)
record("scatter(src=0)", pieces if rank == 0 else None, t)

# reduce_scatter: sum piece i over all ranks, give the result to rank i.
inputs = [mine() + 100 * i for i in range(n)]
t = torch.zeros(2, device=device)
dist.reduce_scatter(t, inputs)
record("reduce_scatter", inputs, t)
# the same with one flat tensor in and out (what older gloo releases support); torch
# 2.13 renamed reduce_scatter_tensor to reduce_scatter_single
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
flat = mine(2 * n); t = torch.zeros(2, device=device)
reduce_scatter_single(t, flat)
record("reduce_scatter_single", flat, t)

# all_to_all: rank r sends piece i to rank i and receives piece r from everyone:
# a transpose of the rank x piece matrix.
inputs = [torch.tensor([10.0 * rank + i], device=device) for i in range(n)]
outputs = [torch.empty(1, device=device) for _ in range(n)]
try:
    dist.all_to_all(outputs, inputs)
    record("all_to_all", inputs, outputs)
except RuntimeError as exc:  # gloo has the list form from torch 2.12; each rank checks alone
    if "does not support alltoall" not in str(exc):
        raise
    record("all_to_all", inputs, f"not in gloo of torch {torch.__version__.split('+')[0]} "
                                 "(from 2.12); all_to_all_single below does the same")
flat = torch.tensor([10.0 * rank + i for i in range(n)], device=device); out = torch.empty_like(flat)
dist.all_to_all_single(out, flat)
record("all_to_all_single", flat, out)

# send / recv: blocking point-to-point between rank 0 and rank 1.
t = mine()
before = t.clone()
if rank == 0:
    dist.send(t, dst=1)
elif rank == 1:
    dist.recv(t, src=0)
record("send 0 -> recv 1", before, t)

# isend / irecv: everyone shifts its tensor one step to the right around the ring,
# at once. Both calls return immediately; wait() blocks until the transfer is done.
# (With NCCL on 2 ranks, right and left are the same peer: group the two calls with
# dist.batch_isend_irecv there, as ring.py does.)
t = mine(); got = torch.empty_like(t)
requests = [dist.isend(t, dst=(rank + 1) % n), dist.irecv(got, src=(rank - 1) % n)]
for request in requests:
    request.wait()
record("isend right / irecv left", t, got)

# async_op=True: the collective runs in the background while this rank computes.
t = mine(); before = t.clone()
work = dist.all_reduce(t, async_op=True)
busy = sum(i * i for i in range(20_000))  # work that overlaps the all_reduce
work.wait()                               # after wait() the result is in t
record("all_reduce(async_op=True) + wait()", before, t)

# barrier: rank r arrives r*0.2 s late; everyone leaves when the last one arrives.
# All times are read on one clock: the wall clock of this host, from rank 0's start.
# (Each rank's own start would not do: the first barrier releases the ranks a few
# milliseconds apart, enough to make a rank seem to leave before the last one arrived.)
dist.barrier()
start = torch.tensor([time.time()], dtype=torch.float64, device=device)  # NCCL sends GPU tensors only
dist.broadcast(start, src=0)
start = start.item()
time.sleep(0.2 * rank)
arrived = time.time() - start
dist.barrier()
left = time.time() - start
report(op="barrier", arrived_s=round(arrived, 3), left_s=round(left, 3))

dist.destroy_process_group()
