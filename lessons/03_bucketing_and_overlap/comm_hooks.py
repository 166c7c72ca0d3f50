"""Communication hooks: one that logs, fp16 compression and PowerSGD, measured.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 03_bucketing_and_overlap/comm_hooks.py
    torchrun --standalone --nproc-per-node 2 03_bucketing_and_overlap/comm_hooks.py --powersgd-race

or from the notebook: launch("03_bucketing_and_overlap/comm_hooks.py", nproc=2).

A communication hook replaces DDP's all-reduce of a bucket: DDP calls
hook(state, bucket) when the bucket is ready and uses the tensor its future returns
as the averaged gradients.

1. logging_hook (below): prints each bucket, then does what DDP does by default.
2. For each hook in HOOKS, the lesson's MLP (bucket_cap_mb=4: three buckets) trains
   --steps steps from the same weights on the same data. Measured: bytes all-reduced
   per step (every dist.all_reduce the hook makes), the gradient's relative error
   against plain all-reduce at the first compressed step, the weights' distance from
   the plain all-reduce run after the last step, and the step time.
3. --powersgd-race: PowerSGD on three buckets without the serialising wrapper; each
   rank prints every all_reduce it issues (size, thread). On gloo it aborts or hangs,
   depending on thread timing: run it with the launcher's hang_timeout.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # models.py sits next to this file
from models import batch, make_mlp  # noqa: E402

from labutils.course.collective_log import count_all_reduces  # noqa: E402
from labutils.dist import init, report  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5, help="training steps per hook")
parser.add_argument("--powersgd-race", action="store_true", help="the hanging PowerSGD run")
args = parser.parse_args()

rank, world_size, device = init()


# ---------------------------------------------------------------- 1. a hook of our own
def logging_hook(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Log the bucket, then all-reduce it and divide by the world size (DDP's default)."""
    buffer = bucket.buffer()  # the bucket's gradients, flattened into one tensor
    if state["rank"] == 0:
        print(f"bucket {bucket.index()}: {buffer.numel():>7} floats from {len(bucket.parameters()):>2} "
              f"tensors, last: {bucket.is_last()}")
    future = dist.all_reduce(buffer, async_op=True).get_future()
    # DDP waits for the returned future and copies its tensor into the .grad fields.
    return future.then(lambda fut: fut.value()[0].div_(state["world_size"]))


# ---------------------------------------------------------------- 2. hooks compared
def powersgd_state(start_iter: int = 2) -> powersgd.PowerSGDState:
    """PowerSGD with rank-2 approximations, from the third step (the first two use plain
    all-reduce, as PowerSGD needs for its warm-up; they also rebuild the buckets)."""
    return powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                  start_powerSGD_iter=start_iter)


def serialised(hook):
    """Wait for each bucket's communication before DDP hands over the next bucket.

    PowerSGD's hook all-reduces the uncompressed tensors from the calling thread, then P
    in a first callback and Q in a second; gloo runs those callbacks on its two worker
    threads, and each waits there for the all-reduce it started. With several buckets in
    flight the ranks can issue their all-reduces in different orders, or both worker
    threads can end up waiting in callbacks with none left to run the all-reduces.
    Waiting here keeps one bucket in flight: equal orders and a free worker thread, at
    the cost of all overlap.
    """
    def serialised_hook(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future
    return serialised_hook


HOOKS = {  # name: (bucket_cap_mb, make state, hook, first compressed step)
    "allreduce (DDP's default)": (4, lambda: None, default_hooks.allreduce_hook, 0),
    "fp16_compress_hook": (4, lambda: None, default_hooks.fp16_compress_hook, 0),
    "PowerSGD, one bucket": (64, powersgd_state, powersgd.powerSGD_hook, 2),
    "PowerSGD, 3 buckets, serialised": (4, powersgd_state, serialised(powersgd.powerSGD_hook), 2),
}


def train(cap_mb: float, state, hook, *, steps: int, on_call=None):
    """Train the MLP with this hook; per step: bytes all-reduced, gradients, seconds."""
    ddp = DDP(make_mlp("mlp").to(device), bucket_cap_mb=cap_mb)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    sent, grads, seconds, losses = [], [], [], []
    for step in range(steps):
        x, y = batch(rank, step)
        t0 = time.perf_counter()
        with count_all_reduces(on_call) as calls:
            loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
            loss.backward()
            if device.type == "cuda":  # time the work, not its queueing
                torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
        sent.append(sum(c.nbytes for c in calls))
        grads.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]))
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    weights = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    return sent, grads, seconds, losses, weights


if args.powersgd_race:
    def show(call):
        print(f"all_reduce of {call.numel:>5} floats from thread {call.thread}", flush=True)

    train(4, powersgd_state(), powersgd.powerSGD_hook, steps=args.steps, on_call=show)
    print("finished: every step completed")
    dist.destroy_process_group()
    sys.exit(0)

ddp = DDP(make_mlp("mlp").to(device), bucket_cap_mb=4)
ddp.register_comm_hook({"rank": rank, "world_size": world_size}, logging_hook)
for step in range(2):
    x, y = batch(rank, step)
    F.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
    if rank == 0:
        print(f"-- backward {step} done")

exact_grads = exact_weights = None
for name, (cap_mb, make_state, hook, first) in HOOKS.items():
    sent, grads, seconds, losses, weights = train(cap_mb, make_state(), hook, steps=args.steps)
    if exact_grads is None:  # the first hook is plain all-reduce: the reference
        exact_grads, exact_weights = grads, weights
    g, g_exact = grads[first], exact_grads[first]
    if rank == 0:
        report(part="hooks", hook=name, bucket_cap_mb=cap_mb, bytes_per_step=sent,
               grad_rel_error=((g - g_exact).norm() / g_exact.norm()).item(),
               weights_max_diff=(weights - exact_weights).abs().max().item(),
               losses=losses, seconds=sorted(seconds)[len(seconds) // 2])

dist.destroy_process_group()
