"""Ranks keep training (printing) until stopped from outside."""
import time

print("starting", flush=True)  # before the slow imports: the log is never empty

import torch
import torch.distributed as dist

from labutils.dist import init

rank, world_size, device = init()
t = torch.ones(1)
step = 0
while True:
    dist.all_reduce(t)
    if step % 20 == 0:
        print(f"step {step}", flush=True)
    step += 1
    time.sleep(0.02)
