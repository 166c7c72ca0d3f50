"""Two dimensions at once: FSDP2 over one mesh dimension, tensor parallelism over the other.

Run it on 4 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 4 11_parallelism_in_several_dimensions/fsdp_tp.py

or from the notebook: launch("11_parallelism_in_several_dimensions/fsdp_tp.py", nproc=4).

The 4 ranks form a 2 x 2 mesh named ("dp", "tp"): ranks {0, 1} and {2, 3} are tensor-
parallel pairs (mesh dimension "tp"), ranks {0, 2} and {1, 3} data-parallel pairs ("dp").
The TinyTransformer of model.py is split by plans.py's "TP + SP" plan over "tp", then
sharded with FSDP2's fully_shard over "dp" (the block, then the whole model): each
parameter is split by tensor parallelism first, and FSDP2 shards each rank's piece
again between the two data-parallel ranks. Each member of a data-parallel pair trains
on its own batch; the two ranks of a tensor-parallel pair share one. --order tp,dp
names the dimensions the other way round: then {0, 1} and {2, 3} are the data-parallel
pairs; --order both runs one order, then the other. On a cluster of 2 hosts with 2 ranks
each, the inner pairs share a host.

Reported: one step's loss, and every gradient against the unsplit model on both
batches together in one process (FSDP2 averages the gradients over "dp": the mean of
the two batches' mean losses is the mean over all their rows); the collectives of the
step with their mesh dimension and sizes (labutils.course.comm_count); the parameter
bytes each rank holds; each dimension's group; with --time-steps, the median of that many
timed training steps (SGD) after one more.
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, str(Path(__file__).parent))  # model.py sits next to this file
from model import TinyTransformer, token_batch
from plans import plans

from labutils.course.comm_count import CollectiveCounter
from labutils.dist import init, report

VOCAB, DIM, HEADS, BATCH, SEQ = 512, 128, 4, 8, 64

parser = argparse.ArgumentParser()
parser.add_argument("--order", choices=("dp,tp", "tp,dp", "both"), default="dp,tp",
                    help="the mesh's dimension names, outer first: the inner dimension's pairs are "
                         "neighbouring ranks, {0, 1} and {2, 3}; both: one order, then the other")
parser.add_argument("--time-steps", type=int, default=0, help="then time this many training steps")
parser.add_argument("--batch", type=int, default=BATCH, help="sequences per data-parallel rank")
args = parser.parse_args()

rank, world_size, device = init()
if world_size != 4:
    raise SystemExit(f"fsdp_tp.py needs 4 ranks for its 2 x 2 mesh, not {world_size}")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


torch.manual_seed(0)
initial = TinyTransformer(VOCAB, DIM, HEADS).to(device)
batches = [tuple(t.to(device) for t in token_batch(args.batch, SEQ, VOCAB, seed=1 + d)) for d in range(2)]

reference = copy.deepcopy(initial)
ref_losses = [F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten()) for ids, targets in batches]
torch.stack(ref_losses).mean().backward()
ref_grads = dict(reference.named_parameters())


def one_order(order: str) -> None:
    """Split, check and (with --time-steps) time the model on the mesh named in this order."""
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=tuple(order.split(",")))
    dp_index = mesh.get_local_rank("dp")
    model = copy.deepcopy(initial)
    block_plan, top_plan = plans("TP + SP")  # tp_block.py's plan with sequence parallelism
    parallelize_module(model.block, mesh["tp"], block_plan)
    parallelize_module(model, mesh["tp"], top_plan)
    fully_shard(model.block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    ids, targets = batches[dp_index]
    with CollectiveCounter(mesh) as forward:
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    with CollectiveCounter(mesh) as backward:
        loss.backward()

    equal = True
    try:
        torch.testing.assert_close(full(loss).detach(), ref_losses[dp_index].detach())
    except AssertionError:
        equal = False
    for name, p in model.named_parameters():
        try:
            torch.testing.assert_close(full(p.grad), ref_grads[name].grad)
        except AssertionError:
            equal = False
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    report(part="2d", equal=equal, dp=dp_index, tp=mesh.get_local_rank("tp"),
           forward=forward.calls, backward=backward.calls,
           param_bytes=sum(t.numel() * t.element_size() for t in local),
           unsplit_param_bytes=sum(p.numel() * p.element_size() for p in reference.parameters()),
           activation_bytes=args.batch * SEQ * DIM * 4, order=order,
           tp_group=dist.get_process_group_ranks(mesh["tp"].get_group()),
           dp_group=dist.get_process_group_ranks(mesh["dp"].get_group()))
    if args.time_steps:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        seconds = []
        for _ in range(args.time_steps + 1):  # the first is a warm-up
            start = time.perf_counter()
            loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seconds.append(time.perf_counter() - start)
        report(part="timing", order=order, step_s=statistics.median(seconds[1:]))


for order in (("dp,tp", "tp,dp") if args.order == "both" else (args.order,)):
    one_order(order)
