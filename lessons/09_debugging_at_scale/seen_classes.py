"""Label counts summed over the ranks as one tensor, built from the labels each rank saw.

    torchrun --standalone --nproc-per-node 2 seen_classes.py
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 seen_classes.py

The dataset (digits 0 to 8, half of them zeros) is sorted by label and cut into
contiguous parts, one per rank: a common accident. Rank 0 holds only zeros, rank 1
the digits 1 to 8. Each rank builds its tensor of counts from the labels it has seen,
1 number on rank 0 and 8 on rank 1, and the all_reduce pairs arrays of different
sizes. gloo finds out only when the data arrives: rank 0 receives more bytes than it
expects, throws a C++ exception that nothing catches, and the process aborts (SIGABRT,
no Python traceback). With TORCH_DISTRIBUTED_DEBUG=DETAIL the fingerprints (shapes [1]
and [8]) differ, and both ranks raise at once, before any data moves. The fix: count
over the list of every label, which all ranks share.
"""

from collections import Counter

import torch
import torch.distributed as dist

from labutils.dist import init

rank, world_size, device = init()
labels = sorted([0] * 48 + [1, 2, 3, 4, 5, 6, 7, 8] * 6)   # sorted by label
part = len(labels) // world_size
counts = Counter(labels[rank * part:(rank + 1) * part])  # this rank's contiguous part
seen = sorted(counts)                                     # the bug: differs from rank to rank
print(f"labels seen: {seen}", flush=True)
total = torch.tensor([float(counts[label]) for label in seen], device=device)
dist.all_reduce(total)
print(f"summed: {dict(zip(seen, total.tolist()))}")
dist.destroy_process_group()
