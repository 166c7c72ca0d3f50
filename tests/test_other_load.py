"""helpers.OtherLoad, which the serial pass prints at its end: the CPU that processes
other than the session's own took, so a failed timing can be read against the load.
The session's own include a warm server's ranks, which leave its process tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from helpers import OtherLoad

BURN = """
import ctypes, sys, time
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME: the name /proc shows
deadline = time.process_time() + 0.4
while time.process_time() < deadline:
    pass
time.sleep(1.0)  # still there at the next sample
"""


def test_processes_with_the_session_token_are_ours_wherever_they_hang():
    token = f"LU_LOAD_TEST={os.getpid()}".encode()
    load = OtherLoad(root=-1, every=0.1, token=token)  # no root: only the token says "ours"
    env = {k: v for k, v in os.environ.items() if k != "LU_LOAD_TEST"}
    procs = [subprocess.Popen([sys.executable, "-c", BURN, "lu-burn-ours"],
                              env={**env, "LU_LOAD_TEST": str(os.getpid())}),
             subprocess.Popen([sys.executable, "-c", BURN, "lu-burn-other"], env=env)]
    try:
        time.sleep(0.3)
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
    others = dict(load.finish())
    assert others.get("lu-burn-other", 0) >= 0.3, others
    assert "lu-burn-ours" not in others, others
    command, seconds = load.busiest()  # the summary's pointer to the biggest one
    assert command and seconds >= others["lu-burn-other"] >= 0.3


def test_a_process_of_ours_stays_ours_when_its_parent_ends_first():
    """What a warm server and its ranks do when their caller ends: they are re-parented
    outside the session's tree; the CPU they used is still the session's."""
    load = OtherLoad(root=os.getpid(), every=0.05)
    # a shell of ours starts the burner and leaves at once: the burner is orphaned
    shell = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$0" lu-burn-orphan & sleep 0.3',
                              BURN])
    shell.wait(timeout=30)
    time.sleep(1.5)  # the orphan burns and sleeps outside the tree
    others = dict(load.finish())
    assert "lu-burn-orphan" not in others, others
