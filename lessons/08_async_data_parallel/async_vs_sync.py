"""Synchronous DDP against an asynchronous parameter server, on the same task and data.

    torchrun --nproc-per-node 4 async_vs_sync.py
    torchrun --nproc-per-node 4 async_vs_sync.py --phases sync@0.1 async@0.1 --slow-ms 160

Rank 0 is the parameter server (idle during the synchronous phases); ranks 1.. are
workers, and the last rank is the slow one. Each phase starts from the same initial
model and makes the workers compute the same number of gradients in all, each worker
always on its own batches in the same order (task.batch), so only the way gradients
are combined differs:

    sync@LR   DDP over the workers (a process group without the server): every step
              averages one gradient from each worker, so each step waits for the slowest
    async@LR  the parameter server of param_server.py: each gradient is applied alone,
              as soon as it arrives
    aware@LR  the same, with each step scaled by 1 / (1 + staleness)

The model is tiny, so its real computation takes well under a millisecond; each
worker pads every gradient to --step-ms (the slow one to --slow-ms) with a sleep, as
if the model were bigger. Sleeping leaves the cores free, so the timings measure the
training schemes rather than four processes competing for two cores.
On a busy machine each message also waits for a core, and the parameter server pays
that four times per gradient: with three other processes spinning on the two cores of
the course's machine, the server phase's fast workers took about 14 ms more per
gradient than their sleep. At 10 ms per gradient that put the server at 0.62-0.66 of
DDP's time (against about 0.4 idle); at the 20 ms default, 0.43-0.49 (2026-12-01).

Reported per phase: the loss on the whole data set against updates and seconds, per
worker the gradients computed and the time spent computing, and for the asynchronous
phases every applied update (worker, push number, staleness, time).
"""

import argparse
import hashlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector

from labutils.dist import init, report
from param_server import serve, work
from task import batch, gradient, loss_of, make_data, make_model

parser = argparse.ArgumentParser()
parser.add_argument("--phases", nargs="+", default=["sync@0.1", "async@0.1", "sync@0.5", "async@0.5", "aware@0.5"],
                    help="MODE@LR with MODE sync, async or aware")
parser.add_argument("--gradients", type=int, default=300, help="gradients computed per phase, all workers together")
parser.add_argument("--step-ms", type=float, default=20.0, help="compute time per gradient")
parser.add_argument("--slow-ms", type=float, default=80.0, help="compute time per gradient of the last rank")
args = parser.parse_args()
phases = [spec.split("@") for spec in args.phases]
for spec, parts in zip(args.phases, phases):  # check them all before any rank starts work
    if len(parts) != 2 or parts[0] not in ("sync", "async", "aware"):
        parser.error(f"bad phase {spec!r}: expected MODE@LR with MODE sync, async or aware, e.g. async@0.1")

# gloo even on GPU machines: the server receives from any source (dist.recv without src),
# which NCCL does not offer, and this tiny model runs on CPU anyway.
rank, world_size, device = init("gloo")
torch.set_num_threads(1)
n_workers = world_size - 1
if n_workers < 1:
    raise SystemExit(f"needs a server and at least one worker: run it on 2 or more ranks, not {world_size}")
worker_group = dist.new_group(list(range(1, world_size)))  # every rank must call new_group
me = rank - 1  # this worker's index, 0 .. n_workers-1 (the server is -1)
compute_s = (args.slow_ms if rank == world_size - 1 else args.step_ms) / 1000
data = make_data()


def flat(model: nn.Module) -> torch.Tensor:
    """A copy of the model's parameters as one flat vector (what the server keeps)."""
    return parameters_to_vector(model.parameters()).detach().clone()


def sha(params: torch.Tensor) -> str:
    """A fingerprint of the exact parameter values."""
    return hashlib.sha256(params.numpy().tobytes()).hexdigest()[:12]


def compute(seconds: float) -> None:
    """The worker's computation, padded to its speed (a sleep, see the docstring)."""
    time.sleep(seconds)


def run_sync(phase: int, lr: float, steps: int) -> None:
    model = make_model()
    if rank == 0:  # the server has no part in DDP: it waits for the phase to end
        dist.barrier()
        dist.barrier()
        return
    ddp = DDP(model, process_group=worker_group)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    snapshots = [(0, 0.0, flat(model))]
    computing = 0.0
    dist.barrier()
    start = time.perf_counter()
    for k in range(steps):
        t = time.perf_counter()
        compute(compute_s)
        x, y = batch(data, me, k, n_workers)
        loss = nn.functional.mse_loss(ddp(x), y)
        computing += time.perf_counter() - t  # backward is not counted: it includes the wait
        opt.zero_grad()
        loss.backward()  # waits here for the all-reduce, i.e. for the slowest worker
        opt.step()
        snapshots.append((k + 1, time.perf_counter() - start, flat(model)))
    wall = time.perf_counter() - start
    dist.barrier()
    final = flat(model)
    report(kind="worker", phase=phase, gradients=steps, computing_s=computing, wall_s=wall,
           params_sha=sha(final))
    if rank == 1:  # the replicas are identical: one of them reports the curve
        report_curve(phase, snapshots, wall)


def run_async(phase: int, lr: float, total: int, staleness_aware: bool) -> None:
    model = make_model()
    params = flat(model)
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        log = serve(params, lr=lr, total_updates=total, n_workers=n_workers,
                    staleness_aware=staleness_aware, snapshot_every=n_workers)
        wall = time.perf_counter() - start
        dist.barrier()
        report(kind="server", phase=phase, version=log["version"], params_sha=sha(params),
               headers=log["headers"], grads=log["grads"], params_sent=log["params_sent"],
               stops_sent=log["stops_sent"],
               worker=log["worker"], seq=log["seq"], staleness=log["staleness"], t=log["t"])
        report_curve(phase, log["snapshots"], wall)
        return
    computing = 0.0

    def gradient_at(current: torch.Tensor, k: int) -> torch.Tensor:
        nonlocal computing
        t = time.perf_counter()
        compute(compute_s)
        grad = gradient(model, current, data, me, k, n_workers)
        computing += time.perf_counter() - t
        return grad

    pushed = work(params, gradient_at)
    wall = time.perf_counter() - start
    dist.barrier()
    report(kind="worker", phase=phase, gradients=pushed, computing_s=computing, wall_s=wall)


def report_curve(phase: int, snapshots, wall: float) -> None:
    """Loss on the whole data set at each snapshot, computed after the timed phase."""
    model = make_model()
    report(kind="curve", phase=phase, updates=[v for v, _, _ in snapshots],
           t=[t for _, t, _ in snapshots], loss=[loss_of(model, p, data) for _, _, p in snapshots],
           wall_s=wall)


for phase, (mode, lr) in enumerate(phases):
    if rank == 0:
        report(kind="phase", phase=phase, mode=mode, lr=float(lr), workers=n_workers,
               step_ms=args.step_ms, slow_ms=args.slow_ms, slow_rank=world_size - 1)
    if mode == "sync":
        run_sync(phase, float(lr), args.gradients // n_workers)
    else:
        run_async(phase, float(lr), args.gradients, staleness_aware=mode == "aware")

dist.destroy_process_group()
