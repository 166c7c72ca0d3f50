"""Train with a fixed global batch, checkpoint, and resume on another number of ranks.

Every step trains on --global-batch items (12), split evenly over the ranks: at 2, 3, 4
or 6 ranks the run takes the same steps on the same items. Every --save-every steps and
when the run ends, a checkpoint goes to its own folder, --ckpt-dir/step-N; a run that
finds one resumes from the newest, whatever the number of ranks it was started with.
A job that ran 4 steps on 3 ranks, then gets 2:

    torchrun --nproc-per-node 3 train.py --steps 4 --ckpt-dir ckpt
    torchrun --nproc-per-node 2 train.py --steps 10 --ckpt-dir ckpt
    launch("train.py", nproc=3, args=["--steps", "4", "--ckpt-dir", "ckpt"])

Each rank reports every step the items it trained on and its loss
(report(step=..., items=[...], loss=...)); the loss of a step is the ranks' mean.
"""

import argparse
import functools
import glob
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init, report

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=10, help="train until this many steps are done")
parser.add_argument("--global-batch", type=int, default=12, help="items per step, all ranks")
parser.add_argument("--save-every", type=int, default=5)
parser.add_argument("--ckpt-dir", default="checkpoints")
args = parser.parse_args()

rank, world_size, device = init()
if args.global_batch % world_size:
    raise SystemExit(f"--global-batch {args.global_batch} does not split over {world_size} ranks: "
                     "pick a world size that divides it")
per_rank = args.global_batch // world_size

# The data: 96 items, shuffled anew every epoch, in the same order on every rank.
generator = torch.Generator().manual_seed(0)
inputs = torch.randn(96, 4, generator=generator)
targets = inputs.sum(dim=1, keepdim=True).sin()


@functools.cache
def epoch_order(epoch: int) -> list[int]:
    return torch.randperm(len(inputs), generator=torch.Generator().manual_seed(epoch)).tolist()


def items_of(step: int) -> list[int]:
    """This rank's share of a step's global batch: the step's global_batch positions in
    the stream of shuffled epochs, cut in world_size slices."""
    first = step * args.global_batch + rank * per_rank
    return [epoch_order(p // len(inputs))[p % len(inputs)] for p in range(first, first + per_rank)]


# A checkpoint folder counts once its save is done: once it holds the file written last.
DONE = "model.pt"


def newest_checkpoint() -> str | None:
    done = glob.glob(os.path.join(args.ckpt_dir, "step-*", DONE))
    folders = [os.path.dirname(path) for path in done]
    return max(folders, key=lambda folder: int(folder.rsplit("-", 1)[1]), default=None)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

samples_seen = 0  # items this rank has trained on
start = 0
folder = newest_checkpoint()
if folder is not None:
    checkpoint = torch.load(os.path.join(folder, DONE), map_location=device)
    model.load_state_dict(checkpoint["model"])
    samples_seen = checkpoint["samples_seen"]
    start = samples_seen // per_rank
    print(f"rank {rank}: resuming at step {start}, from {folder}")
model = DDP(model)


def save_checkpoint(steps_done: int) -> None:
    folder = os.path.join(args.ckpt_dir, f"step-{steps_done}")
    if rank == 0:  # every rank holds the same model
        os.makedirs(folder, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "samples_seen": samples_seen},
                   os.path.join(folder, DONE + ".partial"))
        os.replace(os.path.join(folder, DONE + ".partial"), os.path.join(folder, DONE))
    dist.barrier()


for step in range(start, args.steps):
    items = items_of(step)
    loss = F.mse_loss(model(inputs[items].to(device)), targets[items].to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    samples_seen += len(items)
    report(step=step, items=items, loss=loss.item())
    if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
        save_checkpoint(step + 1)

fingerprint = hashlib.sha256()
for param in model.parameters():
    fingerprint.update(param.detach().cpu().numpy().tobytes())
report(weights_sha256=fingerprint.hexdigest())
dist.destroy_process_group()
