"""Each rank starts two processes that try to outlive the run, then behaves as argv says.

- a child that ignores SIGTERM;
- a daemon: double-forked into a new session (setsid), also ignoring SIGTERM, whose
  parent exits at once, so it is nobody's child in the rank's tree.
Their pids go to the file argv[1], one line per rank. argv[2]: "ok" (finish), "fail"
(rank 1 raises), "hang" (rank 1 sleeps, the others wait in a collective) or "sleep"
(every rank sleeps: for a timeout, a stop or a signal).
"""
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from labutils.dist import init, report

IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
DAEMON = ("import os, subprocess, sys; os.setsid(); "
          "p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], start_new_session=True); "
          "print(p.pid, flush=True)")

rank, world_size, _ = init()
pids_file, mode = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", IGNORE_TERM])
starter = subprocess.Popen([sys.executable, "-c", DAEMON, IGNORE_TERM], stdout=subprocess.PIPE,
                           text=True)
daemon = int(starter.stdout.readline())
starter.wait()
with open(pids_file, "a") as f:
    f.write(f"{child.pid} {daemon}\n")
report(step=0)
if mode == "fail" and rank == 1:
    raise RuntimeError("rank 1 fails on purpose")
if mode == "sleep" or (mode == "hang" and rank == 1):
    time.sleep(600)
if mode == "hang":
    dist.all_reduce(torch.ones(1))
dist.barrier()
