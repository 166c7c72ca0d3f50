"""A job that gets stuck, with torch's debug server running on every rank.

    launch("13_where_time_goes/stuck.py", nproc=2, args=["--port", "25999"], hang_timeout=10)

Every rank starts torch.distributed.debug.start_debug_server (an HTTP server on each rank;
rank 0 also serves a page that gathers them all on --port), trains three steps of
all-reduces, then rank 1 waits forever for data that never comes while rank 0 goes on
into the next all_reduce. Rank 0 reports "stuck" once both are there; a browser (or the
lesson's notebook) can then open http://localhost:PORT/stacks and /fr_trace while the
job hangs, until the launcher's hang timeout ends it.
"""

import argparse
import threading

import torch
import torch.distributed as dist
from torch.distributed.debug import start_debug_server

from labutils.dist import init, report

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, default=25999, help="the debug server's page, on rank 0")
args = parser.parse_args()

rank, world_size, device = init()
start_debug_server(port=args.port)
grad = torch.ones(1024, device=device)
for _ in range(3):
    dist.all_reduce(grad)
report(part="trained", steps=3)


def wait_for_data() -> None:
    """The input pipeline of rank 1, which never delivers."""
    never = threading.Event()
    never.wait()


if rank == 1:
    report(part="stuck", where="wait_for_data")
    wait_for_data()
else:
    report(part="stuck", where="all_reduce")
    dist.all_reduce(grad)
