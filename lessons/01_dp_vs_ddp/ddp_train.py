"""DistributedDataParallel, one step at a time, then measured.

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
4. measurements with one core per rank; a and b with --timing-steps steps:
   a. processes at once: the forward pass (with the loss) of a plain model on rank 0 alone
      (the other ranks wait), then on every rank at the same time, for the two
      models of model.py (MANY_SMALL_OPS, FEW_BIG_OPS); 3 rounds of both (of 4x
      --timing-steps passes for MANY_SMALL_OPS: data_parallel.ROUND_PASSES), the
      fastest round of each kept; with how the ranks spent their time while they all
      ran: the share on a core, and how often they went to sleep;
   b. a DDP training step of MANY_SMALL_OPS with --small-batch samples per rank,
      with and without gradient synchronisation, and the same global batch in one
      process (rank 0, the others waiting) as the baseline: one step of each in
      turn, 3 x --timing-steps steps, the fastest step of each;
   c. with --link-steps steps: bytes through this host's network link (on the
      notebook's virtual cluster: labutils.dist.link_bytes()) while
      DDP(model) is built, and per training step of FEW_BIG_OPS with --batch
      samples per rank.

The same file runs on GPUs: init() picks nccl and cuda:LOCAL_RANK when every rank
has a GPU, the model is moved to the device *before* it is wrapped, and
device_ids is passed only for a GPU module (DDP raises ValueError for device_ids
with a CPU module).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # model.py sits next to this file
from data_parallel import ROUND_PASSES, global_batches, one_process, pass_totals, steps_on_core  # noqa: E402
from model import (  # noqa: E402
    FEW_BIG_OPS, MANY_SMALL_OPS, PROOF, flat_grads, flat_params, make_batch, make_model, make_optimizer,
    param_bytes, shard,
)

from labutils.dist import init, link_bytes, report  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--per-rank-batch", type=int, default=8, help="samples per rank in the proof")
parser.add_argument("--steps", type=int, default=3, help="optimizer steps in the proof")
parser.add_argument("--batch", type=int, default=128, help="samples per rank, FEW_BIG_OPS")
parser.add_argument("--small-batch", type=int, default=16, help="samples per rank, MANY_SMALL_OPS")
parser.add_argument("--timing-steps", type=int, default=10, help="steps in measurements a and b (0: skip)")
parser.add_argument("--link-steps", type=int, default=0, help="steps in measurement c (0: skip)")
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

# ---------------------------------------------------------------- 4. measurements


def moved(before: dict | None, after: dict | None, steps: int = 1) -> dict:
    if before is None or after is None:
        return {"received": None, "sent": None}
    return {k: (after[k] - before[k]) / steps for k in ("received", "sent")}


def median_step(step_fn, batches, passes: tuple[list, list] | None = None) -> float:
    """The median seconds of one step over batches[2:] (two warm-up steps first); with
    ``passes`` (a list of seconds, a list of shares), each of those steps' seconds and how
    this rank's thread spent it (its share on a core, its sleeps: steps_on_core) are
    added to them."""
    for x, y in batches[:2]:
        step_fn(x, y)

    def step(x, y) -> None:
        step_fn(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    seconds, shares = steps_on_core(step, batches[2:])
    if passes is not None:
        passes[0].extend(seconds)
        passes[1].extend(shares)
    return statistics.median(seconds)


def timed(step_fn, x, y) -> float:
    """Seconds of one step (on a GPU, to the end of its kernels)."""
    t0 = time.perf_counter()
    step_fn(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def slowest_rank(seconds: float) -> float:
    """The largest of every rank's ``seconds``: a step ends when its slowest rank does."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / world_size


def my_batches(config: dict, per_rank: int, steps: int) -> list:
    """This rank's shard of each global batch: 2 warm-up steps, then ``steps`` timed ones."""
    out = []
    for s in range(steps + 2):
        x, y = make_batch(s, per_rank * world_size, **config)
        out.append((shard(x, rank, world_size).to(device), shard(y, rank, world_size).to(device)))
    return out


# One core per rank, as one GPU per rank (torchrun sets OMP_NUM_THREADS=1 only when
# a node runs several ranks).
torch.set_num_threads(1)
if args.timing_steps > 0:
    # a. processes at once: no DDP, no communication, only compute
    for name, config, per_rank in (("MANY_SMALL_OPS", MANY_SMALL_OPS, args.small_batch),
                                   ("FEW_BIG_OPS", FEW_BIG_OPS, args.batch)):
        plain = make_model(**config).to(device)
        batches = my_batches(config, per_rank, args.timing_steps * ROUND_PASSES[name])

        def forward(x, y) -> None:  # the backward runs in C++ without the GIL: left out, as for the threads
            loss_fn(plain(x), y)

        # 3 rounds, as long for both models (ROUND_PASSES). The times are each one's fastest
        # round (on the slowest rank), the least disturbed by other work; the share on a
        # core and the sleeps per pass are those of every step of every round together
        # (the mean over ranks), as for the threads in the notebook.
        alone, together, passes = [], [], ([], [])
        for _ in range(3):
            dist.barrier()
            if rank == 0:                                 # rank 0 alone: the others wait
                alone.append(median_step(forward, batches))
            dist.barrier()
            together.append(slowest_rank(median_step(forward, batches, passes)))  # all at once
        shares = {key: mean_over_ranks(value) for key, value in pass_totals(*passes).items()}
        if rank == 0:
            report(part="processes at once", model=name, alone_s=min(alone), together_s=min(together),
                   **shares)

    # b. a DDP training step on the model of many small operations
    small = wrap(make_model(**MANY_SMALL_OPS))
    small_opt = make_optimizer(small)

    def small_step(x, y) -> None:
        small_opt.zero_grad()
        loss_fn(small(x), y).backward()                   # gradients all-reduced here
        small_opt.step()

    def small_step_no_sync(x, y) -> None:                 # the same, without communication
        with small.no_sync():
            small_step(x, y)

    # The three in turn, one step each: the host's speed changes from one fraction of
    # a second to the next, and steps taken in turn see the same machine. Each keeps
    # its fastest step (on the slowest rank), the one least disturbed by other work.
    # 3 x --timing-steps steps, as many as the three rounds of part a.
    whole = global_batches(MANY_SMALL_OPS, args.small_batch * world_size, 3 * args.timing_steps)
    alone = one_process(global_batch=args.small_batch * world_size, config=MANY_SMALL_OPS)
    single, steps, compute = [], [], []
    for x, y in whole:
        dist.barrier()
        if rank == 0:                                     # the others wait at the barrier
            single.append(timed(alone.step, x, y))
        dist.barrier()
        mine = shard(x, rank, world_size).to(device), shard(y, rank, world_size).to(device)
        steps.append(timed(small_step, *mine))
        dist.barrier()
        compute.append(timed(small_step_no_sync, *mine))
    steps, compute = slowest_rank(min(steps[2:])), slowest_rank(min(compute[2:]))
    single = min(single[2:]) if rank == 0 else None
    if rank == 0:
        report(part="ddp step", model="MANY_SMALL_OPS", per_rank_batch=args.small_batch,
               step_s=steps, compute_only_step_s=compute, one_process_step_s=single,
               samples_per_s=args.small_batch * world_size / steps,
               kind=f"DDP, {world_size} processes ({dist.get_backend()}, {device.type})")

# c. bytes through this host's link: building DDP, then per training step
if args.link_steps > 0:
    big = make_model(**FEW_BIG_OPS, seed=rank)  # different on every rank, as in part 1
    dist.barrier()
    before = link_bytes()
    big = wrap(big)                               # broadcasts rank 0's parameters
    dist.barrier()
    construction = moved(before, link_bytes())
    big_opt = make_optimizer(big)

    def big_step(x, y) -> None:
        big_opt.zero_grad()
        loss_fn(big(x), y).backward()
        big_opt.step()

    batches = my_batches(FEW_BIG_OPS, args.batch, args.link_steps)
    for x, y in batches[:2]:                              # warm-up (DDP rebuilds its buckets)
        big_step(x, y)
    dist.barrier()
    before = link_bytes()
    t0 = time.perf_counter()
    for x, y in batches[2:]:
        big_step(x, y)
    big_step_s = (time.perf_counter() - t0) / args.link_steps
    dist.barrier()
    per_step = moved(before, link_bytes(), args.link_steps)
    report(part="link bytes", gradient_bytes=param_bytes(big.module), step_s=big_step_s,
           construction_received=construction["received"], construction_sent=construction["sent"],
           step_received=per_step["received"], step_sent=per_step["sent"])

dist.destroy_process_group()
