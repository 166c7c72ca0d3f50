"""What an OMP_NUM_THREADS exported for another machine costs the ranks here.

    .venv/bin/python benchmarks/omp_threads.py [--threads 8] [--nproc 2] [--repeats 2]

The launcher, like torchrun, gives each rank 1 thread when OMP_NUM_THREADS is unset and
passes the caller's value on when it is set. This runs the same DDP training steps with
`launch(script, nproc)` under both, alternating (unset, set, unset, set, ...), in one
run, and prints each run's milliseconds per step, the threads torch gave each rank, and
the ratio of the medians. `labutils doctor` names the variable when it overfills the
cores (src/labutils/course/doctor.py).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

STEP = '''
import time
import torch
import torch.distributed as dist
import torch.nn.functional as F

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(384, 384), torch.nn.ReLU(), torch.nn.Linear(384, 10))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
x, y = torch.randn(256, 384), torch.randint(0, 10, (256,))


def step():
    opt.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    opt.step()


for _ in range(5):
    step()
dist.barrier()
t = time.perf_counter()
for _ in range(100):
    step()
dist.barrier()
print(f"ms_per_step {(time.perf_counter() - t) * 10:.3f} threads {torch.get_num_threads()}")
'''


def one_run(script: Path, nproc: int, threads: str | None, runs: Path) -> tuple[float, int]:
    from labutils import launch

    saved = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = threads
        result = launch(script, nproc, display="none", log_dir=runs, timeout=300)
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved
    if not result.ok:
        sys.exit(f"a run failed: {result.headline()}")
    found = [re.search(r"ms_per_step ([\d.]+) threads (\d+)", r.stdout) for r in result.ranks]
    if not all(found):
        sys.exit("a rank printed no timing")
    return max(float(m[1]) for m in found if m), int(found[0][2]) if found[0] else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="8", help="the exported value (default 8)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ddp_steps.py"
        script.write_text(STEP)
        samples: dict[str, list[float]] = {"unset": [], args.threads: []}
        given: dict[str, int] = {}
        for _ in range(args.repeats):
            for label, value in (("unset", None), (args.threads, args.threads)):
                ms, threads = one_run(script, args.nproc, value, Path(tmp) / "runs")
                samples[label].append(ms)
                given[label] = threads
                print(f"OMP_NUM_THREADS {label:>6}: {ms:7.2f} ms/step, {threads} thread(s) per rank",
                      flush=True)
    unset, set_ = (statistics.median(samples[k]) for k in ("unset", args.threads))
    print(f"{args.nproc} ranks on {len(os.sched_getaffinity(0))} core(s): OMP_NUM_THREADS="
          f"{args.threads} ({given[args.threads]} thread(s) per rank) takes {set_ / unset:.2f}x "
          f"the time per step of the default (1 per rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
