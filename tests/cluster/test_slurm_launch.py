"""launch(..., scheduler="slurm") against the real local SLURM cluster (tests/slurm_fixture.py).

The run is submitted with sbatch; each node of the allocation runs one `labutils launch`
node; this process follows the run folder as for a local run: live lines, RunResult,
failure and hang diagnosis; stop and interrupt cancel the job and leave the queue empty.
"""

from __future__ import annotations

import json

import subprocess
import textwrap

import pytest

from labutils import launch
from labutils.notebook.display import Display, TextDisplay
from labutils.cluster.slurm_backend import NODES_STOP_S
from labutils.errors import LaunchConfigError
from helpers import SCRIPTS, stop_once
from slurm_fixture import slurm_cluster, slurm_queue  # noqa: F401  (the session's local cluster)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

JOB = textwrap.dedent("""
    import sys, time
    import torch
    import torch.distributed as dist
    from labutils.dist import init, report

    rank, world, _ = init()
    mode = sys.argv[1]
    t = torch.ones(4) * (rank + 1)
    for step in range(3):
        if mode == "fail" and rank == 1 and step == 1:
            raise RuntimeError("planted failure on rank 1")
        if mode == "hang" and rank == 1 and step == 1:
            time.sleep(300)
        dist.all_reduce(t)
        report(step=step, total=3)
        if mode == "slow":
            time.sleep(2)
    print(f"rank {rank} of {world}: sum {t[0].item():.0f}")
""")


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return path


def _layout(cluster) -> dict:
    """2 ranks in all: 2 nodes x 1, or 1 x 2 when the cluster has one node."""
    return {"nnodes": cluster.nodes, "nproc": 2 // cluster.nodes}


def test_job_streams_every_rank_back(slurm_cluster, job, tmp_path):
    lines = []

    class Recording(TextDisplay):
        def lines(self, rank, stream, new):
            lines.extend((rank, line) for line in new)
            super().lines(rank, stream, new)

    result = launch(job, args=["ok"], scheduler="slurm", log_dir=tmp_path / "runs",
                    display=Recording(), hang_timeout=60, timeout=180, **_layout(slurm_cluster))
    assert result.ok, result
    assert result.world_size == 2
    # 1 + 2 summed, then doubled twice by the next two all_reduce calls
    assert (0, "rank 0 of 2: sum 12") in lines and (1, "rank 1 of 2: sum 12") in lines
    assert sorted(r["rank"] for r in result.records) == [0, 0, 0, 1, 1, 1]
    assert (result.log_dir / "job.sbatch").exists()
    assert list(result.log_dir.glob("slurm-*.out"))
    assert result.command[0] == "sbatch"
    assert not slurm_queue().strip()


def test_planted_failure_names_its_rank(slurm_cluster, job, tmp_path):
    result = launch(job, args=["fail"], scheduler="slurm", log_dir=tmp_path / "runs",
                    display="none", hang_timeout=60, timeout=180, **_layout(slurm_cluster))
    assert not result.ok and result.reason == "failed"
    assert (result.failure.rank, result.failure.exc_type) == (1, "RuntimeError")
    assert "planted failure on rank 1" in result.failure.message
    assert result.failure.victims == [0]
    assert result.exit_status == 1
    assert not slurm_queue().strip()
    # no srun --kill-on-bad-exit: each node stopped its own ranks and recorded how they
    # ended, and none was cut short as "interrupted" by srun ending the step
    assert "--kill-on-bad-exit=1" not in (result.log_dir / "job.sbatch").read_text()
    nodes = {p.name: json.loads(p.read_text())["reason"] for p in result.log_dir.glob("summary-node*.json")}
    assert set(nodes.values()) == {"failed"} and len(nodes) == slurm_cluster.nodes, nodes


def test_a_job_that_may_restart_recovers_from_a_fault(slurm_cluster, job, tmp_path):
    """Rank 1 killed at step 1: its node restarts its ranks, the other node joins the next
    round, and the job finishes. The nodes meet through c10d, no --node-rank (with node
    ranks torch's static rendezvous keeps one store, and the restart failed in
    init_process_group)."""
    result = launch(job, args=["ok"], scheduler="slurm", log_dir=tmp_path / "runs",
                    display="none", hang_timeout=60, timeout=180, max_restarts=1,
                    fault={"rank": 1, "step": 1}, **_layout(slurm_cluster))
    assert result.ok, result.headline()
    attempts = result.to_json()["attempts"]
    assert [(a["outcome"], a["failed_rank"]) for a in attempts] == [("restarted", 1), ("ok", None)]
    assert "--node-rank" not in (result.log_dir / "job.sbatch").read_text()
    assert not slurm_queue().strip()


def test_hang_is_diagnosed_and_the_job_cancelled(slurm_cluster, job, tmp_path):
    result = launch(job, args=["hang"], scheduler="slurm", log_dir=tmp_path / "runs",
                    display="none", hang_timeout=5, timeout=180, **_layout(slurm_cluster))
    assert result.reason == "hang"
    assert result.hang.stragglers == [1]
    lines = JOB.splitlines()
    sleep_line = next(i for i, ln in enumerate(lines, 1) if "time.sleep(300)" in ln)
    assert result.hang.waiting[1].endswith(f"job.py:{sleep_line}")
    assert not slurm_queue().strip()


class _StopAfterFirstRecord(Display):
    def record(self, rank, values):
        self.stop_requested.set()


def test_stop_cancels_the_job_and_leaves_nothing(slurm_cluster, job, tmp_path):
    display = _StopAfterFirstRecord()
    result = launch(job, args=["slow"], scheduler="slurm", log_dir=tmp_path / "runs",
                    display=display, hang_timeout=60, timeout=180, **_layout(slurm_cluster))
    assert result.reason == "stopped"
    assert not slurm_queue().strip()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=10).stdout
    assert str(job) not in ps  # no node launcher, agent or rank of the job is left


def test_a_stopped_jobs_ranks_get_one_sigterm_each(slurm_cluster, tmp_path):
    """Each node stops its own ranks through stop.json before anything is cancelled:
    one SIGTERM per rank, from its torchrun agent (scancel alone sends one to every
    process of the job at once: a rank got three within 12 ms, and a second one while
    it writes its stacks ends it mid-stack). The ranks note each SIGTERM and live on, so
    the keeper's last resort follows once the agent's grace is over, then SIGKILL."""
    from labutils.runtime.agent import AGENT_GRACE_S

    counts = tmp_path / "counts"
    counts.mkdir()
    display = stop_once(lambda d: all((counts / f"rank{r}.txt").exists() for r in (0, 1)))
    result = launch(SCRIPTS / "counts_sigterm.py", args=[str(counts)], scheduler="slurm",
                    log_dir=tmp_path / "runs", display=display, hang_timeout=None,
                    timeout=180, **_layout(slurm_cluster))
    assert result.reason == "stopped", result.summary()
    for rank in (0, 1):
        times = [float(t) for t in (counts / f"rank{rank}.txt").read_text().split()]
        assert times and [t for t in times if t - times[0] < AGENT_GRACE_S * 0.75] == times[:1], \
            f"rank {rank}: SIGTERMs at {[round(t - times[0], 3) for t in times]} s"
    assert not any("scancel" in n for n in display.notes), display.notes
    assert not slurm_queue().strip()


def test_a_stopped_job_says_where_each_rank_was(slurm_cluster, tmp_path):
    """The stacks each rank wrote as its SIGTERM ended it, read across the nodes' shared
    run folder, as for a local run (tests/run/test_launcher.py)."""
    script = SCRIPTS / "waits_for_a_flag.py"
    lines = script.read_text().splitlines()
    loop, barrier = (next(i for i, t in enumerate(lines, 1) if t.endswith(tag))
                     for tag in ("# waits here", "# rank 0 waits here"))
    result = launch(script, scheduler="slurm", log_dir=tmp_path / "runs", hang_timeout=None,
                    display=stop_once(lambda d: d.started == {0, 1}), timeout=180,
                    **_layout(slurm_cluster))
    assert result.reason == "stopped" and result.at_stop is not None, result.summary()
    at = result.at_stop
    waiting = {rank: where.rsplit("/", 1)[-1] for rank, where in at.waiting.items()}
    assert (waiting, at.calls, at.stragglers) == (
        {0: f"waits_for_a_flag.py:{barrier}", 1: f"waits_for_a_flag.py:{loop + 1}"},
        {0: "barrier", 1: ""}, [1]), result.summary()
    assert "where each rank was when the run was stopped:" in result.summary()


def test_stop_of_a_job_still_pending_cancels_it_at_once(slurm_cluster, job, tmp_path):
    """No node runs a pending job, so none would read stop.json: scancel at once, not
    after the nodes' grace. Another job holds every node, so this one waits in the queue."""
    import time

    blocker = subprocess.run(
        ["sbatch", "--parsable", f"--nodes={slurm_cluster.nodes}", "--exclusive",
         f"--output={tmp_path}/blocker.out", "--wrap", "sleep 120"],
        capture_output=True, text=True, timeout=30, check=True).stdout.strip().split(";")[0]
    try:
        stopped_at: list[float] = []

        class StopWhenPending(Display):
            def note(self, text):
                if text.endswith(": PENDING") and not self.stop_requested.is_set():
                    stopped_at.append(time.monotonic())
                    self.stop_requested.set()

        result = launch(job, args=["ok"], scheduler="slurm", log_dir=tmp_path / "runs",
                        display=StopWhenPending(), hang_timeout=60, timeout=180,
                        **_layout(slurm_cluster))
        took = time.monotonic() - stopped_at[0]
        assert result.reason == "stopped", result.summary()
        assert took < NODES_STOP_S / 2, f"{took:.1f} s from Stop to the end of a pending job"
    finally:
        subprocess.run(["scancel", blocker], timeout=30)
        _wait_for(lambda: not slurm_queue().strip(), 60, "the queue to empty")


@pytest.mark.parametrize("kwargs, what", [
    (dict(scheduler="pbs"), "scheduler"),
    (dict(slurm={"partition": "debug"}), "slurm"),
    (dict(scheduler="slurm", nnodes="1:2"), "scheduler"),
    (dict(scheduler="slurm", slurm={"queue": "x"}), "slurm"),
    (dict(scheduler="slurm", slurm={"time_limit": "soon"}), "time_limit"),
])
def test_bad_slurm_requests_fail_before_submitting(job, tmp_path, kwargs, what):
    with pytest.raises(LaunchConfigError if what != "time_limit" else ValueError) as err:
        launch(job, 1, log_dir=tmp_path / "runs", display="none", **kwargs)
    assert str(err.value).startswith(f"{what}: expected")
    assert not (tmp_path / "runs").exists()  # no run folder, nothing submitted


def _wait_for(predicate, timeout: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_on_the_cli_ends_the_job(slurm_cluster, job, tmp_path, presses):
    """One Ctrl-C: the nodes stop their own ranks (stop.json), each rank's stacks say
    where it was (waits_for_a_flag.py: each waits at its line), nothing is cancelled. A
    second one while they do: scancel at once. For that case the ranks ignore SIGTERM
    (counts_sigterm.py), so the nodes take the agent's grace and the keeper's (3 s) to
    end them, and the second press comes first."""
    import signal
    import sys

    layout = _layout(slurm_cluster)
    runs = tmp_path / "runs"
    script, args = ((SCRIPTS / "waits_for_a_flag.py", []) if presses == 1 else
                    (SCRIPTS / "counts_sigterm.py", [str(tmp_path)]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "labutils.cli", "launch", "-n", str(layout["nproc"]),
         "--nnodes", str(layout["nnodes"]), "--scheduler", "slurm", "--time-limit", "00:05:00",
         "--log-dir", str(runs), "--json", str(tmp_path / "s.json"), str(script), "--", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if presses == 1:
        _wait_for(lambda: sum("started" in p.read_text() for p in runs.glob("*/rank*/stdout.log")) == 2,
                  120, "both ranks in their waits")
    else:
        _wait_for(lambda: all((tmp_path / f"rank{r}.txt").exists() for r in (0, 1)), 120,
                  "both ranks' SIGTERM handlers")
    proc.send_signal(signal.SIGINT)
    if presses == 2:
        _wait_for(lambda: list(runs.glob("*/stop.json")), 30, "stop.json")
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, out
    assert not slurm_queue().strip()
    if presses == 1:
        assert "cancelling SLURM job" not in out, out
        lines = script.read_text().splitlines()
        loop, barrier = (next(i for i, t in enumerate(lines, 1) if t.endswith(tag))
                         for tag in ("# waits here", "# rank 0 waits here"))
        at = [ln.strip() for ln in out.splitlines() if " was at " in ln]
        assert [ln.split(" was at ")[0] for ln in at] == ["rank 0", "rank 1"], out
        assert f"{script.name}:{barrier} in barrier()" in at[0], out
        assert at[1].endswith(f"{script.name}:{loop + 1}    time.sleep(0.05)"), out
    else:
        assert "cancelling SLURM job" in out, out


def test_a_killed_launcher_does_not_leave_its_job_running(slurm_cluster, job, tmp_path):
    """kill -9 of the process that follows the job (a kernel that dies): the nodes see
    its lease go stale and end the job; nothing is left in the queue."""
    import os
    import signal
    import sys

    import labutils.run.nodes as nodes

    layout = _layout(slurm_cluster)
    runs = tmp_path / "runs"
    code = (f"import labutils.run.launcher as L; "
            f"L.launch({str(job)!r}, {layout['nproc']}, nnodes={layout['nnodes']}, "
            f"args=['hang'], scheduler='slurm', display='none', hang_timeout=None, "
            f"log_dir={str(runs)!r})")
    # The nodes inherit the submitter's environment (sbatch --export=ALL, the default):
    # a 5 s lease instead of 30 s keeps the test short; the mechanism is the same.
    stale_s = 5
    env = {**os.environ, nodes.ENV_LEASE_STALE_S: str(stale_s)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    _wait_for(lambda: list(runs.glob("*/rank0/events.jsonl")) and
              '"record"' in next(runs.glob("*/rank0/events.jsonl")).read_text(), 120,
              "rank 0's first record")
    assert slurm_queue().strip()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _wait_for(lambda: not slurm_queue().strip(), stale_s + 30, "the job to end")
    (run,) = runs.iterdir()
    assert "has not been heard from" in (next(run.glob("slurm-*.out")).read_text())
