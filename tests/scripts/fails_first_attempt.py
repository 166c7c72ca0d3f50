"""The last rank exits 3 the first time (it leaves the file MARKER, the script's argument);
then every rank all-reduces and prints its sum: a job that recovers with one restart.

The marker, not TORCHELASTIC_RESTART_COUNT: each torchrun agent counts its own restarts,
and an agent whose ranks were restarted because another node's failed keeps its count
(seen across two agents, torch 2.13), so the count cannot say which attempt this is."""
import datetime
import os
import sys

import torch
import torch.distributed as dist

marker = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank, world = dist.get_rank(), dist.get_world_size()
if rank == world - 1 and not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(3)
t = torch.ones(1)
dist.all_reduce(t)
# One write per line: a pod's ranks share its output pipe, and with PYTHONUNBUFFERED (the
# manifests set it) print() writes the text and the newline apart, so two ranks' lines
# could interleave ("rank 3 of 4 sum 4rank 2 of 4 sum 4", seen once in a fresh-clone run);
# a write of under PIPE_BUF bytes to a pipe is atomic.
os.write(1, f"rank {rank} of {world} sum {t.item():.0f}\n".encode())
dist.destroy_process_group()
