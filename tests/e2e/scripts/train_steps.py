"""A small data-parallel training loop for the browser tests; it can fail or hang on purpose.

    torchrun --standalone --nproc-per-node 2 train_steps.py --steps 40 --sleep 0.25
    ... --fail-rank 1 --fail-step 5     rank 1 raises at step 5, its peer dies in all_reduce
    ... --stuck-rank 1 --stuck-step 5   rank 1 stops at step 5, its peer waits: a hang

Every step each rank prints one line and reports step and total, which the live
display turns into a progress bar.
"""

import argparse
import time

import torch
import torch.distributed as dist

from labutils.dist import init, report

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--sleep", type=float, default=0.25, help="seconds per step, to watch it")
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--fail-step", type=int, default=None)
parser.add_argument("--stuck-rank", type=int, default=None)
parser.add_argument("--stuck-step", type=int, default=None)
args = parser.parse_args()

rank, world_size, device = init()
torch.manual_seed(rank)  # each rank its own data
model = torch.nn.Linear(8, 1)
print(f"rank {rank} of {world_size} ready", flush=True)
for step in range(args.steps):
    if rank == args.fail_rank and step == args.fail_step:
        raise ValueError(f"bad batch on rank {rank} at step {step}")
    if rank == args.stuck_rank and step == args.stuck_step:
        # The straggler: its peers wait for it in all_reduce.
        time.sleep(600)
    x = torch.randn(16, 8)
    loss = model(x).pow(2).mean()
    model.zero_grad()
    loss.backward()
    for p in model.parameters():  # average the gradients over all ranks
        dist.all_reduce(p.grad)
        p.grad /= world_size
    print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    report(step=step, total=args.steps, loss=loss.item())
    time.sleep(args.sleep)
dist.destroy_process_group()
