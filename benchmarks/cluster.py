"""The virtual cluster's links: the rate set against the rate measured, and an
all_reduce's bus bandwidth on the shaped links against the rate, in one run.

    .venv/bin/python benchmarks/cluster.py [--rates 100mbit,200mbit,...] [--repeats N]
                                           [--hosts 2,4] [--link 400mbit] [--mib M]

Needs root for network namespaces (labutils.cluster.virtual_cluster); without it the
cluster is loopback and the script says so and stops (there is no link to measure).

1. Rate set vs measured: a 2-host cluster; for each rate, set_link(rate) caps both
   ends of every link with an HTB class, then a TCP sender in host 1 streams to host 0
   for 2 s (VirtualCluster.measure: the rate of the best quarter second, timed by the
   kernel's count of arrived bytes); median of --repeats. The ratio shows what HTB and
   TCP's own overhead (headers, acks) leave of the rate.
2. all_reduce busbw: for each host count, one rank per host on links capped at --link,
   then the same ranks on this machine's loopback (one host, no cap: the plain
   alternative); each rank all-reduces an M MiB float32 tensor 5 times after a
   warm-up, the slowest rank's median time counts. busbw = M / t x 2(n-1)/n (the bytes
   each rank sends in a ring all-reduce, nccl-tests' definition): on the shaped links it
   should approach the link rate, since every rank's link carries 2(n-1)/n of the data.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from labutils.cluster import parse_rate, rate_text, virtual_cluster

JOB = """\
import statistics, sys, time
import torch
import torch.distributed as dist
from labutils.dist import init, report

rank, world, _ = init()
t = torch.ones({numel})
dist.all_reduce(t)  # warm-up: every connection made
times = []
for _ in range(5):
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(t)
    times.append(time.perf_counter() - start)
report(seconds=statistics.median(times))
"""


def busbw(result, mib: int, n: int) -> float:
    """Bus bandwidth in bits/s from the slowest rank's median all_reduce time."""
    if not result.ok:
        raise SystemExit(f"the all_reduce job failed: {result.headline()}")
    slowest = max(result.values("seconds"))
    return mib * 2**20 * 8 / slowest * 2 * (n - 1) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="100mbit,200mbit,400mbit,800mbit,1600mbit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hosts", default="2,4")
    parser.add_argument("--link", default="400mbit")
    parser.add_argument("--mib", type=int, default=16)
    ns = parser.parse_args()
    rates = [parse_rate(r) for r in ns.rates.split(",")]
    hosts = [int(h) for h in ns.hosts.split(",")]
    link = parse_rate(ns.link)
    load = os.getloadavg()[0]

    with virtual_cluster(2) as c:
        if c.mode != "namespaces":
            print(f"no link to measure: {c.reason}")
            return 1
        print(f"1. rate set vs measured (2 hosts, TCP for 2 s, best quarter second, median of {ns.repeats})\n")
        print("| rate set | measured | measured / set | round trip |")
        print("| --- | --- | --- | --- |")
        for rate in rates:
            runs = [c.set_link(rate) if k == 0 else c.measure() for k in range(ns.repeats)]
            got = statistics.median(r["measured_bps"] for r in runs)
            rtt = statistics.median(r["rtt_ms"] for r in runs)
            print(f"| {rate_text(rate)} | {rate_text(got)} | {got / rate:.3f} | "
                  f"{rtt * 1e3:.0f} µs |", flush=True)

    print(f"\n2. all_reduce of {ns.mib} MiB, 1 rank per host: links capped at "
          f"{rate_text(link)} vs the same ranks on loopback\n")
    print("| ranks | shaped busbw | busbw / link rate | loopback busbw | measured link |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "allreduce.py"
        script.write_text(JOB.format(numel=ns.mib * 2**20 // 4))
        for n in hosts:
            with virtual_cluster(n, link=link) as shaped, virtual_cluster(1) as one:
                wire = busbw(shaped.launch(script, 1, log_dir=Path(tmp) / "runs", display="none",
                                           hang_timeout=60, timeout=300), ns.mib, n)
                loop = busbw(one.launch(script, n, log_dir=Path(tmp) / "runs", display="none",
                                        hang_timeout=60, timeout=300), ns.mib, n)
                print(f"| {n} | {rate_text(wire)} | {wire / link:.2f} | {rate_text(loop)} | "
                      f"{rate_text(shaped.link['measured_bps'])} |", flush=True)
    print(f"\nload average before the run: {load:.1f} (2 cores: {os.cpu_count()} CPUs seen)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
