"""Read DDP's real buckets, then record one backward pass on a timeline.

Run it with one rank on each of 2 hosts (the lesson runs it on a virtual cluster whose
links are capped, see labutils.cluster), or on one machine, from the lessons folder:

    torchrun --standalone --nproc-per-node 2 03_bucketing_and_overlap/buckets.py

or from the notebook: cluster.launch("03_bucketing_and_overlap/buckets.py", nproc=1).
Three parts:

1. Buckets. For each bucket_cap_mb in --caps ("default" leaves it unset; "default+last"
   leaves it unset with DDP_SET_LAST_BUCKET_CAP=1 in the environment), wrap the model
   in DDP, train 3 iterations with a BucketRecorder as communication hook, and report
   what the hook saw per iteration (bucket index, bytes, parameter names) and what
   DDP's logging data says (sizes at construction, rebuilt sizes and members).
2. Overlap, with --timeline-cap MiB and batches of --batch items. Backward hooks time
   each Linear layer, the BucketRecorder times each bucket's all-reduce, both with this
   rank's clock, for --timeline-steps steps after the rebuild; then as many backward
   passes under no_sync() (no communication) time the computation alone.
3. torch.profiler records one more step and writes a Chrome trace to this rank's run
   folder (runs/<run>/rank<R>/trace.json).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))  # models.py sits next to this file
from models import batch, linear_layers, make_mlp  # noqa: E402

from labutils.course.ddp_probes import BackwardTimer, BucketRecorder, rank_output_dir, reducer_buckets  # noqa: E402
from labutils.dist import init, report  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--caps", default="default,25,4,1,default+last",
                    help="bucket_cap_mb values, comma-separated")
parser.add_argument("--timeline-cap", type=float, default=2.0, help="bucket_cap_mb of the timeline")
parser.add_argument("--batch", type=int, default=2048, help="items per rank and step of the timeline")
parser.add_argument("--timeline-steps", type=int, default=3, help="steps recorded on the timeline")
args = parser.parse_args()

rank, world_size, device = init()
torch.set_num_threads(1)  # one core per rank, whatever MKL_NUM_THREADS says (torch reads it first)


def train_step(ddp, step: int, n: int = 32) -> None:
    x, y = batch(rank, step, n=n)
    loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
    loss.backward()
    ddp.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- 1. buckets
for cap in args.caps.split(","):
    cap_mb = None if cap.startswith("default") else float(cap)
    # The reducer reads DDP_SET_LAST_BUCKET_CAP when it rebuilds the buckets (2nd step).
    os.environ["DDP_SET_LAST_BUCKET_CAP"] = "1" if cap.endswith("+last") else "0"
    ddp = DDP(make_mlp("mlp").to(device), bucket_cap_mb=cap_mb)
    recorder = BucketRecorder(ddp)
    for step in range(3):
        train_step(ddp, step)
    if rank == 0:  # every rank has the same buckets: rank 0 speaks for all
        report(part="buckets", cap=cap, logging=reducer_buckets(ddp),
               calls=[{"iteration": c.iteration, "index": c.index, "nbytes": c.nbytes,
                       "params": c.params} for c in recorder.calls])

# ---------------------------------------------------------------- 2. overlap timeline
os.environ.pop("DDP_SET_LAST_BUCKET_CAP")
ddp = DDP(make_mlp("mlp").to(device), bucket_cap_mb=args.timeline_cap)
recorder = BucketRecorder(ddp)
timer = BackwardTimer(linear_layers(ddp.module))
for step in range(2):  # the first step uses one bucket; the rebuild happens at the second
    train_step(ddp, step, args.batch)
    timer.next_iteration()
recorder.clear()
timer.spans.clear()
starts = []
for step in range(2, 2 + args.timeline_steps):
    x, y = batch(rank, step, n=args.batch)
    loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
    starts.append(time.perf_counter())
    loss.backward()  # returns once every bucket's all-reduce has finished
    starts.append(time.perf_counter())
    ddp.zero_grad(set_to_none=True)
    timer.next_iteration()
# The same backward without communication (no_sync), for the compute alone.
timer.remove()
alone = []
for step in range(2, 2 + args.timeline_steps):
    x, y = batch(rank, step, n=args.batch)
    with ddp.no_sync():
        loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
        t0 = time.perf_counter()
        loss.backward()
        alone.append(time.perf_counter() - t0)
    ddp.zero_grad(set_to_none=True)
report(part="timeline", cap_mb=args.timeline_cap, batch=args.batch,
       backward=[starts[i:i + 2] for i in range(0, len(starts), 2)], backward_alone_s=alone,
       layers=[s.to_json() for s in timer.spans], buckets=[c.to_json() for c in recorder.calls], logging=reducer_buckets(ddp))

# ---------------------------------------------------------------- 3. the same step, profiled
trace = rank_output_dir() / "trace.json"
with profile(activities=[ProfilerActivity.CPU]) as prof:
    with record_function("train_step"):
        train_step(ddp, 2 + args.timeline_steps, args.batch)
prof.export_chrome_trace(str(trace))
report(part="trace", path=str(trace))
