"""Solution: data parallelism without DDP, by hand.

DDP does two things for you: it makes every rank start from rank 0's parameters,
and it averages the gradients over the ranks during backward. Do both yourself
with torch.distributed calls, in the two functions below. The training loop is
the one from ddp_train.py, on the plain model (no DDP wrapper).

Check it from the notebook (check_manual_ddp()): it runs this file on 2 ranks and
compares the final parameters with one process training on the whole batch. Or:

    torchrun --standalone --nproc-per-node 2 01_dp_vs_ddp/exercise_manual_ddp.py
"""

import sys
from pathlib import Path

import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "lessons" / "01_dp_vs_ddp"))
from model import PROOF, flat_params, make_batch, make_model, make_optimizer, shard  # noqa: E402

from labutils.dist import init, report  # noqa: E402


def sync_parameters(model: nn.Module) -> None:
    """Give every rank rank 0's parameters (what DDP's constructor does)."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0)


def average_gradients(model: nn.Module, world_size: int) -> None:
    """Replace every parameter's .grad by its mean over the ranks (what DDP's backward does)."""
    for p in model.parameters():
        dist.all_reduce(p.grad)   # SUM over ranks (AVG is not on every backend)
        p.grad /= world_size


if __name__ == "__main__":
    rank, world_size, device = init()
    model = make_model(**PROOF, seed=rank).to(device)  # different on every rank, on purpose
    sync_parameters(model)
    optimizer = make_optimizer(model)
    per_rank_batch, steps = 8, 3
    for step in range(steps):
        x, y = make_batch(step, per_rank_batch * world_size, **PROOF)
        x, y = shard(x, rank, world_size).to(device), shard(y, rank, world_size).to(device)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        average_gradients(model, world_size)
        optimizer.step()
    report(params=flat_params(model), per_rank_batch=per_rank_batch, steps=steps)
    dist.destroy_process_group()
