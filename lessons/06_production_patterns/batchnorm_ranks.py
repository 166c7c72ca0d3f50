"""BatchNorm under DDP on 2+ ranks, against BatchNorm on the whole batch in one process.

    torchrun --nproc-per-node 2 batchnorm_ranks.py [MODE ...]   # default: all three

Each rank trains 3 steps on its slice of a fixed global batch (the slices come from
different distributions, as shards of real data can). Every rank also computes the
single-process reference: the same model with plain BatchNorm on the concatenated
batch. Reported per rank and mode: how far its BatchNorm output, running statistics
and gradients are from the reference, and a fingerprint of its running statistics.

    local      nn.BatchNorm1d: each rank normalises with its own slice's statistics
    allreduce  AllReduceBatchNorm1d (sync_batchnorm.py): statistics of the global batch
    torch      nn.SyncBatchNorm (needs GPUs: on CPU it raises)
"""

import copy
import hashlib
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init, report
from sync_batchnorm import AllReduceBatchNorm1d

rank, world_size, device = init()
GLOBAL_BATCH, FEATURES = 32, 6
g = torch.Generator().manual_seed(0)
# Rank r's slice is shifted by r: the ranks see different statistics.
x_all = torch.randn(GLOBAL_BATCH, FEATURES, generator=g) + \
    torch.arange(world_size).repeat_interleave(GLOBAL_BATCH // world_size)[:, None].float()
y_all = torch.randn(GLOBAL_BATCH, 1, generator=g)
per_rank = GLOBAL_BATCH // world_size
mine = slice(rank * per_rank, (rank + 1) * per_rank)


def bn_output(module: nn.Module, forward) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's output, what its BatchNorm layer returned) for one forward."""
    seen = {}
    hook = module.register_forward_hook(lambda m, i, o: seen.update(out=o.detach()))
    out = forward()
    hook.remove()
    return out, seen["out"]


def compare(mode: str) -> dict:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    model = copy.deepcopy(reference)
    if mode == "allreduce":
        bn = AllReduceBatchNorm1d(8)
        bn.load_state_dict(model[1].state_dict())
        model[1] = bn
    elif mode == "torch":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = x_all[mine].to(device), y_all[mine].to(device)
    for step in range(3):
        out, bn_out = bn_output(ddp.module[1], lambda: ddp(x))
        opt.zero_grad()
        nn.functional.mse_loss(out, y).backward()
        ref, ref_bn_out = bn_output(reference[1], lambda: reference(x_all))
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref, y_all).backward()
        grad_diff = max((p.grad.cpu() - q.grad).abs().max().item()
                        for p, q in zip(ddp.module.parameters(), reference.parameters()))
        opt.step()
        ref_opt.step()
    stats, ref_stats = ddp.module[1], reference[1]
    stats_diff = max((stats.running_mean.cpu() - ref_stats.running_mean).abs().max().item(),
                     (stats.running_var.cpu() - ref_stats.running_var).abs().max().item())
    fingerprint = hashlib.sha256(torch.cat([stats.running_mean, stats.running_var]).cpu()
                                 .numpy().tobytes()).hexdigest()[:8]
    return {"bn_output_vs_reference": f"{(bn_out.cpu() - ref_bn_out[mine]).abs().max().item():.1e}",
            "running_stats_vs_reference": f"{stats_diff:.1e}",
            "grads_vs_reference": f"{grad_diff:.1e}", "running_stats_sha": fingerprint}


for mode in sys.argv[1:] or ["local", "allreduce", "torch"]:
    try:
        report(mode=mode, **compare(mode))
    except ValueError as exc:  # nn.SyncBatchNorm on CPU
        report(mode=mode, error=f"{type(exc).__name__}: {exc}")
dist.destroy_process_group()
