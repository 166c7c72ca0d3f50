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
from labutils.run.attempts import Attempt, AttemptFold, RankState
from labutils.run.backends import Backend, LocalAgents, scheduler_backend
from labutils.run.display import Display
from labutils.run.hang import Hang, analyse_hang
from labutils.run.nodes import NodeFiles, node_token, ranks_text
from labutils.run.result import RunResult, attempt_line
from labutils.run.spec import LaunchSpec, RunRequest
from labutils.run.states import Ending, RankStatus
from labutils.run.streams import EndingsTail, EventTail, RankOutput
from labutils.runtime import runfiles
from labutils.runtime.procs import claim_port, pid_alive

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
        self.display = display
        # This launcher's node of a job across machines ("" on a one-machine run).
        self.token = node_token(multinode=spec.multinode, node_rank=spec.node_rank)
        self.nodes = NodeFiles(run_dir, self.token, display.note)
        fold = AttemptFold(spec.world_size, token=self.token, close=self._close_attempt)
        self.events = [EventTail(run_dir, r) for r in range(spec.world_size)]
        self.endings = EndingsTail(run_dir)
        made: Backend
        if backend is not None:
            made = backend(spec, run_dir)
        elif scheduler is not None:
            made = scheduler_backend(scheduler)(spec, run_dir, slurm, self.nodes)
        else:
            made = LocalAgents(spec, run_dir, self.token, port=claim_port(),
                               run_id=uuid.uuid4().hex[:12])
        # What the loop gathers, passed to run/outcome.py. Ranks may run where this
        # launcher cannot signal them (other machines' nodes): shared.
        self.state = outcome.RunState(
            spec=spec, run_dir=run_dir, backend=made, fold=fold,
            output=[RankOutput(run_dir, r) for r in range(spec.world_size)],
            shared=spec.multinode or made.shared)
        self.notes: list[str] = []  # lines for the display once the run starts
        # Say which node of a job this launcher is and which interface its ranks use;
        # a virtual cluster turns it off and says what it is instead (cluster/virtual.py).
        self.node_notes = True
        env, self._net_note = self._environment()
        self.request = RunRequest(commands=self.state.backend.commands, env=env, run_dir=run_dir,
                                  start=str(self.state.backend.startup))
        self._host_gone_at: float | None = None
        self._finished_at: float | None = None
        self._wait_noted = False
        self._last_tick = 0.0
        # A rank's debugger socket on this machine, while a session may be open: a rank
        # ended at its breakpoint cannot remove the socket's folder itself (_shutdown).
        self._debug_sockets: dict[int, str] = {}

    @property
    def ranks(self) -> list[RankState]:
        return self.state.ranks

    @property
    def spec(self) -> LaunchSpec:
        return self.state.spec

    @property
    def run_dir(self) -> Path:
        """The run folder (prepare(...).run_dir: known before the run starts)."""
        return self.state.run_dir

    # ---------------------------------------------------------------- lifetime
    def run(self) -> RunResult:
        """Start, follow and end the run; the result (KeyboardInterrupt re-raised after
        every rank is stopped and the summary written)."""
        with contextlib.ExitStack() as logs:
            interrupted = False
            try:
                self.begin(logs)
                while (ending := self.step()) is None:
                    time.sleep(POLL_S)
                self.state.reason = ending
            except KeyboardInterrupt:
                interrupted = True
                self.state.reason = Ending.INTERRUPTED
            return self.end(interrupted=interrupted)

    def begin(self, logs: contextlib.ExitStack) -> None:
        """Show the start and start the back end; the agents' log files are closed
        with ``logs``. run() calls it, and a persistent world (run/world.py), which
        then follows the run cell by cell with step()."""
        spec = self.state.spec
        env, net_note = {**os.environ, **self.request.env}, self._net_note
        self.state.t0 = self.last_activity = time.monotonic()
        self._last_tick = 0.0
        self.display.start(world_size=spec.world_size, log_dir=str(self.state.run_dir),
                           script=str(spec.script))
        if spec.local_agents > 1 and self.state.backend.agents:
            self.display.note(f"{spec.local_agents} agents (nodes) of {spec.nproc} rank(s) each "
                              f"join one rendezvous, --nnodes {spec.nnodes}")
        if spec.multinode and self.node_notes:
            self.display.note(_multinode_line(spec))
        for line in ([net_note] if net_note and self.node_notes else []) + self.notes:
            self.display.note(line)
        self.state.backend.start(env, logs, self.display.note)
        self._write_commands()

    def end(self, *, interrupted: bool = False) -> RunResult:
        """Stop every process (state.reason says why), settle and show the result.
        KeyboardInterrupt once the result is written when ``interrupted``."""
        again = False
        while True:  # a second Ctrl-C must not leave processes behind
            try:
                self._shutdown(again=again)
                break
            except KeyboardInterrupt:  # pressed again while the run was being stopped
                interrupted = again = True
                self.state.reason = Ending.INTERRUPTED
        self.state.backend.close()
        global _last_result
        settled = outcome.final_result(self.state, now=time.monotonic())
        for rank, code in settled.exit_codes.items():
            self.ranks[rank].exit_code = code
        for rank, status in settled.states.items():
            self.set_state(self.ranks[rank], status)
        self.state.attempts = settled.result.attempts
        result = _last_result = settled.result
        result.write_json(runfiles.node_summary_path(self.state.run_dir, self.token) if self.token
                          else self.state.run_dir / "summary.json")
        self.display.finish(result)
        if interrupted:
            raise KeyboardInterrupt(f"run interrupted; every rank was stopped. {result.headline()}")
        return result

    def _write_commands(self) -> None:
        """command.txt: each agent's torchrun command as started (warm or cold)."""
        if self.state.backend.commands:
            name = f"command-{self.token}.txt" if self.token else "command.txt"
            (self.state.run_dir / name).write_text("\n\n".join("\n".join(c) for c in
                                                         self.state.backend.commands) + "\n")

    def _environment(self) -> tuple[dict[str, str], str | None]:
        """The variables the run sets on top of the caller's environment, and a line
        on the network interface chosen (jobs across machines)."""
        spec, env, net_note = self.state.spec, {}, None
        if spec.multinode:
            from labutils.run.network import interface_env

            chosen, net_note = interface_env(spec.rdzv_endpoint or "", {**os.environ, **spec.env})
            env.update(chosen)
            env[runfiles.ENV_NODE] = self.token
        env.update(spec.env)
        env[runfiles.ENV_RUN_DIR] = str(self.state.run_dir)
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

    def step(self) -> Ending | None:
        """One turn of the follow loop: read what is new, show it, and say whether the
        run ends now, and why (None: it goes on; call again after POLL_S)."""
        spec = self.state.spec
        self._poll()
        now = time.monotonic()
        if self._finished(now):
            self._poll(final=True)
            return self._ending()
        if self.display.stop_requested.is_set():
            self.display.note("stop requested: stopping every rank")
            return Ending.STOPPED
        if spec.multinode and self.nodes.stopped_elsewhere():
            return Ending.STOPPED
        if self.state.shared and self.nodes.failed_elsewhere(self.state.fold.remote_nodes,
                                                             self._failed_ranks_of):
            return Ending.FAILED
        if spec.timeout is not None and now - self.state.t0 >= spec.timeout:
            self.display.note(f"timeout of {spec.timeout:g} s reached: stopping every rank")
            return Ending.TIMEOUT
        silent = now - self.last_activity
        first = self.state.backend.scheduled or \
            self.nodes.first_to_diagnose(self.state.fold.remote_nodes)
        if spec.hang_timeout is not None and self._hung() and (
                silent >= spec.hang_timeout * (1 if first else 2)):
            self._diagnose_hang(silent)
            return Ending.HANG
        if now - self._last_tick >= TICK_S:
            self.display.tick()
            self.state.backend.tick(now)
            self._note_waiting_for_nodes(now)
            self._last_tick = now
        return None

    def _ending(self) -> Ending:
        backend = self.state.backend
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
        backend = self.state.backend
        if backend.scheduled:
            return backend.finished(now, self.display.note)
        remote = self.state.fold.remote_nodes
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
        if left and self.state.fold.current and all(
                r.attempt == self.state.fold.index and r.exit_code == 0
                for r in self._members() if r.agent not in left):
            self._finished_at = self._finished_at or now
            if now - self._finished_at >= EXIT_BARRIER_GRACE_S:
                return True
        if backend.host_alive():
            return False
        self._host_gone_at = self._host_gone_at or now
        return now - self._host_gone_at >= AGENT_GRACE_S

    def _members(self) -> list[RankState]:
        return self.state.fold.members(self.state.spec.world_size)

    def _hung(self) -> bool:
        """Every rank has started in this attempt, at least one is still alive, and none
        is in a debugger."""
        if not self.state.fold.current:
            return False
        members = self._members()
        if self.state.shared:  # without a shared run folder only this node's ranks show
            members = [r for r in members if r.pid] or members
        if any(r.debugger for r in members):
            return False  # a rank is being debugged: the others wait for it, not hang
        started = all(r.attempt == self.state.fold.index and r.pid for r in members)
        return started and any(self.alive(r) for r in members)

    def alive(self, r: RankState) -> bool:
        """Whether a rank of the current run is still running."""
        if not r.local and not self.state.backend.scheduled:
            # another machine's rank: alive until it exits or its node is done
            return r.exit_code is None and not self.nodes.done(r.node)
        return self.state.backend.rank_alive(r)

    def _failed_ranks_of(self, token: str) -> list[int]:
        return [r.rank for r in self.ranks if r.node == token and r.attempt == self.state.fold.index
                and (self.state.fold.index in r.exceptions or r.exit_code != 0)]

    def _note_waiting_for_nodes(self, now: float) -> None:
        """Say once, after WAIT_NOTE_S without a rank, that the job waits for its nodes."""
        if not self.state.spec.multinode or self.state.fold.current or self._wait_noted \
                or now - self.state.t0 < WAIT_NOTE_S:
            return
        self._wait_noted = True
        self.display.note(
            f"no rank has started after {now - self.state.t0:.0f} s: the job waits until all "
            f"{self.state.spec.nnodes} nodes have joined at {self.state.spec.rdzv_endpoint} (start the "
            "same launch on every machine, each with its own node rank)")

    def _shutdown(self, *, again: bool = False) -> None:
        self.state.fold.stopping = self.state.reason not in (Ending.OK, Ending.FAILED)
        if self.state.shared:
            self.nodes.tell_others_to_stop(self.state.reason)
        ranks: list[int] = [r.pid for r in self.ranks if r.local and r.pid
                            and self.state.backend.rank_alive(r)] if not self.state.backend.scheduled else []
        self.state.signalled.update(ranks)  # a SIGTERM from here ends none on its own
        self.state.backend.stop(ranks, self.state.reason, self.display.note, again=again)
        self.nodes.mark_done()  # this node's ranks are gone: the others need not wait
        self._wait_for_other_nodes()
        self._poll(final=True)
        for socket_path in self._debug_sockets.values():  # ranks that ended at a breakpoint
            runfiles.remove_socket_folder(socket_path, runfiles.DEBUG_SOCKET_PREFIX)
        self._debug_sockets.clear()
        for output in self.state.output:
            output.close()
        for tail in self.events:
            tail.close()
        self.endings.close()

    def _wait_for_other_nodes(self) -> None:
        """A job that shares its run folder across nodes and is being stopped: each node
        stops its own ranks, a moment after this one told it to. Wait (AGENT_GRACE_S at
        most) until every other node seen in the run folder has said its ranks are gone
        (done-<node>), so that the result reads how and where they ended: their agents'
        reaps and the stacks SIGTERM made them dump. Without the wait a loaded machine's
        second node wrote them after the first had settled its result, whose ranks 2
        and 3 were then "killed", neither placed nor given an exit code."""
        remote = self.state.fold.remote_nodes
        if not self.state.shared or not remote:
            return
        deadline = time.monotonic() + AGENT_GRACE_S
        while not all(self.nodes.done(t) for t in remote) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    # ------------------------------------------------------------- following
    def read_new(self) -> None:
        """Read and show what is new in the run folder now (step() does it each turn)."""
        self._poll()

    def _poll(self, *, final: bool = False) -> None:
        # Events of all ranks in the order they happened, so that the last events of
        # one attempt are never taken for the next attempt's.
        events: list[tuple[float, int, int, dict]] = []
        for rank, tail in enumerate(self.events):
            new_events = tail.poll(final=final)
            events.extend((ev.get("t", 0.0), rank, i, ev) for i, ev in enumerate(new_events))
            if new_events:
                self.last_activity = time.monotonic()
        # how the agents saw ranks end (rank -1: the fold finds the rank by its pid)
        events.extend((rec.get("t", 0.0), -1, i, rec)
                      for i, rec in enumerate(self.endings.poll(final=final)))
        events.sort(key=lambda e: e[:3])
        # Output read with the start of a new attempt is (almost always: the old one's
        # ranks were ended a rendezvous round before) the new attempt's: shown after
        # the notes that end the old attempt and begin the new one, and left out of
        # what the old attempt's ending reads (a restarted rank that fails at once in
        # the same way would lend the old attempt its half-written traceback).
        fold = self.state.fold
        restarting = any(fold.begins_attempt(rank, ev) for _, rank, _, ev in events if rank >= 0)
        if restarting:
            self.state.closing_stderr = {rank: self.state.stderr_lines(rank)
                                         for rank in range(len(self.state.output))}
        lines: list[tuple[int, str, list[str]]] = []
        for rank, output in enumerate(self.state.output):
            new = output.poll(final=final)
            lines.extend((rank, stream, text) for stream, text in new.items())
            if new:
                self.last_activity = time.monotonic()
        if not restarting:
            self._show_lines(lines)
        try:
            for _, rank, _, event in events:
                changes = fold.apply(rank, event) if rank >= 0 else fold.reaped(event)
                for change in changes:
                    self._show(change)
        finally:
            self.state.closing_stderr = None
        if restarting:
            self._show_lines(lines)

    def _show_lines(self, lines: list[tuple[int, str, list[str]]]) -> None:
        for rank, stream, text in lines:
            self.display.lines(rank, stream, text)

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
            rank, event, host = change[1], change[2], self.ranks[change[1]].host
            if event.get("state") == "waiting" and host and host != os.uname().nodename:
                # its socket is on that machine: no console or "continue" reaches it from here
                self.display.note(
                    f"rank {rank} stopped at {event.get('where', 'a breakpoint')} on {host}; the "
                    f"other ranks wait. Debug it there: labutils debug "
                    f"{runfiles.relative_path(self.state.run_dir)} --rank {rank}")
                return
            if event.get("state") == "waiting" and event.get("socket"):
                self._debug_sockets[rank] = event["socket"]
            elif event.get("state") == "ended":
                self._debug_sockets.pop(rank, None)
            self.display.debugger(rank, event)

    def _close_attempt(self, attempt: Attempt, next_world_size: int) -> None:
        """The fold replaces an attempt: record and show how it ended."""
        entry = outcome.close_attempt(self.state, attempt, next_world_size, alive=self.alive)
        self.state.attempts.append(entry)
        self.display.note(attempt_line(entry))

    def set_state(self, r: RankState, state: RankStatus) -> None:
        """Change a rank's state and show it."""
        for change in self.state.fold.set_state(r, state):
            self._show(change)

    def _agent_fault_fired(self, ev: dict) -> None:
        """A rank of agent A killed its agent at step S (the fault's "fault" event)."""
        attempt = self.state.fold.index
        if attempt in self.state.fired:
            return
        for i, fault in enumerate(self.state.spec.faults):
            if fault.get("agent") == ev.get("agent") and fault["step"] == ev.get("step") \
                    and fault["restart"] == ev.get("restart"):
                self.state.fired[attempt] = i
                assert self.state.fold.current is not None  # a rank of it reported the step
                gone = sorted(self.state.fold.current.agents.get(fault["agent"], []))
                self.state.backend.kill_agent(fault["agent"], [pid for g in gone if (pid := self.ranks[g].pid)
                                                         and self.alive(self.ranks[g])], fault)
                for rank in gone:
                    self.ranks[rank].exit_code = -signal.SIGKILL
                    self.set_state(self.ranks[rank], RankStatus.KILLED)
                self.display.note(f"agent {fault['agent']} stopped at step {fault['step']} "
                                  f"(injected fault): rank(s) {ranks_text(gone)} gone, as if "
                                  "their machine died")
                return

    def _diagnose_hang(self, silent: float) -> None:
        self.state.hang = self.read_stacks(silent)
        for r in self.ranks:
            if r.rank in self.state.hang.stacks:
                self.set_state(r, RankStatus.HUNG)

    def read_stacks(self, silent: float, *, script: str | None = None,
                    ranks: set[int] | None = None) -> Hang:
        """Every live rank's stack (of ``ranks``, default all), read now, and where each
        waits in ``script`` (default the run's; a persistent world's cell file)."""
        alive = [r for r in self.ranks if self.alive(r) and (ranks is None or r.rank in ranks)]
        self.display.note(f"no rank made progress for {silent:.0f} s: reading every rank's stack")
        offsets = {r.rank: outcome.stacks_size(self.state.run_dir, r.rank) for r in alive}
        for r in alive:
            if r.local and r.pid:
                try:
                    os.kill(r.pid, signal.SIGUSR1)
                except OSError:
                    pass
        remote = sorted(r.rank for r in alive if not r.local)
        if remote:  # their launchers' machines: ask through the run folder
            self.nodes.request_stacks(remote)
        dumps = outcome.wait_for_dumps(self.state.run_dir, offsets)
        exited: dict[int, int | None] = {r.rank: r.exit_code for r in self._members()
                                          if r.exit_code is not None}
        # a script that ended while a thread that is not a daemon runs on: Python waits
        # for that thread, so the process stays (and holds its peers in their collective)
        lingering = {r.rank: _script_ending(r) for r in self._members()
                     if r.exit_code is not None and r.local and r.pid and pid_alive(r.pid)}
        return analyse_hang(dumps, {r.rank: r.main_tid for r in alive},
                            script or str(self.state.spec.script), exited=exited, silent_s=silent,
                            lingering=lingering)


def _script_ending(r: RankState) -> str:
    """How a rank's script ended, in a few words: its exception and line, or its exit code."""
    ev = r.exceptions.get(r.attempt)
    if ev:
        where = f" at {Path(ev['file']).name}:{ev['line']}" if ev.get("file") else ""
        message = (ev.get("message") or "").strip().splitlines()
        return f"raised {ev.get('exc_type', '?')}{where}{': ' + message[0] if message else ''}"
    return f"ended with exit code {r.exit_code}"


def _multinode_line(spec: LaunchSpec) -> str:
    if spec.node_rank is not None:
        first = spec.node_rank * spec.nproc
        here = f"rank {first}" if spec.nproc == 1 else f"ranks {first}..{first + spec.nproc - 1}"
        return (f"node {spec.node_rank} of {spec.nnodes}: {here} "
                f"here, rendezvous at {spec.rdzv_endpoint} (job {spec.rdzv_id}); ranks of "
                "other nodes show up here when they share this run folder")
    return (f"one node of {spec.nnodes} joining the c10d rendezvous at {spec.rdzv_endpoint} "
            f"(job {spec.rdzv_id}), {spec.nproc} rank(s) here")
