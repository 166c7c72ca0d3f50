"""What a warm server's start costs in CPU, next to a plain interpreter importing the same.

    .venv/bin/python benchmarks/server_start.py [--repeats N]

Each repeat starts, in turn:
- server: `python -m labutils.runtime.server FD` as labutils.run.warm starts it, timed
  until it answers its hello (torch, torch._dynamo, torchrun's agent and the worker
  imported, the one fork that stops OpenBLAS's threads, gc.freeze), then closed;
- plain: `python -c "import torch, torch._dynamo, torch.distributed.run,
  labutils.runtime.worker"`, the same modules imported the ordinary way (the garbage
  collector on throughout).

The CPU is each child's own (user + system, from the kernel's accounting of the
children this script waited for). It prints the medians and their ratio; the ratio
holds better than either figure on a loaded machine, where both grow.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import subprocess
import sys

PLAIN = "import torch, torch._dynamo, torch.distributed.run, labutils.runtime.worker"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def server_cpu() -> float:
    """CPU seconds of one warm server, from its start to its hello's answer and its end."""
    ours, theirs = socket.socketpair()
    before = _children_cpu()
    proc = subprocess.Popen([sys.executable, "-u", "-m", "labutils.runtime.server", str(theirs.fileno())],
                            pass_fds=[theirs.fileno()], start_new_session=True)
    theirs.close()
    with ours, ours.makefile("rwb") as stream:
        stream.write(json.dumps({"op": "hello", "id": 1}).encode() + b"\n")
        stream.flush()
        answer = json.loads(stream.readline())
    if "pid" not in answer:
        raise SystemExit(f"the server did not answer its hello: {answer}")
    proc.wait(timeout=60)  # it ends when its caller's end of the socket closes
    return _children_cpu() - before


def plain_cpu() -> float:
    before = _children_cpu()
    subprocess.run([sys.executable, "-c", PLAIN], check=True)
    return _children_cpu() - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6, help="starts of each (default 6)")
    repeats = parser.parse_args().repeats
    if repeats < 1:
        parser.error("--repeats must be at least 1")
    server, plain = [], []
    for i in range(repeats):
        server.append(server_cpu())
        plain.append(plain_cpu())
        print(f"repeat {i + 1}: server {server[-1]:.2f} CPU-s, plain import {plain[-1]:.2f} CPU-s",
              file=sys.stderr, flush=True)
    s, p = statistics.median(server), statistics.median(plain)
    print(f"medians of {repeats}: warm server start {s:.2f} CPU-s, plain import {p:.2f} CPU-s, "
          f"server / plain {s / p:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
