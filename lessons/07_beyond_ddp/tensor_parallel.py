"""Tensor parallelism by hand: an MLP split column-then-row over the ranks.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 07_beyond_ddp/tensor_parallel.py

or from the notebook: launch("07_beyond_ddp/tensor_parallel.py", nproc=2).

Every rank builds the same MLP (fc1: width -> hidden, GELU, fc2: hidden -> width) and
the same input. Rank r keeps the rows r of fc1 (hidden/n output features: a column
split of fc1's weight as y = x W^T sees it) and the matching columns of fc2 (a row
split), so GELU runs on its own slice without communication and each rank's fc2
produces a partial sum of the output: one all-reduce adds them. In backward, the
mirror image: one all-reduce adds the partial gradients of the input.

Reported: the collectives of forward and backward (CollectiveLog), and the output and
every gradient against the unsplit MLP on the same input (assert_close; max
difference; bitwise); and what fc2's weight gradient becomes when the forward
all-reduce is torch.distributed.nn.functional.all_reduce instead (its ratio to the
right one). Then the same split by torch's own tensor-parallel API
(parallelize_module with ColwiseParallel and RowwiseParallel on a CPU device mesh),
its output against the unsplit MLP, and its collectives counted by DTensor's
CommDebugMode.
"""

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).parent))  # models.py and probes.py sit next to this file
from models import make_mlp  # noqa: E402
from probes import CollectiveLog  # noqa: E402

from labutils.dist import init, report  # noqa: E402

WIDTH, HIDDEN, TOKENS = 64, 256, 8 * 32
rank, world_size, device = init()


class CopyToTensorParallel(torch.autograd.Function):
    """Forward: identity (every rank needs all of x). Backward: all-reduce, because
    every rank's slice of fc1 contributed a part of dL/dx."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromTensorParallel(torch.autograd.Function):
    """Forward: all-reduce of the partial outputs. Backward: identity (each rank's
    partial output got the same gradient as the sum)."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


torch.manual_seed(0)  # the same MLP, input and output gradient on every rank
full = make_mlp(WIDTH, HIDDEN).to(device)
x = torch.randn(TOKENS, WIDTH, device=device)
grad_out = torch.randn(TOKENS, WIDTH, device=device)

# The reference: the unsplit MLP.
x_ref = x.clone().requires_grad_()
y_ref = full(x_ref)
y_ref.backward(grad_out)

# This rank's slices (copies: they are the parameters of the split MLP).
fc1, fc2 = full[0], full[2]
rows = slice(rank * HIDDEN // world_size, (rank + 1) * HIDDEN // world_size)
w1 = fc1.weight.detach()[rows].clone().requires_grad_()     # (hidden/n, width)
b1 = fc1.bias.detach()[rows].clone().requires_grad_()
w2 = fc2.weight.detach()[:, rows].clone().requires_grad_()  # (width, hidden/n)
b2 = fc2.bias.detach().clone().requires_grad_()             # replicated: added once, after the sum

x_tp = x.clone().requires_grad_()
with CollectiveLog(["all_reduce"]) as log:
    log.phase = "forward"
    h = F.gelu(F.linear(CopyToTensorParallel.apply(x_tp), w1, b1))  # (tokens, hidden/n): no communication
    y = ReduceFromTensorParallel.apply(F.linear(h, w2)) + b2         # the one all-reduce of forward
    log.phase = "backward"
    y.backward(grad_out)

pairs = {
    "output y": (y, y_ref),
    "fc1.weight grad (my rows)": (w1.grad, fc1.weight.grad[rows]),
    "fc1.bias grad (my rows)": (b1.grad, fc1.bias.grad[rows]),
    "fc2.weight grad (my columns)": (w2.grad, fc2.weight.grad[:, rows]),
    "fc2.bias grad": (b2.grad, fc2.bias.grad),
    "input grad dL/dx": (x_tp.grad, x_ref.grad),
}
checks = []
for name, (got, want) in pairs.items():
    try:
        torch.testing.assert_close(got, want)
        verdict = "equal (assert_close)"
    except AssertionError:
        verdict = "DIFFERENT"
    checks.append({"tensor": name, "verdict": verdict, "bitwise": torch.equal(got, want),
                   "max_abs_diff": (got - want).abs().max().item()})
# A trap: torch.distributed.nn.functional.all_reduce is differentiable, but its backward
# all-reduces the gradient again, which is right for the input side (CopyToTensorParallel's
# job) and wrong here: every rank's partial output already got the full gradient.
w2_trap = w2.detach().clone().requires_grad_()
h_trap = F.gelu(F.linear(x, w1.detach(), b1.detach()))
with warnings.catch_warnings():  # torch 2.13 marks dist_nn.all_reduce deprecated (FutureWarning)
    warnings.simplefilter("ignore", FutureWarning)
    (dist_nn.all_reduce(F.linear(h_trap, w2_trap)) + b2.detach()).backward(grad_out)
trap_ratio = (w2_trap.grad / w2.grad).mean().item()

report(part="by hand", checks=checks, calls=[c.to_json() for c in log.calls], trap_grad_ratio=trap_ratio,
       weight_bytes_per_rank=sum(t.numel() * t.element_size() for t in (w1, b1, w2, b2)),
       weight_bytes_full=sum(p.numel() * p.element_size() for p in full.parameters()))

# The same split with torch's tensor-parallel API (DTensor) on a CPU device mesh.
mesh = init_device_mesh(device.type, (world_size,))
torch.manual_seed(0)
library = parallelize_module(make_mlp(WIDTH, HIDDEN).to(device), mesh,
                             {"0": ColwiseParallel(), "2": RowwiseParallel()})
with CommDebugMode() as comm:  # counts the collectives DTensor issues
    y_lib = library(x)
counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
y_lib = y_lib.full_tensor() if hasattr(y_lib, "full_tensor") else y_lib
try:
    torch.testing.assert_close(y_lib, y_ref)
    verdict = "equal (assert_close)"
except AssertionError:
    verdict = "DIFFERENT"
report(part="library", verdict=verdict, forward_collectives=counts,
       local_fc1_weight=list(library[0].weight.to_local().shape),
       local_fc2_weight=list(library[2].weight.to_local().shape),
       max_abs_diff=(y_lib - y_ref).abs().max().item())
dist.destroy_process_group()
