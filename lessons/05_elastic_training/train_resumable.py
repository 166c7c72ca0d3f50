"""A DDP training script that can be killed at any moment and resumes exactly.

    torchrun --nproc-per-node 2 --max-restarts 3 train_resumable.py CKPT_DIR
    torchrun --nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:PORT --max-restarts 3 train_resumable.py CKPT_DIR

Every few steps rank 0 writes CKPT_DIR/latest.pt with the whole training state:
model, optimizer, scheduler, grad scaler, the step, the sampler's epoch and
position, and every rank's RNG states (torch, numpy, Python). When torchrun
restarts the ranks (after a crash, or because the set of nodes changed), each rank
loads that file and carries on from there, so that the run ends with the same
parameters, bit for bit, as a run that was never interrupted.

Options (defaults in brackets):
    --steps N         optimizer steps in total [48]
    --save-every K    write a checkpoint after every K steps [4]
    --global-batch B  samples per step for the whole job, split over the ranks [32]
    --state full|model   what the checkpoint holds: everything, or (the common
                      mistake) the model weights and the step only [full]
    --writer atomic|naive   temporary file + os.replace, or straight into latest.pt
"""

import argparse
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from checkpoint import LATEST, read_checkpoint, rng_state, set_rng_state, write_checkpoint
from labutils.dist import init, print0, report
from parts import ResumableSampler, make_dataset, make_model, params_sha256

parser = argparse.ArgumentParser()
parser.add_argument("ckpt_dir")
parser.add_argument("--steps", type=int, default=48)
parser.add_argument("--save-every", type=int, default=4)
parser.add_argument("--global-batch", type=int, default=32)
parser.add_argument("--state", choices=["full", "model"], default="full")
parser.add_argument("--writer", choices=["atomic", "naive"], default="atomic")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

rank, world_size, device = init()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
# The TCP store this attempt's ranks met through (section 1): the agent's own, or one of
# the attempt's own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which launch() sets).
report(restart=restart, master_port=int(os.environ["MASTER_PORT"]),
       agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
ckpt_path = Path(args.ckpt_dir) / LATEST
ckpt_path.parent.mkdir(parents=True, exist_ok=True)

# Same seed on every rank before building the model: identical initial weights.
torch.manual_seed(args.seed)
model = make_model().to(device)
ddp = DDP(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=16, gamma=0.5)
# The scaler matters for float16 on GPUs; it runs (in float32) on CPU too, and its
# state (current scale, steps since the last growth) belongs in the checkpoint.
scaler = torch.amp.GradScaler(device.type, growth_interval=8)

dataset = make_dataset()
sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, seed=args.seed)
# The global batch stays the same whatever the world size: each rank takes its share.
per_rank_batch = args.global_batch // world_size
# A generator of its own: DataLoader draws a seed from the global torch RNG each time
# an epoch starts, which would shift dropout after a resume in the middle of an epoch.
loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler,
                    generator=torch.Generator())

# Dropout and augmentation differ per rank (seed offset), like nanoGPT's seed offset.
torch.manual_seed(args.seed + 1 + rank)
np.random.seed(args.seed + 1 + rank)
random.seed(args.seed + 1 + rank)

step, epoch, position = 0, 0, 0
state = read_checkpoint(ckpt_path, device)
if state is not None:
    model.load_state_dict(state["model"])
    step = state["step"]
    if args.state == "full":
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        epoch, position = state["epoch"], state["position"]
        saved_rngs = state["rng"]
        if len(saved_rngs) == world_size:
            set_rng_state(saved_rngs[rank])
        else:  # the membership changed: rank r is not the process it was
            print0(f"world size {len(saved_rngs)} -> {world_size}: every rank keeps "
                   "its fresh RNG seed")
    else:  # the usual shortcut: weights and step only; the data order is recomputed
        steps_per_epoch = len(dataset) // args.global_batch
        epoch, position = divmod(step, steps_per_epoch)
        position *= args.global_batch
    print0(f"restart {restart}: resumed from step {step} (epoch {epoch}, position "
           f"{position}), world size {world_size}")


def save_checkpoint() -> None:
    """Rank 0 writes every rank's state; the others wait at the barrier."""
    rngs = [None] * world_size if rank == 0 else None
    dist.gather_object(rng_state(), rngs, dst=0)  # each rank's own RNG streams
    if rank == 0:
        full = {"model": model.state_dict(), "step": step}  # model, not ddp: no "module."
        if args.state == "full":
            full.update(optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                        scaler=scaler.state_dict(), epoch=epoch, position=position,
                        rng=rngs, world_size=world_size)
        write_checkpoint(full, ckpt_path, writer=args.writer,
                         halfway=lambda: report(step=step - 1, phase="save"))
    dist.barrier()  # nobody may read (or crash into) a checkpoint that is not complete


while step < args.steps:
    sampler.set_epoch(epoch)
    sampler.set_position(position)
    for x, y, index in loader:
        x = x + torch.from_numpy(np.random.normal(0, 0.05, x.shape).astype(np.float32))
        x[:, random.randrange(x.shape[1])] = 0.0  # augmentation: drop one feature
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # unscale before clipping, or the clip sees scaled grads
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        step, position = step + 1, position + args.global_batch
        report(step=step - 1, loss=loss.item(), lr=scheduler.get_last_lr()[0],
               world_size=world_size, restart=restart, index=index.tolist())
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint()
        if step == args.steps:
            break
    else:  # the epoch is used up
        epoch, position = epoch + 1, 0

digest = params_sha256(model)
report(params_sha256=digest, steps=step)
print0(f"finished {step} steps at world size {world_size}; parameters sha256 {digest[:16]}")
dist.destroy_process_group()
