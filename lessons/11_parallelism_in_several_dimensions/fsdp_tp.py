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
on its own batch; the two ranks of a tensor-parallel pair share one.

--layouts names one or more layouts, run one after the other in one job:
- dp,tp: the mesh above (the inner pairs, {0, 1} and {2, 3}, are tensor-parallel);
- tp,dp: the dimensions named the other way round: the inner pairs are data-parallel;
- hsdp: no tensor parallelism. FSDP2 on a 2 x 2 mesh named ("replicate", "shard")
  shards every parameter within the inner pairs and keeps one replica per outer pair
  (hybrid sharding): gradients are reduce-scattered within a pair, then the shards
  all-reduced across. Each rank trains on its own half of its pair's batch.
On a cluster of 2 hosts with 2 ranks each, the inner pairs share a host.

Reported per layout: one step's loss, and every gradient against the unsplit model on
both batches together in one process (the mean of the batches' mean losses is the mean
over all their rows); the collectives of the step with their mesh dimension and sizes
(labutils.course.comm_count); the parameter bytes each rank holds; each dimension's
group. With --time-steps, that many timed training steps with Adam after one more: their
median; what the rank holds after them (parameters, gradients and Adam's state, each
storage once); the bytes autograd saved for backward in the first step, parameters left
out (labutils.course.memory); and, on a virtual cluster, the bytes its host's link sent
per step (labutils.dist.link_bytes).
"""

import argparse
import contextlib
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

sys.path.insert(0, str(Path(__file__).parent))  # model.py and plans.py sit next to this file
from model import TinyTransformer, token_batch
from plans import plans

from labutils.course.comm_count import CollectiveCounter
from labutils.course.memory import SavedBytes, held_bytes
from labutils.dist import init, link_bytes, report

VOCAB, DIM, HEADS, BATCH, SEQ = 512, 128, 4, 8, 64

parser = argparse.ArgumentParser()
parser.add_argument("--layouts", nargs="+", choices=("dp,tp", "tp,dp", "hsdp"), default=["dp,tp"],
                    help="dp,tp or tp,dp: the 2-D mesh's dimension names, outer first (the inner "
                         "dimension's pairs are neighbouring ranks, {0, 1} and {2, 3}); hsdp: FSDP2 "
                         "sharding within the inner pairs, replicas across them")
parser.add_argument("--time-steps", type=int, default=0, help="then time this many training steps")
parser.add_argument("--batch", type=int, default=BATCH, help="sequences per data-parallel rank")
args = parser.parse_args()

rank, world_size, device = init()
torch.set_num_threads(1)  # one core per rank, whatever MKL_NUM_THREADS says (torch reads it first)
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


def sent_by_link() -> int | None:
    counters = link_bytes()
    return None if counters is None else counters["sent"]


def build(layout: str):
    """(model, mesh, this rank's batch) for a layout."""
    model = copy.deepcopy(initial)
    if layout == "hsdp":
        mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model.block, mesh=mesh)  # a 2-D mesh: replicate over dim 0, shard over dim 1
        fully_shard(model, mesh=mesh)
        ids, targets = batches[mesh.get_local_rank("replicate")]
        half = mesh.get_local_rank("shard")
        # copies: a view would keep (and be counted with) the whole batch's storage
        return model, mesh, tuple(t.chunk(2)[half].clone() for t in (ids, targets))
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=tuple(layout.split(",")))
    block_plan, top_plan = plans("TP + SP")  # tp_block.py's plan with sequence parallelism
    parallelize_module(model.block, mesh["tp"], block_plan)
    parallelize_module(model, mesh["tp"], top_plan)
    fully_shard(model.block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh, batches[mesh.get_local_rank("dp")]


def one_layout(layout: str) -> None:
    """Split, check and (with --time-steps) time the model in this layout."""
    model, mesh, (ids, targets) = build(layout)
    with CollectiveCounter(mesh) as forward:
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    with CollectiveCounter(mesh) as backward:
        loss.backward()

    equal = True
    # hsdp: each rank's loss is its half batch's; the gradients are the mean over all four
    if layout != "hsdp":
        try:
            torch.testing.assert_close(full(loss).detach(), ref_losses[mesh.get_local_rank("dp")].detach())
        except AssertionError:
            equal = False
    for name, p in model.named_parameters():
        try:
            torch.testing.assert_close(full(p.grad), ref_grads[name].grad)
        except AssertionError:
            equal = False
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    groups = {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in mesh.mesh_dim_names}
    report(part="2d", layout=layout, equal=equal, forward=forward.calls, backward=backward.calls,
           param_bytes=sum(t.numel() * t.element_size() for t in local),
           unsplit_param_bytes=sum(p.numel() * p.element_size() for p in reference.parameters()),
           activation_bytes=args.batch * SEQ * DIM * 4,
           **{f"{name}_group": ranks for name, ranks in groups.items()},  # dp_group, tp_group, ...
           **({"dp": mesh.get_local_rank("dp"), "tp": mesh.get_local_rank("tp")} if layout != "hsdp" else {}))
    if args.time_steps:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        seconds = []
        for step in range(args.time_steps + 1):  # the first is a warm-up
            if step == 1:  # the counter read between two barriers: after every rank's warm-up
                dist.barrier()  # step, before any rank's first timed one (the other rank of
                sent_before = sent_by_link()  # this host reads the same counter)
                dist.barrier()
            start = time.perf_counter()
            counting = SavedBytes(model) if step == 0 else contextlib.nullcontext()
            with counting:
                loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
            if step == 0:
                activations = counting.total
            loss.backward()
            optimizer.step()
            if step < args.time_steps:
                optimizer.zero_grad()
            seconds.append(time.perf_counter() - start)
        dist.barrier()
        sent_after = sent_by_link()
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        report(part="timing", layout=layout, step_s=statistics.median(seconds[1:]),
               params=held_bytes(model.parameters()), grads=held_bytes(p.grad for p in model.parameters()),
               optimizer=held_bytes(state), activations=activations,
               link_sent_per_step=None if sent_before is None else (sent_after - sent_before) / args.time_steps)


for layout in args.layouts:
    one_layout(layout)
