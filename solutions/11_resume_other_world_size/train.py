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
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
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


# A checkpoint folder counts once its save is done: once it holds the file written last,
# the .metadata that dcp.save writes when every rank has written its share.
DONE = ".metadata"


def newest_checkpoint() -> str | None:
    done = glob.glob(os.path.join(args.ckpt_dir, "step-*", DONE))
    folders = [os.path.dirname(path) for path in done]
    return max(folders, key=lambda folder: int(folder.rsplit("-", 1)[1]), default=None)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def training_state(samples_seen: int) -> dict:
    """What a run needs to carry on: the model and the optimizer, keyed by parameter name
    (get_state_dict), which does not depend on the number of ranks, and the position in
    the data, counted over all ranks."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "samples_seen": samples_seen}


start = 0
folder = newest_checkpoint()
if folder is not None:
    # dcp.load fills the tensors of the state it is given, in place: each rank reads what
    # it needs of the files the saving ranks wrote, however many ranks there were.
    state = training_state(0)
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    start = state["samples_seen"] // args.global_batch
    print(f"rank {rank}: resuming at step {start}, from {folder}")
model = DDP(model)


def save_checkpoint(steps_done: int) -> None:
    """Every rank calls it: dcp.save spreads the writing over the ranks, and its .metadata
    tells a run at any world size which rank's file holds what."""
    folder = os.path.join(args.ckpt_dir, f"step-{steps_done}")
    dcp.save(training_state(steps_done * args.global_batch), checkpoint_id=folder)


for step in range(start, args.steps):
    items = items_of(step)
    loss = F.mse_loss(model(inputs[items].to(device)), targets[items].to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    report(step=step, items=items, loss=loss.item())
    if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
        save_checkpoint(step + 1)

fingerprint = hashlib.sha256()
for param in model.parameters():
    fingerprint.update(param.detach().cpu().numpy().tobytes())
report(weights_sha256=fingerprint.hexdigest())
dist.destroy_process_group()
