"""FSDP2 against DDP on a wire: the time and the bytes of one training step.

Run it on a virtual cluster of 2 hosts with 1 rank each, from the lessons folder:

    from labutils.cluster import virtual_cluster
    cluster = virtual_cluster(2, link="200mbit")
    cluster.launch("07_beyond_ddp/fsdp_wire.py", nproc=1)

or with plain torchrun on 2 ranks of one machine (then no bytes are counted):

    torchrun --standalone --nproc-per-node 2 07_beyond_ddp/fsdp_wire.py

The same TinyTransformer, from the same weights, trained four ways that take turns
step by step, so that whatever else loads the machine slows every way alike:

- compute only: the plain model on this rank's batch, no communication at all;
- DDP: gradients all-reduced in buckets while backward runs;
- FSDP2: fully_shard on each block and on the root, default settings;
- FSDP2 with an all-to-all reduce-scatter: the same, with the reduce-scatter replaced
  (set_custom_reduce_scatter) by AllToAllReduceScatter below, which sends a rank's
  (n-1)/n of the gradients, as a ring reduce-scatter does. gloo's own
  reduce_scatter_single (once reduce_scatter_tensor) all-reduces the whole input and
  keeps its chunk.

Per way and step: the step time; the bytes this rank's host link sent during the step
(labutils.dist.link_bytes(): the counters that cluster.counters(host) reads from
outside, read by the rank from its own network namespace; after a barrier, so that every byte of
the step has left); the time this rank spent inside FSDP2's collectives (a clock around
each call); the collectives FSDP2 issued (CollectiveLog); the loss.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # models.py and probes.py sit next to this file
from models import TinyTransformer, lm_loss, token_batch  # noqa: E402
from probes import CollectiveLog  # noqa: E402

from labutils.dist import init, link_bytes, report  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6, help="timed steps per way, after 2 warm-up steps")
args = parser.parse_args()

rank, world_size, device = init()
mesh = init_device_mesh(device.type, (world_size,))
def bytes_sent() -> int | None:
    """Bytes this host's link has sent so far (None: not on a virtual cluster)."""
    counters = link_bytes()
    return None if counters is None else counters["sent"]


class AllToAllReduceScatter:
    """A reduce-scatter that sends (n-1)/n of the input: chunk j goes to rank j
    (all_to_all_single), and each rank adds the n chunks it received for its shard."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        n = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)  # chunk j to rank j
        torch.sum(received.view(n, -1), dim=0, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(n)
        elif op != dist.ReduceOp.SUM:
            raise ValueError(f"AllToAllReduceScatter adds or averages; FSDP2 asked for {op}")


WAYS = ["compute only", "DDP", "FSDP2", "FSDP2, all-to-all reduce-scatter"]


def build(way: str):
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    trained = model
    if way == "DDP":
        trained = DDP(model)
    elif way.startswith("FSDP2"):
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root: embeddings, final LayerNorm, head
        if way == "FSDP2, all-to-all reduce-scatter":
            for module in [*model.blocks, model]:  # one setting per fully_shard group
                module.set_custom_reduce_scatter(AllToAllReduceScatter())
    return trained, torch.optim.Adam(model.parameters(), lr=1e-2)


models = {way: build(way) for way in WAYS}
plain = models["compute only"][0]
probe = torch.randn(world_size * 1000, generator=torch.Generator().manual_seed(rank))
mine, gloos = torch.empty(1000), torch.empty(1000)
AllToAllReduceScatter()(mine, probe, dist.group.WORLD, dist.ReduceOp.AVG)
# torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
reduce_scatter_single(gloos, probe, op=dist.ReduceOp.AVG)
report(part="wire model", parameter_bytes=sum(p.numel() * p.element_size() for p in plain.parameters()),
       all_to_all_reduce_scatter_ok=torch.allclose(mine, gloos))  # the same average as gloo's
inside: list[float] = []  # seconds spent inside each collective of the step, in call order


def clocked(real):
    """A collective with a clock around it: records how long the caller spent inside."""
    def call(*a, **k):
        start = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            inside.append(time.perf_counter() - start)
    return call


losses: dict[str, list[float]] = {}
with CollectiveLog(["all_gather_single", "reduce_scatter_single", "all_to_all_single"]) as log:
    for name in log.installed:  # the older names on a torch before 2.13
        setattr(dist, name, clocked(getattr(dist, name)))  # restored when the log closes
    for step in range(2 + args.steps):
        x, y = (t.to(device) for t in token_batch(rank, step))
        for way in WAYS:
            trained, optimizer = models[way]
            dist.barrier()  # both ranks start the step together, with nothing in flight
            log.calls.clear()
            inside.clear()
            before = bytes_sent()
            start = time.perf_counter()
            loss = lm_loss(trained(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - start
            dist.barrier()  # the other rank has received every byte of this step
            after = bytes_sent()
            losses.setdefault(way, []).append(loss.item())
            if step < 2:  # warm-up: DDP rebuilds its buckets, FSDP2 initialises lazily
                report(part="wire warm-up", way=way, step=step, sent=None if before is None else after - before)
                continue
            report(part="wire step", way=way, step=step, step_s=seconds,
                   sent=None if before is None else after - before, loss=loss.item(),
                   calls=[{"op": c.op, "nbytes": c.nbytes, "s": s} for c, s in zip(log.calls, inside)])

for way in WAYS[2:]:  # the FSDP2 ways learn what DDP learns, whatever their reduce-scatter
    try:
        torch.testing.assert_close(torch.tensor(losses[way]), torch.tensor(losses["DDP"]))
        verdict = "equal (assert_close)"
    except AssertionError:
        verdict = "DIFFERENT"
    report(part="wire check", way=way, losses=verdict)
dist.destroy_process_group()
