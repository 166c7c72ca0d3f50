"""run/crash.py: a rank that died without a Python exception is explained from its stderr
(std::terminate's what() line, faulthandler's dump of the thread that ran the script)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import DATA

from labutils.run.crash import explain_crash, read_crash
from labutils.run.diagnosis import Failure

# rank 0's stderr after an all_reduce of 1 float against rank 1's 8 (gloo, torch 2.13,
# a warm rank); the paths are rewritten to a learner's checkout
GLOO_ABORT = (DATA / "gloo_abort_stderr.txt").read_text()


def _signal_failure() -> Failure:
    return Failure(rank=0, exc_type="SIGABRT", message="killed by SIGABRT (no Python exception: "
                   "the process was killed or crashed)", file=None, line=None, traceback="tail",
                   exit_code=-6)


def test_a_gloo_abort_gives_the_cpp_error_and_the_scripts_line():
    message, frames = read_crash(GLOO_ABORT)
    assert message.startswith("gloo::EnforceNotMet: [enforce fail at ")
    assert "8 vs 4. Received data size doesn't match expected size." in message
    # the main thread, not the progress watcher printed first, cut below the script
    assert [(Path(f.file).name, f.line, f.func) for f in frames] == [
        ("distributed_c10d.py", 3252, "all_reduce"), ("c10d_logger.py", 83, "wrapper"),
        ("shapes.py", 6, "<module>")]


def test_explain_crash_fills_in_message_location_and_stack():
    failure = _signal_failure()
    explain_crash(failure, GLOO_ABORT)
    assert failure.message.endswith("(the process died of SIGABRT: no Python exception)")
    assert "Received data size doesn't match" in failure.message
    assert (failure.file, failure.line) == ("/home/learner/course/shapes.py", 6)
    assert failure.traceback.splitlines()[-1] == \
        '  File "/home/learner/course/shapes.py", line 6 in <module>'
    # library files as a learner reads them, as in the panes' tracebacks
    assert '  File ".../site-packages/torch/distributed/distributed_c10d.py", line 3252 in ' \
        'all_reduce' in failure.traceback
    assert "server.py" not in failure.traceback and "worker.py" not in failure.traceback


@pytest.mark.parametrize(("stderr", "message", "frames"), [
    ("", "", 0),                                         # SIGKILL: nothing written
    ("some log line\nanother\n", "", 0),
    # a segfault: faulthandler's dump but no C++ exception
    ('Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f (most recent call first):\n'
     '  File "/home/learner/course/train.py", line 9 in step\n'
     '  File "/home/learner/course/train.py", line 20 in <module>\n', "", 2),
    # std::terminate without a faulthandler dump
    ("terminate called after throwing an instance of 'c10::Error'\n  what():  boom\n",
     "c10::Error: boom", 0),
    # a dump whose threads are all library code: no line to point at
    ('Fatal Python error: Aborted\n\nThread 0x1 (most recent call first):\n'
     '  File "/usr/lib/python3.11/threading.py", line 327 in wait\n', "", 0),
])
def test_read_crash_on_what_other_endings_leave(stderr, message, frames):
    got_message, got_frames = read_crash(stderr)
    assert got_message == message and len(got_frames) == frames


def test_explain_crash_leaves_a_failure_alone_when_stderr_says_nothing():
    failure = _signal_failure()
    explain_crash(failure, "some log line\n")
    assert failure == _signal_failure()


THREAD_FAILED = """Exception in thread Thread-1 (load):
Traceback (most recent call last):
  File "/usr/lib/python3.11/threading.py", line 982, in run
    self._target(*self._args, **self._kwargs)
  File "/home/learner/course/train.py", line 37, in load
    raise RuntimeError("the loader thread failed")
RuntimeError: the loader thread failed
"""


def test_an_exit_after_another_thread_failed_names_that_threads_error():
    failure = Failure(rank=1, exc_type="SystemExit", message="exit code 1", file="train.py",
                      line=64, traceback="", exit_code=1, kind="exit")
    explain_crash(failure, "a line\n" + THREAD_FAILED)
    assert failure.message == ("exit code 1, after thread Thread-1 (load) raised RuntimeError: "
                               "the loader thread failed")
    assert (failure.file, failure.line) == ("train.py", 64)  # where the script exited


def test_a_fatal_dump_in_a_pane_stops_at_the_worker_bootstrap():
    from labutils.run.streams import FatalDumpCut

    dump = ["Fatal Python error: Aborted", "",
            "Thread 0x00007f01 (most recent call first):",
            '  File "/x/src/labutils/runtime/worker.py", line 107 in _watch_progress',
            '  File "/usr/lib/python3.11/threading.py", line 982 in run', "",
            "Current thread 0x00007f02 (most recent call first):",
            '  File "/home/learner/course/train.py", line 56 in <module>',
            '  File "<frozen runpy>", line 88 in _run_code',
            '  File "/x/src/labutils/runtime/worker.py", line 204 in main',
            '  File "/x/site-packages/torch/distributed/run.py", line 982 in run_script_path',
            '  File "/x/src/labutils/runtime/server.py", line 78 in start_keeper', "",
            "Extension modules: torch._C (total: 1)"]
    cut = FatalDumpCut()
    shown = cut.feed(["before"] + dump[:9]) + cut.feed(dump[9:] + ["after"], final=True)
    assert shown == ["before", "Fatal Python error: Aborted", "",
                     "Current thread 0x00007f02 (most recent call first):",
                     '  File "/home/learner/course/train.py", line 56 in <module>', "",
                     "Extension modules: torch._C (total: 1)", "after"]


def test_a_sigterm_dump_written_elsewhere_gives_the_scripts_line():
    """SIGTERM's stacks go to rankN/ended-stacks.txt, one dump per attempt and no header:
    the last thread with the script's frames is read."""
    dump = ('Current thread 0x1 (most recent call first):\n'
            '  File "/course/train.py", line 7 in <module>\n\n'
            'Thread 0x2 (most recent call first):\n'
            '  File "/venv/lib/python3.11/threading.py", line 320 in wait\n\n'
            'Current thread 0x3 (most recent call first):\n'
            '  File "/venv/lib/python3.11/subprocess.py", line 2004 in _try_wait\n'
            '  File "/course/train.py", line 12 in <module>\n')
    message, frames = read_crash("", dump)
    assert message == "" and [(Path(f.file).name, f.line) for f in frames][-1] == ("train.py", 12)
    assert read_crash("", "") == ("", [])
