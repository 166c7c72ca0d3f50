"""Class counts summed over the ranks, one all_reduce per class, in each rank's own order.

    torchrun --standalone --nproc-per-node 2 class_counts.py
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 class_counts.py

Each rank counts the labels of its part of the data with collections.Counter (to
weight the loss by class frequency, say) and sums every class's count over the
ranks. A Counter lists the classes in the order it first met them, which differs
from rank to rank. The all_reduce calls pair up by order, and all of them have the
same shape, so counts of different classes are added together: no error, no hang,
wrong numbers. TORCH_DISTRIBUTED_DEBUG=DETAIL compares the calls' fingerprints
(operation, shapes, dtypes), which are identical here, so it sees nothing either.
The fix is one all_reduce of a tensor in an order every rank agrees on.
"""

from collections import Counter

import torch
import torch.distributed as dist

from labutils.dist import init, report

CLASSES = ("cat", "dog", "bird")

rank, world_size, device = init()
picks = torch.randint(0, len(CLASSES), (50,), generator=torch.Generator().manual_seed(100 + rank))
labels = [CLASSES[i] for i in picks.tolist()]  # this rank's part of the data
counts = Counter(labels)

summed = {}
for name, n in counts.items():  # the bug: each rank iterates in its own order
    total = torch.tensor(float(n), device=device)
    dist.all_reduce(total)
    summed[name] = int(total.item())

# The fix: one tensor, in the order of CLASSES on every rank.
fixed = torch.tensor([float(counts[name]) for name in CLASSES], device=device)
dist.all_reduce(fixed)

print(f"counted {dict(counts)}; summed one class at a time {summed}")
report(order=list(counts), own={name: counts[name] for name in CLASSES},
       summed={name: summed[name] for name in CLASSES},
       correct=dict(zip(CLASSES, (int(v) for v in fixed.tolist()))),
       debug_level=str(dist.get_debug_level()))
dist.destroy_process_group()
