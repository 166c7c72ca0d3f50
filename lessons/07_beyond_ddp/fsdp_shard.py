"""Parameter sharding with FSDP2 (fully_shard) on a CPU device mesh, against DDP.

Run it on 2 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 07_beyond_ddp/fsdp_shard.py

or from the notebook: launch("07_beyond_ddp/fsdp_shard.py", nproc=2).

Three runs of STEPS Adam steps from the same weights and data:

- DDP: every rank holds everything (BucketRecorder counts its all-reduces);
- FSDP2: fully_shard on each transformer block, then on the whole model (the root:
  embeddings, final LayerNorm and head), reshard_after_forward left at its default
  (True for the blocks; FSDP2 sets it to False for the root);
- FSDP2 with reshard_after_forward=False everywhere (ZeRO-2-like: parameters stay
  gathered from forward to backward).

Per run and rank: the bytes of its parameters, gradients and Adam state (DTensors:
the local shard), the loss of every step, the collectives of the last step per phase
(CollectiveLog on all_gather_single / reduce_scatter_single, which FSDP2 calls). At the
end: each FSDP run's loss curve against DDP's (assert_close
with float32's default tolerances, and bitwise), and its final full weights (bitwise,
and the largest difference).
"""

import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))  # models.py and probes.py sit next to this file
from models import TinyTransformer, lm_loss, token_batch  # noqa: E402
from probes import CollectiveLog, optimizer_state_tensors, storage_bytes  # noqa: E402

from labutils.course.ddp_probes import BucketRecorder  # noqa: E402
from labutils.dist import init, report  # noqa: E402

STEPS, LR = 12, 1e-2
rank, world_size, device = init()
mesh = init_device_mesh(device.type, (world_size,))
RUNS = {"DDP": None, "FSDP2": {}, "FSDP2, reshard_after_forward=False": {"reshard_after_forward": False}}


def full_weights(model) -> list[torch.Tensor]:
    """Every parameter in full on this rank (FSDP: gathered from the shards)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


results: dict[str, dict] = {}
for name, options in RUNS.items():
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    buckets = None
    if options is None:
        trained = DDP(model)
        buckets = BucketRecorder(trained)
    else:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)  # the root: what no block holds
        trained = model
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)  # FSDP: built on the sharded parameters
    losses = []
    with CollectiveLog(["all_gather_single", "reduce_scatter_single"]) as log:
        for step in range(STEPS):
            x, y = (t.to(device) for t in token_batch(rank, step))
            log.calls.clear()
            if buckets:
                buckets.clear()
            log.phase = "forward"
            loss = lm_loss(trained(x), y)
            log.phase = "backward"
            loss.backward()
            log.phase = "optimizer step"
            optimizer.step()
            if step == STEPS - 1:  # the gradients as they are before zero_grad
                grads = storage_bytes(p.grad for p in model.parameters())
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    calls = [c.to_json() for c in log.calls]
    if buckets:
        calls += [{"op": "all_reduce", "nbytes": c.nbytes, "phase": "backward", "peer": None} for c in buckets.calls]
    results[name] = {"losses": losses, "weights": full_weights(model)}
    report(part="run", run=name, losses=losses,
           parameters=storage_bytes(model.parameters()), gradients=grads,
           optimizer_state=storage_bytes(optimizer_state_tensors(optimizer.state)),
           parameter_count=sum(p.numel() for p in model.parameters()), calls=calls)

reference = results["DDP"]
for name, res in results.items():
    try:  # float32's default tolerances: a few units in the last place of the loss
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(reference["losses"]))
        curve = "equal (assert_close)"
    except AssertionError:
        curve = "DIFFERENT"
    report(part="check", run=name, loss_curve=curve,
           losses_bitwise=res["losses"] == reference["losses"],
           max_loss_diff=max(abs(a - b) for a, b in zip(res["losses"], reference["losses"])),
           weights_bitwise=all(torch.equal(a, b) for a, b in zip(res["weights"], reference["weights"])),
           max_abs_diff=max((a - b).abs().max().item() for a, b in zip(res["weights"], reference["weights"])))
torch.distributed.destroy_process_group()
