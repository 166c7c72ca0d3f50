"""Real torchrun runs through launch(): output, records, failures, hangs, lifetimes."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS, stop_once

from labutils import launch
from labutils.runtime.procs import pid_alive
from labutils.notebook.display import TextDisplay

# Every test here runs warm and cold (conftest.py: the `start` fixture).
pytestmark = pytest.mark.usefixtures("start")



def text_display(limit=None):
    out, err = io.StringIO(), io.StringIO()
    return TextDisplay(out=out, err=err, limit=limit), out, err


def test_hello_four_ranks(runs_dir):
    display, out, _ = text_display()
    result = launch(SCRIPTS / "hello.py", 4, display=display)
    assert result.ok and result.reason == "ok" and result.exit_status == 0
    assert result.world_size == 4
    assert [r.state for r in result.ranks] == ["done"] * 4
    assert [r.exit_code for r in result.ranks] == [0] * 4
    assert sorted(rec["rank"] for rec in result.records) == [0, 1, 2, 3]
    assert {rec["sum"] for rec in result.records} == {6.0}
    assert result.ranks[0].stdout == "hello from rank 0 of 4, sum=6\nonly rank 0 says this\n"
    assert result.ranks[3].stdout == "hello from rank 3 of 4, sum=6\n"
    shown = out.getvalue()
    for r in range(4):
        assert f"[rank {r}] hello from rank {r} of 4, sum=6\n" in shown
    assert "run finished: 4 rank(s)" in shown
    summary = json.loads((result.log_dir / "summary.json").read_text())
    assert summary["ok"] is True and len(summary["ranks"]) == 4
    port = next(ln for ln in (result.log_dir / "command.txt").read_text().splitlines()
                if ln.startswith("127.0.0.1:"))
    assert port != "127.0.0.1:29500"


def test_ranks_never_mix_within_a_line(runs_dir):
    display, out, err = text_display()
    result = launch(SCRIPTS / "chatty.py", 3, display=display)
    assert result.ok
    for stream, text in (("stdout", out.getvalue()), ("stderr", err.getvalue())):
        lines = [ln for ln in text.splitlines() if ln.startswith("[rank ")]
        assert lines
        for line in lines:
            m = re.fullmatch(r"\[rank (\d)\] ([RE])(\d)-\d{5}-(\d+)", line)
            assert m, f"mangled {stream} line: {line[:80]}"
            rank, _, rank_in_text, body = m.groups()
            assert rank == rank_in_text and set(body) == {rank}
    for r in result.ranks:
        assert r.stdout_lines == 3000 and r.stderr_lines == 300
        assert r.stdout.count("\n") == 3000


@pytest.mark.warm_only("cold: tests/run/test_endings.py runs an exception in the main thread "
                       "cold, with 2 and 4 ranks, and requires the same verdict as warm")
def test_failure_names_root_cause_and_victims(runs_dir):
    display, out, _ = text_display()
    result = launch(SCRIPTS / "fail_rank2.py", 4, display=display)
    assert not result.ok and result.reason == "failed" and result.exit_status == 1
    f = result.failure
    assert (f.rank, f.exc_type, f.message) == (2, "ValueError", "bad batch shape on rank 2")
    assert f.file.endswith("fail_rank2.py") and f.line == 11
    assert "labutils" not in f.traceback and "runpy" not in f.traceback
    assert f.traceback.startswith("Traceback (most recent call last):")
    assert f.victims == [0, 1, 3]
    assert result.ranks[2].state == "failed" and not result.ranks[2].victim
    assert all(result.ranks[r].victim for r in (0, 1, 3))
    text = out.getvalue()
    assert "root cause: rank 2 raised ValueError: bad batch shape on rank 2" in text
    assert "fail_rank2.py:11" in text


@pytest.mark.warm_only("the exception events it reads are written by the same worker code "
                       "cold (test_failure_names_root_cause_and_victims[cold])")
def test_collective_timeouts_are_reported_as_a_mismatch_with_every_ranks_call(runs_dir):
    """Every rank gives up after the process group's timeout: nobody is blamed alone."""
    display, out, _ = text_display()
    result = launch(SCRIPTS / "timeout_mismatch.py", 2, display=display, hang_timeout=60)
    assert result.reason == "failed" and result.exit_status == 1
    mismatch = result.failure.mismatch
    assert {r: (m["collective"], m["where"].rsplit("/", 1)[-1]) for r, m in mismatch.items()} == {
        0: ("all_reduce", "timeout_mismatch.py:11"), 1: ("barrier", "timeout_mismatch.py:12")}
    text = out.getvalue()
    assert "collectives did not match" in text and "root cause" not in text
    assert "rank 0 waited in all_reduce() at" in text and "rank 1 waited in barrier() at" in text


@pytest.mark.warm_only("cold: test_endings.py's size_mismatch ending, gloo's abort, cold")
def test_a_rank_killed_by_a_cpp_error_is_reported_with_the_error_and_its_line(runs_dir):
    """gloo aborts a rank (SIGABRT, no Python exception): its stderr still says why and where."""
    display, out, _ = text_display()
    result = launch(SCRIPTS / "shape_mismatch.py", 2, display=display, hang_timeout=30)
    assert result.reason == "failed" and not result.ok
    failure = result.failure
    assert failure.exc_type == "SIGABRT" and failure.exit_code == -signal.SIGABRT
    assert "Received data size doesn't match expected size" in failure.message
    assert failure.where.endswith("shape_mismatch.py:10") and failure.source == "dist.all_reduce(x)"
    assert failure.victims == [1 - failure.rank]
    text = out.getvalue()
    assert "gloo::EnforceNotMet" in text and "runtime/server.py" not in text


@pytest.mark.warm_only("cold: test_endings.py's hang ending (a rank stuck in a collective), cold")
def test_hang_reports_stacks_waiting_lines_and_straggler(runs_dir):
    display, out, _ = text_display()
    hang_timeout = 3.0
    result = launch(SCRIPTS / "straggler.py", 3, display=display, hang_timeout=hang_timeout)
    came_back = time.time()
    assert result.reason == "hang" and result.exit_status == 3 and not result.ok
    stacks, waiting, stragglers = result.hang
    assert stragglers == [1]
    assert waiting[1].endswith("straggler.py:14")
    assert waiting[0].endswith("straggler.py:15") and waiting[2].endswith("straggler.py:15")
    assert result.hang.calls[0] == "all_reduce"
    assert "time.sleep(600)" in result.hang.sources[1]
    assert "straggler.py" in stacks[1] and "worker.py" not in stacks[1]
    assert [r.state for r in result.ranks] == ["hung"] * 3
    silent_from = max(rec["silent_from"] for rec in result.records)
    # Reported within hang_timeout + 5 s of the last progress (DESIGN target).
    assert came_back - silent_from < hang_timeout + 5
    assert "<- straggler" in out.getvalue()


def test_an_agent_killed_by_sigkill_is_named_and_takes_its_ranks_along(runs_dir, write_script):
    """A rank kills its own torchrun agent with SIGKILL (as the OOM killer may): the keeper
    ends the ranks and exits as the agent did; the summary names the agent's signal."""
    script = write_script("kills_agent.py", """
        import os, signal, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        if dist.get_rank() == 1:
            os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)
    """)
    result = launch(script, 2, display="none", hang_timeout=30, timeout=90)
    assert (result.reason, result.failure.kind) == ("failed", "torchrun"), result.summary()
    assert "torchrun's agent was killed by SIGKILL" in result.failure.message
    assert result.agent_exit_code == -signal.SIGKILL
    assert "Traceback" not in (result.log_dir / "agent.log").read_text()  # the keeper's own exit
    assert all(r.pid and not pid_alive(r.pid) for r in result.ranks)


def test_a_script_that_ended_while_its_thread_runs_on_is_named_in_the_hang_report(
        runs_dir, write_script):
    """Rank 1's script raises, but Python waits for a thread that is not a daemon, so its
    process stays: the report says so, not that rank 1 already left the run."""
    script = write_script("lingers.py", """
        import threading, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        if dist.get_rank() == 1:
            threading.Thread(target=time.sleep, args=(120,)).start()
            raise ValueError("no batches left")
        dist.barrier()
    """)
    display, out, _ = text_display()
    result = launch(script, 2, display=display, hang_timeout=3, timeout=90)
    assert result.reason == "hang", result.summary()
    assert result.hang.exited == {1: 1}
    assert result.hang.lingering == {1: "raised ValueError at lingers.py:8: no batches left"}
    assert "rank 1, whose script ended but whose process runs on" in result.hang.explanation
    assert "rank 1's script raised ValueError at lingers.py:8: no batches left, but its process " \
           "runs on" in out.getvalue()
    assert all(r.pid and not pid_alive(r.pid) for r in result.ranks)


@pytest.mark.warm_only("a cold run's ranks are ended by the same stop path in "
                       "test_lifetime.py's [stop-cold] and [caller-kill9-cold]")
def test_timeout_stops_every_rank_quickly(runs_dir):
    t0 = time.monotonic()
    # 10 s: a warm rank prints its first line within a second (a few on a loaded machine)
    result = launch(SCRIPTS / "forever.py", 2, display="none", timeout=10, hang_timeout=None)
    assert result.reason == "timeout" and result.exit_status == 4
    assert time.monotonic() - t0 < 10 + 5
    assert [r.state for r in result.ranks] == ["killed", "killed"]
    assert all(r.pid and not pid_alive(r.pid) for r in result.ranks)
    assert result.ranks[0].stdout.startswith("starting\n")  # logs kept


@pytest.mark.parametrize("ending", ["timeout", "stopped"])
def test_a_stopped_run_says_where_each_rank_was(runs_dir, ending):
    """Rank 1 loops outside any collective, rank 0 waits in barrier(): no failure, no hang
    (hang_timeout=None), only the timeout or Stop ends it. The summary names each rank's
    line and call from the stacks the ranks dumped when SIGTERM ended them (result.at_stop
    has the straggler too; one look at a run that may have been well is no verdict, so
    the summary does not say it)."""
    script = SCRIPTS / "waits_for_a_flag.py"
    lines = script.read_text().splitlines()
    loop, barrier = (next(i for i, t in enumerate(lines, 1) if t.endswith(tag))
                     for tag in ("# waits here", "# rank 0 waits here"))
    # the timeout: every rank is in its wait within a few seconds, cold on a loaded machine too
    result = launch(script, 2, hang_timeout=None, **(
        {"display": "none", "timeout": 20} if ending == "timeout" else
        {"display": stop_once(lambda d: len(d.started) == 2), "timeout": 120}))
    assert result.reason == ending and result.hang is None, result.summary()
    at = result.at_stop
    assert at is not None, result.summary()
    waiting = {rank: where.rsplit("/", 1)[-1] for rank, where in at.waiting.items()}
    assert (waiting, at.calls, at.stragglers) == (
        {0: f"waits_for_a_flag.py:{barrier}", 1: f"waits_for_a_flag.py:{loop + 1}"},
        {0: "barrier", 1: ""}, [1]), result.summary()
    text = result.summary()
    when = {"timeout": "at the timeout", "stopped": "when the run was stopped"}[ending]
    assert f"where each rank was {when}:\n  rank 0 was at {at.waiting[0]} in barrier()    " \
           f"dist.barrier()  # rank 0 waits here\n  rank 1 was at {at.waiting[1]}    " \
           "time.sleep(0.05)" in text, text
    assert "at_stop" not in result.to_json() and result.to_json()["hang"] is None


@pytest.mark.warm_only("a rank's output takes one path warm and cold (the worker bootstrap's "
                       "fd redirect to the run folder's files); test_hello_four_ranks[cold] "
                       "reads a cold run's lines")
def test_flood_is_complete_on_disk_and_bounded_on_screen(runs_dir):
    n = 200_000
    display, out, _ = text_display(limit=200)
    result = launch(SCRIPTS / "flood.py", 2, args=[str(n)], display=display)
    assert result.ok
    log = (result.log_dir / "rank0" / "stdout.log").read_text().splitlines()
    assert len(log) == n and log[0] == "flood line 0" and log[-1] == f"flood line {n - 1}"
    assert result.ranks[0].stdout_lines == n
    shown = out.getvalue()
    assert shown.count("[rank 0] flood line") == 200 + 10  # first 200 live, last 10 at the end
    assert f"[rank 0] ... {n - 200 - 10} earlier lines in" in shown
    assert f"[rank 0] flood line {n - 1}\n" in shown
    assert len(shown) < 50_000


def test_restart_after_injected_kill_resumes(runs_dir, tmp_path):
    ckpt = tmp_path / "ckpt.txt"
    result = launch(SCRIPTS / "resume.py", 2, args=[str(ckpt)], display="none",
                    max_restarts=1, fault={"rank": 1, "step": 2})
    assert result.ok, result.summary()
    first, second = result.attempts
    assert first["failed_rank"] == 1 and first["injected"] == {"rank": 1, "step": 2}
    assert first["outcome"] == "restarted" and "SIGKILL" in first["why"]
    assert second["outcome"] == "ok"
    steps = sorted((rec["restart"], rec["step"]) for rec in result.records if rec["rank"] == 1)
    assert steps[-1] == (1, 5) and (0, 3) not in steps


@pytest.mark.warm_only("the rounds are told apart by the worker bootstrap and the fold, the same "
                       "warm and cold; test_restart_after_injected_kill_resumes[cold] restarts cold")
def test_a_hang_after_a_restart_through_the_agents_shared_store_is_declared(runs_dir, write_script):
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0: every round on the agent store's port. The
    second attempt's ranks are both its members, so its silence is a hang within
    hang_timeout (it was never declared: rank 1's restart was taken for a late start of
    the first attempt, and the run waited for its timeout)."""
    script = write_script("silent_restart.py", """
        import os
        import sys
        import time
        from labutils.dist import report
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            if os.environ["RANK"] == "1":
                sys.exit(3)   # torchrun restarts both ranks
            time.sleep(120)   # until the agent stops rank 0
        report(store=os.environ["TORCHELASTIC_USE_AGENT_STORE"])
        time.sleep(120)       # the second attempt says nothing more: a hang
    """)
    started = time.monotonic()
    result = launch(script, 2, display="none", max_restarts=1, hang_timeout=4, timeout=100,
                    env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert result.reason == "hang", result.summary()
    assert time.monotonic() - started < 60
    assert [rec["store"] for rec in result.records] == ["True", "True"]
    assert [a["outcome"] for a in result.attempts] == ["restarted", "hang"]
    assert [r.state for r in result.ranks] == ["hung", "hung"]


def test_report_values_and_env_pass_through(runs_dir, write_script):
    script = write_script("env.py", """
        import os
        import torch
        from labutils.dist import report
        report(debug=os.environ["TORCH_DISTRIBUTED_DEBUG"], t=torch.tensor([1.5, 2.0]),
               nested={"a": [1, 2]})
    """)
    result = launch(script, 1, display="none", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert result.ok
    assert result.records == [{"rank": 0, "debug": "DETAIL", "t": [1.5, 2.0],
                               "nested": {"a": [1, 2]}}]


def test_script_args_and_sys_exit_code(runs_dir, write_script):
    script = write_script("exit.py", """
        import sys
        print(sys.argv[1:])
        sys.exit(int(sys.argv[1]) if __name__ == "__main__" else 9)
    """)
    result = launch(script, 1, args=["3", "--flag"], display="none")
    assert not result.ok and result.ranks[0].exit_code == 3
    assert result.ranks[0].stdout == "['3', '--flag']\n"
    assert result.failure.rank == 0 and result.failure.exc_type == "SystemExit"


def test_torchruns_own_log_folder_is_in_the_run_folder(runs_dir, write_script):
    """torchrun's --log-dir is the run folder's elastic/: a script using torch's @record
    leaves its error.json there, and nothing is made in /tmp (torchrun's own default,
    never removed: a folder per run)."""
    script = write_script("recorded.py", """
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise ValueError("recorded by torch")

        main()
    """)
    result = launch(script, 1, display="none")
    assert not result.ok and result.failure.exc_type == "ValueError"
    command = (result.log_dir / "command.txt").read_text().splitlines()
    assert command[command.index("--log-dir") + 1] == str(result.log_dir / "elastic")
    (error_file,) = (result.log_dir / "elastic").glob("*/attempt_0/0/error.json")
    assert "recorded by torch" in error_file.read_text()


# ------------------------------------------------------------------ lifetimes

def _pids_of_run(runs_dir: Path, world: int, timeout: float = 90) -> list[int]:
    """Worker pids of the one run under runs_dir, once every rank has printed a line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        printed = [p for p in runs_dir.glob("*/rank*/stdout.log") if p.stat().st_size]
        if len(printed) < world:
            time.sleep(0.1)
            continue
        pids = []
        for events in runs_dir.glob("*/rank*/events.jsonl"):
            for line in events.read_text().splitlines():
                ev = json.loads(line)
                if ev.get("kind") == "start":
                    pids.append(ev["pid"])
        if len(pids) >= world:
            return pids
        time.sleep(0.1)
    raise AssertionError("ranks did not start")


def _agent_pids(parent: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(parent).children(recursive=True)]


def _all_gone(pids, within=5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_ctrl_c_on_the_cli_stops_everything(runs_dir, tmp_path):
    out_json = tmp_path / "out.json"
    cli = subprocess.Popen(
        [sys.executable, "-m", "labutils", "launch", "-n", "2", str(SCRIPTS / "forever.py"),
         "--json", str(out_json)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    pids = _pids_of_run(runs_dir, 2)
    pids += _agent_pids(cli.pid)
    t0 = time.monotonic()
    cli.send_signal(signal.SIGINT)
    cli.wait(timeout=30)
    assert time.monotonic() - t0 < 5
    assert cli.returncode == 130
    assert _all_gone(pids, within=1)
    summary = json.loads(out_json.read_text())
    assert summary["reason"] == "interrupted"
    assert [r["state"] for r in summary["ranks"]] == ["killed", "killed"]


def test_killing_the_caller_with_sigkill_takes_the_run_down(runs_dir):
    caller = subprocess.Popen(
        [sys.executable, "-c",
         "from labutils import launch; "
         f"launch({str(SCRIPTS / 'forever.py')!r}, 2, display='none', hang_timeout=None)"],
    )
    pids = _pids_of_run(runs_dir, 2)
    pids += _agent_pids(caller.pid)
    assert len(pids) >= 3  # the agent and two ranks
    caller.kill()
    caller.wait()
    assert _all_gone(pids, within=5), [p for p in pids if pid_alive(p)]
    logs = list(runs_dir.glob("*/rank0/stdout.log"))
    assert logs and logs[0].read_text().startswith("starting\n")


@pytest.mark.warm_only("the CLI's cold runs: test_ctrl_c_on_the_cli_stops_everything[cold], "
                       "test_cli_script_args_after_double_dash[cold] and test_lifetime.py's "
                       "[cli-sigterm-cold]; exit statuses and the JSON do not depend on the start")
@pytest.mark.parametrize(("script", "args", "status"), [
    ("hello.py", [], 0),
    ("fail_rank2.py", [], 1),
    ("straggler.py", ["--hang-timeout", "2"], 3),
])
def test_cli_exit_status_and_json(runs_dir, tmp_path, script, args, status):
    _cli_exit_status_and_json(tmp_path, script, args, status)


@pytest.mark.warm_only("a cold run stopped from outside: test_lifetime.py's [cli-sigterm-cold]")
def test_cli_exit_status_4_on_timeout(runs_dir, tmp_path):
    _cli_exit_status_and_json(tmp_path, "forever.py", ["--timeout", "8", "--hang-timeout", "0"], 4)


def _cli_exit_status_and_json(tmp_path, script, args, status):
    out_json = tmp_path / "out.json"
    n = "4" if script == "fail_rank2.py" else "2"
    proc = subprocess.run(
        [sys.executable, "-m", "labutils", "launch", "-n", n, str(SCRIPTS / script),
         "--json", str(out_json), *args],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == status, proc.stdout + proc.stderr
    summary = json.loads(out_json.read_text())
    assert set(summary) >= {"ok", "world_size", "duration_s", "log_dir", "ranks", "failure",
                            "hang", "attempts", "records"}
    assert summary["ok"] is (status == 0)
    assert set(summary["ranks"][0]) == {"rank", "exit_code", "state", "stdout_lines",
                                        "stderr_lines"}
    if status == 1:
        assert summary["failure"]["rank"] == 2
    if status == 3:
        assert summary["hang"]["stragglers"] == [1]
        assert set(summary["hang"]) >= {"stacks", "waiting", "stragglers"}
    if status == 0:
        assert "[rank 0] hello from rank 0 of 2" in proc.stdout


def test_cli_usage_error_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "labutils", "launch", "-n", "0", "x.py"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "nproc: expected a whole number of ranks >= 1" in proc.stderr


def test_cli_script_args_after_double_dash(runs_dir, write_script, tmp_path):
    script = write_script("args.py", "import sys\nprint(sys.argv[1:])\n")
    proc = subprocess.run(
        [sys.executable, "-m", "labutils", "launch", "-n", "1", str(script), "--", "--epochs", "2"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0
    assert "[rank 0] ['--epochs', '2']" in proc.stdout


def test_a_run_holds_its_rendezvous_port_against_other_launchers_until_it_ends(
        runs_dir, write_script, tmp_path):
    """The port is claimed from the moment it is drawn (runtime/procs.py): another
    launcher's draw skips it while this run goes, and takes it again once it is over.
    Agent 0 is told it hosts the store, so a taken port fails the run instead of making
    it a client of another run's store."""
    import threading

    from labutils.run.launcher import prepare
    from labutils.runtime.procs import claim

    flag = tmp_path / "go"
    script = write_script("waits.py", f"""
        import pathlib, time
        while not pathlib.Path({str(flag)!r}).exists():
            time.sleep(0.05)
        print("over")
        """)
    run = prepare(script, 1, display="none")
    command = run.request.commands[0]
    port = int(command[command.index("--rdzv-endpoint") + 1].rsplit(":", 1)[1])
    assert "is_host=true" in command[command.index("--rdzv-conf") + 1]
    assert claim("port", port) is None   # held before it starts...
    done: list = []
    thread = threading.Thread(target=lambda: done.append(run.run()))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not list(runs_dir.glob("*/rank0/events.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert claim("port", port) is None   # ...and while it runs
    finally:
        flag.touch()
        thread.join(90)
    assert done and done[0].ok, done
    again = claim("port", port)   # let go once it is over
    assert again is not None
    again.release()
