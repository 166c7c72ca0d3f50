"""launch(): run a script on N ranks with torchrun and own the run's whole lifetime.

The calling thread runs one loop: read new lines and events from the run folder,
hand them to the display, and watch for the end (the agents exit), a stop
request, the timeout, or a hang (no rank made progress for hang_timeout
seconds). Whatever ends the run, _shutdown() leaves no process behind: every rank
and every agent's keeper get SIGTERM, and each keeper ends whatever is left below
it, the ranks' own children and daemons included. If this process dies, the
keepers notice and do the same (see runtime/agent.py).

A run may have several agents on this machine (launch(nnodes="1:2")), each one a
"node" of the same c10d rendezvous on loopback, all writing into one run folder.
Ranks are global, and which agent runs which rank, like the world size, is only
known once the rendezvous of an attempt is complete: the launcher learns both
from each rank's start event and keeps a history of attempts (result.attempts):
world size, restart count, which rank failed and why.

A run can also be one node of a job across machines (launch(nnodes=2, node_rank=K,
rdzv_endpoint=..., rdzv_id=...)), one launch() per machine. When the machines
share the log folder, every node writes into one run folder named by rdzv_id, so
each launcher shows every rank of the job. A launcher signals only its own ranks
(those whose start event carries its node token); for the others it works
through files in the run folder: stack-request.json to read their stacks, stop.json
to end the job on every node, summary-<node>.json to say a node is done.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from labutils.runtime import runfiles
from labutils.runtime.procs import (descendants, free_port, ownership_mode, pid_alive, signal_all,
                                     stop_processes)
from labutils.run.spec import LaunchSpec, make_spec, new_run_dir, public_fault, torchrun_command
from labutils.cluster.network import check_endpoint_host, interface_env
from labutils.run.diagnosis import analyse_hang, find_failure
from labutils.notebook.display import Display
from labutils.notebook.modes import make_display
from labutils.errors import LaunchConfigError
from labutils.run.result import RankResult, RunResult, attempt_line
from labutils.run.streams import EventTail, RankOutput

POLL_S = 0.05
TICK_S = 0.2
STACK_WAIT_S = 3.0
AGENT_GRACE_S = 10.0  # how long other agents may outlive agent 0, the rendezvous host
# How long agents may linger once every rank has finished while an agent is gone by an
# injected fault: torchrun's exit barrier would wait 300 s for the agent that left.
EXIT_BARRIER_GRACE_S = 2.0
# How long a stopped agent's keeper may take to end its tree (its own limits add up to
# about 8 s: ranks 2 s, what is left 1 s, SIGKILL until gone) before it is killed.
KEEPER_WAIT_S = 15.0
# A job's nodes end it when the launcher following it (scheduler="slurm") has not renewed
# its lease for this long: that launcher, or the kernel it ran in, was killed.
WAIT_NOTE_S = 15.0  # a multi-node job with no rank yet: when to say it waits for nodes
LEASE_RENEW_S = 1.0
LEASE_STALE_S = 30.0
ENV_LEASE_STALE_S = "LABUTILS_LEASE_STALE_S"  # overrides LEASE_STALE_S on the nodes
_AGENT_FAILURE_RE = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)"
)
# torchrun's log line the moment it sees a worker fail: the exit code, by pid.
_WORKER_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)")

_last_result: RunResult | None = None


def last_result() -> RunResult | None:
    """The result of the most recent launch() in this process (also after an interrupt)."""
    return _last_result


class _Rank:
    """What the launcher knows about one rank while the run goes."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.rank = rank
        self.output = RankOutput(run_dir, rank)
        self.events = EventTail(run_dir, rank)
        self.state = "starting"
        self.pid: int | None = None
        self.main_tid: int | None = None
        self.attempt = -1  # the launcher's attempt this rank last started in
        self.agent: int | None = None
        self.node = ""  # the token of the launcher that started it ("" : this one)
        self.local = True  # started by this launcher (its pid can be signalled)
        self.exit_code: int | None = None
        self.exceptions: dict[int, dict] = {}  # attempt -> exception event


class _Agent:
    """One torchrun agent of the run (a "node"); agent 0 hosts the rendezvous store."""

    def __init__(self, index: int, command: list[str], log_path: Path) -> None:
        self.index = index
        self.command = command
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.stopped_by_fault: dict | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Launch:
    """One run: start the agents, follow them, end them, build the RunResult."""

    def __init__(self, spec: LaunchSpec, run_dir: Path, display: Display) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.display = display
        self.ranks = [_Rank(run_dir, r) for r in range(spec.world_size)]
        self.agents: list[_Agent] = []
        self.records: list[dict] = []
        self.attempts: list[dict] = []
        self.attempt = 0
        self.round: str | None = None  # the rendezvous round of the current attempt
        self.old_rounds: set[str] = set()
        self.current: dict = {}  # the current attempt: world_size, restart_count, agents
        self.fired: dict[int, int] = {}  # attempt -> index in spec.faults of an agent fault
        self.reason = "ok"
        self.hang = None
        self.command: list[str] = []
        self._host_gone_at: float | None = None
        self._finished_at: float | None = None
        # This launcher's node of a job across machines ("" on a one-machine run).
        self.token = _node_token(spec)
        self.remote_nodes: set[str] = set()  # tokens of other machines' launchers seen
        self.stop_seen = False
        self.notes: list[str] = []  # lines for the display once the run starts
        self._wait_noted = False  # said that a multi-node job waits for its nodes
        # Ranks may run where this launcher cannot signal them (other machines' nodes).
        self.shared = spec.multinode

    @property
    def proc(self) -> subprocess.Popen | None:
        """Agent 0's process (the rendezvous host)."""
        return self.agents[0].proc if self.agents else None

    # ---------------------------------------------------------------- lifetime
    def run(self) -> RunResult:
        global _last_result
        spec = self.spec
        port, run_id = free_port(), uuid.uuid4().hex[:12]
        self.agents = self._make_agents(port, run_id)
        if self.agents:
            self.command = self.agents[0].command
            command_file = f"command-{self.token}.txt" if self.token else "command.txt"
            (self.run_dir / command_file).write_text(
                "\n\n".join("\n".join(a.command) for a in self.agents) + "\n")
        env = os.environ.copy()
        net_note = None
        if spec.multinode:
            chosen, net_note = interface_env(spec.rdzv_endpoint, {**env, **spec.env})
            env.update(chosen)
            env[runfiles.ENV_NODE] = self.token
        env.update(spec.env)
        env[runfiles.ENV_RUN_DIR] = str(self.run_dir)
        env[runfiles.ENV_PARENT_PID] = str(os.getpid())
        env["LABUTILS_BACKEND"] = spec.backend
        # Re-initialising gloo through the agent's shared store after a restart fails
        # intermittently; a store per round does not (CURRICULUM.md, lesson 05).
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        if spec.faults:  # the ranks carry them out, inside report(step=S): see dist.py
            env[runfiles.ENV_FAULT] = json.dumps(spec.faults)
        if spec.world_size > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun would set, minus its warning
        self.t0 = time.monotonic()
        self.last_activity = self.t0
        interrupted = False
        self.display.start(world_size=spec.world_size, log_dir=str(self.run_dir),
                           script=str(spec.script))
        if spec.local_agents > 1 and self.agents:
            self.display.note(f"{spec.local_agents} agents (nodes) of {spec.nproc} rank(s) each "
                              f"join one rendezvous, --nnodes {spec.nnodes}")
        if spec.multinode:
            self.display.note(_multinode_line(spec))
            if net_note:
                self.display.note(net_note)
        for line in self.notes:
            self.display.note(line)
        with contextlib.ExitStack() as logs:
            try:
                self._start(env, logs)
                self._follow()
            except KeyboardInterrupt:
                interrupted = True
                self.reason = "interrupted"
            finally:
                while True:  # a second Ctrl-C must not leave processes behind
                    try:
                        self._shutdown()
                        break
                    except KeyboardInterrupt:
                        interrupted = True
                        self.reason = "interrupted"
        result = self._result()
        _last_result = result
        result.write_json(runfiles.node_summary_path(self.run_dir, self.token) if self.token
                          else self.run_dir / "summary.json")
        self.display.finish(result)
        if interrupted:
            raise KeyboardInterrupt(f"run interrupted; every rank was stopped. {result.headline()}")
        return result

    def _make_agents(self, port: int, run_id: str) -> list[_Agent]:
        return [_Agent(i, torchrun_command(self.spec, port=port, run_id=run_id, agent=i),
                       runfiles.agent_log_path(self.run_dir, self.token or i))
                for i in range(self.spec.local_agents)]

    def _start(self, env: dict[str, str], logs: contextlib.ExitStack) -> None:
        """Start the agents (a scheduler's launch submits its job instead)."""
        for agent in self.agents:
            log = logs.enter_context(open(agent.log_path, "wb"))
            agent.proc = subprocess.Popen(
                agent.command, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                env={**env, runfiles.ENV_AGENT_INDEX: str(agent.index + self.spec.node_index)},
            )

    def _follow(self) -> None:
        spec, last_tick = self.spec, 0.0
        while True:
            self._poll()
            now = time.monotonic()
            if self._agents_done(now):
                self._poll(final=True)
                codes = [a.proc.poll() for a in self.agents if not a.stopped_by_fault]
                finished = self._finished_at is not None  # the rest wait in the exit barrier
                self.reason = "ok" if all(c == 0 or (c is None and finished) for c in codes) \
                    else "failed"
                return
            if self.display.stop_requested.is_set():
                self.display.note("stop requested: stopping every rank")
                self.reason = "stopped"
                return
            if self.spec.multinode and self._stopped_elsewhere():
                self.reason = "stopped"
                return
            if self.shared and self._failed_elsewhere():
                self.reason = "failed"
                return
            if spec.timeout is not None and now - self.t0 >= spec.timeout:
                self.display.note(f"timeout of {spec.timeout:g} s reached: stopping every rank")
                self.reason = "timeout"
                return
            silent = now - self.last_activity
            if spec.hang_timeout is not None and self._hung() and (
                    silent >= spec.hang_timeout * (1 if self._diagnoses_hangs() else 2)):
                self._diagnose_hang(silent)
                self.reason = "hang"
                return
            if now - last_tick >= TICK_S:
                self.display.tick()
                self._renew_lease(now)
                self._note_waiting_for_nodes(now)
                last_tick = now
            time.sleep(POLL_S)

    def _agents_done(self, now: float) -> bool:
        """Every agent has exited, or agent 0 (the rendezvous host) exited a while ago,
        or every rank finished after an agent left by a fault (the others would wait
        in torchrun's exit barrier for the agent that is gone). In a job across
        machines, also every other node seen in the run folder has written its summary
        (or AGENT_GRACE_S passed since this node's agent exited)."""
        if not any(a.alive() for a in self.agents):
            if self.token and self._host_gone_at is None:
                runfiles.node_done_path(self.run_dir, self.token).touch()
            if not self.remote_nodes or self._remote_nodes_done():
                return True
            self._host_gone_at = self._host_gone_at or now
            return now - self._host_gone_at >= AGENT_GRACE_S
        left = {a.index for a in self.agents if a.stopped_by_fault}
        if left and self.current and all(r.attempt == self.attempt and r.exit_code == 0
                                         for r in self._members() if r.agent not in left):
            self._finished_at = self._finished_at or now
            if now - self._finished_at >= EXIT_BARRIER_GRACE_S:
                return True
        if self.agents[0].alive():
            return False
        if self._host_gone_at is None:
            self._host_gone_at = now
        return now - self._host_gone_at >= AGENT_GRACE_S

    def _members(self) -> list[_Rank]:
        """The ranks of the current attempt."""
        return self.ranks[: self.current.get("world_size", self.spec.world_size)]

    def _hung(self) -> bool:
        """Every rank has started in this attempt and at least one is still alive."""
        if not self.current:
            return False
        members = self._members()
        if self.shared:  # without a shared run folder only this node's ranks show
            members = [r for r in members if r.pid] or members
        started = all(r.attempt == self.attempt and r.pid for r in members)
        return started and any(self._alive(r) for r in members)

    def _alive(self, r: _Rank) -> bool:
        if not r.local:  # another machine's rank: alive until it exits or its node is done
            return r.exit_code is None and not self._node_done(r.node)
        return bool(r.pid) and r.exit_code is None and pid_alive(r.pid)

    # ----------------------------------------------------------- across machines
    def _node_done(self, token: str) -> bool:
        return runfiles.node_done_path(self.run_dir, token).exists()

    def _remote_nodes_done(self) -> bool:
        return all(self._node_done(t) for t in self.remote_nodes)

    def _diagnoses_hangs(self) -> bool:
        """Whether this node reads the stacks when the job hangs: the first node among
        those that share the run folder (the others would only race it), or any node
        once twice hang_timeout has passed (the first one may be gone)."""
        if not self.remote_nodes:
            return True
        return _node_order(self.token) <= min(map(_node_order, self.remote_nodes))

    def _note_waiting_for_nodes(self, now: float) -> None:
        """Say once, after WAIT_NOTE_S without a rank, that the job waits for its nodes."""
        if not self.spec.multinode or self.current or self._wait_noted \
                or now - self.t0 < WAIT_NOTE_S:
            return
        self._wait_noted = True
        self.display.note(
            f"no rank has started after {now - self.t0:.0f} s: the job waits until all "
            f"{self.spec.nnodes} nodes have joined at {self.spec.rdzv_endpoint} (start the "
            "same launch on every machine, each with its own node rank)")

    def _failed_elsewhere(self) -> bool:
        """Another node is done and some of its ranks failed: this node's ranks would
        only wait for peers that are gone (in init_process_group, or in a collective
        until gloo's timeout), so the job has failed; stop them."""
        for token in sorted(self.remote_nodes):
            if not self._node_done(token):
                continue
            failed = [r.rank for r in self.ranks if r.node == token and r.attempt == self.attempt
                      and (self.attempt in r.exceptions or r.exit_code != 0)]
            if failed:
                self.display.note(f"{token} has ended and its rank(s) {_ranks_text(failed)} "
                                  "failed: stopping the ranks still waiting for them")
                return True
        return False

    def _renew_lease(self, now: float) -> None:
        """Only a launcher that follows a job it submitted holds a lease."""

    def _lease_lost(self) -> bool:
        """The launcher that submitted this job stopped renewing its lease."""
        try:
            age = time.time() - runfiles.lease_path(self.run_dir).stat().st_mtime
        except OSError:
            return False
        try:
            stale_after = float(os.environ.get(ENV_LEASE_STALE_S, LEASE_STALE_S))
        except ValueError:
            stale_after = LEASE_STALE_S
        if age < stale_after:
            return False
        self.display.note(f"the launcher that submitted this job has not been heard from for "
                          f"{age:.0f} s (its lease): ending the job")
        return True

    def _stopped_elsewhere(self) -> bool:
        """Another node's launcher ended the job early (stop.json), or the launcher that
        submitted it is gone (a stale lease): stop here too."""
        path = runfiles.stop_path(self.run_dir)
        if self.stop_seen:
            return False
        if not path.exists():
            return self._lease_lost()
        try:
            stop = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        if stop.get("by") == self.token:
            return False
        self.stop_seen = True
        self.display.note(f"{stop.get('by', 'another node')} ended the job "
                          f"({stop.get('reason', 'stopped')}): stopping this node's ranks")
        return True

    def _tell_other_nodes(self) -> None:
        """Ask every other node's launcher to stop (this one is ending the job early)."""
        if not self.shared or self.stop_seen or self.reason not in (
                "stopped", "timeout", "hang", "interrupted"):
            return
        path = runfiles.stop_path(self.run_dir)
        if not path.exists():
            runfiles.write_atomic(path, json.dumps({"by": self.token or "launcher",
                                                    "reason": self.reason}))

    def _shutdown(self) -> None:
        self._tell_other_nodes()
        ranks = [r.pid for r in self.ranks if r.local and r.pid and pid_alive(r.pid)]
        keepers = [agent.proc for agent in self.agents if agent.alive()]
        # Each agent's keeper ends everything below it, the ranks' own children and
        # daemons included (runtime/agent.py); the ranks also get SIGTERM from here at
        # once, as torchrun would send it. A keeper is never SIGKILLed while it works:
        # only one that has not finished after KEEPER_WAIT_S is, with its tree.
        signal_all([*ranks, *(k.pid for k in keepers)], signal.SIGTERM)
        deadline = time.monotonic() + KEEPER_WAIT_S
        for keeper in keepers:
            try:
                keeper.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_processes([keeper.pid, *descendants(keeper.pid)], grace_s=0.5)
        stop_processes([p for p in ranks if pid_alive(p)], grace_s=0.5)  # an agent already gone
        for agent in self.agents:
            if agent.proc is not None and agent.proc.poll() is None:
                agent.proc.kill()
                agent.proc.wait()
        if self.token:  # this node's ranks are gone: the other nodes need not wait for them
            runfiles.node_done_path(self.run_dir, self.token).touch()
        self._poll(final=True)
        for r in self.ranks:
            r.output.close()
            r.events.close()

    # ------------------------------------------------------------- following
    def _poll(self, *, final: bool = False) -> None:
        # Events of all ranks in the order they happened, so that the last events of
        # one attempt are never taken for the next attempt's.
        events = []
        for r in self.ranks:
            new_events = r.events.poll(final=final)
            events.extend((ev.get("t", 0.0), r.rank, i, ev) for i, ev in enumerate(new_events))
            new = r.output.poll(final=final)
            for stream, lines in new.items():
                self.display.lines(r.rank, stream, lines)
            if new_events or new:
                self.last_activity = time.monotonic()
        for _, rank, _, event in sorted(events, key=lambda e: e[:3]):
            self._on_event(self.ranks[rank], event)

    def _set_state(self, r: _Rank, state: str) -> None:
        if r.state != state:
            r.state = state
            self.display.state(r.rank, state)

    def _on_event(self, r: _Rank, ev: dict) -> None:
        kind = ev.get("kind")
        if kind == "start":
            self._on_start(r, ev)
        elif kind == "record":
            values = ev.get("values", {})
            self.records.append({"rank": r.rank, **values})
            self.display.record(r.rank, values)
        elif kind == "fault":
            self._agent_fault_fired(ev)
        elif kind == "exception":
            r.exceptions[r.attempt] = ev
            self._set_state(r, "failed")
        elif kind == "exit":
            r.exit_code = int(ev.get("code", 0))
            self._set_state(r, "done" if r.exit_code == 0 else "failed")

    def _on_start(self, r: _Rank, ev: dict) -> None:
        """A rank started: in the current attempt, or as the first rank of the next one.

        The ranks of one attempt share its rendezvous round (MASTER_ADDR:MASTER_PORT,
        fresh each round); a rank that starts twice in one round also begins a new one.
        """
        restart = int(ev.get("restart", 0))
        key = ev.get("round") or f"restart {restart}"
        if key in self.old_rounds:
            return  # a late start event of an attempt that is over
        if self.round is None:
            self._open_attempt(key, ev)
        elif key != self.round or r.attempt == self.attempt:
            previous = self.current["world_size"]
            self._close_attempt(next_world_size=int(ev.get("world_size", 1)))
            self.attempt += 1
            self._open_attempt(key, ev)
            size = self.current["world_size"]
            change = f" (was {previous}: the membership changed)" if previous != size else ""
            self.display.note(f"restart {self.attempt}: torchrun started the ranks again, "
                              f"restart count {restart}, world size {size}{change}")
        agent = int(ev.get("agent", 0))
        self.current["agents"].setdefault(agent, []).append(r.rank)
        r.node = ev.get("node") or ""
        r.local = r.node == self.token
        if not r.local:
            self.remote_nodes.add(r.node)
        if r.rank == 0:
            self.current["restart_count"] = restart
        r.attempt, r.pid, r.main_tid, r.exit_code = self.attempt, ev.get("pid"), ev.get("main_tid"), None
        r.agent = agent
        self._set_state(r, "running")

    def _open_attempt(self, key: str, ev: dict) -> None:
        self.round = key
        self.current = {"world_size": int(ev.get("world_size", 1)),
                        "restart_count": int(ev.get("restart", 0)), "agents": {}}

    def _agent_fault_fired(self, ev: dict) -> None:
        """A rank of agent A killed its agent at step S (the fault's "fault" event)."""
        if self.attempt in self.fired:
            return
        for i, fault in enumerate(self.spec.faults):
            if fault.get("agent") == ev.get("agent") and fault["step"] == ev.get("step") \
                    and fault["restart"] == ev.get("restart"):
                self.fired[self.attempt] = i
                self._stop_agent(fault)
                return

    def _stop_agent(self, fault: dict) -> None:
        """Make sure one agent and its ranks are gone, as when their machine dies.

        The rank that reported the step has already SIGKILLed the agent and itself;
        this reaches whatever else of the agent's tree is still alive.
        """
        agent = self.agents[fault["agent"]]
        gone = sorted(self.current.get("agents", {}).get(agent.index, []))
        pids = [self.ranks[rank].pid for rank in gone if self._alive(self.ranks[rank])]
        if agent.alive():
            pids = [agent.proc.pid, *descendants(agent.proc.pid), *pids]
        signal_all(pids, signal.SIGKILL)
        agent.stopped_by_fault = fault
        for rank in gone:
            self.ranks[rank].exit_code = -signal.SIGKILL
            self._set_state(self.ranks[rank], "killed")
        self.display.note(f"agent {agent.index} stopped at step {fault['step']} (injected fault): "
                          f"rank(s) {_ranks_text(gone)} gone, as if their machine died")

    def _failure_of(self, attempt: int, exit_codes: dict[int, int | None],
                    finished: set[int] = frozenset()):
        members = [self.ranks[rank] for rank in exit_codes]
        exceptions = {r.rank: r.exceptions[attempt] for r in members if attempt in r.exceptions}
        failed = [r.rank for r in members
                  if r.rank in exceptions or (exit_codes.get(r.rank) not in (0, None))]
        tails = {r.rank: "\n".join(line for stream, line in list(r.output.combined)[-20:]
                                    if stream == "stderr") for r in members}
        return find_failure(exceptions, exit_codes, failed, finished=finished,
                            stderr_tails=tails)

    def _fault_of(self, attempt: int) -> dict | None:
        """The fault meant for an attempt: its agent fault if it fired, else its rank fault."""
        if attempt in self.fired:
            return self.spec.faults[self.fired[attempt]]
        for fault in self.spec.faults:
            if "rank" in fault and fault["restart"] == attempt:
                return fault
        return None

    def _worker_exit_codes(self) -> dict[int, int]:
        """pid -> exit code of the workers torchrun saw fail, from the agents' logs so far."""
        codes = {}
        for agent in self.agents:
            try:
                text = agent.log_path.read_text(errors="replace")
            except OSError:
                continue
            codes.update({int(pid): int(code) for code, pid in _WORKER_FAILED_RE.findall(text)})
        return codes

    def _close_attempt(self, *, next_world_size: int) -> None:
        """Record why the attempt that is being replaced ended."""
        seen = self._worker_exit_codes()
        fault = self._fault_of(self.attempt)
        codes = {}
        for r in self.ranks:
            if r.attempt != self.attempt or not r.pid:
                continue
            code = r.exit_code
            if code is None and r.local and not pid_alive(r.pid):
                if r.pid in seen:
                    code = seen[r.pid]
                elif fault and fault.get("rank") == r.rank:
                    code = -signal.SIGKILL  # the injected kill
                else:
                    code = -signal.SIGTERM  # torchrun stopped it because a peer failed
            codes[r.rank] = code
        failure = self._failure_of(self.attempt, codes)
        entry = _attempt_entry(self.attempt, failure, codes)
        self._describe(entry, fault)
        size = self.current["world_size"]
        if failure is None and fault is None and next_world_size > size:
            entry["outcome"] = "membership change"
            entry["why"] = (f"more agents joined (world size {size} -> {next_world_size}): "
                            "torchrun restarts every rank to let them in")
        self.attempts.append(entry)
        self.old_rounds.add(self.round)
        self.display.note(attempt_line(entry))

    def _describe(self, entry: dict, fault: dict | None) -> None:
        """Add the attempt's world size, restart count, agents and injected fault."""
        entry["world_size"] = self.current.get("world_size", self.spec.world_size)
        entry["restart_count"] = self.current.get("restart_count", 0)
        if self.spec.local_agents > 1:
            entry["agents"] = {str(a): sorted(rs)
                               for a, rs in sorted(self.current.get("agents", {}).items())}
        if fault is None:
            return
        entry["injected"] = public_fault(fault)
        if "rank" in fault and entry["failed_rank"] == fault["rank"] and \
                entry["exit_codes"].get(str(fault["rank"])) == -signal.SIGKILL:
            phase = f", phase {fault['phase']!r}" if "phase" in fault else ""
            entry["why"] = f"SIGKILL: killed at step {fault['step']}{phase} (injected fault)"
        if "agent" in fault:
            gone = sorted(self.current.get("agents", {}).get(fault["agent"], []))
            entry["failed_rank"] = gone[0] if gone else None
            entry["failed_agent"] = fault["agent"]
            entry["why"] = (f"agent {fault['agent']} left at step {fault['step']} (injected: "
                            f"SIGKILL to the agent and its rank(s) {_ranks_text(gone)})")

    def _diagnose_hang(self, silent: float) -> None:
        alive = [r for r in self.ranks if self._alive(r)]
        self.display.note(f"no rank made progress for {silent:.0f} s: reading every rank's stack")
        offsets = {r.rank: runfiles.stacks_path(self.run_dir, r.rank).stat().st_size
                   if runfiles.stacks_path(self.run_dir, r.rank).exists() else 0 for r in alive}
        for r in alive:
            if r.local:
                try:
                    os.kill(r.pid, signal.SIGUSR1)
                except OSError:
                    pass
        remote = sorted(r.rank for r in alive if not r.local)
        if remote:  # their launchers' machines: ask through the run folder
            path = runfiles.stack_request_path(self.run_dir)
            runfiles.write_atomic(path, json.dumps({"by": self.token, "ranks": remote}))
        dumps = _wait_for_dumps(self.run_dir, offsets)
        exited = {r.rank: r.exit_code for r in self._members() if r.exit_code is not None}
        self.hang = analyse_hang(dumps, {r.rank: r.main_tid for r in alive}, str(self.spec.script),
                                 exited=exited, silent_s=silent)
        for r in alive:
            self._set_state(r, "hung")

    # ---------------------------------------------------------------- result
    def _result(self) -> RunResult:
        logs = [a for a in self.agents if a.log_path.exists()]
        agent_text = "\n".join(a.log_path.read_text(errors="replace") for a in logs
                               if not a.stopped_by_fault)
        if self.shared:  # every node's torchrun says which of its ranks failed
            agent_text = "\n".join(p.read_text(errors="replace")
                                   for p in runfiles.agent_logs(self.run_dir))
        # torchrun's own list of failed ranks is the final word on exit codes: a rank
        # can finish its script (exit event 0) and still die while Python shuts down.
        agent_codes = {int(r): int(c) for r, c in _AGENT_FAILURE_RE.findall(agent_text)}
        members = [r for r in self.ranks if r.attempt == self.attempt] if self.current else self.ranks
        finished = set()
        for r in members:
            if r.rank in agent_codes and agent_codes[r.rank] != r.exit_code:
                if r.exit_code == 0:
                    finished.add(r.rank)
                    self._set_state(r, "killed" if agent_codes[r.rank] == -signal.SIGTERM
                                    else "failed")
                r.exit_code = agent_codes[r.rank]
        failure = None
        if self.reason == "failed":
            codes = {r.rank: r.exit_code for r in members}
            failure = self._failure_of(self.attempt, codes, finished)
            if failure is None:
                failure = _agent_failure(agent_text or "\n".join(
                    a.log_path.read_text(errors="replace") for a in logs))
        for r in self.ranks:
            if r.state in ("starting", "running"):
                if self.reason == "failed" and failure and r.rank == failure.rank:
                    self._set_state(r, "failed")
                elif self.reason == "ok" and r.exit_code == 0:
                    self._set_state(r, "done")
                else:
                    self._set_state(r, "killed")
        codes = {r.rank: r.exit_code for r in members}
        entry = _attempt_entry(self.attempt, failure, codes, final=self.reason)
        self._describe(entry, self.spec.faults[self.fired[self.attempt]]
                       if self.attempt in self.fired else None)
        self.attempts.append(entry)
        victims = set(failure.victims) if failure else set()
        shown = self.ranks
        if (self.spec.elastic or self.shared) and any(r.pid for r in self.ranks):
            shown = [r for r in self.ranks if r.pid]  # the ranks that ran in some attempt
        ranks = [
            RankResult(
                rank=r.rank, state=r.state, exit_code=r.exit_code, pid=r.pid,
                log_dir=self.run_dir, stdout_lines=r.output.counts["stdout"],
                stderr_lines=r.output.counts["stderr"], tail=list(r.output.combined)[-50:],
                victim=r.rank in victims,
            )
            for r in shown
        ]
        return RunResult(
            ok=self.reason == "ok",
            world_size=self.current.get("world_size", self.spec.world_size),
            duration_s=time.monotonic() - self.t0, log_dir=self.run_dir, ranks=ranks,
            records=self.records, failure=failure, hang=self.hang, attempts=self.attempts,
            reason=self.reason, script=str(self.spec.script), command=self.command,
            commands=[a.command for a in self.agents],
            agent_exit_code=self.proc.returncode if self.proc else None,
            ownership=ownership_mode() if self.agents else None,
        )


class SlurmLaunch(Launch):
    """launch(..., scheduler="slurm"): the run as a SLURM batch job, followed from here.

    The job's script (labutils.cluster.slurm.sbatch_script) runs one `labutils launch` per
    node of the allocation, each one node of a multi-node job (node rank
    $SLURM_NODEID, rendezvous at the first node) writing into this run folder. So
    this launcher starts no process itself: it submits the job, shows every rank's
    lines and events as they land in the folder (the cluster's nodes must share it
    with this machine, as home and project folders are on SLURM clusters), reads
    the stacks of a hung job through stack-request.json, and ends the job with
    stop.json and scancel (on stop, interrupt, timeout or hang), waiting until it has
    left the queue.
    """

    STATE_POLL_S = 0.5

    def __init__(self, spec: LaunchSpec, run_dir: Path, display: Display,
                 options: dict | None = None) -> None:
        super().__init__(spec, run_dir, display)
        self.shared = True
        self.options = dict(options or {})
        self.job = None
        self.job_state: str | None = None
        self._state_at = 0.0
        self._lease_at = 0.0

    def _node_command(self, node):
        spec = self.spec
        words = [node.python, "-m", "labutils.run.cli", "launch", "-n", str(spec.nproc),
                 "--nnodes", node.nnodes, "--node-rank", node.node_rank,
                 "--rdzv-endpoint", node.rdzv_endpoint, "--rdzv-id", self.run_dir.name,
                 "--log-dir", str(self.run_dir.parent), "--backend", spec.backend,
                 # This launcher reads the stacks of a hung job; the nodes only stop
                 # when it says so (stop.json) or at the timeout.
                 "--hang-timeout", "0", "--max-restarts", str(spec.max_restarts)]
        if spec.timeout is not None:
            words += ["--timeout", f"{spec.timeout:g}"]
        fault = spec.fault
        if fault is not None:
            words += ["--kill-rank", str(fault["rank"]), "--kill-at-step", str(fault["step"])]
        return [*words, node.script, "--", *node.args]

    def _make_agents(self, port: int, run_id: str) -> list[_Agent]:
        return []  # the job's nodes start theirs

    def _renew_lease(self, now: float) -> None:
        if now - self._lease_at >= LEASE_RENEW_S:
            self._lease_at = now
            runfiles.lease_path(self.run_dir).touch()

    def batch_script(self) -> str:
        from labutils.runtime.procs import free_port
        from labutils.cluster.slurm import sbatch_script

        opts = {"time_limit": "00:30:00", **self.options}
        return sbatch_script(
            str(self.spec.script), nnodes=self.spec.local_agents, nproc_per_node=self.spec.nproc,
            args=self.spec.args, job_name=opts.pop("job_name", self.spec.script.stem),
            output="slurm-%j.out", run_dir=str(self.run_dir), rdzv_port=free_port(),
            python=sys.executable, node_command=self._node_command, **opts)

    def _start(self, env, logs) -> None:
        from labutils.cluster.slurm import SlurmJob

        text = self.batch_script()
        (self.run_dir / "job.sbatch").write_text(text)
        self._renew_lease(time.monotonic())
        self.job = SlurmJob.submit(text, self.run_dir)
        self.command = ["sbatch", str(self.run_dir / "job.sbatch")]
        self.display.note(f"SLURM job {self.job.job_id} submitted: {self.spec.local_agents} "
                          f"node(s) x {self.spec.nproc} rank(s); batch script job.sbatch, "
                          f"SLURM's output slurm-{self.job.job_id}.out in the run folder")

    def _agents_done(self, now: float) -> bool:
        if self.job is None:
            return True
        if now - self._state_at >= self.STATE_POLL_S:
            self._state_at = now
            state = self.job.state()
            if state != self.job_state:
                self.job_state = state
                self.display.note(f"SLURM job {self.job.job_id}: {state}")
        from labutils.cluster.slurm import ACTIVE_STATES

        return self.job_state not in ACTIVE_STATES

    def _alive(self, r: _Rank) -> bool:
        return r.exit_code is None and not self._node_done(r.node) and \
            self.job_state in (None, "RUNNING", "COMPLETING", "CONFIGURING")

    def _diagnoses_hangs(self) -> bool:
        return True

    def _shutdown(self) -> None:
        self._tell_other_nodes()
        if self.job is not None and self.reason != "ok" and self.job_state not in (
                "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            self.display.note(f"cancelling SLURM job {self.job.job_id} (scancel)")
            self.job_state = self.job.cancel(wait=True)
        self._poll(final=True)
        for r in self.ranks:
            r.output.close()
            r.events.close()

    def _result(self) -> RunResult:
        code = self.job.exit_code() if self.job is not None else None
        if self.reason == "ok" and self.job is not None and (
                self.job_state != "COMPLETED" or code not in (0, None)):
            self.reason = "failed"
        result = super()._result()
        result.command = self.command
        result.agent_exit_code = code
        return result


def _node_token(spec: LaunchSpec) -> str:
    """This launcher's name among the nodes of a job ("" when the run is one machine's):
    node<K> with node ranks, else host-pid (c10d numbers the nodes only as they join)."""
    if not spec.multinode:
        return ""
    if spec.node_rank is not None:
        return f"node{spec.node_rank}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{os.uname().nodename}-{os.getpid()}")


def _node_order(token: str) -> tuple:
    """node2 before node10; host-pid tokens (c10d) after node ranks, by name."""
    m = re.fullmatch(r"node(\d+)", token)
    return (0, int(m.group(1)), "") if m else (1, 0, token)


def _multinode_line(spec: LaunchSpec) -> str:
    if spec.node_rank is not None:
        first = spec.node_rank * spec.nproc
        here = f"rank {first}" if spec.nproc == 1 else f"ranks {first}..{first + spec.nproc - 1}"
        return (f"node {spec.node_rank} of {spec.nnodes}: {here} "
                f"here, rendezvous at {spec.rdzv_endpoint} (job {spec.rdzv_id}); ranks of "
                "other nodes show up here when they share this run folder")
    return (f"one node of {spec.nnodes} joining the c10d rendezvous at {spec.rdzv_endpoint} "
            f"(job {spec.rdzv_id}), {spec.nproc} rank(s) here")


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if ranks else "(none had started)"


def _attempt_entry(attempt: int, failure, codes: dict, final: str | None = None) -> dict:
    entry = {
        "attempt": attempt,
        "failed_rank": failure.rank if failure else None,
        "why": f"{failure.exc_type}: {failure.message}" if failure else None,
        "exit_codes": {str(k): v for k, v in codes.items()},
    }
    entry["outcome"] = final if final is not None else "restarted"
    return entry


def _agent_failure(agent_text: str):
    """A failure of torchrun itself (before any rank ran), from the agent's log."""
    from labutils.run.diagnosis import Failure

    lines = [ln for ln in agent_text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^\w*(Error|Exception)\b", ln)]
    message = errors[-1] if errors else (lines[-1] if lines else "torchrun exited with an error")
    return Failure(rank=-1, exc_type="torchrun", message=message, file=None, line=None,
                   traceback="\n".join(lines[-30:]))


def _wait_for_dumps(run_dir: Path, offsets: dict[int, int]) -> dict[int, str]:
    """Each rank's new stack text, once every file has grown and stopped growing."""
    deadline = time.monotonic() + STACK_WAIT_S
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:
        now = {r: runfiles.stacks_path(run_dir, r).stat().st_size
               if runfiles.stacks_path(run_dir, r).exists() else 0 for r in offsets}
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


def launch(
    script: str | os.PathLike,
    nproc: int = 2,
    *,
    args=(),
    backend: str = "auto",
    hang_timeout: float | None = 30.0,
    timeout: float | None = None,
    max_restarts: int = 0,
    log_dir: str | os.PathLike | None = None,
    display: str | Display = "auto",
    env: dict[str, str] | None = None,
    fault: dict | list[dict] | None = None,
    nnodes: int | str = 1,
    local_agents: int | None = None,
    rdzv_conf: dict | None = None,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    scheduler: str | None = None,
    slurm: dict | None = None,
) -> RunResult:
    """Run ``script`` on ``nproc`` ranks with torchrun and return what happened.

    Each rank's output streams into the cell as it arrives (live panes in
    JupyterLab, ``[rank N] line`` text elsewhere) and is kept complete in the run
    folder. Bad input raises LaunchConfigError before any process starts.

    Args:
        script: the training script, run unchanged in every rank.
        nproc: number of ranks (processes) per agent; with one agent, on this machine.
        args: command-line arguments for the script, a list of strings.
        backend: "auto" (nccl with a GPU per rank, else gloo), "gloo" or "nccl";
            scripts read it through labutils.dist.init().
        hang_timeout: seconds without progress from any rank before the run is
            declared hung, every stack is read and the run is stopped; None: never.
        timeout: wall-clock limit for the whole run in seconds; None: no limit.
        max_restarts: how often torchrun restarts all ranks after a failure.
        log_dir: folder for run folders (default $LABUTILS_RUNS_DIR or ./runs).
        display: "auto", "widgets", "text", "terminal", "none" or a Display.
        env: extra environment variables for the ranks.
        fault: fault injection, one fault for the first attempt or a list with one per
            attempt (the k-th fires when torchrun's restart count is k); needs
            max_restarts >= the number of faults. {"rank": R, "step": S}: rank R is
            SIGKILLed inside its report(step=S); "step": (lo, hi) with "seed": k draws
            the step; "phase": P matches only report(step=S, phase=P). {"agent": A,
            "step": S}: agent A and its ranks are SIGKILLed inside the report(step=S)
            of one of A's ranks (a node leaves; needs several agents). The restart history is in
            result.attempts.
        nnodes: torchrun's --nnodes, N or "MIN:MAX": the run continues while at least
            MIN agents (nodes) are there and admits up to MAX.
        local_agents: torchrun agents started on this machine, each a "node" with
            nproc ranks, all joining one c10d rendezvous on loopback; default MAX.
            Ranks are numbered across agents (agent order is the rendezvous's).
        rdzv_conf: rendezvous settings passed as torchrun --rdzv-conf, over the
            short defaults launch() uses when there are several agents
            (config.ELASTIC_RDZV_CONF), e.g. {"last_call_timeout": 5}.
        node_rank, rdzv_endpoint, rdzv_id: make this launch() one node of a job
            across machines, one launch() (or `labutils launch`) per machine, each
            with the same nnodes, nproc, rdzv_endpoint "HOST:PORT" (node 0's
            address) and rdzv_id (the job's name). With node_rank (0..nnodes-1),
            torchrun's static rendezvous: global rank = node_rank * nproc + local
            rank; without, c10d (nnodes may be "MIN:MAX"). The run folder is
            <log_dir>/<rdzv_id>: with a log folder every machine shares, each node
            shows every rank. GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME are set to the
            interface that reaches the endpoint unless env (or the environment)
            sets them.
        scheduler: None (start the ranks here) or "slurm": submit the run as a batch
            job of nnodes nodes x nproc ranks (sbatch) and follow it from here like a
            local run: same display, RunResult, failure and hang diagnosis; stop,
            interrupt, timeout and hang cancel the job (scancel). The run folder must
            be one the cluster's nodes share with this machine.
        slurm: sbatch settings for scheduler="slurm": partition, time_limit
            ("HH:MM:SS", default 00:30:00), gpus_per_node, cpus_per_task, job_name.

    Returns:
        RunResult. A Ctrl-C or Jupyter interrupt stops every rank, prints the
        summary and re-raises KeyboardInterrupt; last_result() still has the result.
    """
    return prepare(script, nproc, args=args, backend=backend, hang_timeout=hang_timeout,
                   timeout=timeout, max_restarts=max_restarts, log_dir=log_dir, display=display,
                   env=env, fault=fault, nnodes=nnodes, local_agents=local_agents,
                   rdzv_conf=rdzv_conf, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                   rdzv_id=rdzv_id, scheduler=scheduler, slurm=slurm).run()


SCHEDULERS = (None, "slurm")


def prepare(script, nproc: int = 2, *, log_dir=None, display="auto", scheduler=None,
            slurm: dict | None = None, **kwargs) -> Launch:
    """launch() up to the moment processes start: every input checked (LaunchConfigError
    on the first bad one), the display made, the run folder created. .run() starts it."""
    if scheduler not in SCHEDULERS:
        raise LaunchConfigError("scheduler", expected="None (this machine) or 'slurm'",
                                given=scheduler, fix='pass scheduler="slurm" or leave it out')
    if scheduler is None and slurm is not None:
        raise LaunchConfigError("slurm", expected='scheduler="slurm" with it', given=slurm,
                                fix='pass scheduler="slurm", slurm={"partition": ...}')
    spec = make_spec(script, nproc, **kwargs)
    if scheduler == "slurm":
        _check_slurm_request(spec, slurm)
    if spec.multinode:
        check_endpoint_host(spec.rdzv_endpoint)
    if not isinstance(display, Display):
        display = make_display(display)
    run_dir = new_run_dir(spec.script, log_dir, job=spec.rdzv_id)
    if scheduler == "slurm":
        return SlurmLaunch(spec, run_dir, display, slurm)
    return Launch(spec, run_dir, display)


_SLURM_OPTIONS = ("partition", "time_limit", "gpus_per_node", "cpus_per_task", "job_name")


def _check_slurm_request(spec: LaunchSpec, slurm) -> None:
    """What scheduler="slurm" cannot take, and whether the cluster answers: one line each."""
    from labutils.cluster.slurm import check_cluster, sbatch_script

    if spec.multinode or spec.min_nodes != spec.max_nodes:
        raise LaunchConfigError(
            "scheduler", expected='a fixed nnodes=N and no node_rank/rdzv_endpoint/rdzv_id: '
            'SLURM says where the nodes meet', given=f"nnodes={spec.nnodes}",
            fix='pass e.g. launch("train.py", nproc=2, nnodes=2, scheduler="slurm")')
    if len(spec.faults) > 1 or any("agent" in f for f in spec.faults):
        raise LaunchConfigError("fault", expected='one {"rank": R, "step": S} fault with SLURM',
                                given=[public_fault(f) for f in spec.faults],
                                fix="inject one rank fault, or run the scenario locally")
    if slurm is not None and (not isinstance(slurm, dict) or set(slurm) - set(_SLURM_OPTIONS)):
        raise LaunchConfigError("slurm", expected=f"a dict with keys among {', '.join(_SLURM_OPTIONS)}",
                                given=slurm, fix='pass e.g. slurm={"partition": "debug", '
                                '"time_limit": "00:10:00"}')
    opts = {"time_limit": "00:30:00", **(slurm or {})}
    sbatch_script(str(spec.script), nnodes=spec.local_agents, nproc_per_node=spec.nproc,
                  args=spec.args, **opts)  # the sbatch settings' own checks, before submitting
    check_cluster()
