"""A training loop that hangs: one rank's data loader thread dies, and the rank waits for it.

Run it on 3 ranks, from this folder (rank 2's loader fails at batch 3):

    torchrun --standalone --nproc-per-node 3 hang.py --stuck-rank 2 --stuck-step 3

Nothing ends that run: torchrun waits for its workers and the workers wait for
each other (press Ctrl-C). From a notebook cell the launcher notices that no rank
made progress for hang_timeout seconds, reads every rank's Python stack, names
the rank the others wait for (the straggler) and stops the run:

    from labutils import launch
    result = launch("00_first_distributed_run/hang.py", nproc=3, hang_timeout=3,
                    args=["--stuck-rank", "2", "--stuck-step", "3"])
    result.hang           # where each rank waits, and the straggler

Batches come from a background thread that reads ahead, as DataLoader workers
do. An exception in a thread does not end the process: Python prints it and the
thread is gone, while the main thread waits for a batch that never comes. The
other ranks wait for that rank inside all_reduce.
"""

import argparse
import queue
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labutils.dist import init

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--stuck-rank", type=int, default=2, help="the rank whose loader dies")
parser.add_argument("--stuck-step", type=int, default=3, help="the batch its loader fails on")
args = parser.parse_args()


def start_loader(rank: int, steps: int, *, fail_at: int | None) -> queue.Queue:
    """This rank's batches, made by a background thread up to two steps ahead."""
    batches: queue.Queue = queue.Queue(maxsize=2)

    def load() -> None:
        data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
        for step in range(steps):
            if step == fail_at:  # stands for a truncated file in this rank's part of the data
                raise OSError(f"shard of rank {rank}: unexpected end of file at batch {step}")
            batches.put((torch.randn(16, 8, generator=data), torch.randint(0, 4, (16,), generator=data)))

    threading.Thread(target=load, name="loader", daemon=True).start()
    return batches


rank, world_size, device = init()
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Linear(8, 4).to(device)
batches = start_loader(rank, args.steps, fail_at=args.stuck_step if rank == args.stuck_rank else None)

for step in range(args.steps):
    # Wait for the loader thread's next batch: forever, if the thread died.
    x, y = batches.get()
    x, y = x.to(device), y.to(device)
    loss = F.cross_entropy(model(x), y)
    model.zero_grad()
    loss.backward()
    for p in model.parameters():  # average the gradients over all ranks
        dist.all_reduce(p.grad)
        p.grad /= world_size
    with torch.no_grad():  # plain SGD by hand: what torch.optim.SGD would do
        for p in model.parameters():
            p -= args.lr * p.grad
    print(f"step {step}: loss {loss.item():.4f}")

dist.destroy_process_group()
