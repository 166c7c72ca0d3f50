"""Check the from-scratch all-reduces against dist.all_reduce, count their bytes, time them.

Run it on 4 ranks, from the lessons folder:

    torchrun --standalone --nproc-per-node 4 02_collectives/ring_bench.py

or from the notebook: launch("02_collectives/ring_bench.py", nproc=4), or one rank per
host of a virtual cluster: cluster.launch("02_collectives/ring_bench.py", nproc=1,
args=["--skip-checks", ...]). Three parts:

1. correctness: every algorithm in ring.py equals dist.all_reduce on groups of 2, 3
   and 4 ranks, for sizes that do not divide evenly into chunks (1, 2, 3, 5, 7, 10,
   1001 and 4099 elements): rank 0 collects every rank's results and compares them
   with torch.testing.assert_close; report(check=...) per group size. The pipelined
   ring runs here with 256-byte segments, so that the larger sizes really are cut
   into many segments in flight.
2. traffic: bytes each rank sent and received for one all-reduce of 1001 float32
   elements (4004 bytes) on each group size; report(traffic=...) per rank.
3. speed, like nccl-tests: all_reduce of float32 arrays from --min-bytes to --max-bytes
   (times 4 each step) on every rank, the library against the algorithms of ring.py.
   Each call starts after a barrier; a call's time is that of the slowest rank; the
   algorithms take turns, one call each per round, so that a busy moment of the machine
   slows all of them alike; rank 0 reports each one's median per size. --check-only skips this part, --skip-checks parts 1-2.
   On a virtual cluster (labutils.cluster), every rank also counts the bytes its host's
   link carried during the untimed warm-up call, headers included
   (labutils.dist.link_bytes()), and rank 0 reports them with the timings. With every
   rank on this machine, rank 0 also reports how many of its cores other programs kept
   busy on average while the calls were timed (others_cores, of cores).

Runs on gloo (CPU) and NCCL (GPUs): tensors live on the device init() picked.
"""

import argparse
import os
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # ring.py sits next to this file
from ring import ALGORITHMS, pipelined_ring_all_reduce  # noqa: E402

from labutils.dist import init, link_bytes, report  # noqa: E402
from labutils.course.timing import machine_cpu_so_far, median, time_calls  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--min-bytes", type=int, default=8, help="smallest array, bytes")
parser.add_argument("--max-bytes", type=int, default=32 * 2**20, help="largest array, bytes")
parser.add_argument("--algorithms", nargs="+", default=["library", *ALGORITHMS],
                    choices=["library", *ALGORITHMS], help="what the sweep times")
parser.add_argument("--iters", type=int, default=0,
                    help="timed calls per size (default: 8 up to 128 KiB, 5 up to 2 MiB, then 3)")
parser.add_argument("--check-only", action="store_true", help="skip the timing sweep")
parser.add_argument("--skip-checks", action="store_true", help="only the timing sweep")
args = parser.parse_args()

rank, world_size, device = init()
torch.set_num_threads(1)  # one core per rank, whatever OMP_NUM_THREADS says: the ranks share the machine's cores
on_cluster = link_bytes() is not None  # a virtual cluster names this host's link
# Every rank on this machine (a virtual cluster's hosts are too): what other programs took
# of its cores while the calls were timed can be counted.
one_machine = on_cluster or os.environ.get("LOCAL_WORLD_SIZE") == str(world_size)
CHECK_SIZES = (1, 2, 3, 5, 7, 10, 1001, 4099)  # elements; most are not multiples of 2, 3, 4
TRAFFIC_SIZE = 1001

# ---------------------------------------------------------------- 1. correctness
# new_group() must be called by every rank, members or not.
groups = {} if args.skip_checks else {n: dist.new_group(list(range(n)))
                                       for n in range(2, world_size + 1)}
# 256-byte segments: 1001 float64 elements on 2 ranks make 16 segments per chunk.
CHECKED = {**ALGORITHMS, "pipelined ring": partial(pipelined_ring_all_reduce, segment_bytes=256)}
results = []  # (group size, elements, algorithm, result, dist.all_reduce's result) of this rank
for n, group in groups.items():
    if rank >= n:
        continue
    for numel in CHECK_SIZES:
        gen = torch.Generator().manual_seed(1000 * rank + numel)
        data = torch.randn(numel, generator=gen, dtype=torch.float64).to(device)
        expected = data.clone()
        dist.all_reduce(expected, group=group)
        for name, all_reduce in CHECKED.items():
            results.append((n, numel, name, all_reduce(data.clone(), group).cpu(), expected.cpu()))
# Rank 0 checks every rank's results (assert_close's first call imports sympy, seconds of
# CPU: once, not once per rank). A mismatch raises here and fails the run.
everyone = [None] * world_size
if groups:
    dist.gather_object(results, everyone if rank == 0 else None, dst=0)
if rank == 0 and groups:
    for n in groups:
        worst, checked = 0.0, 0
        for r, rank_results in enumerate(everyone):
            for size, numel, name, got, expected in rank_results:
                if size != n:
                    continue
                torch.testing.assert_close(
                    got, expected, msg=lambda m: f"{name}, rank {r} of {n}, {numel} elements: {m}")
                worst = max(worst, (got - expected).abs().max().item())
                checked += 1
        report(check="ring == dist.all_reduce", group_size=n, sizes=list(CHECK_SIZES),
               algorithms=list(ALGORITHMS), results_checked=checked, max_abs_diff=worst)

# ---------------------------------------------------------------- 2. traffic
for n, group in groups.items():
    if rank >= n:
        continue
    data = torch.ones(TRAFFIC_SIZE, dtype=torch.float32, device=device)
    for name, all_reduce in ALGORITHMS.items():
        traffic = Counter()
        all_reduce(data.clone(), group, traffic=traffic)
        report(traffic=name, group_size=n, data_bytes=data.numel() * data.element_size(),
               sent=traffic["sent"], received=traffic["received"])

# ---------------------------------------------------------------- 3. speed
if args.check_only:
    dist.destroy_process_group()
    sys.exit(0)


def sync() -> None:
    """All ranks start each timed call together (and GPU work is finished)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def library(tensor: torch.Tensor, group=None) -> torch.Tensor:
    dist.all_reduce(tensor, group=group)
    return tensor


candidates = {name: {"library": library, **ALGORITHMS}[name] for name in args.algorithms}
nbytes = args.min_bytes
while nbytes <= args.max_bytes:
    x = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)  # sums of zeros never overflow
    iters = args.iters or (8 if nbytes <= 128 * 2**10 else 5 if nbytes <= 2 * 2**20 else 3)
    def call_of(all_reduce):
        def call():
            all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return call

    calls = {name: call_of(all_reduce) for name, all_reduce in candidates.items()}
    on_links = {}
    for name, call in calls.items():
        sync()
        before = link_bytes() or {"sent": 0, "received": 0}
        call()  # the warm-up call, not timed: its bytes on the link are counted
        sync()  # every rank has received everything: every byte has crossed the links
        after = link_bytes() or {"sent": 0, "received": 0}
        on_links[name] = torch.tensor([after[k] - before[k] for k in ("sent", "received")],
                                      dtype=torch.float64, device=device)
    # One timed call of each algorithm per round, the rounds one after the other: a busy
    # moment of the machine then slows every algorithm alike, not one of them.
    timed = {name: [] for name in calls}
    machine, own, t0 = machine_cpu_so_far(), sum(os.times()[:2]), time.perf_counter()
    for _ in range(iters):
        for name, call in calls.items():
            timed[name] += time_calls(call, iters=1, warmup=0, sync=sync)
    # The cores other programs kept busy meanwhile, on average: the machine's CPU time
    # less the ranks' own (summed over the ranks), of all the cores /proc/stat counts.
    machine_after, wall = machine_cpu_so_far(), time.perf_counter() - t0
    own_cpu = torch.tensor([sum(os.times()[:2]) - own], dtype=torch.float64, device=device)
    dist.all_reduce(own_cpu)
    others = {}
    if one_machine and machine is not None and machine_after is not None:
        used = machine_after - machine - own_cpu.item()
        others = {"others_cores": round(max(used, 0.0) / wall, 2), "cores": os.cpu_count() or 1}
    for name in calls:
        times = torch.tensor(timed[name], device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a call lasts until its slowest rank is done
        every_link = [torch.zeros_like(on_links[name]) for _ in range(world_size)]
        if on_cluster:
            dist.all_gather(every_link, on_links[name])
        if rank == 0:
            extra = {}
            if on_cluster:
                extra = {"link_sent": [int(t[0]) for t in every_link],
                         "link_received": [int(t[1]) for t in every_link]}
            report(algorithm=name, nbytes=nbytes, seconds=median(times.tolist()), iters=iters,
                   **extra, **others)
    nbytes *= 4

dist.destroy_process_group()
