"""Gradient accumulation: a global batch larger than the ranks hold at once, checked.

    launch("12_where_memory_goes/accumulation.py", nproc=4)

Each rank takes ACCUM micro-steps of MICRO rows before the optimizer would step, so one
step sees MICRO x ACCUM x world_size rows: the global batch. The gradient that step
uses must be the gradient of the mean loss over all of those rows, which one process
computes here on the whole global batch at once (the reference). Ways compared:

- ddp: DDP with no_sync() on all but the last micro-step, each loss divided by ACCUM;
- ddp, every micro-step synced: the same gradient, ACCUM times the all-reduces;
- ddp, loss not divided by ACCUM: the gradient of the *sum* of the micro-steps' means;
- fsdp2: fully_shard, set_requires_gradient_sync(False) on all but the last micro-step.

Reported per way: whether the gradient equals the reference (assert_close), its size
against the reference's (norm ratio), and per micro-step the collectives that carried
gradients: DDP's all-reduces counted by a communication hook, FSDP2's reduce-scatters by
labutils.course.comm_count.CollectiveCounter.
"""

import contextlib
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # model.py sits next to this file
from model import batch, make_mlp

from labutils.course.comm_count import CollectiveCounter
from labutils.dist import init, report

MICRO, ACCUM = 8, 4

rank, world_size, device = init()
initial = make_mlp().to(device)


def micro_batch(r: int, m: int):
    x, y = batch(100 * r + m, rows=MICRO)
    return x.to(device), y.to(device)


# The reference: one process, the whole global batch, the mean loss over every row.
reference = copy.deepcopy(initial)
rows = [micro_batch(r, m) for r in range(world_size) for m in range(ACCUM)]
xs, ys = torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])
F.mse_loss(reference(xs), ys).backward()
ref_grads = [p.grad for p in reference.parameters()]


def compare(model) -> tuple[bool, float]:
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    try:
        for g, want in zip(grads, ref_grads):
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
        equal = True
    except AssertionError:
        equal = False
    norm = torch.cat([g.flatten() for g in grads]).norm() / torch.cat([g.flatten() for g in ref_grads]).norm()
    return equal, round(norm.item(), 4)


def ddp_way(*, sync_every_step: bool, divide: bool) -> dict:
    model = DDP(copy.deepcopy(initial))
    calls = []

    def counting(state, bucket):
        calls.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(model.process_group, counting)
    per_step = []
    for m in range(ACCUM):
        last = m == ACCUM - 1
        before = len(calls)
        with contextlib.nullcontext() if (last or sync_every_step) else model.no_sync():
            x, y = micro_batch(rank, m)
            loss = F.mse_loss(model(x), y)
            (loss / ACCUM if divide else loss).backward()
        per_step.append(len(calls) - before)
    equal, norm = compare(model)
    return {"equal": equal, "norm_ratio": norm, "collective": "all_reduce", "calls": per_step}


def fsdp2_way() -> dict:
    model = copy.deepcopy(initial)
    mesh = init_device_mesh(device.type, (world_size,))  # init()'s device, not the machine's GPU
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls = []
    for m in range(ACCUM):
        model.set_requires_gradient_sync(m == ACCUM - 1)
        x, y = micro_batch(rank, m)
        loss = F.mse_loss(model(x), y) / ACCUM
        with CollectiveCounter(mesh) as comm:  # backward's collectives: where gradients travel
            loss.backward()
        calls.append(sum(1 for c in comm.calls if c["op"] == "reduce_scatter"))
    equal, norm = compare(model)
    return {"equal": equal, "norm_ratio": norm, "collective": "reduce_scatter", "calls": calls}


report(part="accumulation", way="ddp, no_sync", **ddp_way(sync_every_step=False, divide=True))
report(part="accumulation", way="ddp, every micro-step synced", **ddp_way(sync_every_step=True, divide=True))
report(part="accumulation", way="ddp, loss not divided", **ddp_way(sync_every_step=False, divide=False))
report(part="accumulation", way="fsdp2, sync on the last", **fsdp2_way())
report(part="global_batch", micro=MICRO, accum=ACCUM, world_size=world_size, rows=len(xs))
