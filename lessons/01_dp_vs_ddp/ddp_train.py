"""DistributedDataParallel, one step at a time, then timed.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 01_dp_vs_ddp/ddp_train.py

or from the notebook: launch("01_dp_vs_ddp/ddp_train.py", nproc=2). Every value
the notebook shows arrives through report(). The parts:

1. construction: each rank builds the model from its own seed (deliberately
   different), then DDP(model) broadcasts rank 0's parameters to every rank;
2. backward: the gradient of this rank's own batch (computed under no_sync(), no
   communication) against DDP's gradient, which backward() averaged over the
   ranks with all-reduce;
3. steps: --steps optimizer steps on this rank's shard of each global batch; rank 0
   reports the gradients of the first step and the parameters after the last, so
   the notebook can compare them with one process training on the whole batch;
4. timing: --timing-steps steps of the larger TIMING model with --batch samples per
   rank, with and without gradient synchronisation.

The same file runs on GPUs: init() picks nccl and cuda:LOCAL_RANK when every rank
has a GPU, the model is moved to the device *before* it is wrapped, and
device_ids is passed only for a GPU module (DDP raises ValueError for device_ids
with a CPU module).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # model.py sits next to this file
from model import PROOF, TIMING, flat_grads, flat_params, make_batch, make_model, make_optimizer, shard  # noqa: E402

from labutils.dist import init, report  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--per-rank-batch", type=int, default=8, help="samples per rank in the proof")
parser.add_argument("--steps", type=int, default=3, help="optimizer steps in the proof")
parser.add_argument("--batch", type=int, default=128, help="samples per rank when timing")
parser.add_argument("--timing-steps", type=int, default=10, help="timed steps (0: no timing)")
args = parser.parse_args()

rank, world_size, device = init()
loss_fn = nn.functional.cross_entropy


def wrap(model: nn.Module) -> DDP:
    """model.to(device) first; device_ids only for a GPU module."""
    model = model.to(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def checksum(model: nn.Module) -> float:
    return round(flat_params(model).double().sum().item(), 6)


# ---------------------------------------------------------------- 1. construction
model = make_model(**PROOF, seed=rank)  # a different seed on every rank, on purpose
before = checksum(model)
ddp = wrap(model)                       # broadcasts rank 0's parameters and buffers
report(part="construction", checksum_before=before, checksum_after=checksum(ddp.module))
if device.type == "cpu" and rank == 0:  # device_ids is for GPU modules only
    try:
        DDP(make_model(**PROOF), device_ids=[0])
    except ValueError as exc:           # raised before any communication: safe to go on
        report(part="device_ids on a CPU module", error=f"ValueError: {exc}")

# ---------------------------------------------------------------- 2. backward
optimizer = make_optimizer(ddp)
global_batch = args.per_rank_batch * world_size
x, y = make_batch(0, global_batch, **PROOF)
x, y = shard(x, rank, world_size).to(device), shard(y, rank, world_size).to(device)

with ddp.no_sync():                     # backward without the all-reduce: this rank's own gradient
    loss_fn(ddp(x), y).backward()
local = flat_grads(ddp.module)
optimizer.zero_grad()

loss = loss_fn(ddp(x), y)
loss.backward()                         # DDP all-reduces the gradients during backward
averaged = flat_grads(ddp.module)

by_hand = local.clone().to(device)      # the same average, computed explicitly
dist.all_reduce(by_hand)
by_hand = by_hand.cpu() / world_size
report(part="backward", loss=loss.item(), local_grad_norm=local.norm().item(),
       ddp_grad_norm=averaged.norm().item(),
       ddp_minus_mean_of_local=(averaged - by_hand).abs().max().item())

# ---------------------------------------------------------------- 3. steps
for step in range(args.steps):
    if step > 0:
        x, y = make_batch(step, global_batch, **PROOF)
        x, y = shard(x, rank, world_size).to(device), shard(y, rank, world_size).to(device)
        optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()
    if step == 0 and rank == 0:
        report(part="first gradients", grads=flat_grads(ddp.module))
    optimizer.step()                    # same gradients + same state -> same update everywhere

params = flat_params(ddp.module)
reference = params.clone().to(device)
dist.broadcast(reference, src=0)        # rank 0's parameters, on every rank
report(part="after steps", steps=args.steps, checksum=checksum(ddp.module),
       max_diff_to_rank0=(params - reference.cpu()).abs().max().item())
if rank == 0:
    report(part="final parameters", params=params)

# ---------------------------------------------------------------- 4. timing
if args.timing_steps > 0:
    big = wrap(make_model(**TIMING))
    big_opt = make_optimizer(big)
    batches = [make_batch(s, args.batch * world_size, **TIMING) for s in range(args.timing_steps + 2)]
    batches = [(shard(x, rank, world_size).to(device), shard(y, rank, world_size).to(device))
               for x, y in batches]

    def train_step(x, y) -> None:
        big_opt.zero_grad()
        loss_fn(big(x), y).backward()
        big_opt.step()

    def timed(steps_fn) -> float:
        """Seconds per step, as long as the slowest rank took."""
        for x, y in batches[:2]:        # warm-up
            steps_fn(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for x, y in batches[2:]:
            steps_fn(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = torch.tensor([(time.perf_counter() - t0) / args.timing_steps], device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return seconds.item()

    step_s = timed(train_step)

    def compute_only(x, y) -> None:     # the same step without gradient synchronisation
        with big.no_sync():
            train_step(x, y)

    compute_s = timed(compute_only)
    if rank == 0:
        report(part="timing", kind=f"DDP, {world_size} processes ({dist.get_backend()}, {device.type})",
               per_rank_batch=args.batch, step_s=step_s, compute_only_step_s=compute_s,
               samples_per_s=args.batch * world_size / step_s)

dist.destroy_process_group()
