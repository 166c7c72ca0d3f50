"""A 2-node job on two virtual hosts: VirtualCluster.launch() next to bare torchrun, in one run.

    .venv/bin/python benchmarks/multinode.py [--repeats N] [--mib M] [--json FILE]

Both sides run the same plain torch.distributed script (4 ranks: 2 nodes x 2, each
all-reducing an M MiB float32 tensor 5 times) on the same two "machines":
node 0 in this process's network namespace, node 1 in a namespace of its own, each
with an uncapped link into one bridge (labutils.cluster.virtual_cluster(2); needs root,
else both nodes run on loopback and the table says so).

- bare: ``python -m torch.distributed.run --nnodes 2 --node-rank K --rdzv-backend
  static --rdzv-endpoint ADDR0:PORT`` started for each node (node 1 through
  ``ip netns exec``), with GLOO_SOCKET_IFNAME set by hand to each node's end of its
  link, as one would on real machines;
- labutils: cluster.launch(), node 0 through launch() in this process, node 1
  through `labutils launch` in its namespace, every rank's output followed from the
  shared run folder.

Runs alternate (labutils, bare, labutils, bare...). Figures: wall time per job (median,
min-max) and the bytes that crossed node 0's link per job, which must be the same on both
sides: the launcher adds files, not traffic. Exit status 1 when a job failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labutils.cluster import virtual_cluster
from labutils.runtime.procs import free_port

JOB = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones({numel})
for _ in range(5):
    dist.all_reduce(t)
assert t[0].item() == 4 ** 5
print(f"rank {{dist.get_rank()}}: ok", flush=True)
dist.destroy_process_group()
"""


def bare(hosts, script: Path, workdir: Path) -> float:
    port = free_port(hosts.addresses[0])
    procs = []
    t0 = time.monotonic()
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(node), "--nproc-per-node", "2", "--rdzv-backend", "static",
               "--rdzv-endpoint", f"{hosts.addresses[0]}:{port}", str(script)]
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        if hosts.interfaces[node]:
            env["GLOO_SOCKET_IFNAME"] = hosts.interfaces[node]
        log = open(workdir / f"bare-node{node}.log", "wb")  # noqa: SIM115
        procs.append((subprocess.Popen(hosts.command(node, cmd), stdout=log,
                                       stderr=subprocess.STDOUT, env=env), log))
    codes = []
    for proc, log in procs:
        codes.append(proc.wait(timeout=300))
        log.close()
    elapsed = time.monotonic() - t0
    if any(codes):
        raise SystemExit(f"bare torchrun failed: exit codes {codes}; see {workdir}")
    return elapsed


def labutils_side(hosts, script: Path, workdir: Path) -> float:
    t0 = time.monotonic()
    result = hosts.launch(script, 2, log_dir=workdir / "runs", display="none",
                          hang_timeout=60, timeout=300)
    elapsed = time.monotonic() - t0
    if not result.ok:
        raise SystemExit(f"cluster.launch failed: {result.headline()}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mib", type=int, default=16, help="all_reduce size in MiB")
    parser.add_argument("--json", default=None)
    ns = parser.parse_args()
    samples = {"labutils": [], "bare": []}
    crossed = {"labutils": [], "bare": []}
    with tempfile.TemporaryDirectory() as tmp, virtual_cluster(2) as hosts:
        work = Path(tmp)
        script = work / "job.py"
        script.write_text(JOB.format(numel=ns.mib * 2**20 // 4))
        print(f"virtual hosts: {hosts.mode}" + (f" ({hosts.reason})" if hosts.reason else ""),
              file=sys.stderr)
        for side in ("labutils", "bare"):  # warm-up: file cache, __pycache__
            (labutils_side if side == "labutils" else bare)(hosts, script, work)
        for i in range(ns.repeats):
            for side in ("labutils", "bare"):
                before = hosts.counters(0).get("tx_bytes", 0)
                run = labutils_side if side == "labutils" else bare
                samples[side].append(run(hosts, script, work))
                crossed[side].append(hosts.counters(0).get("tx_bytes", 0) - before)
                print(f"{side} {i + 1}/{ns.repeats}: {samples[side][-1]:.2f} s, "
                      f"{crossed[side][-1] / 2**20:.1f} MiB sent over node 0's link", file=sys.stderr)
        mode = hosts.mode
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"2 nodes x 2 ranks on virtual hosts ({mode}), 5 all_reduce of {ns.mib} MiB")
    print("| side | median s | min-max s | MiB node 0 sent over its link (median) |")
    print("| --- | --- | --- | --- |")
    for side in ("labutils", "bare"):
        v = samples[side]
        print(f"| {side} | {med[side]:.2f} | {min(v):.2f}-{max(v):.2f} | "
              f"{statistics.median(crossed[side]) / 2**20:.1f} |")
    print(f"ratio labutils / bare: {med['labutils'] / med['bare']:.2f}x")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"mode": mode, "samples": samples,
                                             "crossed_bytes": crossed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
