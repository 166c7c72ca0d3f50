"""What gradient_as_bucket_view, static_graph and find_unused_parameters change, measured.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 03_bucketing_and_overlap/ddp_options.py

or from the notebook: launch("03_bucketing_and_overlap/ddp_options.py", nproc=2).

1. On the lesson's MLP, for each setting in SETTINGS: the median step time, the bucket
   sizes at construction and after the rebuild, whether each .grad is a view into a
   bucket buffer, and the bytes of gradient memory (distinct storages of the .grad
   tensors and the bucket buffers).
   Then, with gradient_as_bucket_view=True: is a .grad a view after backward; can it
   be detached in place; is it still a view after being replaced, and after the next
   backward?
2. On BranchNet, whose branch is not used: with static_graph=True when no rank uses it,
   with find_unused_parameters=True when only rank 0 skips it. Each trains --steps
   steps; report whether the weights are identical on every rank.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # models.py sits next to this file
from models import BranchNet, batch, make_mlp  # noqa: E402

from labutils.course.ddp_probes import BucketRecorder, reducer_buckets  # noqa: E402
from labutils.dist import init, report  # noqa: E402
from labutils.course.timing import median, time_calls  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5, help="timed steps per setting")
args = parser.parse_args()

rank, world_size, device = init()

SETTINGS = {
    "default": {},
    "gradient_as_bucket_view=True": {"gradient_as_bucket_view": True},
    "static_graph=True": {"static_graph": True},
    "find_unused_parameters=True": {"find_unused_parameters": True},
}


def slowest(seconds: list[float]) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ---------------------------------------------------------------- 1. the MLP, per setting
for name, options in SETTINGS.items():
    ddp = DDP(make_mlp("mlp").to(device), bucket_cap_mb=4, **options)
    recorder = BucketRecorder(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    step = 0

    def train_step():
        global step
        x, y = batch(rank, step)
        step += 1
        F.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep .grad alive so we can look at it below
        if device.type == "cuda":  # time the work, not its queueing
            torch.cuda.synchronize(device)

    seconds = slowest(time_calls(train_step, iters=args.steps, warmup=2, sync=dist.barrier))
    buffers = {c.storage: c.nbytes for c in recorder.calls if c.iteration == recorder.iteration - 1}
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
             for p in ddp.parameters()}
    # each parameter's .grad counted once, whatever storage it shares
    views = sum(p.grad.untyped_storage().data_ptr() in buffers for p in ddp.parameters())
    info = reducer_buckets(ddp)
    if rank == 0:
        report(part="options", setting=name, seconds=median(seconds),
               initial_buckets=len(info["initial_sizes"]), rebuilt_buckets=len(info["rebuilt_sizes"]),
               grads_in_buckets=f"{views} of {len(list(ddp.parameters()))}",
               gradient_mib=sum({**grads, **buffers}.values()) / 2**20)
    del ddp, opt, recorder

# ---------------------------------------------------------------- 1b. a gradient that is a view
# With gradient_as_bucket_view=True, what may code do to a .grad? Detach it in place, and
# replace it, then look at it after the next backward.
ddp = DDP(make_mlp("mlp").to(device), bucket_cap_mb=4, gradient_as_bucket_view=True)
for step in range(3):  # after the rebuild, the gradients are views into the buckets
    ddp.zero_grad(set_to_none=False)
    x, y = batch(rank, step)
    F.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
weight = ddp.module.fc1.weight
view_after_backward = weight.grad._base is not None
try:
    weight.grad.detach_()
    detach_error = ""
except RuntimeError as exc:
    detach_error = str(exc).split(". ")[0]
weight.grad = weight.grad.clone()  # replaced by a tensor of its own
view_after_assign = weight.grad._base is not None
ddp.zero_grad(set_to_none=False)
x, y = batch(rank, 3)
F.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
if rank == 0:
    report(part="views", view_after_backward=view_after_backward, detach_error=detach_error,
           view_after_assign=view_after_assign, view_after_next_backward=weight.grad._base is not None)
del ddp

# ---------------------------------------------------------------- 2. an unused branch


def train_branch(ddp, *, use_branch: bool) -> bool:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        x, _ = batch(rank, step, size="small", n=8)
        ddp(x[:, :64].to(device), use_branch=use_branch).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    weights = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    everyone = [torch.empty_like(weights) for _ in range(world_size)]
    dist.all_gather(everyone, weights)
    return all(torch.equal(everyone[0], w) for w in everyone)


same = train_branch(DDP(BranchNet().to(device), static_graph=True), use_branch=False)
if rank == 0:
    report(part="unused", setting="static_graph=True", who_skips="every rank", steps=3,
           same_on_all_ranks=same)
same = train_branch(DDP(BranchNet().to(device), find_unused_parameters=True), use_branch=rank != 0)
if rank == 0:
    report(part="unused", setting="find_unused_parameters=True", who_skips="rank 0", steps=3,
           same_on_all_ranks=same)

dist.destroy_process_group()
