"""FSDP2 in practice: mixed precision, gradient clipping on DTensors, HSDP on a 2-D mesh.

Run it on 4 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 4 10_current_stack/fsdp_practice.py

or from the notebook: launch("10_current_stack/fsdp_practice.py", nproc=4).

The model is MLP(512, 4) (models.py): four layers of 1 MiB and a head, each layer a
fully_shard group of its own, and the root (the head) one more.

Part 1 (precision): STEPS Adam steps, from the same weights on the same data, under
three MixedPrecisionPolicy settings: the default (float32 throughout), bf16 parameters with
float32 gradient reduction, bf16 for both. Reported: the losses, the collectives of the
last step (CollectiveCounter: CommDebugMode with sizes), the dtypes of what it held.
Part 2 (clip): one backward, then clip_grad_norm_ over the sharded gradients (DTensors),
against the same clip in one process on the whole batch (rank 0 builds that reference
itself). Reported: the norms, whether the clipped gradients agree, the collectives the
clip issued, and the norm of each rank's own shard.
Part 3 (HSDP): the float32 run of part 1 again on a 2 x 2 mesh (replicate x shard):
parameters sharded over 2 ranks, and replicated twice. Reported: the losses, the
collectives of the last step per mesh dimension, the bytes of parameters each rank holds.
"""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from labutils.course.comm_count import CollectiveCounter
from labutils.dist import init, report
from models import MLP, mse, regression_batch

WIDTH, DEPTH, STEPS, MAX_NORM = 512, 4, 8, 0.05

rank, world_size, device = init()
if world_size != 4:
    raise SystemExit(f"fsdp_practice.py needs 4 ranks (a 2 x 2 mesh for HSDP), not {world_size}")
torch.set_num_threads(1)  # the ranks share this machine's cores
mesh_1d = init_device_mesh(device.type, (4,), mesh_dim_names=("shard",))
mesh_2d = init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))


def sharded_model(mesh, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()):
    """MLP(WIDTH, DEPTH) with a fully_shard group per layer and one for the root (the
    head). MixedPrecisionPolicy() is FSDP2's default: no casting, float32 throughout."""
    torch.manual_seed(0)
    model = MLP(WIDTH, DEPTH).to(device)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    return fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def train(model, mesh) -> tuple[list[float], list[dict], dict]:
    """STEPS Adam steps; the losses, the collectives of the last step, and the dtypes
    of what the last step held (sharded parameters, their gradients, the model's output)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in regression_batch(rank, step, width=WIDTH))
        with CollectiveCounter(mesh) as comm:
            output = model(x)
            loss = mse(output, y)
            loss.backward()
        weight = model.layers[0].weight
        dtypes = {"parameters": weight.dtype, "gradients": weight.grad.dtype, "output": output.dtype}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, comm.calls, {k: str(v).replace("torch.", "") for k, v in dtypes.items()}


# Part 1: mixed precision.
POLICIES = {
    "float32": MixedPrecisionPolicy(),
    "bf16 params, fp32 reduce": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16 params, bf16 reduce": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
}
def held_bytes(model) -> int:
    """Bytes of the parameter shards this rank holds."""
    return sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())


fp32_losses = None
for name, policy in POLICIES.items():
    model = sharded_model(mesh_1d, policy)
    if name == "float32":
        report(part="held 1-D", held_bytes=held_bytes(model))
    losses, calls, dtypes = train(model, mesh_1d)
    fp32_losses = fp32_losses or losses
    if rank == 0:
        report(part="precision", policy=name, losses=losses, calls=calls, dtypes=dtypes)

# Part 2: clip_grad_norm_ over DTensor gradients, against one process on the whole batch.
model = sharded_model(mesh_1d)
x, y = regression_batch(rank, 0, width=WIDTH)
mse(model(x.to(device)), y.to(device)).backward()  # FSDP2 averages the gradients over the ranks
own_shards = torch.linalg.vector_norm(torch.stack([p.grad.to_local().norm() for p in model.parameters()]))
with CollectiveCounter(mesh_1d) as comm:
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
clipped = [p.grad.full_tensor() for p in model.parameters()]  # every rank: all-gathers
report(part="clip shard", own_shard_norm=own_shards.item())
if rank == 0:
    torch.manual_seed(0)
    reference = MLP(WIDTH, DEPTH)  # one process, the 4 ranks' batches together
    batches = [regression_batch(r, 0, width=WIDTH) for r in range(world_size)]
    mse(reference(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches])).backward()
    reference_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    try:
        torch.testing.assert_close([g.cpu() for g in clipped], [p.grad for p in reference.parameters()])
        gradients = "equal (assert_close)"
    except AssertionError:
        gradients = "DIFFERENT"
    report(part="clip", max_norm=MAX_NORM, total_norm=total.full_tensor().item(), total_type=type(total).__name__,
           total_placements=str(total.placements), reference_norm=reference_total.item(),
           clipped_gradients=gradients, calls=comm.calls)

# Part 3: HSDP, the float32 run on a 2 x 2 mesh.
model = sharded_model(mesh_2d)
held = held_bytes(model)
losses, calls, _ = train(model, mesh_2d)
if rank == 0:
    try:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32_losses))
        same = "equal (assert_close)"
    except AssertionError:
        same = "DIFFERENT"
    report(part="hsdp", losses=losses, calls=calls, vs_fsdp=same, bitwise=losses == fp32_losses)
report(part="held", held_bytes=held)
torch.distributed.destroy_process_group()
