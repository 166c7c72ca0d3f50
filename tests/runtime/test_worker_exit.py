"""The worker bootstrap ends a rank without the interpreter's teardown (worker.finish):
what a normal exit does for the script must still happen."""

from __future__ import annotations

import pytest

from labutils import launch

# Every test here runs warm and cold (conftest.py: the `start` fixture).
pytestmark = pytest.mark.usefixtures("start")


def test_exit_keeps_threads_atexit_handlers_unclosed_files_and_exit_codes(runs_dir, write_script,
                                                                          tmp_path):
    out = tmp_path / "out.txt"
    script = write_script("exit_semantics.py", f"""
        import atexit, sys, threading, time
        log = open({str(out)!r}, "w")              # never closed: its buffer must reach the disk
        log.write("unclosed file\\n")
        atexit.register(lambda: open({str(out)!r} + ".atexit", "w").write("atexit ran"))
        def late():
            time.sleep(0.5)
            open({str(out)!r} + ".thread", "w").write("thread finished")
        threading.Thread(target=late).start()     # a non-daemon thread outlives the script
        sys.exit(int(sys.argv[1]) if sys.argv[1].lstrip("-").isdigit() else sys.argv[1])
    """)
    # sys.exit(-1): the process ends with 255, and the summary still names the sys.exit line
    for arg, code in (("0", 0), ("3", 3), ("-1", 255), ("no config file", 1)):
        result = launch(script, 1, args=[arg], display="none")
        assert result.ranks[0].exit_code == code and result.ok is (code == 0)
        assert out.read_text() == "unclosed file\n"
        assert (tmp_path / "out.txt.atexit").read_text() == "atexit ran"
        assert (tmp_path / "out.txt.thread").read_text() == "thread finished"
        # sys.exit("why") prints its text and exits 1; the summary says both
        number = arg.lstrip("-").isdigit()
        assert result.ranks[0].stderr == ("" if number else f"{arg}\n")
        if code:
            assert result.failure.message == f"exit code {code}" + ("" if number else f": {arg}")
            assert (result.failure.kind, result.failure.line) == ("exit", 10)


def test_the_scripts_objects_live_until_the_rank_ends(runs_dir, write_script):
    """Freed as the script returns, a DDP model can free gloo's process group in the
    main thread holding the GIL while a gloo thread waits for it, and the rank never
    exits (worker.run_as_main): the objects of a script, one that raised too, and of a
    script run under the grader's probe, stay until the process ends."""
    from labutils.grading.probe import launch_measured

    script = write_script("objects.py", """
        import argparse, sys, weakref
        kept = argparse.Namespace()   # no function of the script refers to it: no cycle
        weakref.finalize(kept, print, "freed", flush=True).atexit = False
        print("script over", flush=True)
        if sys.argv[1] == "raise":
            raise ValueError("ended by an exception")
    """)
    for how in ("return", "raise"):
        result = launch(script, 1, args=[how], display="none")
        assert "script over" in result.ranks[0].stdout and "freed" not in result.ranks[0].stdout, how
    probed = launch_measured(str(script), 1, measure=["steps"], args=["return"], display="none")
    assert "script over" in probed.ranks[0].stdout and "freed" not in probed.ranks[0].stdout


def test_a_handler_the_script_left_cannot_raise_into_the_report(tmp_path):
    """torch's DataLoader raises from SIGCHLD when a worker died, often after its own
    check already raised: once the script is over its handlers are off, and the
    script's own exception is the one reported."""
    import signal
    import time

    from labutils.runtime.worker import run_script

    script = tmp_path / "late_handler.py"
    script.write_text(
        "import signal, subprocess\n"
        "def late(signum, frame):\n"
        "    raise RuntimeError('a handler raised after the script ended')\n"
        "signal.signal(signal.SIGCHLD, late)\n"
        "signal.signal(signal.SIGUSR2, late)\n"
        "subprocess.Popen(['sleep', '0.3'])  # its SIGCHLD comes after the script\n"
        "raise ValueError('the script failed')\n")
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGCHLD, signal.SIGUSR2)}
    try:
        raised = run_script(str(script))
        assert isinstance(raised, ValueError) and str(raised) == "the script failed"
        assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
        time.sleep(0.6)  # the child's SIGCHLD arrives: nothing raises here
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_handler_firing_while_the_exception_is_read_cannot_replace_it(tmp_path, monkeypatch):
    """SIGCHLD came while the bootstrap read which exception was the script's (a 4-rank cold
    run of the endings table's killed DataLoader worker): torch's handler raised there, and
    the rank ended with no exception event. The handlers are off before it is read."""
    import os
    import signal

    from labutils.runtime import worker

    script = tmp_path / "dataloader_like.py"
    script.write_text(
        "import signal\n"
        "def late(signum, frame):\n"
        "    raise RuntimeError('DataLoader worker (pid 7) is killed by signal: Killed.')\n"
        "signal.signal(signal.SIGCHLD, late)\n"
        "raise ValueError('the script failed')\n")
    read = worker.scripts_own_exception

    def reading(exc, path):
        os.kill(os.getpid(), signal.SIGCHLD)  # the script's worker died just now
        return read(exc, path)

    monkeypatch.setattr(worker, "scripts_own_exception", reading)
    before = signal.getsignal(signal.SIGCHLD)
    try:
        raised = worker.run_script(str(script))
        assert isinstance(raised, ValueError) and str(raised) == "the script failed"
    finally:
        signal.signal(signal.SIGCHLD, before)


def test_an_exception_a_handler_raised_whilescripts_own_exception_unwound_gives_way(tmp_path):
    """The handler's exception, raised outside the script's frames, has the script's
    own as its __context__: that one is reported, with the script's line."""
    from labutils.runtime.worker import run_script

    script = tmp_path / "unwinding.py"
    script.write_text("def fail():\n    raise ValueError('the script failed')\nfail()\n")
    raised = run_script(str(script))
    assert isinstance(raised, ValueError)
    # what the bootstrap is handed when a library frame raised during the unwinding
    from labutils.runtime.worker import scripts_own_exception

    late = RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed.")
    late.__context__ = raised
    assert scripts_own_exception(late, str(script)) is raised
    assert scripts_own_exception(raised, str(script)) is raised
    outside = RuntimeError("no script frame, no context")
    assert scripts_own_exception(outside, str(script)) is outside


def test_a_rank_stopped_while_it_reports_its_exception_is_placed_at_its_line(runs_dir, write_script,
                                                                            tmp_path):
    """A SIGTERM that comes while the bootstrap formats the script's exception (a peer
    on another node stopped a moment earlier, on a loaded machine) waits until the
    exception is written: "where each rank was" places the rank at its raise, not in
    the report's frames. Here rank 1's exception is described only once rank 0, which
    waits in a loop, has been ended by Stop: torchrun sent rank 1 its SIGTERM with
    rank 0's."""
    from helpers import stop_once

    script = write_script("slow_report.py", f"""
        import os, time
        PID = {str(tmp_path / "rank0.pid")!r}
        def rank0_gone():
            try:
                pid = int(open(PID).read())  # rank 1 may get here before rank 0 wrote it
            except (OSError, ValueError):
                return False
            try:
                with open(f"/proc/{{pid}}/stat") as stat:
                    return stat.read().rsplit(")", 1)[1].split()[0] in "ZX"
            except OSError:
                return True
        class DescribedAfterStop(Exception):
            def __str__(self):
                deadline = time.monotonic() + 60
                while not rank0_gone() and time.monotonic() < deadline:
                    time.sleep(0.02)
                time.sleep(0.2)
                return "described after Stop"
        if os.environ["RANK"] == "0":
            open(PID + ".tmp", "w").write(str(os.getpid()))
            os.replace(PID + ".tmp", PID)
        print("started", flush=True)
        if os.environ["RANK"] == "1":
            raise DescribedAfterStop()
        while True:
            time.sleep(0.05)
    """)
    lines = script.read_text().splitlines()
    raise_line, loop = (lines.index(text) + 1 for text in ("    raise DescribedAfterStop()", "while True:"))
    result = launch(script, 2, display=stop_once(lambda d: d.started == {0, 1}, after_s=0.5),
                    hang_timeout=None, timeout=120)
    assert result.reason == "stopped" and result.at_stop is not None, result.summary()
    assert {r: w.rsplit("/", 1)[-1] for r, w in result.at_stop.waiting.items()} == \
        {0: f"slow_report.py:{loop + 1}", 1: f"slow_report.py:{raise_line}"}, result.summary()
    assert [r.exit_code for r in result.ranks] == [-15, -15], result.summary()
    assert "DescribedAfterStop: described after Stop" in result.ranks[1].stderr


@pytest.mark.parametrize("how", ["closed", "none"])
def test_a_script_that_closes_or_drops_its_streams_ends_as_python_would(runs_dir, write_script, how):
    """`sys.stdout.close()` or `sys.stdout = None` in a script: python exits 0 after it.
    The bootstrap's flush raised, and such a rank was reported as failing ("exit code 1
    without a Python exception"), its peer a victim when warm; one that then raised lost
    its traceback. Now the rank ends as it would alone, and the traceback reaches its
    stderr.log."""
    script = write_script("streams.py", f"""
        import sys
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        if dist.get_rank() == 1:
            if {how!r} == "closed":
                sys.stdout.close(); sys.stderr.close()
            else:
                sys.stdout = sys.stderr = None
            if sys.argv[1] == "raise":
                raise ValueError("the batch is empty")  # the line
        dist.destroy_process_group()
    """)
    fine = launch(script, 2, args=["return"], display="none")
    assert fine.ok and [r.exit_code for r in fine.ranks] == [0, 0], fine.summary()
    failed = launch(script, 2, args=["raise"], display="none")
    f = failed.failure
    line = next(i for i, t in enumerate(script.read_text().splitlines(), 1) if t.endswith("# the line"))
    assert (f.rank, f.kind, f.exc_type, f.line) == (1, "exception", "ValueError", line), failed.summary()
    assert failed.ranks[1].stderr.rstrip().endswith("ValueError: the batch is empty")
