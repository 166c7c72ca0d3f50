"""One rank ends in a chosen way while its peers go on into a collective.

    python endings.py HOW FAILING_RANK

Every rank joins one all_reduce first (the group is up and connected); then the failing
rank ends as HOW says, on the line tagged `# ending: HOW`, and every other rank calls
barrier(), which the failing rank never joins. tests/run/test_endings.py runs each HOW
warm and cold and checks what the launcher says about it.
"""
import ctypes
import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

how, failing = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["RANK"])


class KilledWorkerData(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # the DataLoader's worker process dies
        return torch.tensor([float(i)])


class FailingWorkerData(KilledWorkerData):
    def __getitem__(self, i):
        if i == 2:
            raise KeyError(f"item {i} is missing")  # ending: dataloader_worker_error
        return torch.tensor([float(i)])


class UnprintableError(Exception):
    def __str__(self):
        raise TypeError("no text")  # a __str__ with a bug: the report must still name the rank


def fail_in_a_thread():
    raise RuntimeError("the loader thread failed")


if how == "init_error" and rank == failing:
    dist.init_process_group("no-such-backend")  # ending: init_error
# timeout_one_side: only the failing rank's timeout is short (its peers lose it first);
# stuck_timeout: the failing rank loops as in stuck until its peers' barrier times out.
seconds = 3 if how in ("timeout_mismatch", "stuck_timeout") or (how == "timeout_one_side" and rank == failing) else 60
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
x = torch.ones(4)
dist.all_reduce(x)
if how == "breakpoint_peer" and rank != failing:
    breakpoint()  # waits for a debugger nobody opens, while the failing rank raises
if how == "size_mismatch":
    dist.all_reduce(torch.ones(1 if rank == failing else 8))  # ending: size_mismatch
if rank == failing:
    if how in ("exception", "breakpoint_peer"):
        raise ValueError("the batch is empty")  # ending: exception
    if how == "unprintable_exception":
        raise UnprintableError()  # ending: unprintable_exception
    if how == "syntax_error":
        exec(compile("steps = (1, 2", "config.py", "exec"))  # ending: syntax_error
    if how == "sys_exit":
        sys.exit(3)  # ending: sys_exit
    if how == "os_exit":
        os._exit(3)  # ending: os_exit
    if how == "abort":
        os.abort()  # ending: abort
    if how == "segfault":
        ctypes.string_at(0)  # ending: segfault
    if how in ("sigkill", "sigterm"):  # sigterm: a SIGTERM that neither torchrun nor labutils sent
        subprocess.run(["kill", {"sigkill": "-KILL", "sigterm": "-TERM"}[how], str(os.getpid())]); time.sleep(60)  # ending: sigkill
    if how == "thread_error":
        worker = threading.Thread(target=fail_in_a_thread)
        worker.start(); worker.join()
        sys.exit(1)  # ending: thread_error
    if how == "return_early":
        sys.exit(0)  # ending: return_early
    if how == "dataloader_worker_killed":
        list(torch.utils.data.DataLoader(KilledWorkerData(), num_workers=1))  # ending: dataloader_worker_killed
    if how == "dataloader_worker_error":  # the worker raises; the rank re-raises it
        list(torch.utils.data.DataLoader(FailingWorkerData(), num_workers=1))
    if how in ("stuck", "stuck_timeout"):
        while True:
            time.sleep(0.2)  # ending: stuck
    if how == "timeout_mismatch":
        dist.all_reduce(x)  # ending: timeout_mismatch
    if how == "timeout_one_side":
        dist.all_reduce(x)  # ending: timeout_one_side
dist.barrier()
dist.destroy_process_group()
