"""The follow loop's order of what it shows, without torchrun: a fake back end writes a
run folder in phases, one phase per turn of the loop, as ranks and torchrun would."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from replay import ReplayAgents

from labutils.run.backends import LocalAgents
from labutils.run.display import Display
from labutils.run.follow import Run
from labutils.run.spec import make_spec, new_run_dir
from labutils.run.warm import Start
from labutils.runtime import runfiles
from labutils.runtime.procs import Claim

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "endings.py"


def _start(rank: int, restart: int, round_: str, t: float) -> dict:
    return {"kind": "start", "t": t, "pid": 1000 + 10 * restart + rank, "main_tid": 1, "restart": restart,
            "local_rank": rank, "world_size": 2, "host": "vm", "round": round_, "agent": 0,
            "group_rank": 0, "node": ""}


# What each rank writes in each phase: (events, stdout lines). In the last phase the
# restarted ranks' start events and their first output arrive in one turn of the loop.
PHASES = [
    {0: ([_start(0, 0, "h:1", 1.0)], ["step 0"]), 1: ([_start(1, 0, "h:1", 1.0)], ["step 0"])},
    {0: ([_start(0, 1, "h:2", 3.0), {"kind": "exit", "t": 4.0, "code": 0, "restart": 1}], ["resuming at step 1"]),
     1: ([_start(1, 1, "h:2", 3.0), {"kind": "exit", "t": 4.0, "code": 0, "restart": 1}], ["resuming at step 1"])},
]


class PhasedAgents(ReplayAgents):
    """One agent that writes the next phase of the run folder each time it is asked
    whether it is alive, and exits with 0 after the last."""

    def __init__(self, spec, run_dir: Path) -> None:  # ReplayAgents', without a recording
        LocalAgents.__init__(self, spec, run_dir, "", port=Claim(0, None), run_id="phased")
        self.run_dir, self.phases, self.stopped = run_dir, list(PHASES), []
        self.meta = {"agent_exit_code": 0}
        self.startup = Start("cold", "a fake back end")

    def start(self, env: dict[str, str], logs: contextlib.ExitStack, note) -> None:
        self._write(self.phases.pop(0))

    def _write(self, phase: dict) -> None:
        for rank, (events, lines) in phase.items():
            runfiles.rank_dir(self.run_dir, rank).mkdir(parents=True, exist_ok=True)
            with open(runfiles.rank_dir(self.run_dir, rank) / "events.jsonl", "a") as fh:
                fh.writelines(json.dumps(ev) + "\n" for ev in events)
            with open(runfiles.stream_path(self.run_dir, rank, "stdout"), "a") as fh:
                fh.writelines(line + "\n" for line in lines)

    def any_alive(self) -> bool:
        if self.phases:
            self._write(self.phases.pop(0))
            return True
        return False


class Said(Display):
    def __init__(self) -> None:
        super().__init__()
        self.said: list[str] = []

    def lines(self, rank: int, stream: str, lines: list[str]) -> None:
        self.said += [f"[rank {rank}] {line}" for line in lines]

    def note(self, text: str) -> None:
        self.said.append(text)


def test_a_restarted_ranks_first_lines_come_after_the_notes_of_its_restart(tmp_path):
    spec = make_spec(SCRIPT, 2, max_restarts=1)
    display = Said()
    run = Run(spec, new_run_dir(spec.script, tmp_path), display,
              backend=lambda spec, run_dir: PhasedAgents(spec, run_dir))
    assert run.run().ok
    said = [line for line in display.said if not line.startswith("run ")]
    restart = next(i for i, line in enumerate(said) if line.startswith("restart 1:"))
    attempt = next(i for i, line in enumerate(said) if line.startswith("attempt 0:"))
    resumed = [i for i, line in enumerate(said) if "resuming" in line]
    assert said[:2] == ["[rank 0] step 0", "[rank 1] step 0"], said
    assert len(resumed) == 2 and attempt < restart < min(resumed), said



class Debugged(Said):
    def __init__(self) -> None:
        super().__init__()
        self.consoles: list[tuple[int, str]] = []

    def debugger(self, rank: int, event: dict) -> None:
        self.consoles.append((rank, event["state"]))


def test_a_rank_at_a_breakpoint_on_another_machine_gets_a_note_not_a_console(tmp_path):
    """Its debugger's socket is on its own machine: a console (or display="none"'s
    "continue") from here would not reach it, and the pane once said the rank "ended
    before its debugger opened" while it waited there."""
    elsewhere = {**_start(1, 0, "h:1", 1.0), "host": "node-b"}
    here = {**_start(0, 0, "h:1", 1.0), "host": os.uname().nodename}
    waiting = {"kind": "debugger", "state": "waiting", "t": 2.0, "where": "endings.py:49",
               "socket": str(tmp_path / "rank.sock")}
    ended = [{"kind": "exit", "t": 4.0, "code": 0, "restart": 0}]
    spec = make_spec(SCRIPT, 2)
    display = Debugged()

    class Phases(PhasedAgents):
        def __init__(self, spec, run_dir: Path) -> None:
            super().__init__(spec, run_dir)
            self.phases = [{0: ([here], []), 1: ([elsewhere], [])},
                           {0: ([{**waiting, "socket": str(tmp_path / "r0.sock")}], []),
                            1: ([waiting], [])},
                           {0: (ended, []), 1: (ended, [])}]

    run = Run(spec, new_run_dir(spec.script, tmp_path), display,
              backend=lambda spec, run_dir: Phases(spec, run_dir))
    assert run.run().ok
    assert display.consoles == [(0, "waiting")]  # this machine's rank only
    assert any(line.startswith("rank 1 stopped at endings.py:49 on node-b; the other ranks wait. "
                               "Debug it there: labutils debug ") and line.endswith(" --rank 1")
               for line in display.said), display.said


THREAD_FAILED = ["Exception in thread Thread-1 (fail_in_a_thread):", "Traceback (most recent call last):",
                 '  File "/home/learner/course/endings.py", line 49, in fail_in_a_thread',
                 '    raise RuntimeError("the loader thread failed")',
                 "RuntimeError: the loader thread failed"]


def test_an_attempts_ending_reads_its_own_stderr_not_the_restarted_ranks(tmp_path):
    """A restarted rank writes to the same stderr.log. Its thread failed again at once,
    and the turn of the loop that read its start also read the first two lines of its
    traceback: the ending of the attempt before once read those, and said its thread
    "raised Traceback (most recent call last):" (seen warm, once in 19 endings)."""
    def ended(rank: int, restart: int, t: float) -> list[dict]:
        if rank == 1:
            return [{"kind": "exit", "t": t, "code": 1, "restart": restart, "file": str(SCRIPT),
                     "line": 84, "source": "sys.exit(1)  # ending: thread_error"}]
        return [{"kind": "exception", "t": t, "restart": restart, "exc_type": "RuntimeError",
                 "message": "Connection closed by peer [127.0.0.1]:1234", "file": str(SCRIPT), "line": 98,
                 "source": "dist.barrier()"},
                {"kind": "exit", "t": t, "code": 1, "restart": restart}]

    class Restarted(PhasedAgents):
        def __init__(self, spec, run_dir: Path) -> None:
            super().__init__(spec, run_dir)
            self.meta = {"agent_exit_code": 1}
            self.phases = [
                {0: ([_start(0, 0, "h:1", 1.0)], []), 1: ([_start(1, 0, "h:1", 1.0)], [])},
                {0: (ended(0, 0, 2.1), []), 1: (ended(1, 0, 2.0), THREAD_FAILED)},
                {0: ([_start(0, 1, "h:2", 3.0)], []), 1: ([_start(1, 1, "h:2", 3.0)], THREAD_FAILED[:2])},
                {0: (ended(0, 1, 4.1), []), 1: (ended(1, 1, 4.0), THREAD_FAILED[2:])}]

        def _write(self, phase: dict) -> None:
            super()._write({rank: (events, []) for rank, (events, _) in phase.items()})
            for rank, (_, lines) in phase.items():
                with open(runfiles.stream_path(self.run_dir, rank, "stderr"), "a") as fh:
                    fh.writelines(line + "\n" for line in lines)

    spec = make_spec(SCRIPT, 2, max_restarts=1)
    run = Run(spec, new_run_dir(spec.script, tmp_path), Said(),
              backend=lambda spec, run_dir: Restarted(spec, run_dir))
    result = run.run()
    why = ("SystemExit: exit code 1, after thread Thread-1 (fail_in_a_thread) raised "
           "RuntimeError: the loader thread failed")
    assert [(a["failed_rank"], a["why"]) for a in result.attempts] == [(1, why), (1, why)], result.attempts


def test_a_stopped_job_waits_for_the_other_nodes_to_say_their_ranks_are_gone(tmp_path, monkeypatch):
    """Each node stops its own ranks; node 0 once settled its result before node 1's agent
    had reaped its ranks (a loaded machine), and ranks 2 and 3 were neither placed nor
    given an exit code. It now waits for done-node1, AGENT_GRACE_S at most."""
    import threading
    import time
    from types import SimpleNamespace

    from labutils.run import follow
    from labutils.run.nodes import NodeFiles

    nodes = NodeFiles(tmp_path, "node0", note=print)
    run = SimpleNamespace(state=SimpleNamespace(shared=True, fold=SimpleNamespace(remote_nodes={"node1"})),
                          nodes=nodes)
    marker = runfiles.node_done_path(tmp_path, "node1")
    threading.Timer(0.4, marker.touch).start()
    started = time.monotonic()
    follow.Run._wait_for_other_nodes(run)
    assert marker.exists() and 0.3 <= time.monotonic() - started < 5
    marker.unlink()
    monkeypatch.setattr(follow, "AGENT_GRACE_S", 0.3)   # a node that never says so: bounded
    started = time.monotonic()
    follow.Run._wait_for_other_nodes(run)
    assert 0.3 <= time.monotonic() - started < 2
    run.state.shared = False                             # one node: nothing to wait for
    started = time.monotonic()
    follow.Run._wait_for_other_nodes(run)
    assert time.monotonic() - started < 0.1
