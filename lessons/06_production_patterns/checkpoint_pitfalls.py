"""Three checkpoint mistakes under DDP, each shown for real on 2 ranks.

    torchrun --nproc-per-node 2 checkpoint_pitfalls.py CKPT_DIR

1. The `module.` prefix: ddp.state_dict() names every tensor "module.<name>"; a plain
   model (for evaluation, export, a single-GPU run) refuses those keys.
2. No barrier: rank 0 writes the checkpoint (slowly, like a big model on a shared disk)
   and rank 1 reads it straight away: it finds no file, or half of one.
3. With the barrier, rank 1 reads the complete file, and map_location puts the tensors
   on rank 1's own device (on GPUs: cuda:1, not the cuda:0 they were saved from).
"""

import io
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.dist import init, report

rank, world_size, device = init()
ckpt = Path(sys.argv[1]) / "model.pt"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).to(device)
ddp = DDP(model)

# 1. the prefix
if rank == 0:
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    try:
        plain.load_state_dict(ddp.state_dict())
        prefix_error = "none"
    except RuntimeError as exc:
        prefix_error = str(exc).splitlines()[1].strip()[:60]
    report(ddp_keys=list(ddp.state_dict())[:2], module_keys=list(ddp.module.state_dict())[:2],
           strict_load_of_ddp_state_dict=prefix_error)


def slow_save(state: dict, path: Path) -> None:
    """torch.save in two halves with a pause between: a big file on a slow disk."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        time.sleep(1.5)
        f.write(data[len(data) // 2:])


def try_load(path: Path) -> str:
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        return f"loaded, on {next(iter(state.values())).device}"
    except FileNotFoundError:
        return "no file yet"
    except (RuntimeError, OSError, EOFError) as exc:
        return f"broken file ({type(exc).__name__})"


# 2. without a barrier
dist.barrier()  # both ranks start this part together
if rank == 0:
    slow_save(model.state_dict(), ckpt)
else:
    time.sleep(0.5)  # rank 0 is in the middle of the write now
    report(without_barrier=try_load(ckpt))

# 3. with the barrier
dist.barrier()
if rank == 0:
    ckpt.unlink()
dist.barrier()
if rank == 0:
    slow_save(model.state_dict(), ckpt)
dist.barrier()  # nobody reads before the file is complete
report(with_barrier=try_load(ckpt))
dist.destroy_process_group()
