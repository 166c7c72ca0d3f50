"""Where a run's ranks are started: the Backend interface, and torchrun agents here.

A back end starts the run, says whether it is over, says whether a rank it runs is
alive, and ends it; the follower (run/follow.py) does everything else the same way
for all. LocalAgents starts one torchrun agent per simulated node under a keeper
(runtime/agent.py). A scheduler's back end (launch(scheduler=...)) lives with the rest
of that scheduler's code, above the engine, and is found by name in SCHEDULERS:
SLURM's (labutils.cluster.slurm_backend) submits a batch job whose nodes each run
`labutils launch` into the same run folder, and follows it from there.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from labutils.run.attempts import RankState
from labutils.run.spec import LaunchSpec, torchrun_command
from labutils.run.warm import Keeper, Start, decide_start
from labutils.runtime import runfiles
from labutils.runtime.procs import Claim, pid_alive, signal_all, stop_processes, tree

if TYPE_CHECKING:
    AgentProcess = subprocess.Popen | Keeper  # a cold agent's Popen, or a warm server's keeper

# How long a stopped agent's keeper may take to end its tree (its own limits add up to
# about 8 s: ranks 2 s, what is left 1 s, SIGKILL until gone) before it is killed.
KEEPER_WAIT_S = 15.0
# Back ends that run the ranks through a scheduler, by launch(scheduler=...) name:
# "module:class", imported when a run asks for it. Such a class is made as
# cls(spec, run_dir, options, nodes) (options: launch()'s scheduler options, nodes: the
# run folder's protocol, run/nodes.py) and checks a request with cls.check_request.
SCHEDULERS = {"slurm": "labutils.cluster.slurm_backend:SlurmBackend"}


def scheduler_backend(name: str) -> Any:
    """The back end class of a scheduler named in SCHEDULERS (made with the scheduler's
    own arguments, so typed Any here)."""
    module, _, attribute = SCHEDULERS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass
class Agent:
    """One torchrun agent of the run (a "node"); agent 0 hosts the rendezvous store."""

    index: int
    command: list[str]
    log_path: Path
    proc: subprocess.Popen | Keeper | None = None
    stopped_by_fault: dict | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Backend:
    """What the follow loop (run/follow.py) drives: where a run's ranks start and end.

    Lifecycle: constructed (its commands known, nothing started) -> start() -> while
    the run goes, tick() and rank_alive() -> stop(), which leaves no process behind ->
    logs() and exit_code for the ending. LocalAgents and SlurmJob implement it.
    """

    shared: bool = False  # ranks run where this launcher cannot signal them
    scheduled: bool = False  # a scheduler's job: finished() and failed() say how it goes
    startup: Start = Start("cold")  # warm or cold, and why (run/warm.py, decide_start)
    command: list[str]
    commands: list[list[str]]
    agents: list[Agent]

    def start(self, env: dict[str, str], logs: contextlib.ExitStack, note) -> None:
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Called every few hundred milliseconds while the run goes."""

    def rank_alive(self, r: RankState) -> bool:
        raise NotImplementedError

    def stop(self, ranks: list[int], reason: str, note, *, again: bool = False) -> None:
        """End every process of the run (reason: why). ``again``: a second Ctrl-C came
        while a first stop was under way: end what is left at once."""
        raise NotImplementedError

    def logs(self, *, faulted: bool = True) -> list[Path]:
        """torchrun's own logs (those of agents a fault stopped only when faulted)."""
        return []

    @property
    def exit_code(self) -> int | None:
        raise NotImplementedError

    def kill_agent(self, index: int, rank_pids: list[int], fault: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot stop one agent of a run")

    # Agents this launcher started (scheduled is False):
    def any_alive(self) -> bool:
        raise NotImplementedError

    def host_alive(self) -> bool:
        """Agent 0, the rendezvous host."""
        raise NotImplementedError

    def exit_codes(self) -> list[int | None]:
        raise NotImplementedError

    # A scheduler's job (scheduled is True):
    @classmethod
    def check_request(cls, spec: LaunchSpec, options: dict | None) -> None:
        """Raise LaunchConfigError for what the scheduler cannot run, before anything starts."""

    def close(self) -> None:
        """The run is over, every process of it ended: let go of what the back end held."""

    def finished(self, now: float, note) -> bool:
        raise NotImplementedError

    def failed(self) -> bool:
        raise NotImplementedError


class LocalAgents(Backend):
    """The run's agents on this machine, each under its keeper."""

    shared = False  # every rank is this launcher's to signal (unless multi-node)

    def __init__(self, spec: LaunchSpec, run_dir: Path, token: str, *, port: Claim,
                 run_id: str) -> None:
        self.spec = spec
        # the rendezvous port, claimed until the run is over (runtime/procs.py says why)
        self.port, self.run_id, self._claim = port.port, run_id, port
        self.elastic_dir = runfiles.elastic_dir(run_dir)
        self.startup = decide_start(spec)  # the plan; start() decides again with the servers
        self.agents = [Agent(i, [], runfiles.agent_log_path(run_dir, token or i))
                       for i in range(spec.local_agents)]
        self._commands()

    def _commands(self) -> None:
        for agent in self.agents:
            agent.command = torchrun_command(self.spec, port=self.port, run_id=self.run_id,
                                             agent=agent.index, warm=self.startup.warm,
                                             log_dir=self.elastic_dir)
        self.command = self.agents[0].command
        self.commands = [a.command for a in self.agents]

    def start(self, env: dict[str, str], logs: contextlib.ExitStack, note) -> None:
        if self.startup.warm:
            self.startup = decide_start(self.spec, env)
            if not self.startup.warm:  # no server could serve it
                self._commands()
                note(f"starting cold: {self.startup.reason}")
        server = self.startup.server
        # A launcher placed on this machine next to others of the same job (a virtual
        # cluster's host) is told its own place; its agents count within it.
        outer, launchers = runfiles.local_agent(env)
        agents_here = launchers * self.spec.local_agents
        for agent in self.agents:
            place = outer * self.spec.local_agents + agent.index
            agent_env = {**env, runfiles.ENV_AGENT_INDEX: str(agent.index + self.spec.node_index),
                         runfiles.ENV_LOCAL_AGENT: f"{place}/{agents_here}"}
            if server is not None:
                # the keeper's arguments: its command without "python -m labutils.runtime.agent"
                agent.proc = server.start(agent.command[3:], agent_env, agent.log_path)
                continue
            log = logs.enter_context(open(agent.log_path, "wb"))  # noqa: SIM115 - logs closes it
            agent.proc = subprocess.Popen(
                agent.command, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, env=agent_env)

    def tick(self, now: float) -> None:
        """Nothing to renew: the agents are this launcher's children."""

    def close(self) -> None:
        self._claim.release()

    def any_alive(self) -> bool:
        return any(a.alive() for a in self.agents)

    def host_alive(self) -> bool:
        """Agent 0, the rendezvous host."""
        return self.agents[0].alive()

    def exit_codes(self) -> list[int | None]:
        """The exit codes of the agents that no fault stopped (None: still running)."""
        return [cast("AgentProcess", a.proc).poll() for a in self.agents if not a.stopped_by_fault]

    @property
    def exit_code(self) -> int | None:
        proc = self.agents[0].proc
        return proc.returncode if proc else None

    def logs(self, *, faulted: bool = True) -> list[Path]:
        return [a.log_path for a in self.agents if a.log_path.exists()
                and (faulted or not a.stopped_by_fault)]

    def rank_alive(self, r: RankState) -> bool:
        return bool(r.pid) and r.exit_code is None and pid_alive(cast(int, r.pid))

    def stop(self, ranks: list[int], reason: str, note, *, again: bool = False) -> None:
        """End every process: SIGTERM to each keeper, which ends whatever is below it
        (runtime/agent.py end_tree: torchrun's agent ends its ranks, then the keeper the
        ranks' own children and daemons), and to the ranks no keeper holds. Nothing
        else here signals a rank a keeper holds: a rank writes its stacks as SIGTERM
        ends it, and a second SIGTERM while it writes ends it mid-stack. A keeper is
        never SIGKILLed while it works: only one not done after KEEPER_WAIT_S is."""
        keepers = [cast("AgentProcess", a.proc) for a in self.agents if a.alive()]
        held = {pid for keeper in keepers for pid in tree(keeper.pid)}
        for keeper in keepers:
            with contextlib.suppress(OSError):  # the keeper alone, not its process group
                os.kill(keeper.pid, signal.SIGTERM)
        signal_all([pid for pid in ranks if pid not in held], signal.SIGTERM)
        deadline = time.monotonic() + KEEPER_WAIT_S
        for keeper in keepers:
            try:
                keeper.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop_processes([keeper.pid, *tree(keeper.pid)], grace_s=0.5)
        stop_processes([p for p in ranks if pid_alive(p)], grace_s=0.5)  # an agent already gone
        for agent in self.agents:
            if agent.proc is not None and agent.proc.poll() is None:
                agent.proc.kill()
                agent.proc.wait()

    def kill_agent(self, index: int, rank_pids: list[int], fault: dict) -> None:
        """Make sure one agent and its ranks are gone, as when their machine dies (the
        rank that reported the step has already SIGKILLed the agent and itself)."""
        agent = self.agents[index]
        pids = list(rank_pids)
        if agent.alive():
            proc = cast("AgentProcess", agent.proc)
            pids = [proc.pid, *tree(proc.pid), *pids]
        signal_all(pids, signal.SIGKILL)
        agent.stopped_by_fault = fault
