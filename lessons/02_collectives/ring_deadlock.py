"""The ring all-reduce with blocking send() then recv(): it deadlocks, even for 4 bytes.

    torchrun --standalone --nproc-per-node 3 02_collectives/ring_deadlock.py

Every rank first calls dist.send() to its right neighbour. gloo's send returns only
once the receiver has posted the matching recv(), and every receiver is itself
stuck in send(): a cycle of waits with no way out. Nothing fails and nothing
prints; run it through launch(..., hang_timeout=3) to see where each rank waits.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from ring import blocking_ring_all_reduce  # noqa: E402

from labutils.dist import init, print0  # noqa: E402

rank, world_size, device = init()
x = torch.ones(world_size, device=device)  # one float per chunk: 4 bytes per message
print0(f"blocking ring all-reduce of {x.numel() * x.element_size()} bytes on {world_size} ranks...")
blocking_ring_all_reduce(x)
print0("done (never printed)")
dist.destroy_process_group()
