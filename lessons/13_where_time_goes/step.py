"""Where one DDP training step's time goes, on every rank: a torch.profiler trace each.

Run it with one rank on each of 2 hosts (the lesson uses a virtual cluster whose links are
capped, so that gradients take time to travel), or on one machine, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 13_where_time_goes/step.py --bucket-mb 1

or from the notebook: cluster.launch("13_where_time_goes/step.py", nproc=1, args=[...]).

The model is an MLP of 4 Linear(1024, 1024) layers, 4.2 million parameters, 16 MiB of
gradients, trained with DDP and SGD on --batch rows per rank. After two steps (DDP builds
its buckets in the first), --steps steps are profiled, each marked with record_function
spans: "data" (make the batch; the rank named by --slow-rank also sleeps --slow-ms
there, a slow input pipeline), "forward", "backward" (DDP's all-reduces start inside it
and the last wait ends it) and "optimizer". The trace goes to this rank's run folder
(runs/<run>/rank<R>/trace.json); the report gives its path and the wall-clock time
(time.time_ns) of a marker span, so that the traces of all ranks can be put on one clock.

--bucket-mb sets DDP's bucket_cap_mb: 1 gives many buckets, whose all-reduces start while
backward still computes; 64 gives one bucket, which can only start when backward ends.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from labutils.course.ddp_probes import rank_output_dir, reducer_buckets
from labutils.dist import init, report

parser = argparse.ArgumentParser()
parser.add_argument("--bucket-mb", type=float, default=1.0, help="DDP's bucket_cap_mb")
parser.add_argument("--batch", type=int, default=512, help="rows per rank and step")
parser.add_argument("--steps", type=int, default=3, help="steps profiled")
parser.add_argument("--slow-rank", type=int, default=-1, help="this rank's data step is slow")
parser.add_argument("--slow-ms", type=float, default=0.0, help="how much slower, in ms")
args = parser.parse_args()

WIDTH, LAYERS = 1024, 4
rank, world_size, device = init()
# One core per rank, as the notebook's OMP_NUM_THREADS=1 asks: a MKL_NUM_THREADS set in
# the environment would otherwise win (torch reads it first) and the ranks share cores.
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]).to(device)
ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(rank)


def step() -> None:
    with record_function("data"):
        x = torch.randn(args.batch, WIDTH, generator=generator).to(device)
        y = torch.randn(args.batch, WIDTH, generator=generator).to(device)
        if rank == args.slow_rank:
            time.sleep(args.slow_ms / 1000)
    with record_function("forward"):
        loss = F.mse_loss(ddp(x), y)
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


for _ in range(2):
    step()
trace = rank_output_dir() / "trace.json"
with profile(activities=[ProfilerActivity.CPU]) as prof:
    with record_function("clock"):  # one span whose wall-clock start this rank knows
        clock_ns = time.time_ns()
    for i in range(args.steps):
        with record_function(f"step {i}"):
            step()
prof.export_chrome_trace(str(trace))
report(part="trace", path=str(trace), clock_ns=clock_ns, bucket_mb=args.bucket_mb,
       slow_rank=args.slow_rank, slow_ms=args.slow_ms, batch=args.batch,
       buckets=len(reducer_buckets(ddp)["rebuilt_sizes"] or reducer_buckets(ddp)["initial_sizes"]))
