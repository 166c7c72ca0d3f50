"""Sharded checkpoints with torch.distributed.checkpoint (DCP), saved on 4 ranks.

Run it on 4 ranks, then load on 2 with dcp_load.py, from the lessons folder:

    torchrun --standalone --nproc-per-node 4 10_current_stack/dcp_save.py --ckpt-dir CKPT
    torchrun --standalone --nproc-per-node 2 10_current_stack/dcp_load.py --ckpt-dir CKPT

The model (ckpt_state.py) has 25 MB of parameters; with Adam's two moments its
training state is 76 MB.

Part 1: DDP, 2 Adam steps, dcp.save into CKPT/ddp.
Part 2: FSDP2, 2 Adam steps, dcp.async_save into CKPT/fsdp; training goes on (one
        step) while the checkpoint is written.
Part 3: timings on the FSDP2 model, ROUNDS rounds of three ways to save:
        - "torch.save on rank 0" (lesson 05's way): the full state gathered onto rank 0,
          written to a temporary file, fsync, os.replace; the others wait at a barrier;
        - dcp.save: every rank writes its own shard, then rank 0 writes .metadata;
        - dcp.async_save: the state is copied to memory, the files are written by a
          background thread while training goes on.
        The timing checkpoints are removed at the end.

Reported: for parts 1 and 2, fingerprints of the state at the moment of saving (and,
for part 2, after the step taken meanwhile) and the checkpoint's files with their
sizes; for part 3, per rank and way, the seconds training was blocked and the seconds
until the checkpoint was on disk.
"""

import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh

from ckpt_state import build, fingerprints, train_step, training_state
from labutils.dist import init, report

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", default="checkpoints", help="where the checkpoints go")
parser.add_argument("--rounds", type=int, default=3,  # a median of 3: one slow save does not decide
                    help="timing rounds per way of saving (the tables take the median)")
args = parser.parse_args()

rank, world_size, device = init()
torch.set_num_threads(1)  # the ranks share this machine's cores
mesh = init_device_mesh(device.type, (world_size,))
# async_save runs its own collectives (which rank writes what) from a background thread
# while training runs collectives too: on one process group the two streams could
# interleave differently on different ranks. A group of its own keeps them apart; gloo
# even when training runs on NCCL, since async_save needs a group that works on CPU.
checkpoint_group = dist.new_group(backend="gloo")


def files_of(folder: str) -> list[list]:
    return [[name, os.path.getsize(os.path.join(folder, name))] for name in sorted(os.listdir(folder))]


# Part 1: DDP.
model, optimizer, trained = build("DDP", mesh, device)
for step in range(2):
    train_step(trained, optimizer, rank=rank, step=step, device=device)
dcp.save(training_state(model, optimizer), checkpoint_id=os.path.join(args.ckpt_dir, "ddp"))
saved = fingerprints(model, optimizer)
if rank == 0:
    report(part="saved", checkpoint="ddp", wrapper="DDP", fingerprints=saved,
           files=files_of(os.path.join(args.ckpt_dir, "ddp")))

# Part 2: FSDP2, saved asynchronously while training goes on.
model, optimizer, trained = build("FSDP2", mesh, device)
for step in range(2):
    train_step(trained, optimizer, rank=rank, step=step, device=device)
saved = fingerprints(model, optimizer)  # the state async_save is given
future = dcp.async_save(training_state(model, optimizer), checkpoint_id=os.path.join(args.ckpt_dir, "fsdp"),
                        process_group=checkpoint_group)
train_step(trained, optimizer, rank=rank, step=2, device=device)  # changes the parameters meanwhile
future.result()  # the checkpoint is complete
after = fingerprints(model, optimizer)
if rank == 0:
    report(part="saved", checkpoint="fsdp", wrapper="FSDP2", fingerprints=saved, after_step=after,
           files=files_of(os.path.join(args.ckpt_dir, "fsdp")))

# Part 3: what each way of saving costs the training loop.
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to rank 0, in CPU memory
STEPS_DURING_ASYNC = 2
timing_dir = os.path.join(args.ckpt_dir, "timing")
os.makedirs(timing_dir, exist_ok=True)
step = 3


def save_on_rank0(path: str) -> None:
    """Lesson 05's checkpoint: the full state on rank 0, written atomically."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=FULL_STATE)  # every rank: a gather
    if rank == 0:
        with open(path + ".tmp", "wb") as f:
            torch.save({"model": model_state, "optimizer": optimizer_state}, f)
            f.flush()
            os.fsync(f.fileno())  # on disk, not only in the page cache
        os.replace(path + ".tmp", path)
    dist.barrier()  # nobody trains on before the file is there


for round_ in range(args.rounds):
    for way in ["torch.save on rank 0", "dcp.save", "dcp.async_save"]:
        path = os.path.join(timing_dir, f"{way.replace(' ', '_')}-{round_}")
        step_s = []
        dist.barrier()  # all ranks start each save together
        start = time.perf_counter()
        if way == "torch.save on rank 0":
            save_on_rank0(path)
        elif way == "dcp.save":  # returns when every rank's file and the .metadata are written
            dcp.save(training_state(model, optimizer), checkpoint_id=path)
        blocked = durable = time.perf_counter() - start
        if way == "dcp.async_save":
            future = dcp.async_save(training_state(model, optimizer), checkpoint_id=path,
                                    process_group=checkpoint_group)
            blocked = time.perf_counter() - start  # training resumes here
            finished = []
            future.add_done_callback(lambda _: finished.append(time.perf_counter()))
            for _ in range(STEPS_DURING_ASYNC):
                begin = time.perf_counter()
                train_step(trained, optimizer, rank=rank, step=step, device=device)
                step_s.append(time.perf_counter() - begin)
                step += 1
            future.result()
            durable = finished[0] - start
        report(part="timing", round=round_, way=way, blocked_s=blocked, durable_s=durable, step_s=step_s)
    # a few plain steps: what a training step costs when nothing is being saved
    plain = []
    for _ in range(STEPS_DURING_ASYNC):
        begin = time.perf_counter()
        train_step(trained, optimizer, rank=rank, step=step, device=device)
        plain.append(time.perf_counter() - begin)
        step += 1
    report(part="timing", round=round_, way="no checkpoint", blocked_s=0.0, durable_s=None, step_s=plain)

dist.barrier()
if rank == 0:
    shutil.rmtree(timing_dir)  # the timing checkpoints, 76 MB each: only their times were wanted
dist.destroy_process_group()
