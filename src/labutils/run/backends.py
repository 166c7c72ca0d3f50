"""Where a run's ranks are started: torchrun agents here, or a SLURM job's nodes.

A back end starts the run, says whether it is over, says whether a rank it runs is
alive, and ends it; the follower (run/follow.py) does everything else the same way
for both. LocalAgents starts one torchrun agent per simulated node under a keeper
(runtime/agent.py); SlurmJob submits a batch job whose nodes each run `labutils
launch` into the same run folder, and follows it from there.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from labutils.run.attempts import RankState
from labutils.run.nodes import LEASE_RENEW_S
from labutils.run.options import node_words
from labutils.run.spec import LaunchSpec, torchrun_command
from labutils.run.warm import Keeper, WarmUnavailable, cold_reason, server_for
from labutils.runtime import runfiles
from labutils.runtime.procs import pid_alive, signal_all, stop_processes, tree

if TYPE_CHECKING:
    from labutils.cluster.slurm import SlurmJob as Submitted

    AgentProcess = subprocess.Popen | Keeper  # a cold agent's Popen, or a warm server's keeper

# How long a stopped agent's keeper may take to end its tree (its own limits add up to
# about 8 s: ranks 2 s, what is left 1 s, SIGKILL until gone) before it is killed.
KEEPER_WAIT_S = 15.0
SLURM_POLL_S = 0.5
SLURM_RUNNING = (None, "RUNNING", "COMPLETING", "CONFIGURING")
SLURM_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


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
    start_kind: str = "cold"  # "warm" or "cold"
    start_reason: str | None = None  # why cold, or that a warm server was started
    command: list[str]
    commands: list[list[str]]
    agents: list[Agent]

    def start(self, env: dict[str, str], logs: contextlib.ExitStack, note) -> None:
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Called every few hundred milliseconds while the run goes."""

    def rank_alive(self, r: RankState) -> bool:
        raise NotImplementedError

    def stop(self, ranks: list[int], reason: str, note) -> None:
        raise NotImplementedError

    def logs(self, *, faulted: bool = True) -> list[Path]:
        """torchrun's own logs (those of agents a fault stopped only when faulted)."""
        return []

    @property
    def exit_code(self) -> int | None:
        raise NotImplementedError

    def kill_agent(self, index: int, rank_pids: list[int], fault: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot stop one agent of a run")


class LocalAgents(Backend):
    """The run's agents on this machine, each under its keeper."""

    shared = False  # every rank is this launcher's to signal (unless multi-node)

    def __init__(self, spec: LaunchSpec, run_dir: Path, token: str, *, port: int,
                 run_id: str) -> None:
        self.spec = spec
        self.port, self.run_id = port, run_id
        # "warm" (forked from this caller's warm server, run/warm.py) or "cold"; why cold
        self.start_reason = cold_reason(spec)
        self.start_kind = "cold" if self.start_reason else "warm"
        self.agents = [Agent(i, [], runfiles.agent_log_path(run_dir, token or i))
                       for i in range(spec.local_agents)]
        self._commands()

    def _commands(self) -> None:
        for agent in self.agents:
            agent.command = torchrun_command(self.spec, port=self.port, run_id=self.run_id,
                                             agent=agent.index, warm=self.start_kind == "warm")
        self.command = self.agents[0].command
        self.commands = [a.command for a in self.agents]

    def start(self, env: dict[str, str], logs: contextlib.ExitStack, note) -> None:
        server = None
        if self.start_kind == "warm":
            try:
                server, started = server_for(env)
                if started:
                    self.start_reason = started
            except WarmUnavailable as exc:
                self.start_kind, self.start_reason = "cold", str(exc)
                self._commands()
                note(f"starting cold: {exc}")
        for agent in self.agents:
            agent_env = {**env, runfiles.ENV_AGENT_INDEX: str(agent.index + self.spec.node_index)}
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

    def stop(self, ranks: list[int], reason: str, note) -> None:
        """End every process: SIGTERM to the ranks and the keepers, which end whatever
        is left below them (the ranks' own children and daemons included). A keeper is
        never SIGKILLed while it works: only one not done after KEEPER_WAIT_S is."""
        keepers = [cast("AgentProcess", a.proc) for a in self.agents if a.alive()]
        signal_all([*ranks, *(k.pid for k in keepers)], signal.SIGTERM)
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


class SlurmJob(Backend):
    """launch(..., scheduler="slurm"): the run as a SLURM batch job, followed from here.

    The job's script (labutils.cluster.slurm.sbatch_script) runs one `labutils launch`
    per node of the allocation, each one node of a multi-node job (node rank
    $SLURM_NODEID, rendezvous at the first node) writing into this run folder; the
    nodes must share it with this machine, as home and project folders are on SLURM
    clusters. Stop, interrupt, timeout and hang end the job with stop.json and
    scancel, waiting until it has left the queue.
    """

    shared = True  # the ranks run on the cluster's nodes
    start_kind = "cold"
    start_reason = "a SLURM job's nodes start cold"

    def __init__(self, spec: LaunchSpec, run_dir: Path, options: dict | None, nodes) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.options = dict(options or {})
        self.nodes = nodes  # the run folder's protocol (run/nodes.py): the lease
        self.agents: list[Agent] = []
        self.job: Submitted | None = None
        self.state: str | None = None
        self.command: list[str] = []
        self.commands: list[list[str]] = []
        self._state_at = 0.0
        self._lease_at = 0.0
        self._exit_code: int | None = None

    def node_command(self, node) -> list[str]:
        """One node's `labutils launch` (node's fields are the batch script's shell values)."""
        spec = self.spec
        # This launcher reads the stacks of a hung job (hang_timeout None on the nodes);
        # the nodes only stop when it says so (stop.json) or at the timeout.
        return [node.python, "-m", "labutils.run.cli", *node_words(
            script=node.script, nproc=spec.nproc, nnodes=node.nnodes, node_rank=node.node_rank,
            rdzv_endpoint=node.rdzv_endpoint, rdzv_id=self.run_dir.name,
            log_dir=str(self.run_dir.parent), backend=spec.backend, hang_timeout=None,
            max_restarts=spec.max_restarts, timeout=spec.timeout, fault=spec.fault,
            warm=False, args=node.args)]

    def batch_script(self) -> str:
        from labutils.cluster.slurm import sbatch_script
        from labutils.runtime.procs import free_port

        opts = {"time_limit": "00:30:00", **self.options}
        return sbatch_script(
            str(self.spec.script), nnodes=self.spec.local_agents, nproc_per_node=self.spec.nproc,
            args=self.spec.args, job_name=opts.pop("job_name", self.spec.script.stem),
            output="slurm-%j.out", run_dir=str(self.run_dir), rdzv_port=free_port(),
            python=sys.executable, node_command=self.node_command, **opts)

    def start(self, env: dict[str, str], logs: contextlib.ExitStack, note) -> None:
        from labutils.cluster.slurm import SlurmJob as Submitted

        text = self.batch_script()
        (self.run_dir / "job.sbatch").write_text(text)
        self.tick(time.monotonic())
        self.job = Submitted.submit(text, self.run_dir)
        self.command = ["sbatch", str(self.run_dir / "job.sbatch")]
        note(f"SLURM job {self.job.job_id} submitted: {self.spec.local_agents} "
             f"node(s) x {self.spec.nproc} rank(s); batch script job.sbatch, "
             f"SLURM's output slurm-{self.job.job_id}.out in the run folder")

    def tick(self, now: float) -> None:
        """Renew the lease that keeps the job's nodes going (see run/nodes.py)."""
        if now - self._lease_at >= LEASE_RENEW_S:
            self._lease_at = now
            self.nodes.renew_lease()

    def finished(self, now: float, note) -> bool:
        if self.job is None:
            return True
        if now - self._state_at >= SLURM_POLL_S:
            self._state_at = now
            state = self.job.state()
            if state != self.state:
                self.state = state
                note(f"SLURM job {self.job.job_id}: {state}")
        from labutils.cluster.slurm import ACTIVE_STATES

        return self.state not in ACTIVE_STATES

    def rank_alive(self, r: RankState) -> bool:
        return r.exit_code is None and not self.nodes.done(r.node) and self.state in SLURM_RUNNING

    def stop(self, ranks: list[int], reason: str, note) -> None:
        if self.job is not None and reason != "ok" and self.state not in SLURM_ENDED:
            note(f"cancelling SLURM job {self.job.job_id} (scancel)")
            self.state = self.job.cancel(wait=True)

    @property
    def exit_code(self) -> int | None:
        """The job's exit code (sacct), asked once the job has left the queue."""
        if self._exit_code is None and self.job is not None:
            self._exit_code = self.job.exit_code()
        return self._exit_code

    def failed(self) -> bool:
        """The job ended some other way than COMPLETED with exit code 0."""
        return self.job is not None and (self.state != "COMPLETED"
                                         or self.exit_code not in (0, None))

    def logs(self, *, faulted: bool = True) -> list[Path]:
        return []

