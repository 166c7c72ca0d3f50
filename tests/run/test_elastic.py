"""Elastic runs for real: several agents on one rendezvous, an agent that leaves,
restart after restart on gloo, and the command-line flags for all of it.

tests/scripts/elastic_steps.py counts steps with one all_reduce each and resumes
from rank 0's checkpoint file, so every attempt's first step says where the
previous attempt really stopped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SCRIPTS

from labutils import launch
from labutils.cli import build_parser, launch_kwargs
from labutils.runtime.runfiles import events_path

# Every test here runs warm and cold (conftest.py: the `start` fixture).
pytestmark = pytest.mark.usefixtures("start")

STEPS = SCRIPTS / "elastic_steps.py"
# Generous limits for a loaded machine; the assertions on what happened stay strict.
LIMITS = {"hang_timeout": 90, "timeout": 240, "display": "none"}


def step_records(result, rank: int = 0) -> list[tuple[int, int, int]]:
    """(restart, step, world_size) of every per-step record of one rank, in order."""
    return [(rec["restart"], rec["step"], rec["world_size"]) for rec in result.records
            if rec["rank"] == rank and "world_size" in rec]


def events(result, rank: int, kind: str) -> list[dict]:
    lines = events_path(result.log_dir, rank).read_text().splitlines()
    return [ev for ev in map(json.loads, lines) if ev["kind"] == kind]


def test_two_agents_share_one_rendezvous_and_one_run_folder(runs_dir, tmp_path):
    result = launch(STEPS, 2, args=[str(tmp_path / "ckpt"), "3"], nnodes=2, **LIMITS)
    assert result.ok, result.summary()
    assert result.world_size == 4 and [r.rank for r in result.ranks] == [0, 1, 2, 3]
    assert len(result.attempts) == 1 and result.attempts[0]["outcome"] == "ok"
    seen = {(rec["rank"], rec["agent"], rec["group_rank"]) for rec in result.records
            if "agent" in rec}
    # Global ranks: agent (node) g runs ranks 2g and 2g+1, whichever agent got which g.
    assert {rank for rank, _, _ in seen} == {0, 1, 2, 3}
    assert all(rank // 2 == group for rank, _, group in seen)
    by_agent = {agent: sorted(rank for rank, a, _ in seen if a == agent) for agent in ("0", "1")}
    assert sorted(by_agent.values()) == [[0, 1], [2, 3]]
    assert result.attempts[0]["agents"] == {a: rs for a, rs in by_agent.items()}
    assert {rec["total"] for rec in result.records if "total" in rec} == {4.0}
    run_dir = result.log_dir
    assert (run_dir / "agent.log").exists() and (run_dir / "agent1.log").exists()
    assert all((run_dir / f"rank{r}" / "stdout.log").exists() for r in range(4))
    assert len(result.commands) == 2
    assert all("--nnodes" in c and c[c.index("--nnodes") + 1] == "2" for c in result.commands)


def test_agent_leaves_and_the_run_continues_at_the_smaller_world(runs_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    result = launch(STEPS, 1, args=[str(ckpt), "8"], nnodes="1:2", local_agents=2,
                    max_restarts=2, fault={"agent": 1, "step": 3}, **LIMITS)
    assert result.ok, result.summary()
    first, second = result.attempts
    assert first["world_size"] == 2 and first["restart_count"] == 0
    assert first["outcome"] == "restarted" and first["injected"] == {"agent": 1, "step": 3}
    assert first["failed_agent"] == 1 and first["failed_rank"] == first["agents"]["1"][0]
    assert "agent 1 left at step 3" in first["why"]
    assert second == {**second, "world_size": 1, "restart_count": 1, "outcome": "ok",
                      "agents": {"0": [0]}}
    # Every step once, at world size 2 up to the leave and 1 after, from the checkpoint.
    survivor = first["agents"]["0"][0]
    assert [(r, s, w) for r, s, w in step_records(result, survivor) if r == 0] == \
        [(0, s, 2) for s in range(4)]
    assert [(r, s, w) for r, s, w in step_records(result, 0) if r == 1] == \
        [(1, s, 1) for s in range(4, 8)]
    assert ckpt.read_text() == "8"
    assert result.ranks[0].stdout.endswith("rank 0 of 1 finished at step 8\n")
    # The survivor re-rendezvoused within seconds of the kill (short rdzv timeouts).
    killed_at = next(ev["t"] for r in (0, 1) for ev in events(result, r, "fault"))
    restarted_at = events(result, 0, "start")[-1]["t"]
    assert 0 < restarted_at - killed_at < 30


@pytest.mark.warm_only("an agent killed cold: test_agent_leaves_and_the_run_continues_at_the_"
                       "smaller_world[cold] kills one the same way, a step earlier")
def test_agent_leaving_at_the_last_step_does_not_wait_for_the_exit_barrier(runs_dir, tmp_path):
    # torchrun's exit barrier would keep the other agent for 300 s.
    result = launch(STEPS, 1, args=[str(tmp_path / "ckpt"), "4"], nnodes="1:2",
                    local_agents=2, max_restarts=1, fault={"agent": 1, "step": 3}, **LIMITS)
    assert result.ok, result.summary()
    assert len(result.attempts) == 1 and result.attempts[0]["injected"] == {"agent": 1, "step": 3}
    assert result.duration_s < 120


def test_an_agent_whose_rank_failed_does_not_leave_the_other_in_the_exit_barrier(runs_dir,
                                                                                 tmp_path):
    """Agent 1's rank fails once both ranks have finished their collectives, with no restart
    left: agent 1 ends, agent 0's rank ends well, and torchrun's exit barrier would keep
    agent 0 waiting for agent 1 for 300 s. The run ends failed, with rank 1 the cause."""
    script = tmp_path / "late_failure.py"
    script.write_text("import torch.distributed as dist\nfrom labutils.dist import init\n"
                      "rank, _, _ = init()\ndist.barrier()\ndist.destroy_process_group()\n"
                      "if rank == 1:\n    raise SystemExit('rank 1 gives up after the work')\n")
    result = launch(script, 1, nnodes="1:2", local_agents=2, **LIMITS)
    assert result.reason == "failed" and result.failure.rank == 1, result.summary()
    assert result.duration_s < 60, result.summary()


@pytest.mark.warm_only("cold restarts: test_restart_after_injected_kill_resumes[cold] and "
                       "test_agent_leaves_and_the_run_continues_at_the_smaller_world[cold]")
def test_twenty_restarts_in_a_row_all_resume_where_they_stopped(runs_dir, tmp_path):
    """Kill a rank in each of 20 attempts (every 5th in the middle of a checkpoint write)."""
    n = 20
    faults = [{"rank": 0, "step": k + 1, "phase": "save"} if k % 5 == 3 else
              {"rank": k % 2, "step": k + 1} for k in range(n)]
    ckpt = tmp_path / "ckpt"
    result = launch(STEPS, 2, args=[str(ckpt), str(n + 3)], max_restarts=n, fault=faults,
                    **{**LIMITS, "timeout": 600})
    assert result.ok, result.summary()
    assert [a["outcome"] for a in result.attempts] == ["restarted"] * n + ["ok"]
    records = step_records(result)
    resumed_at = {rec["restart"]: rec["resumed_at"] for rec in result.records
                  if rec["rank"] == 0 and "resumed_at" in rec}
    assert resumed_at[0] == 0
    for k, fault in enumerate(faults):
        attempt = result.attempts[k]
        assert attempt["injected"] == fault and attempt["failed_rank"] == fault["rank"]
        assert attempt["why"].startswith("SIGKILL") and attempt["restart_count"] == k
        # A kill after step S's checkpoint resumes at S+1; a kill inside the write of
        # checkpoint S+1 leaves checkpoint S intact, so the step is done again.
        assert resumed_at[k + 1] == fault["step"] + (0 if "phase" in fault else 1)
    assert sorted({s for _, s, _ in records}) == list(range(n + 3))
    assert ckpt.read_text() == str(n + 3) and not Path(f"{ckpt}.tmp").exists()
    assert {rec["total"] for rec in result.records if "total" in rec} == {2.0}


@pytest.mark.warm_only("the flags' cold run: test_agent_leaves_and_the_run_continues_at_the_"
                       "smaller_world[cold] runs the same elastic launch cold")
def test_cli_elastic_flags(runs_dir, tmp_path):
    out_json = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "labutils", "launch", "-n", "1", "--nnodes", "1:2",
         "--local-agents", "2", "--rdzv-conf", "last_call_timeout=2", "--max-restarts", "1",
         "--kill-agent", "1", "--kill-at-step", "1", "--hang-timeout", "90",
         "--json", str(out_json), str(STEPS), "--", str(tmp_path / "ckpt"), "3"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out_json.read_text())
    assert [(a["world_size"], a["outcome"]) for a in summary["attempts"]] == \
        [(2, "restarted"), (1, "ok")]
    assert "agent 1 stopped at step 1 (injected fault)" in proc.stdout
    command = (Path(summary["log_dir"]) / "command.txt").read_text()
    assert "last_call_timeout=2" in command and "is_host=false" in command


@pytest.mark.parametrize(("argv", "expected"), [
    (["--kill-rank", "1", "--kill-at-step", "5", "--max-restarts", "1"],
     {"fault": {"rank": 1, "step": 5}, "max_restarts": 1}),
    (["--kill-rank", "0", "--kill-at-step", "3:8", "--fault-seed", "4"],
     {"fault": {"rank": 0, "step": (3, 8), "seed": 4}}),
    (["--nnodes", "1:2", "--local-agents", "2", "--kill-agent", "1", "--kill-at-step", "2"],
     {"nnodes": "1:2", "local_agents": 2, "fault": {"agent": 1, "step": 2}}),
    (["--nnodes", "2", "--rdzv-conf", "last_call_timeout=5,join_timeout=30"],
     {"nnodes": 2, "rdzv_conf": {"last_call_timeout": "5", "join_timeout": "30"}}),
])
def test_cli_flags_become_launch_arguments(argv, expected):
    ns = build_parser().parse_args(["launch", *argv, "train.py"])
    ns.script_args = []
    kwargs = launch_kwargs(ns)
    assert kwargs == {**kwargs, **expected}
