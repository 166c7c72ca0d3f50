"""Following one run from start to end: lines and events in, a RunResult out.

The calling thread runs one loop: read new lines and events from the run folder,
fold the events into attempts (run/attempts.py), hand lines and changes to the
display, and watch for the end: the back end is done (run/backends.py), a stop
request, the timeout, another node's stop or failure (run/nodes.py), or a hang (no
rank made progress for hang_timeout seconds: every stack is read). Whatever ends
the run, the back end's stop() leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from labutils.run import outcome
from labutils.run.attempts import AttemptFold, RankState
from labutils.run.backends import Backend, LocalAgents, scheduler_backend
from labutils.run.display import Display
from labutils.run.hang import Hang, analyse_hang
from labutils.run.nodes import NodeFiles, node_token, ranks_text
from labutils.run.result import RunResult
from labutils.run.spec import LaunchSpec, RunRequest
from labutils.run.states import Ending, RankStatus
from labutils.run.streams import EndingsTail, EventTail, RankOutput
from labutils.runtime import runfiles
from labutils.runtime.procs import free_port

_last_result: RunResult | None = None


def last_result() -> RunResult | None:
    """The result of the most recent launch() in this process (also after an interrupt)."""
    return _last_result


POLL_S = 0.05
TICK_S = 0.2
AGENT_GRACE_S = 10.0  # how long other agents may outlive agent 0, the rendezvous host
# How long agents may linger once every rank has finished while an agent is gone by an
# injected fault: torchrun's exit barrier would wait 300 s for the agent that left.
EXIT_BARRIER_GRACE_S = 2.0
WAIT_NOTE_S = 15.0  # a multi-node job with no rank yet: when to say it waits for nodes


class Run:
    """One run: start it through its back end, follow it, end it, build the RunResult."""

    def __init__(self, spec: LaunchSpec, run_dir: Path, display: Display, *,
                 scheduler: str | None = None, slurm: dict | None = None,
                 backend: Callable[[LaunchSpec, Path], Backend] | None = None) -> None:
        """Args:
            spec: the checked inputs (run.spec.make_spec).
            run_dir: the run folder, created and empty.
            display: where lines, states and the result go.
            scheduler: None (torchrun agents on this machine) or "slurm".
            slurm: the SLURM job's options (scheduler="slurm").
            backend: makes the back end from the spec and the run folder instead
                (the tests' replay of recorded runs).
        """
        self.spec = spec
        self.run_dir = run_dir
        self.display = display
        # This launcher's node of a job across machines ("" on a one-machine run).
        self.token = node_token(multinode=spec.multinode, node_rank=spec.node_rank)
        self.nodes = NodeFiles(run_dir, self.token, display.note)
        self.fold = AttemptFold(spec.world_size, token=self.token,
                                 close=lambda a, size: outcome.close_attempt(self, a, size))
        self.output = [RankOutput(run_dir, r) for r in range(spec.world_size)]
        self.events = [EventTail(run_dir, r) for r in range(spec.world_size)]
        self.endings = EndingsTail(run_dir)
        self.backend: Backend
        if backend is not None:
            self.backend = backend(spec, run_dir)
        elif scheduler is not None:
            self.backend = scheduler_backend(scheduler)(spec, run_dir, slurm, self.nodes)
        else:
            self.backend = LocalAgents(spec, run_dir, self.token, port=free_port(),
                                       run_id=uuid.uuid4().hex[:12])
        # Ranks may run where this launcher cannot signal them (other machines' nodes).
        self.shared = spec.multinode or self.backend.shared
        self.attempts: list[dict] = []
        self.fired: dict[int, int] = {}  # attempt -> index in spec.faults of an agent fault
        self.reason: Ending = Ending.OK
        self.hang: Hang | None = None
        self.notes: list[str] = []  # lines for the display once the run starts
        env, self._net_note = self._environment()
        self.request = RunRequest(commands=self.backend.commands, env=env, run_dir=run_dir,
                                  start=str(self.backend.startup))
        self._host_gone_at: float | None = None
        self._finished_at: float | None = None
        self._wait_noted = False

    @property
    def ranks(self) -> list[RankState]:
        return self.fold.ranks

    # ---------------------------------------------------------------- lifetime
    def run(self) -> RunResult:
        """Start, follow and end the run; the result (KeyboardInterrupt re-raised after
        every rank is stopped and the summary written)."""
        spec = self.spec
        env, net_note = {**os.environ, **self.request.env}, self._net_note
        self.t0 = self.last_activity = time.monotonic()
        interrupted = False
        self.display.start(world_size=spec.world_size, log_dir=str(self.run_dir),
                           script=str(spec.script))
        if spec.local_agents > 1 and self.backend.agents:
            self.display.note(f"{spec.local_agents} agents (nodes) of {spec.nproc} rank(s) each "
                              f"join one rendezvous, --nnodes {spec.nnodes}")
        if spec.multinode:
            self.display.note(_multinode_line(spec))
        for line in ([net_note] if net_note else []) + self.notes:
            self.display.note(line)
        with contextlib.ExitStack() as logs:
            try:
                self.backend.start(env, logs, self.display.note)
                self._write_commands()
                self._follow()
            except KeyboardInterrupt:
                interrupted = True
                self.reason = Ending.INTERRUPTED
            finally:
                while True:  # a second Ctrl-C must not leave processes behind
                    try:
                        self._shutdown()
                        break
                    except KeyboardInterrupt:
                        interrupted = True
                        self.reason = Ending.INTERRUPTED
        global _last_result
        result = _last_result = outcome.final_result(self)
        result.write_json(runfiles.node_summary_path(self.run_dir, self.token) if self.token
                          else self.run_dir / "summary.json")
        self.display.finish(result)
        if interrupted:
            raise KeyboardInterrupt(f"run interrupted; every rank was stopped. {result.headline()}")
        return result

    def _write_commands(self) -> None:
        """command.txt: each agent's torchrun command as started (warm or cold)."""
        if self.backend.commands:
            name = f"command-{self.token}.txt" if self.token else "command.txt"
            (self.run_dir / name).write_text("\n\n".join("\n".join(c) for c in
                                                         self.backend.commands) + "\n")

    def _environment(self) -> tuple[dict[str, str], str | None]:
        """The variables the run sets on top of the caller's environment, and a line
        on the network interface chosen (jobs across machines)."""
        spec, env, net_note = self.spec, {}, None
        if spec.multinode:
            from labutils.run.network import interface_env

            chosen, net_note = interface_env(spec.rdzv_endpoint or "", {**os.environ, **spec.env})
            env.update(chosen)
            env[runfiles.ENV_NODE] = self.token
        env.update(spec.env)
        env[runfiles.ENV_RUN_DIR] = str(self.run_dir)
        env[runfiles.ENV_PARENT_PID] = str(os.getpid())
        env[runfiles.ENV_BACKEND] = spec.backend
        # Re-initialising gloo through the agent's shared store after a restart fails
        # intermittently; a store per round does not (docs/architecture.md, restarts).
        if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
            env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        if spec.faults:  # the ranks carry them out, inside report(step=S): see dist.py
            env[runfiles.ENV_FAULT] = json.dumps(spec.faults)
        if spec.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun would set, minus its warning
        return env, net_note

    def _follow(self) -> None:
        spec, last_tick = self.spec, 0.0
        while True:
            self._poll()
            now = time.monotonic()
            if self._finished(now):
                self._poll(final=True)
                self.reason = self._ending()
                return
            if self.display.stop_requested.is_set():
                self.display.note("stop requested: stopping every rank")
                self.reason = Ending.STOPPED
                return
            if spec.multinode and self.nodes.stopped_elsewhere():
                self.reason = Ending.STOPPED
                return
            if self.shared and self.nodes.failed_elsewhere(self.fold.remote_nodes,
                                                           self._failed_ranks_of):
                self.reason = Ending.FAILED
                return
            if spec.timeout is not None and now - self.t0 >= spec.timeout:
                self.display.note(f"timeout of {spec.timeout:g} s reached: stopping every rank")
                self.reason = Ending.TIMEOUT
                return
            silent = now - self.last_activity
            first = self.backend.scheduled or \
                self.nodes.first_to_diagnose(self.fold.remote_nodes)
            if spec.hang_timeout is not None and self._hung() and (
                    silent >= spec.hang_timeout * (1 if first else 2)):
                self._diagnose_hang(silent)
                self.reason = Ending.HANG
                return
            if now - last_tick >= TICK_S:
                self.display.tick()
                self.backend.tick(now)
                self._note_waiting_for_nodes(now)
                last_tick = now
            time.sleep(POLL_S)

    def _ending(self) -> Ending:
        backend = self.backend
        if backend.scheduled:
            return Ending.FAILED if backend.failed() else Ending.OK
        finished = self._finished_at is not None  # the rest wait in the exit barrier
        codes = backend.exit_codes()
        return Ending.OK if all(c == 0 or (c is None and finished) for c in codes) \
            else Ending.FAILED

    def _finished(self, now: float) -> bool:
        """The back end is done. Locally: every agent has exited, or agent 0 (the
        rendezvous host) exited a while ago, or every rank of the other agents finished
        after an agent left, by a fault or on its own (they would wait in torchrun's exit
        barrier for the agent that is gone); in a job across machines, also every other
        node seen in the run folder is done (or AGENT_GRACE_S passed since this node's
        agent exited)."""
        backend = self.backend
        if backend.scheduled:
            return backend.finished(now, self.display.note)
        remote = self.fold.remote_nodes
        if not backend.any_alive():
            if self.token and self._host_gone_at is None:
                self.nodes.mark_done()
            if not remote or all(self.nodes.done(t) for t in remote):
                return True
            self._host_gone_at = self._host_gone_at or now
            return now - self._host_gone_at >= AGENT_GRACE_S
        # agents gone, by a fault or on their own (out of restarts): the others' ranks
        # that finished wait in torchrun's exit barrier for them
        left = {a.index for a in backend.agents
                if a.stopped_by_fault or (a.proc is not None and not a.alive())}
        if left and self.fold.current and all(
                r.attempt == self.fold.index and r.exit_code == 0
                for r in self._members() if r.agent not in left):
            self._finished_at = self._finished_at or now
            if now - self._finished_at >= EXIT_BARRIER_GRACE_S:
                return True
        if backend.host_alive():
            return False
        self._host_gone_at = self._host_gone_at or now
        return now - self._host_gone_at >= AGENT_GRACE_S

    def _members(self) -> list[RankState]:
        return self.fold.members(self.spec.world_size)

    def _hung(self) -> bool:
        """Every rank has started in this attempt, at least one is still alive, and none
        is in a debugger."""
        if not self.fold.current:
            return False
        members = self._members()
        if self.shared:  # without a shared run folder only this node's ranks show
            members = [r for r in members if r.pid] or members
        if any(r.debugger for r in members):
            return False  # a rank is being debugged: the others wait for it, not hang
        started = all(r.attempt == self.fold.index and r.pid for r in members)
        return started and any(self.alive(r) for r in members)

    def alive(self, r: RankState) -> bool:
        """Whether a rank of the current run is still running."""
        if not r.local and not self.backend.scheduled:
            # another machine's rank: alive until it exits or its node is done
            return r.exit_code is None and not self.nodes.done(r.node)
        return self.backend.rank_alive(r)

    def _failed_ranks_of(self, token: str) -> list[int]:
        return [r.rank for r in self.ranks if r.node == token and r.attempt == self.fold.index
                and (self.fold.index in r.exceptions or r.exit_code != 0)]

    def _note_waiting_for_nodes(self, now: float) -> None:
        """Say once, after WAIT_NOTE_S without a rank, that the job waits for its nodes."""
        if not self.spec.multinode or self.fold.current or self._wait_noted \
                or now - self.t0 < WAIT_NOTE_S:
            return
        self._wait_noted = True
        self.display.note(
            f"no rank has started after {now - self.t0:.0f} s: the job waits until all "
            f"{self.spec.nnodes} nodes have joined at {self.spec.rdzv_endpoint} (start the "
            "same launch on every machine, each with its own node rank)")

    def _shutdown(self) -> None:
        self.fold.stopping = self.reason not in (Ending.OK, Ending.FAILED)
        if self.shared:
            self.nodes.tell_others_to_stop(self.reason)
        ranks: list[int] = [r.pid for r in self.ranks if r.local and r.pid
                            and self.backend.rank_alive(r)] if not self.backend.scheduled else []
        self.backend.stop(ranks, self.reason, self.display.note)
        self.nodes.mark_done()  # this node's ranks are gone: the others need not wait
        self._poll(final=True)
        for output in self.output:
            output.close()
        for tail in self.events:
            tail.close()
        self.endings.close()

    # ------------------------------------------------------------- following
    def _poll(self, *, final: bool = False) -> None:
        # Events of all ranks in the order they happened, so that the last events of
        # one attempt are never taken for the next attempt's.
        events: list[tuple[float, int, int, dict]] = []
        for rank, (output, tail) in enumerate(zip(self.output, self.events)):
            new_events = tail.poll(final=final)
            events.extend((ev.get("t", 0.0), rank, i, ev) for i, ev in enumerate(new_events))
            new = output.poll(final=final)
            for stream, lines in new.items():
                self.display.lines(rank, stream, lines)
            if new_events or new:
                self.last_activity = time.monotonic()
        # how the agents saw ranks end (rank -1: the fold finds the rank by its pid)
        events.extend((rec.get("t", 0.0), -1, i, rec)
                      for i, rec in enumerate(self.endings.poll(final=final)))
        for _, rank, _, event in sorted(events, key=lambda e: e[:3]):
            changes = self.fold.apply(rank, event) if rank >= 0 else self.fold.reaped(event)
            for change in changes:
                self._show(change)

    def _show(self, change: tuple) -> None:
        kind = change[0]
        if kind == "state":
            self.display.state(change[1], change[2])
        elif kind == "record":
            self.display.record(change[1], change[2])
        elif kind == "restart":
            self.display.note(change[2])
        elif kind == "fault":
            self._agent_fault_fired(change[1])
        elif kind == "debugger":
            self.last_activity = time.monotonic()  # silence counts from the session's end
            self.display.debugger(change[1], change[2])

    def set_state(self, r: RankState, state: RankStatus) -> None:
        """Change a rank's state and show it."""
        for change in self.fold.set_state(r, state):
            self._show(change)

    def _agent_fault_fired(self, ev: dict) -> None:
        """A rank of agent A killed its agent at step S (the fault's "fault" event)."""
        attempt = self.fold.index
        if attempt in self.fired:
            return
        for i, fault in enumerate(self.spec.faults):
            if fault.get("agent") == ev.get("agent") and fault["step"] == ev.get("step") \
                    and fault["restart"] == ev.get("restart"):
                self.fired[attempt] = i
                assert self.fold.current is not None  # a rank of it reported the step
                gone = sorted(self.fold.current.agents.get(fault["agent"], []))
                self.backend.kill_agent(fault["agent"], [pid for g in gone if (pid := self.ranks[g].pid)
                                                         and self.alive(self.ranks[g])], fault)
                for rank in gone:
                    self.ranks[rank].exit_code = -signal.SIGKILL
                    self.set_state(self.ranks[rank], RankStatus.KILLED)
                self.display.note(f"agent {fault['agent']} stopped at step {fault['step']} "
                                  f"(injected fault): rank(s) {ranks_text(gone)} gone, as if "
                                  "their machine died")
                return

    def _diagnose_hang(self, silent: float) -> None:
        alive = [r for r in self.ranks if self.alive(r)]
        self.display.note(f"no rank made progress for {silent:.0f} s: reading every rank's stack")
        offsets = {r.rank: outcome.stacks_size(self.run_dir, r.rank) for r in alive}
        for r in alive:
            if r.local and r.pid:
                try:
                    os.kill(r.pid, signal.SIGUSR1)
                except OSError:
                    pass
        remote = sorted(r.rank for r in alive if not r.local)
        if remote:  # their launchers' machines: ask through the run folder
            self.nodes.request_stacks(remote)
        dumps = outcome.wait_for_dumps(self.run_dir, offsets)
        exited: dict[int, int | None] = {r.rank: r.exit_code for r in self._members()
                                          if r.exit_code is not None}
        self.hang = analyse_hang(dumps, {r.rank: r.main_tid for r in alive}, str(self.spec.script),
                                 exited=exited, silent_s=silent)
        for r in alive:
            self.set_state(r, RankStatus.HUNG)



def _multinode_line(spec: LaunchSpec) -> str:
    if spec.node_rank is not None:
        first = spec.node_rank * spec.nproc
        here = f"rank {first}" if spec.nproc == 1 else f"ranks {first}..{first + spec.nproc - 1}"
        return (f"node {spec.node_rank} of {spec.nnodes}: {here} "
                f"here, rendezvous at {spec.rdzv_endpoint} (job {spec.rdzv_id}); ranks of "
                "other nodes show up here when they share this run folder")
    return (f"one node of {spec.nnodes} joining the c10d rendezvous at {spec.rdzv_endpoint} "
            f"(job {spec.rdzv_id}), {spec.nproc} rank(s) here")
