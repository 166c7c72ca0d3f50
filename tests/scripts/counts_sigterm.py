"""Each rank notes the time of every SIGTERM it receives in FOLDER/rank<R>.txt, one line
each, and lives on after it; the run ends only by its timeout (tests/run/test_lifetime.py)."""

import os
import signal
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
path = os.path.join(sys.argv[1], f"rank{dist.get_rank()}.txt")


def noted(signum, frame):
    with open(path, "a") as f:
        f.write(f"{time.time()}\n")


signal.signal(signal.SIGTERM, noted)
with open(path, "a") as f:
    f.write("")  # the file exists once the handler is in place
while True:
    time.sleep(0.05)
