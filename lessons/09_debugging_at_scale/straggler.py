"""A rank that stops arriving: it waits forever for its data, and the others for it.

    torchrun --standalone --nproc-per-node 4 straggler.py --check monitored --stuck-ranks 2 3 --slow-rank 1
    torchrun --standalone --nproc-per-node 2 straggler.py --py-spy-after 1.5

Every step each rank reads a batch and averages it with all_reduce. From --stuck-step
on, the reads of --stuck-ranks never return (a file system that stopped answering);
--slow-rank's read takes --slow-s longer every step, but returns. Plain torchrun
would wait for the stuck ranks as long as the process group's timeout (30 minutes
for gloo by default).

--check monitored: before the all_reduce every rank calls
    dist.monitored_barrier(wait_all_ranks=True, timeout=...)
and rank 0 waits up to that timeout for each other rank, then raises, naming every
rank that did not arrive. Only gloo has it: on GPUs, give it a gloo group made with
dist.new_group(backend="gloo"). A rank that arrived learns of the failure as soon as
rank 0 does; it waits 2 s before failing, so that rank 0's error, the one that names
the missing ranks, is written before torchrun stops every rank.

--py-spy-after S: rank 0 runs a watchdog thread; once a step has taken more than S
seconds it runs `py-spy dump --pid PID` on every rank (the pids were gathered at the
start) and prints each main thread's stack (stack_dump.py).
"""

import argparse
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from labutils.dist import init
from stack_dump import allow_tracing, py_spy_dump

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--stuck-ranks", type=int, nargs="+", default=[1])
parser.add_argument("--stuck-step", type=int, default=2)
parser.add_argument("--slow-rank", type=int, default=None)
parser.add_argument("--slow-s", type=float, default=0.5)
parser.add_argument("--check", choices=["none", "monitored"], default="none")
parser.add_argument("--barrier-timeout-s", type=float, default=3.0)
parser.add_argument("--py-spy-after", type=float, default=None,
                    help="seconds a step may take before rank 0 dumps every rank's stack")
args = parser.parse_args()


def read_batch(step: int) -> torch.Tensor:
    if rank in args.stuck_ranks and step >= args.stuck_step:
        threading.Event().wait()  # stands for a read that never returns
    if rank == args.slow_rank:
        time.sleep(args.slow_s)
    return torch.full((4,), float(rank + step))


def watchdog(pids: list[int], last_step_end: list[float]) -> None:
    """Rank 0's thread: once a step takes too long, dump every rank's stack, once."""
    while time.monotonic() - last_step_end[0] < args.py_spy_after:
        time.sleep(0.1)
    for r, pid in enumerate(pids):
        print(f"py-spy dump --pid <rank {r}>\n{py_spy_dump(pid)}", flush=True)


rank, world_size, device = init("gloo")  # monitored_barrier is gloo's; the rest works on NCCL too
allow_tracing()  # let rank 0's py-spy read this process (stack_dump.py says why)
pids = [None] * world_size
dist.all_gather_object(pids, os.getpid())  # every rank learns the others' pids
last_step_end = [time.monotonic()]
if rank == 0 and args.py_spy_after is not None:
    threading.Thread(target=watchdog, args=(pids, last_step_end), daemon=True).start()

for step in range(args.steps):
    x = read_batch(step).to(device)
    if args.check == "monitored":  # gloo only: rank 0 names the ranks that do not arrive
        try:
            dist.monitored_barrier(wait_all_ranks=True, timeout=timedelta(seconds=args.barrier_timeout_s))
        except RuntimeError:
            if rank != 0:  # rank 0's error names the missing ranks: let it reach the log before
                time.sleep(2)  # this one ends its process and torchrun stops every rank
            raise
    dist.all_reduce(x)
    last_step_end[0] = time.monotonic()
    print(f"step {step}: sum {x[0].item():g}", flush=True)

dist.destroy_process_group()
