"""Where a rank's memory goes: parameters, gradients, optimizer state and activations,
for one model trained four ways.

Run it on 4 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 4 12_where_memory_goes/anatomy.py

or from the notebook: launch("12_where_memory_goes/anatomy.py", nproc=4).

The same MLP (model.py) takes one Adam step under each way of splitting it:

- ddp: DistributedDataParallel, every rank holds everything (gradient_as_bucket_view,
  so the gradients are DDP's own bucket buffers, not a second copy);
- zero1: DDP and torch's ZeroRedundancyOptimizer, which keeps the optimizer state of
  1/N of the parameters on each rank;
- fsdp2: fully_shard on every block and on the whole model: parameters, gradients and
  optimizer state are each split in N;
- tp: tensor parallelism (parallelize_module): each block's first Linear split by its
  output features (ColwiseParallel), the second by its input features (RowwiseParallel),
  every rank on the same batch.

What each rank holds after the step is measured by walking the objects: every tensor
of the parameters, their .grad and the optimizer's state, counted once per storage
(a DTensor counts its local piece). Activations are measured as autograd saves them
during the forward pass (torch.autograd.graph.saved_tensors_hooks): the bytes of every
tensor saved for backward that is not a parameter, each storage once. Reported per rank
and way.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # model.py sits next to this file
from model import DIM, batch, make_mlp

from labutils.course.memory import SavedBytes, held_bytes
from labutils.dist import init, report

ROWS = 64  # rows of each rank's batch

rank, world_size, device = init()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def build(way: str):
    model = make_mlp().to(device)
    if way == "ddp":
        wrapped = DDP(model, gradient_as_bucket_view=True)
        return wrapped, torch.optim.Adam(wrapped.parameters(), lr=1e-3)
    if way == "zero1":
        wrapped = DDP(model, gradient_as_bucket_view=True)
        return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.Adam,
                                                lr=1e-3)
    # the mesh names the device init() chose: without one, fully_shard would build its own
    # on the machine's accelerator, a GPU that gloo's ranks on the CPU do not use
    mesh = init_device_mesh(device.type, (world_size,))
    if way == "fsdp2":
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    for block in model:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


for way in ("ddp", "zero1", "fsdp2", "tp"):
    model, optimizer = build(way)
    # tp: every rank of the group works on the same rows; the others: a batch each
    x, y = batch(0 if way == "tp" else rank, rows=ROWS)
    x, y = x.to(device), y.to(device)
    with SavedBytes() as saved:
        loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    if way == "zero1":  # ZeroRedundancyOptimizer keeps its partition's state in .optim
        state = [v for s in optimizer.optim.state.values() for v in s.values() if torch.is_tensor(v)]
    state = [v for v in state if v.dim() > 0]  # Adam's step counters are scalars
    report(part="anatomy", way=way, params=held_bytes(params),
           grads=held_bytes(p.grad for p in params), optimizer=held_bytes(state),
           activations=saved.total, loss=loss.item(),
           numel=sum(local(p).numel() for p in params))
    del model, optimizer, loss
    dist.barrier()

report(part="model", numel=sum(p.numel() for p in make_mlp().parameters()), dim=DIM, rows=ROWS)
dist.destroy_process_group()
