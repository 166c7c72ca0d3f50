"""launch(..., scheduler="slurm"): the engine's back end for a SLURM batch job.

The engine (labutils.run) finds it by name (run/backends.py, SCHEDULERS) and follows it
through the Backend interface like its own local agents; the batch script comes from
sbatch.py and the job's commands from slurm_job.py.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from labutils.cluster.sbatch import sbatch_script
from labutils.cluster.slurm_job import ACTIVE_STATES, SlurmError, SlurmJob, check_cluster
from labutils.errors import LaunchConfigError
from labutils.run.attempts import RankState
from labutils.run.backends import Agent, Backend
from labutils.run.nodes import LEASE_RENEW_S
from labutils.run.options import node_words
from labutils.run.spec import LaunchSpec, public_fault
from labutils.run.warm import Start
from labutils.runtime.procs import Claim, claim_port

SLURM_POLL_S = 0.5
NODES_STOP_S = 10.0  # how long the nodes may take to stop their own ranks before scancel
SLURM_RUNNING = (None, "RUNNING", "COMPLETING", "CONFIGURING")
SLURM_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
# No node runs the batch script (yet, or now): none would read stop.json
SLURM_NOT_STARTED = ("PENDING", "CONFIGURING", "SUSPENDED")
_SLURM_OPTIONS = ("partition", "time_limit", "gpus_per_node", "cpus_per_task", "job_name")


class SlurmBackend(Backend):
    """launch(..., scheduler="slurm"): the run as a SLURM batch job, followed from here.

    The job's script (labutils.cluster.sbatch.sbatch_script) runs one `labutils launch`
    per node of the allocation, each one node of a multi-node job (node rank
    $SLURM_NODEID, rendezvous at the first node) writing into this run folder; the
    nodes must share it with this machine, as home and project folders are on SLURM
    clusters. Stop, interrupt, timeout and hang end the job with stop.json (each node
    stops its own ranks), then scancel what is left, waiting until it has left the queue.
    """

    shared = True  # the ranks run on the cluster's nodes
    scheduled = True
    startup = Start("cold", "a SLURM job's nodes start cold")

    def __init__(self, spec: LaunchSpec, run_dir: Path, options: dict | None, nodes) -> None:
        self.spec = spec
        self.run_dir = run_dir
        self.options = dict(options or {})
        self.nodes = nodes  # the run folder's protocol (run/nodes.py): the lease
        self.agents: list[Agent] = []
        self.job: SlurmJob | None = None
        self.state: str | None = None
        self.command: list[str] = []
        self.commands: list[list[str]] = []
        self._state_at = 0.0
        self._lease_at = 0.0
        self._exit_code: int | None = None
        self._stop_asked = False
        self._port: Claim | None = None  # the rendezvous port, claimed in batch_script()

    @classmethod
    def check_request(cls, spec: LaunchSpec, options: dict | None) -> None:
        """What scheduler="slurm" cannot take, and whether the cluster answers: one line each."""
        if spec.multinode or spec.min_nodes != spec.max_nodes:
            raise LaunchConfigError(
                "scheduler", expected='a fixed nnodes=N and no node_rank/rdzv_endpoint/rdzv_id: '
                'SLURM says where the nodes meet', given=f"nnodes={spec.nnodes}",
                fix='pass e.g. launch("train.py", nproc=2, nnodes=2, scheduler="slurm")')
        if len(spec.faults) > 1 or any("agent" in f for f in spec.faults):
            raise LaunchConfigError("fault", expected='one {"rank": R, "step": S} fault with SLURM',
                                    given=[public_fault(f) for f in spec.faults],
                                    fix="inject one rank fault, or run the scenario locally")
        if options is not None and (not isinstance(options, dict) or set(options) - set(_SLURM_OPTIONS)):
            raise LaunchConfigError("slurm", expected=f"a dict with keys among {', '.join(_SLURM_OPTIONS)}",
                                    given=options, fix='pass e.g. slurm={"partition": "debug", '
                                    '"time_limit": "00:10:00"}')
        opts = {"time_limit": "00:30:00", **(options or {})}
        sbatch_script(str(spec.script), nnodes=spec.local_agents, nproc_per_node=spec.nproc,
                      args=spec.args, **opts)  # the sbatch settings' own checks, before submitting
        check_cluster()

    def node_command(self, node) -> list[str]:
        """One node's `labutils launch` (node's fields are the batch script's shell values)."""
        spec = self.spec
        # This launcher reads the stacks of a hung job (hang_timeout None on the nodes);
        # the nodes only stop when it says so (stop.json) or at the timeout. A job that may
        # restart meets through c10d, without node ranks (run.checks.check_node_rank_restarts
        # says why).
        return [node.python, "-m", "labutils.cli", *node_words(
            script=node.script, nproc=spec.nproc, nnodes=node.nnodes,
            node_rank=None if spec.max_restarts else node.node_rank,
            rdzv_endpoint=node.rdzv_endpoint, rdzv_id=self.run_dir.name,
            log_dir=str(self.run_dir.parent), backend=spec.backend, hang_timeout=None,
            max_restarts=spec.max_restarts, timeout=spec.timeout, fault=spec.fault,
            warm=False, args=node.args)]

    def batch_script(self) -> str:
        opts = {"time_limit": "00:30:00", **self.options}
        # claimed against this machine's other launchers until the job is over (close)
        self._port = claim_port()
        return sbatch_script(
            str(self.spec.script), nnodes=self.spec.local_agents, nproc_per_node=self.spec.nproc,
            args=self.spec.args, job_name=opts.pop("job_name", self.spec.script.stem),
            output="slurm-%j.out", run_dir=str(self.run_dir), rdzv_port=self._port.port,
            python=sys.executable, node_command=self.node_command, labutils_nodes=True, **opts)

    def start(self, env: dict[str, str], logs: contextlib.ExitStack, note) -> None:
        text = self.batch_script()
        (self.run_dir / "job.sbatch").write_text(text)
        self.tick(time.monotonic())
        self.job = SlurmJob.submit(text, self.run_dir)
        self.command = ["sbatch", str(self.run_dir / "job.sbatch")]
        note(f"SLURM job {self.job.job_id} submitted: {self.spec.local_agents} "
             f"node(s) x {self.spec.nproc} rank(s); batch script job.sbatch, "
             f"SLURM's output slurm-{self.job.job_id}.out in the run folder")

    def tick(self, now: float) -> None:
        """Renew the lease that keeps the job's nodes going (see run/nodes.py)."""
        if now - self._lease_at >= LEASE_RENEW_S:
            self._lease_at = now
            self.nodes.renew_lease()

    def close(self) -> None:
        if self._port is not None:
            self._port.release()

    def finished(self, now: float, note) -> bool:
        if self.job is None:
            return True
        if now - self._state_at >= SLURM_POLL_S:
            self._state_at = now
            self._read_state(note)
        return self.state not in ACTIVE_STATES

    def _read_state(self, note) -> None:
        assert self.job is not None
        state = self.job.state()
        if state != self.state:
            self.state = state
            note(f"SLURM job {self.job.job_id}: {state}")

    def rank_alive(self, r: RankState) -> bool:
        return r.exit_code is None and not self.nodes.done(r.node) and self.state in SLURM_RUNNING

    def stop(self, ranks: list[int], reason: str, note, *, again: bool = False) -> None:
        """End the job, the nodes first: each stops its own ranks, so that every rank gets
        one SIGTERM, from its torchrun agent, and writes its stacks whole (where each
        rank was at a timeout or Stop), and records how each ended (a victim's exit
        code). After an early ending (stop, interrupt, timeout, hang) they read
        stop.json, after a node failed they see it (run/nodes.py: failed_elsewhere).
        What is still in the queue after NODES_STOP_S is cancelled (scancel: SIGTERM to
        every process of the job at once, which would end a rank in the middle of
        its stacks, SIGKILL after KillWait); at once when no node runs it (a job still
        pending) or on a second Ctrl-C: ``again``, or a second call (the press may come
        before this one is entered, after stop.json is written)."""
        if self.job is None or reason == "ok":
            return
        at_once, self._stop_asked = again or self._stop_asked, True
        with contextlib.suppress(SlurmError):
            self._read_state(note)
        waits = not at_once and self.state not in SLURM_NOT_STARTED
        deadline = time.monotonic() + (NODES_STOP_S if waits else 0.0)
        while self.state not in SLURM_ENDED and time.monotonic() < deadline:
            time.sleep(SLURM_POLL_S)
            try:
                self._read_state(note)
            except SlurmError:
                break
        if self.state not in SLURM_ENDED:
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

