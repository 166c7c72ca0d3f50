"""How a run, and each attempt of it, ended: the facts result.attempts and RunResult hold.

The functions that take a ``RunState`` read what the follow loop (run/follow.py) has
gathered and change nothing: close_attempt() returns an attempt's entry and
final_result() returns the ending (the result, and the states and exit codes it
settled), which the loop then records and shows.

torchrun's own log is read here too: the agent writes one line per worker it saw
fail (its exit code, by pid) and, at the end, its list of failed ranks, which is
the final word on exit codes (a rank can finish its script and still die while
Python shuts down).
"""

from __future__ import annotations

import linecache
import os
import re
import signal
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

from labutils.run.attempts import Attempt, AttemptFold, RankState
from labutils.run.backends import Backend
from labutils.run.crash import explain_crash
from labutils.run.diagnosis import Failure, find_failure, signal_name
from labutils.run.hang import (
    Hang,
    analyse_hang,
    collective_of,
    parse_faulthandler,
    passing,
    user_frame,
    where_text,
)
from labutils.run.nodes import ranks_text
from labutils.run.result import RankResult, RunResult
from labutils.run.spec import LaunchSpec, public_fault
from labutils.run.states import LIVE, Ending, RankStatus
from labutils.run.streams import RankOutput
from labutils.runtime import runfiles
from labutils.runtime.frames import Frame, traceback_frames
from labutils.runtime.procs import ownership_mode

STACK_WAIT_S = 3.0
_AGENT_FAILURE_RE = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)"
)
# torchrun's log line the moment it sees a worker fail: the exit code, by pid.
_WORKER_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)")
# With a function entry point (a warm run's forked ranks) torchrun lists only the first
# failed rank; it logs the signal it sends each rank still running when it ends them.
_WORKER_SIGNALLED_RE = re.compile(r"(?:Terminating|Closing) process (\d+) via signal (SIG[A-Z]+)")
# The same line with a script as the entry point (a cold run's ranks).
_SCRIPT_SIGNALLED_RE = re.compile(r"Sending process (\d+) closing signal (SIG[A-Z]+)")


@dataclass
class RunState:
    """What following one run has gathered, passed explicitly to this module's functions.

    The follow loop (run/follow.py) owns it and is the only writer: spec, run folder,
    back end, the fold of events into attempts (with every rank's RankState), each
    rank's output; whether ranks run where this launcher cannot signal them; when the
    run started; the attempts closed so far; which agent fault fired in which attempt;
    why the run ended; the hang report.
    """

    spec: LaunchSpec
    run_dir: Path
    backend: Backend
    fold: AttemptFold
    output: list[RankOutput]
    shared: bool = False
    t0: float = 0.0
    attempts: list[dict] = field(default_factory=list)
    fired: dict[int, int] = field(default_factory=dict)  # attempt -> index in spec.faults
    reason: Ending = Ending.OK
    hang: Hang | None = None
    signalled: set[int] = field(default_factory=set)  # rank pids this launcher signalled
    # Set while the fold closes an attempt in a turn that also read the next attempt's
    # output (a restarted rank writes to the same stderr.log): each rank's stderr lines as
    # they stood before that turn, which are the closing attempt's.
    closing_stderr: dict[int, list[str]] | None = None

    @property
    def ranks(self) -> list[RankState]:
        return self.fold.ranks

    def stderr_lines(self, rank: int) -> list[str]:
        """A rank's stderr lines kept so far (those of the attempt being closed, while
        one is)."""
        if self.closing_stderr is not None and rank in self.closing_stderr:
            return self.closing_stderr[rank]
        return [line for stream, line in self.output[rank].combined if stream == "stderr"]


@dataclass
class Settled:
    """final_result()'s answer: the result, and what it settled that the loop applies
    (and shows): each rank's final state where it changed, each exit code it corrected."""

    result: RunResult
    states: dict[int, RankStatus]
    exit_codes: dict[int, int | None]


def agent_rank_codes(agent_text: str) -> dict[int, int]:
    """rank -> exit code from torchrun's final list of failed ranks."""
    return {int(r): int(c) for r, c in _AGENT_FAILURE_RE.findall(agent_text)}


def worker_exit_codes(logs: list[Path]) -> dict[int, int]:
    """pid -> exit code of the workers torchrun saw fail, from the agents' logs so far."""
    codes = {}
    for path in logs:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        codes.update({int(pid): -signal.Signals[name].value
                      for pid, name in _WORKER_SIGNALLED_RE.findall(text)
                      if name in signal.Signals.__members__})
        codes.update({int(pid): int(code) for code, pid in _WORKER_FAILED_RE.findall(text)})
    return codes


def torchrun_signalled(logs: list[Path]) -> set[int]:
    """The pids torchrun's agents signalled (to end the peers of a failed rank, to restart,
    to stop), from their logs: torchrun writes the line before it sends the signal."""
    pids: set[int] = set()
    for path in logs:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        pids.update(int(pid) for regex in (_WORKER_SIGNALLED_RE, _SCRIPT_SIGNALLED_RE)
                    for pid, _ in regex.findall(text))
    return pids


def terminated_elsewhere(state: RunState, members: list[RankState],
                         exit_codes: dict[int, int | None], assumed: AbstractSet[int]) -> set[int]:
    """Ranks that SIGTERM ended although neither torchrun nor a launcher of the run sent
    it (a `kill PID`, a scheduler's preemption, the script signalling itself): they
    ended on their own, like a rank SIGKILL ended. assumed: ranks whose SIGTERM exit
    code was assumed, not read.

    On one machine every agent's log is here, and this launcher knows what it signalled.
    A run whose nodes share a run folder (SLURM, a multi-node job) is read by
    shared_run_terminated()."""
    ended = [r for r in members if exit_codes.get(r.rank) == -signal.SIGTERM and r.pid
             and r.rank not in assumed and not (r.local and r.pid in state.signalled)]
    if not ended:
        return set()
    if state.shared or state.backend.scheduled:
        return {r.rank for r in ended if shared_run_terminated(state, r)}
    by_torchrun = torchrun_signalled(state.backend.logs())
    return {r.rank for r in ended if r.local and r.pid not in by_torchrun}


def shared_run_terminated(state: RunState, r: RankState) -> bool:
    """terminated_elsewhere() for one rank of a run whose nodes share its folder. Every
    node's torchrun log is there (agent<node>.log), but not what the other nodes'
    launchers, or SLURM, signalled. They signal ranks only once a node is done (its
    done-<node> file: a node launcher stops its ranks when another node's failed, and
    srun ends a job step when one of its launchers fails) or once the job is ended early
    (stop.json). So the SIGTERM was nobody's on our side when the rank ended before any
    of those files was written and its node's torchrun log is here and did not send
    it."""
    if r.ended_t is None:
        return False
    markers = [runfiles.stop_path(state.run_dir), *runfiles.node_done_paths(state.run_dir)]
    for path in markers:
        try:
            if path.stat().st_mtime <= r.ended_t:
                return False
        except OSError:
            continue  # not written
    logs = state.backend.logs() if r.local else \
        [runfiles.agent_log_path(state.run_dir, r.node)] if r.node else []
    return any(log.is_file() for log in logs) and r.pid not in torchrun_signalled(logs)


def stopped_by_its_agent(state: RunState, failure: Failure, codes: dict[int, int | None],
                         agent_text: str) -> bool:
    """No rank failed on its own: every rank that ended badly was ended with SIGTERM by
    torchrun, and torchrun then exited with an error of its own (not a rank's
    ChildFailedError): it lost its rendezvous store, say. Its failure is the root cause,
    not the first rank it stopped (once "rank 0: SIGTERM")."""
    if failure.kind != "signal" or failure.exit_code != -signal.SIGTERM \
            or state.backend.exit_code in (0, None):
        return False
    if "Traceback (most recent call last)" not in agent_text or "ChildFailedError" in agent_text:
        return False
    logs = runfiles.agent_logs(state.run_dir) if state.shared else state.backend.logs()
    signalled = torchrun_signalled(logs)
    bad = [r for r in state.ranks if codes.get(r.rank) not in (0, None)
           or state.fold.index in r.exceptions]
    return bool(bad) and all(codes.get(r.rank) == -signal.SIGTERM and r.pid in signalled
                             and state.fold.index not in r.exceptions for r in bad)


def agent_failure(agent_text: str, exit_code: int | None = None) -> Failure:
    """A failure of torchrun itself (before any rank ran, or its agent killed), from the
    agent's log and its exit code (negative: the signal that ended it)."""
    lines = [ln for ln in agent_text.strip().splitlines() if ln.strip()]
    # a Python exception's line ("torch.distributed...RendezvousConnectionError: ..."), not
    # a C++ warning's ("Exception raised from sendBytes at ...")
    errors = [ln for ln in lines if re.match(r"^(?:\w+\.)*\w*(?:Error|Exception)(?::|$)", ln)]
    message = errors[-1] if errors else (lines[-1] if lines else "torchrun exited with an error")
    taken = re.search(r"failed to listen on any local network address\. port: (\d+).*EADDRINUSE",
                      agent_text)
    if taken:  # the store's port, free when drawn, was bound by another program since
        message = (f"the rendezvous port {taken.group(1)} was taken by another program before "
                   "torchrun's store could listen on it: run again (each run draws a new port)")
    elif "RendezvousConnectionError" in message and "Connection was likely closed" in agent_text:
        message = ("torchrun's agent lost the connection to its rendezvous store (the process "
                   "that held the store ended or closed it) and stopped every rank")
    elif not errors and exit_code is not None and exit_code < 0:
        message = (f"torchrun's agent was killed by {signal_name(exit_code)}, and its ranks were "
                   "stopped with it (a kill of the agent's pid, or the OOM killer)")
    return Failure(rank=-1, exc_type="torchrun", message=message, file=None, line=None,
                   traceback="\n".join(lines[-30:]), kind="torchrun")


def attempt_entry(attempt: int, failure, codes: dict, final: str | None = None) -> dict:
    """One entry of result.attempts: which rank failed, why, every rank's exit code."""
    why = None
    if failure is not None:
        # a straggler's SIGTERM (torchrun's) is not why it failed: it never came
        said = failure.ended_how().removeprefix(f"rank {failure.rank} ") \
            if failure.kind == "straggler" else failure.exc_type
        why = f"{said}: {failure.message}" if failure.message else said
    return {
        "attempt": attempt,
        "failed_rank": failure.rank if failure else None,
        "why": why,
        "exit_codes": {str(k): v for k, v in codes.items()},
        "outcome": final if final is not None else "restarted",
    }


def describe_attempt(entry: dict, *, world_size: int, restart_count: int,
                     agents: dict[int, list[int]] | None, fault: dict | None) -> None:
    """Add an attempt's world size, restart count, agents (several agents only) and the
    fault injected into it, told as what happened."""
    entry["world_size"] = world_size
    entry["restart_count"] = restart_count
    if agents is not None:
        entry["agents"] = {str(a): sorted(rs) for a, rs in sorted(agents.items())}
    if fault is None:
        return
    entry["injected"] = public_fault(fault)
    if "rank" in fault and entry["failed_rank"] == fault["rank"] and \
            entry["exit_codes"].get(str(fault["rank"])) == -signal.SIGKILL:
        phase = f", phase {fault['phase']!r}" if "phase" in fault else ""
        entry["why"] = f"SIGKILL: killed at step {fault['step']}{phase} (injected fault)"
    if "agent" in fault:
        gone = sorted((agents or {}).get(fault["agent"], []))
        entry["failed_rank"] = gone[0] if gone else None
        entry["failed_agent"] = fault["agent"]
        entry["why"] = (f"agent {fault['agent']} left at step {fault['step']} (injected: "
                        f"SIGKILL to the agent and its rank(s) {ranks_text(gone)})")


def wait_for_dumps(run_dir: Path, offsets: dict[int, int]) -> dict[int, str]:
    """Each rank's new stack text, once every file has grown and stopped growing."""
    deadline = time.monotonic() + STACK_WAIT_S
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:
        now = {r: stacks_size(run_dir, r) for r in offsets}
        grown = all(now[r] > offsets[r] for r in offsets)
        if grown and now == sizes:
            break
        sizes = now
        time.sleep(0.1)
    dumps = {}
    for r, off in offsets.items():
        path = runfiles.stacks_path(run_dir, r)
        with open(path, "rb") if path.exists() else open(os.devnull, "rb") as f:
            f.seek(off)
            dumps[r] = f.read().decode(errors="replace")
    return dumps


def stacks_size(run_dir: Path, rank: int) -> int:
    path = runfiles.stacks_path(run_dir, rank)
    return path.stat().st_size if path.exists() else 0


def stopped_at(state: RunState, rank_state: RankState) -> dict | None:
    """Where a rank that SIGTERM ended was, from the stacks it dumped then
    (runfiles.ended_stacks_path): {"collective", "where", "source", "file", "line",
    "passing"}, the collective "" when it was not inside a torch.distributed call
    (backward counts: DDP's gradient all-reduce), "passing" whether it was passing through
    its line (hang.passing); None when it dumped none."""
    path = runfiles.ended_stacks_path(state.run_dir, rank_state.rank)
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    frames = parse_faulthandler(text, rank_state.main_tid)
    at = user_frame(frames, str(state.spec.script))
    if at is None:
        return None
    collective = collective_of(frames, at)
    return {"collective": collective, "where": f"{where_text(at.file)}:{at.line}",
            "source": linecache.getline(at.file, at.line).strip(), "file": at.file,
            "line": at.line, "passing": passing(frames, at)}


# Endings in which the launcher stops the ranks that still run (SIGTERM)
STOPPING = (Ending.TIMEOUT, Ending.STOPPED, Ending.INTERRUPTED)


def positions_at_stop(state: RunState, members: list[RankState],
                      codes: dict[int, int | None]) -> Hang | None:
    """Where each rank was when the launcher stopped the run (a timeout, Stop, an
    interrupt), from the stacks it dumped on SIGTERM (runfiles.ended_stacks_path), read as
    a hang report is; None when no rank that SIGTERM ended left one.

    A rank that raised first is placed at its exception's line: across nodes, each node
    stops its own ranks, and a rank whose peer on another node was stopped a moment
    earlier fails in its collective ("Connection closed by peer") before its own
    SIGTERM comes, which then dumps only the rank's last steps of winding down."""
    dumps: dict[int, str | list[Frame]] = {}
    for r in members:
        raised = r.exceptions.get(state.fold.index, {}).get("traceback")
        if raised and (frames := traceback_frames(raised)):
            dumps[r.rank] = frames[::-1]
            continue
        if codes.get(r.rank) != -signal.SIGTERM:
            continue
        try:
            dumps[r.rank] = runfiles.ended_stacks_path(state.run_dir, r.rank).read_text(errors="replace")
        except OSError:
            continue
    if not any(isinstance(dump, str) and dump.strip() for dump in dumps.values()):
        return None
    return analyse_hang(dumps, {r.rank: r.main_tid for r in members}, str(state.spec.script))


def failure_of(state: RunState, attempt: int, exit_codes: dict[int, int | None],
               finished: AbstractSet[int] = frozenset(),
               assumed: AbstractSet[int] = frozenset()) -> Failure | None:
    """The root cause among an attempt's ranks (diagnosis.find_failure), or None.
    assumed: ranks whose exit code (SIGTERM) was assumed, not read."""
    members = [state.ranks[rank] for rank in exit_codes]
    exceptions = {r.rank: r.exceptions[attempt] for r in members if attempt in r.exceptions}
    failed = [r.rank for r in members
              if r.rank in exceptions or (exit_codes.get(r.rank) not in (0, None))]
    stderr = {r.rank: state.stderr_lines(r.rank) for r in members}
    tails = {rank: "\n".join(lines[-20:]) for rank, lines in stderr.items()}
    ended = [r for r in members if r.attempt == attempt]
    stopped = {r.rank: position for r in members
               if r.rank not in exceptions and exit_codes.get(r.rank) == -signal.SIGTERM
               and (position := stopped_at(state, r))}
    terminated = terminated_elsewhere(state, members, exit_codes, assumed)
    stopped = {rank: where for rank, where in stopped.items() if rank not in terminated}
    failure = find_failure(exceptions, exit_codes, failed, finished=finished,
                           stderr_tails=tails,
                           ended_at={r.rank: r.ended_t for r in ended if r.ended_t is not None},
                           exit_events={r.rank: r.exit_event for r in ended if r.exit_event},
                           stopped_in=stopped, terminated=terminated)
    if failure is not None and failure.kind in ("exit", "signal") and \
            failure.rank not in finished:
        dump = ""
        if failure.rank in terminated:  # its stacks went to the file SIGTERM writes
            try:
                dump = runfiles.ended_stacks_path(state.run_dir, failure.rank).read_text(
                    errors="replace")
            except OSError:
                pass
        explain_crash(failure, "\n".join(stderr.get(failure.rank, [])[-300:]), dump=dump)
    return failure


def fault_of(state: RunState, attempt: int) -> dict | None:
    """The fault meant for an attempt: its agent fault if it fired, else its rank fault."""
    if attempt in state.fired:
        return state.spec.faults[state.fired[attempt]]
    for fault in state.spec.faults:
        if "rank" in fault and fault["restart"] == attempt:
            return fault
    return None


def describe(state: RunState, entry: dict, attempt: Attempt | None, fault: dict | None) -> None:
    """describe_attempt() with what the run knows of the attempt."""
    describe_attempt(
        entry, world_size=attempt.world_size if attempt else state.spec.world_size,
        restart_count=attempt.restart_count if attempt else 0,
        agents=(attempt.agents if attempt else {}) if state.spec.local_agents > 1 else None,
        fault=fault)


def close_attempt(state: RunState, attempt: Attempt, next_world_size: int, *,
                  alive: Callable[[RankState], bool]) -> dict:
    """Why the attempt that is being replaced ended (the fold asks when it replaces it):
    its entry for result.attempts. alive: whether a rank's process still runs."""
    seen = worker_exit_codes(state.backend.logs())
    fault = fault_of(state, attempt.index)
    codes, assumed = {}, set()
    for r in state.ranks:
        if r.attempt != attempt.index or not r.pid:
            continue
        code = r.exit_code
        if code is None and r.local and not alive(r):
            if r.pid in seen:
                code = seen[r.pid]
            elif fault and fault.get("rank") == r.rank:
                code = -signal.SIGKILL  # the injected kill
            else:
                code = -signal.SIGTERM  # torchrun stopped it because a peer failed
                assumed.add(r.rank)
        codes[r.rank] = code
    failure = failure_of(state, attempt.index, codes, assumed=assumed)
    entry = attempt_entry(attempt.index, failure, codes)
    describe(state, entry, attempt, fault)
    if failure is None and fault is None and next_world_size > attempt.world_size:
        entry["outcome"] = "membership change"
        entry["why"] = (f"more agents joined (world size {attempt.world_size} -> "
                        f"{next_world_size}): torchrun restarts every rank to let them in")
    return entry


def final_result(state: RunState, *, now: float) -> Settled:
    """The ending once every process is gone, from the state and the logs: exit codes
    settled with torchrun's log, the failure found, the last attempt recorded, every
    rank's final state. Nothing in the state changes: the loop applies what it says."""
    backend, reason = state.backend, state.reason
    logs = backend.logs(faulted=False)
    agent_text = "\n".join(p.read_text(errors="replace") for p in logs)
    if state.shared:  # every node's torchrun says which of its ranks failed
        agent_text = "\n".join(p.read_text(errors="replace")
                               for p in runfiles.agent_logs(state.run_dir))
    agent_codes = agent_rank_codes(agent_text)
    members = [r for r in state.ranks if r.attempt == state.fold.index] \
        if state.fold.current else state.ranks
    codes: dict[int, int | None] = {r.rank: r.exit_code for r in state.ranks}
    states: dict[int, RankStatus] = {}
    finished = set()
    for r in members:
        if r.rank in agent_codes and agent_codes[r.rank] != r.exit_code:
            if r.exit_code == 0:
                finished.add(r.rank)
                states[r.rank] = RankStatus.KILLED if agent_codes[r.rank] == -signal.SIGTERM \
                    else RankStatus.FAILED
            codes[r.rank] = agent_codes[r.rank]
    seen = worker_exit_codes(logs)  # a warm run's torchrun lists only the first failure
    for r in members:
        if codes[r.rank] is None and r.pid in seen:
            codes[r.rank] = seen[r.pid]
    for r in members:  # its script ended, then its process died (the agent reaped it so)
        if r.exit_event and r.exit_event.get("code") == 0 and codes[r.rank] not in (0, None):
            finished.add(r.rank)
            states[r.rank] = RankStatus.KILLED if codes[r.rank] == -signal.SIGTERM \
                else RankStatus.FAILED
    member_codes = {r.rank: codes[r.rank] for r in members}
    failure = None
    if reason == Ending.FAILED:
        failure = failure_of(state, state.fold.index, member_codes, finished)
        if failure is None or stopped_by_its_agent(state, failure, member_codes, agent_text):
            failure = agent_failure(agent_text or "\n".join(
                p.read_text(errors="replace") for p in backend.logs()), backend.exit_code)
    if failure is not None and 0 <= failure.rank < len(state.ranks) and \
            states.get(failure.rank, state.ranks[failure.rank].state) == RankStatus.KILLED:
        states[failure.rank] = RankStatus.FAILED  # a SIGTERM nobody on our side sent
    for r in state.ranks:
        if states.get(r.rank, r.state) in LIVE:  # a rank at a breakpoint at the end too
            if reason == Ending.FAILED and failure and r.rank == failure.rank:
                states[r.rank] = RankStatus.FAILED
            elif reason == Ending.OK and codes[r.rank] == 0:
                states[r.rank] = RankStatus.DONE
            else:
                states[r.rank] = RankStatus.KILLED
    entry = attempt_entry(state.fold.index, failure, member_codes, final=reason)
    describe(state, entry, state.fold.current, state.spec.faults[state.fired[state.fold.index]]
             if state.fold.index in state.fired else None)
    victims = set(failure.victims) if failure else set()
    shown = state.ranks
    if (state.spec.elastic or state.shared) and any(r.pid for r in state.ranks):
        shown = [r for r in state.ranks if r.pid]  # the ranks that ran in some attempt
    ranks = [RankResult(rank=r.rank, state=str(states.get(r.rank, r.state)),
                        exit_code=codes[r.rank], pid=r.pid, log_dir=state.run_dir,
                        stdout_lines=state.output[r.rank].counts["stdout"],
                        stderr_lines=state.output[r.rank].counts["stderr"],
                        tail=list(state.output[r.rank].combined)[-50:], victim=r.rank in victims)
             for r in shown]
    result = RunResult(
        ok=reason == Ending.OK,
        world_size=state.fold.current.world_size if state.fold.current else state.spec.world_size,
        duration_s=now - state.t0, log_dir=state.run_dir, ranks=ranks,
        records=state.fold.records, failure=failure, hang=state.hang,
        at_stop=positions_at_stop(state, members, codes) if reason in STOPPING else None,
        attempts=[*state.attempts, entry],
        reason=str(reason), script=str(state.spec.script), command=backend.command,
        commands=backend.commands, agent_exit_code=backend.exit_code,
        ownership=ownership_mode() if backend.agents else None,
        start=backend.startup.kind, start_reason=backend.startup.reason,
        warm_server=backend.startup.new_server,
    )
    changed = {rank: st for rank, st in states.items() if st != state.ranks[rank].state}
    fixed = {rank: c for rank, c in codes.items() if c != state.ranks[rank].exit_code}
    return Settled(result, changed, fixed)
