"""run/outcome.py without torchrun or a follow loop: a RunState built by hand, from the
events a run folder holds, and the ending computed from it alone.

final_result() and close_attempt() are functions of the state and the logs: they
return what they settled and change nothing, and the loop applies it (run/follow.py).
"""

from __future__ import annotations

import copy
import os
import signal

import pytest

from labutils.run import outcome
from labutils.run.attempts import AttemptFold
from labutils.run.backends import Backend
from labutils.run.spec import make_spec
from labutils.run.states import Ending, RankStatus
from labutils.run.streams import RankOutput
from labutils.run.warm import Start

SCRIPT = "train.py"


class Over(Backend):
    """A back end whose agents have run and left no log, or the one at agent_log."""

    def __init__(self, agent_log=None) -> None:
        self.command, self.commands, self.agents = ["torchrun"], [["torchrun"]], []
        self.startup = Start("warm")
        self.agent_log = agent_log

    @property
    def exit_code(self) -> int | None:
        return 1

    def logs(self, *, faulted: bool = True):
        return [self.agent_log] if self.agent_log else []


def _state(tmp_path, events: dict[int, list[dict]], endings: list[dict], *,
           reason=Ending.FAILED) -> outcome.RunState:
    (tmp_path / SCRIPT).write_text("pass\n")
    spec = make_spec(tmp_path / SCRIPT, len(events))
    fold = AttemptFold(spec.world_size)
    for rank, evs in events.items():
        for ev in evs:
            fold.apply(rank, ev)
    for rec in endings:
        fold.reaped(rec)
    return outcome.RunState(spec=spec, run_dir=tmp_path, backend=Over(), fold=fold,
                            output=[RankOutput(tmp_path, r) for r in events], reason=reason)


def _start(rank: int, t: float) -> dict:
    return {"kind": "start", "t": t, "pid": 100 + rank, "main_tid": 1, "restart": 0,
            "local_rank": rank, "world_size": 2, "host": "vm", "agent": 0, "node": ""}


def _gloo_error(t: float) -> dict:
    return {"kind": "exception", "t": t, "restart": 0, "exc_type": "RuntimeError",
            "message": "Connection closed by peer [127.0.0.1]:1234", "file": f"/x/{SCRIPT}",
            "line": 9, "source": "dist.all_reduce(x)", "traceback": ""}


def _snapshot(state: outcome.RunState):
    return ([(r.rank, r.state, r.exit_code) for r in state.ranks], copy.deepcopy(state.attempts))


def test_the_rank_that_exited_first_is_the_root_cause_and_nothing_in_the_state_changes(tmp_path):
    state = _state(tmp_path, {
        0: [_start(0, 1.0), _gloo_error(3.0)],
        1: [_start(1, 1.0), {"kind": "exit", "t": 2.0, "code": 3, "restart": 0,
                             "file": f"/x/{SCRIPT}", "line": 5, "source": "sys.exit(3)"}],
    }, [{"host": "vm", "pid": 101, "code": 3, "t": 2.1}, {"host": "vm", "pid": 100, "code": 1, "t": 3.1}])
    before = _snapshot(state)
    settled = outcome.final_result(state, now=10.0)
    assert _snapshot(state) == before  # a function of the state: the loop applies it
    result = settled.result
    assert (result.failure.rank, result.failure.kind) == (1, "exit")
    assert result.failure.victims == [0]
    assert [r.victim for r in result.ranks] == [True, False]
    # both raised or exited of their own: the victim is flagged, not killed
    assert [r.state for r in result.ranks] == ["failed", "failed"]
    assert settled.states == {}  # the events had set both already
    assert result.attempts[-1]["failed_rank"] == 1 and state.attempts == []
    assert result.duration_s == 10.0 - state.t0


def test_a_rank_whose_script_ended_and_then_died_is_settled_as_failed(tmp_path):
    """Its exit event says 0; the agent reaped it with SIGABRT (died in teardown)."""
    state = _state(tmp_path, {
        0: [_start(0, 1.0), {"kind": "exit", "t": 2.0, "code": 0, "restart": 0}],
        1: [_start(1, 1.0), {"kind": "exit", "t": 2.0, "code": 0, "restart": 0}],
    }, [{"host": "vm", "pid": 100, "code": -signal.SIGABRT, "t": 2.5},
        {"host": "vm", "pid": 101, "code": 0, "t": 2.5}])
    settled = outcome.final_result(state, now=5.0)
    assert settled.result.failure.rank == 0
    assert settled.result.ranks[0].exit_code == -signal.SIGABRT
    assert settled.states.get(0) == RankStatus.FAILED
    assert settled.result.ranks[1].state == "done" and settled.result.ranks[1].exit_code == 0


def test_an_ok_run_ends_every_rank_done(tmp_path):
    events = {r: [_start(r, 1.0), {"kind": "exit", "t": 2.0, "code": 0, "restart": 0}]
              for r in (0, 1)}
    state = _state(tmp_path, events, [{"host": "vm", "pid": 100 + r, "code": 0, "t": 2.5}
                                      for r in (0, 1)], reason=Ending.OK)
    settled = outcome.final_result(state, now=3.0)
    assert settled.result.ok and settled.result.failure is None
    assert [r.state for r in settled.result.ranks] == ["done", "done"]
    assert settled.exit_codes == {}  # nothing to correct


def test_closing_an_attempt_returns_its_entry_and_reads_liveness_from_the_caller(tmp_path):
    """Rank 1 raised; rank 0 is gone without an exit code (torchrun stopped it)."""
    state = _state(tmp_path, {0: [_start(0, 1.0)],
                              1: [_start(1, 1.0), {**_gloo_error(2.0), "message": "boom",
                                                   "exc_type": "ValueError"}]}, [])
    attempt = state.fold.current
    entry = outcome.close_attempt(state, attempt, 2, alive=lambda r: False)
    assert entry["failed_rank"] == 1 and entry["why"] == "ValueError: boom"
    assert entry["exit_codes"]["0"] == -signal.SIGTERM
    assert entry["outcome"] == "restarted" and state.attempts == []


# torchrun's lines as it signals a worker: a script's (cold) and a function's (warm)
_SENDS = "W1128 11:40:26.602000 1 api.py:1028] Sending process {pid} closing signal SIGTERM\n"
_TERMINATES = "W1128 11:40:22.982000 1 spawn.py:165] Terminating process {pid} via signal SIGTERM\n"


def _terminated_first(tmp_path, agent_log: str) -> outcome.RunState:
    """Rank 1 ends by SIGTERM without an exception; rank 0 then loses it in a collective."""
    state = _state(tmp_path, {0: [_start(0, 1.0), _gloo_error(3.0)], 1: [_start(1, 1.0)]},
                   [{"host": "vm", "pid": 101, "code": -signal.SIGTERM, "t": 2.0},
                    {"host": "vm", "pid": 100, "code": 1, "t": 3.1}])
    (tmp_path / "agent.log").write_text(agent_log)
    state.backend = Over(tmp_path / "agent.log")
    return state


@pytest.mark.parametrize("line", [_SENDS, _TERMINATES], ids=["cold", "warm"])
def test_a_sigterm_nobody_on_our_side_sent_is_a_root_cause(tmp_path, line):
    """torchrun's log names the pids it signalled: rank 1's is not among them."""
    state = _terminated_first(tmp_path, line.format(pid=100))
    assert outcome.torchrun_signalled([tmp_path / "agent.log"]) == {100}
    result = outcome.final_result(state, now=5.0).result
    f = result.failure
    assert (f.rank, f.kind, f.exc_type, f.exit_code) == (1, "signal", "SIGTERM", -signal.SIGTERM)
    assert "neither torchrun nor the launcher sent" in f.message
    assert f.victims == [0]
    assert [r.state for r in result.ranks] == ["failed", "failed"]  # not "killed": it failed


@pytest.mark.parametrize("by", ["torchrun", "launcher"])
def test_a_sigterm_torchrun_or_the_launcher_sent_is_no_root_cause(tmp_path, by):
    state = _terminated_first(tmp_path, _SENDS.format(pid=101) if by == "torchrun" else "")
    if by == "launcher":
        state.signalled.add(101)
    f = outcome.final_result(state, now=5.0).result.failure
    assert (f.rank, f.kind) == (0, "exception")  # only rank 0's error is left to name


def _shared(tmp_path, *, node1_log: str | None = "", stop_at: float | None = None,
            done_at: float | None = None, reason=Ending.FAILED,
            rank0_raises_at: float | None = None) -> outcome.RunState:
    """A SLURM job's two nodes, followed through their shared run folder by the launcher
    that submitted it (no rank is its own): rank 1 (node1) ends by SIGTERM at t=2, rank 0
    (node0) then loses it in a collective; or rank 0 raises first, at rank0_raises_at.
    stop.json and done-node0 written at stop_at and done_at."""
    def start(rank: int) -> dict:
        return {**_start(rank, 1.0), "node": f"node{rank}"}

    own = [{**_gloo_error(rank0_raises_at), "exc_type": "ValueError", "message": "bad batch"}] \
        if rank0_raises_at is not None else [_gloo_error(3.0)]
    state = _state(tmp_path, {0: [start(0), *own], 1: [start(1)]},
                   [{"host": "vm", "pid": 101, "code": -signal.SIGTERM, "t": 2.0},
                    {"host": "vm", "pid": 100, "code": 1, "t": 3.1}], reason=reason)
    state.shared = True
    (tmp_path / "agentnode0.log").write_text("")
    if node1_log is not None:
        (tmp_path / "agentnode1.log").write_text(node1_log)
    for name, at in (("stop.json", stop_at), ("done-node0", done_at)):
        if at is not None:
            (tmp_path / name).write_text('{"by": "node0", "reason": "stopped"}')
            os.utime(tmp_path / name, (at, at))
    assert not any(r.local for r in state.ranks)
    return state


def test_through_a_shared_run_folder_a_sigterm_nobody_sent_is_a_root_cause(tmp_path):
    """The job's nodes' torchrun logs are in the run folder: rank 1's node did not send its
    SIGTERM, it ended first, and nobody had ended the job yet (no stop.json before)."""
    f = outcome.final_result(_shared(tmp_path, stop_at=9.0, done_at=9.0), now=5.0).result.failure
    assert (f.rank, f.kind, f.exc_type, f.exit_code) == (1, "signal", "SIGTERM", -signal.SIGTERM)
    assert "neither torchrun nor the launcher sent" in f.message and f.victims == [0]
    (tmp_path / "no-stop").mkdir()
    f = outcome.final_result(_shared(tmp_path / "no-stop"), now=5.0).result.failure
    assert f.rank == 1


@pytest.mark.parametrize("case", ["its node's torchrun sent it", "the job was ended first",
                                  "another node was done first", "the run was stopped",
                                  "a peer failed first", "its node's log is not here"])
def test_through_a_shared_run_folder_a_sigterm_of_ours_is_no_root_cause(tmp_path, case):
    """What the other nodes' launchers (and srun) signalled is not known here; they signal
    only once another node is done (done-<node>) or the job was ended early (stop.json)."""
    state = _shared(tmp_path, **{
        "its node's torchrun sent it": {"node1_log": _SENDS.format(pid=101)},
        "the job was ended first": {"stop_at": 1.5},
        "another node was done first": {"done_at": 2.0},
        "the run was stopped": {"reason": Ending.STOPPED},
        "a peer failed first": {"rank0_raises_at": 1.5},
        "its node's log is not here": {"node1_log": None},
    }[case])
    f = outcome.final_result(state, now=5.0).result.failure
    if case == "the run was stopped":
        assert f is None  # a stopped run names no failure
    else:
        assert (f.rank, f.kind) == (0, "exception"), f


def test_a_sigterm_exit_code_assumed_when_closing_an_attempt_is_no_root_cause(tmp_path):
    """Rank 0 is gone without an exit code (assumed: torchrun's SIGTERM); rank 1's SIGTERM
    was read from its agent's record and torchrun never sent it."""
    state = _state(tmp_path, {0: [_start(0, 1.0)], 1: [_start(1, 1.0)]},
                   [{"host": "vm", "pid": 101, "code": -signal.SIGTERM, "t": 2.0}])
    (tmp_path / "agent.log").write_text("")
    state.backend = Over(tmp_path / "agent.log")
    entry = outcome.close_attempt(state, state.fold.current, 2, alive=lambda r: False)
    assert entry["failed_rank"] == 1 and entry["why"].startswith("SIGTERM: killed by SIGTERM")
    assert entry["exit_codes"] == {"0": -signal.SIGTERM, "1": -signal.SIGTERM}


def test_a_rank_that_raised_as_the_job_was_stopped_is_placed_at_its_exception(tmp_path):
    """Across nodes each node stops its own ranks: rank 1 (node1) was stopped first, and
    rank 0 (node0), waiting for it in all_reduce, raised "Connection closed by peer"
    before its own SIGTERM came, which then dumped only its winding down (found under
    SLURM on a loaded machine: "rank 0 was at unknown"). Where it was is its exception's
    line; rank 1's is the stack its SIGTERM dumped."""
    script = tmp_path / SCRIPT
    raised = {**_gloo_error(2.1), "traceback": (
        "Traceback (most recent call last):\n"
        f'  File "{script}", line 9, in <module>\n    dist.all_reduce(x)\n'
        '  File ".../site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper\n'
        "    return func(*args, **kwargs)\n"
        '  File ".../site-packages/torch/distributed/distributed_c10d.py", line 3000, in all_reduce\n'
        "    work.wait()\nRuntimeError: Connection closed by peer [127.0.0.1]:1234\n")}
    state = _state(tmp_path, {0: [{**_start(0, 1.0), "node": "node0"}, raised],
                              1: [{**_start(1, 1.0), "node": "node1"}]},
                   [{"host": "vm", "pid": 101, "code": -signal.SIGTERM, "t": 2.0},
                    {"host": "vm", "pid": 100, "code": -signal.SIGTERM, "t": 2.2}],
                   reason=Ending.STOPPED)
    state.shared = True
    script.write_text("".join(f"line_{n} = {n}\n" for n in range(1, 9)) + "dist.all_reduce(x)\n")
    worker = os.path.normpath(os.path.join(os.path.dirname(outcome.__file__), "..", "runtime", "worker.py"))
    for rank, frames in ((0, [(worker, 344, "_wind_down"), (worker, 467, "<module>")]),
                         (1, [(str(script), 5, "<module>")])):
        folder = tmp_path / f"rank{rank}"
        folder.mkdir(exist_ok=True)
        (folder / "ended-stacks.txt").write_text(
            "Current thread 0x0000000000000001 (most recent call first):\n" +
            "".join(f'  File "{f}", line {n} in {func}\n' for f, n, func in frames))
    at = outcome.final_result(state, now=5.0).result.at_stop
    assert at is not None
    assert ({r: w.rsplit("/", 1)[-1] for r, w in at.waiting.items()}, at.calls, at.sources) == (
        {0: f"{SCRIPT}:9", 1: f"{SCRIPT}:5"}, {0: "all_reduce", 1: ""},
        {0: "dist.all_reduce(x)", 1: "line_5 = 5"})


def test_a_rendezvous_port_taken_by_another_program_is_said_in_words():
    """Agent 0 is told it hosts the store (run/spec.py), so a port another program bound
    after it was drawn fails the run; the root cause says so instead of torchrun's
    "See inner exception for details" (the agent's log as torch 2.13 writes it)."""
    log = "\n".join([
        "[W1130 19:06:46.0 socket.cpp:767] [c10d] The server socket has failed to listen on "
        "any local network address.",
        "Traceback (most recent call last):",
        '  File "c10d_rendezvous_backend.py", line 160, in _create_tcp_store',
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any "
        "local network address. port: 41927, useIpv6: false, code: -98, name: EADDRINUSE, "
        "message: address already in use",
        "The above exception was the direct cause of the following exception:",
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection "
        "to the C10d store has failed. See inner exception for details."])
    failure = outcome.agent_failure(log, 1)
    assert failure.kind == "torchrun" and failure.rank == -1
    assert failure.message.startswith("the rendezvous port 41927 was taken by another program")
    assert "run again" in failure.message
    other = outcome.agent_failure(log.replace("EADDRINUSE", "ECONNREFUSED"), 1)
    assert other.message.endswith("See inner exception for details.")
