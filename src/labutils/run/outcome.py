"""How a run, and each attempt of it, ended: the facts result.attempts and RunResult hold.

The functions that take ``run`` read a follower's state (run/follow.py's Run: its
spec, fold, back end and per-rank output) and write only result.attempts and rank
states.

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
from collections.abc import Set as AbstractSet
from pathlib import Path

from labutils.run.attempts import Attempt
from labutils.run.crash import explain_crash
from labutils.run.diagnosis import Failure, find_failure
from labutils.run.hang import collective_of, parse_faulthandler, user_frame, where_text
from labutils.run.nodes import ranks_text
from labutils.run.result import RankResult, RunResult, attempt_line
from labutils.run.spec import public_fault
from labutils.run.states import LIVE, Ending, RankStatus
from labutils.runtime import runfiles
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


def agent_failure(agent_text: str) -> Failure:
    """A failure of torchrun itself (before any rank ran), from the agent's log."""
    lines = [ln for ln in agent_text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^\w*(Error|Exception)\b", ln)]
    message = errors[-1] if errors else (lines[-1] if lines else "torchrun exited with an error")
    return Failure(rank=-1, exc_type="torchrun", message=message, file=None, line=None,
                   traceback="\n".join(lines[-30:]), kind="torchrun")


def attempt_entry(attempt: int, failure, codes: dict, final: str | None = None) -> dict:
    """One entry of result.attempts: which rank failed, why, every rank's exit code."""
    return {
        "attempt": attempt,
        "failed_rank": failure.rank if failure else None,
        "why": f"{failure.exc_type}: {failure.message}" if failure else None,
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


def stopped_at(run, rank_state) -> dict | None:
    """Where a rank that SIGTERM ended was waiting, from the stacks it dumped then
    (runfiles.ended_stacks_path): {"collective", "where", "source"}, or None when it
    dumped none or was not inside a torch.distributed call (backward counts: DDP's
    gradient all-reduce)."""
    path = runfiles.ended_stacks_path(run.run_dir, rank_state.rank)
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    frames = parse_faulthandler(text, rank_state.main_tid)
    at = user_frame(frames, str(run.spec.script))
    collective = collective_of(frames, at)
    if at is None or not collective:
        return None
    return {"collective": collective, "where": f"{where_text(at.file)}:{at.line}",
            "source": linecache.getline(at.file, at.line).strip()}


def failure_of(run, attempt: int, exit_codes: dict[int, int | None],
               finished: AbstractSet[int] = frozenset()):
    """The root cause among an attempt's ranks (diagnosis.find_failure), or None."""
    members = [run.ranks[rank] for rank in exit_codes]
    exceptions = {r.rank: r.exceptions[attempt] for r in members if attempt in r.exceptions}
    failed = [r.rank for r in members
              if r.rank in exceptions or (exit_codes.get(r.rank) not in (0, None))]
    stderr = {r.rank: [line for stream, line in run.output[r.rank].combined if stream == "stderr"]
              for r in members}
    tails = {rank: "\n".join(lines[-20:]) for rank, lines in stderr.items()}
    ended = [r for r in members if r.attempt == attempt]
    stopped = {r.rank: position for r in members
               if r.rank not in exceptions and exit_codes.get(r.rank) == -signal.SIGTERM
               and (position := stopped_at(run, r))}
    failure = find_failure(exceptions, exit_codes, failed, finished=finished,
                           stderr_tails=tails,
                           ended_at={r.rank: r.ended_t for r in ended if r.ended_t is not None},
                           exit_events={r.rank: r.exit_event for r in ended if r.exit_event},
                           stopped_in=stopped)
    if failure is not None and failure.kind in ("exit", "signal") and \
            failure.rank not in finished:
        explain_crash(failure, "\n".join(stderr.get(failure.rank, [])[-300:]))
    return failure


def fault_of(run, attempt: int) -> dict | None:
    """The fault meant for an attempt: its agent fault if it fired, else its rank fault."""
    if attempt in run.fired:
        return run.spec.faults[run.fired[attempt]]
    for fault in run.spec.faults:
        if "rank" in fault and fault["restart"] == attempt:
            return fault
    return None


def describe(run, entry: dict, attempt: Attempt | None, fault: dict | None) -> None:
    """describe_attempt() with what the run knows of the attempt."""
    describe_attempt(
        entry, world_size=attempt.world_size if attempt else run.spec.world_size,
        restart_count=attempt.restart_count if attempt else 0,
        agents=(attempt.agents if attempt else {}) if run.spec.local_agents > 1 else None,
        fault=fault)


def close_attempt(run, attempt: Attempt, next_world_size: int) -> None:
    """Record why the attempt that is being replaced ended (the fold calls this)."""
    seen = worker_exit_codes(run.backend.logs())
    fault = fault_of(run, attempt.index)
    codes = {}
    for r in run.ranks:
        if r.attempt != attempt.index or not r.pid:
            continue
        code = r.exit_code
        if code is None and r.local and not run.alive(r):
            if r.pid in seen:
                code = seen[r.pid]
            elif fault and fault.get("rank") == r.rank:
                code = -signal.SIGKILL  # the injected kill
            else:
                code = -signal.SIGTERM  # torchrun stopped it because a peer failed
        codes[r.rank] = code
    failure = failure_of(run, attempt.index, codes)
    entry = attempt_entry(attempt.index, failure, codes)
    describe(run, entry, attempt, fault)
    if failure is None and fault is None and next_world_size > attempt.world_size:
        entry["outcome"] = "membership change"
        entry["why"] = (f"more agents joined (world size {attempt.world_size} -> "
                        f"{next_world_size}): torchrun restarts every rank to let them in")
    run.attempts.append(entry)
    run.display.note(attempt_line(entry))


def final_result(run) -> RunResult:
    """The RunResult once every process is gone: exit codes settled with torchrun's
    log, the failure found, the last attempt recorded, every rank's final state."""
    logs = run.backend.logs(faulted=False)
    agent_text = "\n".join(p.read_text(errors="replace") for p in logs)
    if run.shared:  # every node's torchrun says which of its ranks failed
        agent_text = "\n".join(p.read_text(errors="replace")
                               for p in runfiles.agent_logs(run.run_dir))
    agent_codes = agent_rank_codes(agent_text)
    members = [r for r in run.ranks if r.attempt == run.fold.index] if run.fold.current \
        else run.ranks
    finished = set()
    for r in members:
        if r.rank in agent_codes and agent_codes[r.rank] != r.exit_code:
            if r.exit_code == 0:
                finished.add(r.rank)
                run.set_state(r, RankStatus.KILLED if agent_codes[r.rank] == -signal.SIGTERM
                              else RankStatus.FAILED)
            r.exit_code = agent_codes[r.rank]
    seen = worker_exit_codes(logs)  # a warm run's torchrun lists only the first failure
    for r in members:
        if r.exit_code is None and r.pid in seen:
            r.exit_code = seen[r.pid]
    for r in members:  # its script ended, then its process died (the agent reaped it so)
        if r.exit_event and r.exit_event.get("code") == 0 and r.exit_code not in (0, None):
            finished.add(r.rank)
            run.set_state(r, RankStatus.KILLED if r.exit_code == -signal.SIGTERM
                          else RankStatus.FAILED)
    failure = None
    if run.reason == Ending.FAILED:
        failure = failure_of(run, run.fold.index, {r.rank: r.exit_code for r in members},
                             finished)
        if failure is None:
            failure = agent_failure(agent_text or "\n".join(
                p.read_text(errors="replace") for p in run.backend.logs()))
    for r in run.ranks:
        if r.state in LIVE:  # a rank at a breakpoint at the end too
            if run.reason == Ending.FAILED and failure and r.rank == failure.rank:
                run.set_state(r, RankStatus.FAILED)
            elif run.reason == Ending.OK and r.exit_code == 0:
                run.set_state(r, RankStatus.DONE)
            else:
                run.set_state(r, RankStatus.KILLED)
    entry = attempt_entry(run.fold.index, failure, {r.rank: r.exit_code for r in members},
                          final=run.reason)
    describe(run, entry, run.fold.current, run.spec.faults[run.fired[run.fold.index]]
             if run.fold.index in run.fired else None)
    run.attempts.append(entry)
    victims = set(failure.victims) if failure else set()
    shown = run.ranks
    if (run.spec.elastic or run.shared) and any(r.pid for r in run.ranks):
        shown = [r for r in run.ranks if r.pid]  # the ranks that ran in some attempt
    ranks = [RankResult(rank=r.rank, state=str(r.state), exit_code=r.exit_code, pid=r.pid,
                        log_dir=run.run_dir, stdout_lines=run.output[r.rank].counts["stdout"],
                        stderr_lines=run.output[r.rank].counts["stderr"],
                        tail=list(run.output[r.rank].combined)[-50:],
                        victim=r.rank in victims)
             for r in shown]
    return RunResult(
        ok=run.reason == Ending.OK,
        world_size=run.fold.current.world_size if run.fold.current else run.spec.world_size,
        duration_s=time.monotonic() - run.t0, log_dir=run.run_dir, ranks=ranks,
        records=run.fold.records, failure=failure, hang=run.hang, attempts=run.attempts,
        reason=str(run.reason), script=str(run.spec.script), command=run.backend.command,
        commands=run.backend.commands, agent_exit_code=run.backend.exit_code,
        ownership=ownership_mode() if run.backend.agents else None,
        start=run.backend.startup.kind, start_reason=run.backend.startup.reason,
        warm_server=run.backend.startup.new_server,
    )
