"""The fold of rank events into attempts (run/attempts.py), on events recorded from real runs.

tests/data/events/<scenario>/ holds each rank's events.jsonl from one launch() and the
result.attempts that run produced (attempts.json): the fold alone, with no process
and no torchrun, must find the same attempts, world sizes, agents and rank states.
Recorded with torch 2.13 by launch() on this project's scripts:
- rank_fault_restart: resume.py, 2 ranks, fault {"rank": 1, "step": 2}, max_restarts=1;
- failure: fail_rank2.py, 3 ranks, rank 2 raises;
- agent_leaves: elastic_steps.py, nnodes="1:2", 2 agents of 1 rank, fault {"agent": 1, "step": 3}.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import DATA

from labutils.run.attempts import AttemptFold, fold_events
from labutils.run.states import RankStatus

DATA = DATA / "events"


def recorded(name: str) -> tuple[dict[int, list[dict]], list[dict]]:
    folder = DATA / name
    events = {int(p.parent.name[4:]): [json.loads(line) for line in p.read_text().splitlines()]
              for p in folder.glob("rank*/events.jsonl")}
    return events, json.loads((folder / "attempts.json").read_text())


def fold_with_history(name: str):
    """The fold of a recording, and what it told its close() about each closed attempt."""
    events, expected = recorded(name)
    closed = []

    def close(attempt, next_world_size):
        members = {r.rank: r.exit_code for r in fold.ranks if r.attempt == attempt.index and r.pid}
        closed.append({"attempt": attempt.index, "world_size": attempt.world_size,
                       "restart_count": attempt.restart_count, "next": next_world_size,
                       "agents": {str(a): sorted(rs) for a, rs in attempt.agents.items()},
                       "members": members})

    fold = AttemptFold(max(events) + 1, close=close)
    ordered = sorted((ev.get("t", 0.0), rank, i, ev) for rank, evs in events.items()
                     for i, ev in enumerate(evs))
    changes = [c for _, rank, _, ev in ordered for c in fold.apply(rank, ev)]
    return fold, closed, changes, expected


@pytest.mark.parametrize("name", ["rank_fault_restart", "failure", "agent_leaves"])
def test_the_fold_finds_the_attempts_the_run_had(name):
    fold, closed, changes, expected = fold_with_history(name)
    assert fold.index == len(expected) - 1
    assert [c["attempt"] for c in closed] == [e["attempt"] for e in expected[:-1]]
    for seen, entry in zip([*closed, None], expected):
        size = seen["world_size"] if seen else fold.current.world_size
        assert size == entry["world_size"]
        restart = seen["restart_count"] if seen else fold.current.restart_count
        assert restart == entry["restart_count"]
        if "agents" in entry:
            agents = seen["agents"] if seen else {str(a): sorted(r) for a, r in
                                                   fold.current.agents.items()}
            assert agents == entry["agents"]
    restarts = [c for c in changes if c[0] == "restart"]
    assert [c[1] for c in restarts] == list(range(1, len(expected)))


def test_a_rank_killed_mid_attempt_has_no_exit_code_until_the_launcher_settles_it():
    fold, closed, _, expected = fold_with_history("rank_fault_restart")
    # Rank 1 was SIGKILLed inside report(step=2): no exit event, so the fold leaves it
    # to the launcher (torchrun's log, or the fault it injected) to say -9. Rank 0 lost
    # its peer and exited with 1 by itself: its exit event says so.
    assert closed[0]["members"] == {0: 1, 1: None}
    assert expected[0]["exit_codes"] == {"0": 1, "1": -9}
    # The second attempt ends normally: both ranks' exit events are there.
    assert {r.rank: r.exit_code for r in fold.ranks} == {0: 0, 1: 0}
    assert [r.state for r in fold.ranks] == ["done", "done"]


def test_the_failing_rank_is_marked_failed_by_its_exception_event():
    fold, _, changes, expected = fold_with_history("failure")
    assert expected[0]["failed_rank"] == 2
    assert fold.ranks[2].state == "failed" and 0 in fold.ranks[2].exceptions
    assert fold.ranks[2].exceptions[0]["exc_type"] == "ValueError"
    assert ("state", 2, "failed") in changes


def test_the_agent_that_left_takes_its_rank_out_of_the_next_attempt():
    fold, closed, changes, _ = fold_with_history("agent_leaves")
    assert closed[0]["next"] == 1  # the next attempt's world size, as its first start said
    assert [c for c in changes if c[0] == "fault"]  # rank 1 carried out the agent fault
    assert "(was 2: the membership changed)" in [c for c in changes if c[0] == "restart"][0][2]
    assert fold.members(2) == fold.ranks[:1]


def test_records_keep_every_report_with_its_rank():
    events, _ = recorded("rank_fault_restart")
    fold = fold_events(events, 2)
    reported = sum(1 for evs in events.values() for ev in evs if ev["kind"] == "record")
    assert len(fold.records) == reported
    assert {r["rank"] for r in fold.records} == {0, 1}


@pytest.mark.parametrize(("events", "state"), [
    ([{"kind": "start", "t": 1, "pid": 5, "world_size": 1}], "running"),
    ([{"kind": "start", "t": 1, "pid": 5, "world_size": 1}, {"kind": "exit", "t": 2, "code": 0}],
     "done"),
    ([{"kind": "start", "t": 1, "pid": 5, "world_size": 1}, {"kind": "exit", "t": 2, "code": 3}],
     "failed"),
    ([{"kind": "progress", "t": 1}], "starting"),
])
def test_one_rank_states(events, state):
    assert fold_events({0: events}, 1).ranks[0].state == state


def test_a_late_start_of_an_attempt_that_is_over_is_ignored():
    start = {"kind": "start", "pid": 5, "world_size": 1}
    fold = AttemptFold(1)
    fold.apply(0, {**start, "t": 1, "round": "a", "restart": 0})
    fold.apply(0, {**start, "t": 2, "round": "b", "restart": 1})
    assert fold.apply(0, {**start, "t": 3, "round": "a", "restart": 0}) == []
    assert fold.index == 1 and fold.current.round == "b"


def test_a_restart_through_the_agents_shared_store_is_an_attempt_of_its_own_for_every_rank():
    """With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0 every round keeps the agent store's
    MASTER_PORT. Keyed by the port alone, the restart's first start opened attempt 1 and
    the second rank's start was dropped as a late one of attempt 0: that rank stayed
    "killed" in attempt 0, and a hang of attempt 1 was never declared (a lesson 05 run
    waited past its hang_timeout until its timeout)."""
    from labutils.runtime.worker import rendezvous_round

    def env(restart: int, shared: bool) -> dict:
        return {"MASTER_ADDR": "localhost", "MASTER_PORT": "43147",
                "TORCHELASTIC_RESTART_COUNT": str(restart),
                "TORCHELASTIC_USE_AGENT_STORE": str(shared)}

    assert rendezvous_round(env(0, False)) == rendezvous_round(env(1, False)) == "localhost:43147"
    assert rendezvous_round(env(0, True)) != rendezvous_round(env(1, True))
    fold = AttemptFold(2)
    for restart in (0, 1):
        for rank in (0, 1):
            fold.apply(rank, {"kind": "start", "t": restart * 10 + rank, "pid": 100 + 10 * restart + rank,
                              "round": rendezvous_round(env(restart, True)), "restart": restart,
                              "world_size": 2})
    assert fold.index == 1
    assert [(r.attempt, r.pid) for r in fold.ranks] == [(1, 110), (1, 111)]


def _started_fold() -> AttemptFold:
    fold = AttemptFold(2)
    for rank in (0, 1):
        fold.apply(rank, {"kind": "start", "t": 1.0, "pid": 100 + rank, "host": "h",
                          "round": "a:1", "world_size": 2})
    return fold


@pytest.mark.parametrize(("stopping", "code", "message", "states"), [
    # a failed run: the agent's reap and the events say who failed
    (False, -11, "Connection closed by peer", ["failed", "failed"]),
    (False, -15, "Connection closed by peer", ["killed", "failed"]),
    # the launcher is stopping the run (Stop, Ctrl-C, timeout): its SIGTERM or SIGKILL
    # ended rank 0, and rank 1 lost it in a collective before its own SIGTERM came
    (True, -15, "Connection closed by peer", ["killed", "killed"]),
    (True, -9, "Connection closed by peer", ["killed", "killed"]),
    # an error of rank 1's own while the run stops is still rank 1's
    (True, -15, "the batch is empty", ["killed", "failed"]),
])
def test_how_ranks_end_is_folded_from_the_agents_reaps_and_the_events(stopping, code, message,
                                                                     states):
    fold = _started_fold()
    fold.stopping = stopping
    fold.reaped({"host": "h", "pid": 100, "code": code, "t": 2.0})
    fold.apply(1, {"kind": "exception", "t": 2.1, "exc_type": "RuntimeError", "message": message})
    fold.apply(1, {"kind": "exit", "t": 2.2, "code": 1})
    fold.reaped({"host": "h", "pid": 101, "code": 1, "t": 2.3})
    assert [r.state for r in fold.ranks] == states
    assert [r.exit_code for r in fold.ranks] == [code, 1]
    assert [r.ended_t for r in fold.ranks] == [2.0, 2.2]  # the exit event's time first


def test_a_reap_of_another_host_or_an_old_attempt_changes_nothing():
    fold = _started_fold()
    assert fold.reaped({"host": "other", "pid": 100, "code": -9, "t": 2.0}) == []
    assert fold.reaped({"host": "h", "pid": 999, "code": -9, "t": 2.0}) == []
    assert fold.ranks[0].exit_code is None and fold.ranks[0].state == "running"


def test_a_hung_rank_stays_hung_whatever_the_stop_after_the_hang_report_makes_it_say():
    fold = _started_fold()
    for r in fold.ranks:
        fold.set_state(r, RankStatus.HUNG)
    fold.stopping = True
    fold.apply(0, {"kind": "exception", "t": 3.0, "exc_type": "RuntimeError",
                   "message": "Connection closed by peer"})
    fold.apply(0, {"kind": "exit", "t": 3.1, "code": 1})
    fold.reaped({"host": "h", "pid": 101, "code": -15, "t": 3.2})
    assert [r.state for r in fold.ranks] == ["hung", "hung"]
