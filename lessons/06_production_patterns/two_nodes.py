"""One script, two machines: 2 nodes x 2 ranks all-reduce a 1 MiB "gradient".

Nothing in it knows about nodes: torchrun on each machine sets RANK (global),
LOCAL_RANK (on this machine), GROUP_RANK (the node's rank) and WORLD_SIZE, and
init_process_group() meets the other machine's ranks through the rendezvous.
Run one command per machine, the same except for --node-rank:

    # machine 0 (reachable from machine 1 as node0):
    labutils launch -n 2 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500 \\
        --rdzv-id demo two_nodes.py
    # machine 1:
    labutils launch -n 2 --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29500 \\
        --rdzv-id demo two_nodes.py

(plain torchrun: torchrun --nnodes 2 --node-rank K --nproc-per-node 2
--master-addr node0 --master-port 29500 two_nodes.py). Each rank reports where it
runs and the sum every rank must get: 1 + 2 + 3 + 4 = 10.
"""

import os

import torch
import torch.distributed as dist

from labutils.dist import init, report

PAYLOAD = 1 << 18  # float32 values per all_reduce: 1 MiB, so the traffic stands out
STEPS = 4

rank, world_size, device = init()
gradient = torch.full((PAYLOAD,), float(rank + 1), device=device)
for step in range(STEPS):
    summed = gradient.clone()
    dist.all_reduce(summed)  # a ring over ranks 0-1-2-3: two of its links cross machines

report(group_rank=int(os.environ["GROUP_RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
       local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]), world_size=world_size,
       sum=summed[0].item(), payload_bytes=PAYLOAD * 4, steps=STEPS,
       ifname=os.environ.get("GLOO_SOCKET_IFNAME", ""))
dist.destroy_process_group()
