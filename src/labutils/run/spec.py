"""A launch request, checked before anything starts, and the torchrun command it becomes.

make_spec checks every input (the checks of the larger ones are in labutils.run.checks,
re-exported here, where the launcher, the tests and the old path labutils.config find
them) into a LaunchSpec; torchrun_command turns a LaunchSpec into one agent's command;
new_run_dir makes the run's folder.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from labutils.errors import LaunchConfigError, cannot_write, real_number, whole_number
from labutils.run.checks import (
    MAX_LOCAL_AGENTS,
    MAX_NODES,
    check_fault,
    check_faults,
    check_multinode,
    check_nnodes,
    check_node_rank_restarts,
    check_rdzv_conf,
    check_script,
    public_fault,
)
from labutils.runtime import runfiles

__all__ = [
    "BACKENDS", "ELASTIC_RDZV_CONF", "ENV_RUNS_DIR", "MAX_LOCAL_AGENTS", "MAX_NODES", "MAX_NPROC",
    "LaunchSpec", "RunRequest", "check_fault", "check_faults", "check_multinode", "check_nnodes",
    "check_rdzv_conf", "check_script", "gpu_count", "make_spec", "new_run_dir", "public_fault",
    "runs_root", "torchrun_command",
]

# The worker bootstrap as a file: a warm agent runs it by path in each forked rank.
WORKER_PATH = str(Path(runfiles.__file__).with_name("worker.py"))
MAX_NPROC = 64  # per node; more than this on one machine is a typo, not a plan
BACKENDS = ("auto", "gloo", "nccl")
ENV_RUNS_DIR = runfiles.ENV_RUNS_DIR
# Rendezvous settings for runs with several agents or an elastic --nnodes MIN:MAX, tuned
# for agents on one machine: torch's defaults (30 s last call, 15 s to declare a silent
# agent dead, 600 s to join) are made for clusters and would make a membership change
# take most of a minute. Seconds, as torchrun's --rdzv-conf takes them.
ELASTIC_RDZV_CONF = {
    "join_timeout": "60",           # give up when MIN agents have not met after this long
    "last_call_timeout": "3",       # once MIN agents are there, wait this long for more
    "keep_alive_interval": "1",     # each agent's heartbeat period
    "keep_alive_max_attempt": "3",  # missed heartbeats before an agent counts as dead
}


@dataclass
class LaunchSpec:
    """A validated launch request."""

    script: Path
    nproc: int
    args: list[str] = field(default_factory=list)
    backend: str = "auto"
    hang_timeout: float | None = 30.0
    timeout: float | None = None
    max_restarts: int = 0
    min_nodes: int = 1
    max_nodes: int = 1
    local_agents: int = 1  # torchrun agents started on this machine, each one a "node"
    env: dict[str, str] = field(default_factory=dict)
    # Checked faults, one per attempt at most: {"restart": k, "rank": R, "step": S
    # [, "phase": P]} SIGKILLs rank R when it reports step S in restart k;
    # {"restart": k, "agent": A, "step": S} stops agent A and its ranks when one of
    # A's ranks reports step S in A's restart k.
    faults: list[dict] = field(default_factory=list)
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    # A job across machines: this launch() is one node of it (see check_multinode).
    rdzv_endpoint: str | None = None  # "host:port" every node of the job reaches
    rdzv_id: str | None = None        # the job's name, also the shared run folder's name
    node_rank: int | None = None      # this node's rank (static rendezvous), or None
    warm: bool = True  # start from the caller's warm server where it applies (run/warm.py)

    @property
    def multinode(self) -> bool:
        """This launch() is one node of a job whose other nodes run elsewhere."""
        return self.rdzv_endpoint is not None

    @property
    def world_size(self) -> int:
        """The most ranks of the run: nproc per agent, every agent (every node of a
        multi-node job, wherever it runs)."""
        if self.multinode:
            return self.nproc * self.max_nodes
        return self.nproc * self.local_agents

    @property
    def node_index(self) -> int:
        """This machine's node number: the node rank, else 0."""
        return self.node_rank or 0

    @property
    def elastic(self) -> bool:
        """Several agents, or a node count that may change (--nnodes MIN:MAX), or
        nodes that meet through the c10d rendezvous (a multi-node job without node ranks)."""
        if self.multinode:
            return self.node_rank is None
        return self.local_agents > 1 or self.min_nodes != self.max_nodes

    @property
    def nnodes(self) -> str:
        """torchrun's --nnodes value: "N" or "MIN:MAX"."""
        if self.min_nodes == self.max_nodes:
            return str(self.min_nodes)
        return f"{self.min_nodes}:{self.max_nodes}"

    @property
    def fault(self) -> dict | None:
        """The fault of the first attempt, as it was asked for (None: no fault)."""
        first = [f for f in self.faults if f["restart"] == 0]
        return public_fault(first[0]) if first else None

def _number(name: str, value, *, allow_none: bool, minimum: float, fix: str) -> float | None:
    if value is None and allow_none:
        return None
    if not real_number(value) or value < minimum:
        expected = f"a number >= {minimum}" + (" or None" if allow_none else "")
        raise LaunchConfigError(name, expected=expected, given=value, fix=fix)
    return float(value)

def gpu_count() -> int:
    """GPUs torch can see (imports torch: only called when nccl is asked for)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def make_spec(
    script: str | os.PathLike,
    nproc: int,
    *,
    args=(),
    backend: str = "auto",
    hang_timeout: float | None = 30.0,
    timeout: float | None = None,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    fault: dict | list | None = None,
    nnodes: int | str = 1,
    local_agents: int | None = None,
    rdzv_conf: dict | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    node_rank: int | None = None,
    warm: bool = True,
) -> LaunchSpec:
    """Check every input; raise LaunchConfigError with a one-line fix on the first bad one.

    Args (launch()'s, which says more about each):
        script: the training script.
        nproc: ranks per agent.
        args: the script's arguments, a list of strings.
        backend: "auto", "gloo" or "nccl" (nccl: a GPU per rank).
        hang_timeout: seconds without progress before a hang (at least 0.5); None: never
            (the command line's 0 is None).
        timeout: the run's wall-clock limit in seconds; None: none.
        max_restarts: torchrun's restarts after a failure.
        env: extra environment variables for the ranks.
        fault: fault injection (check_faults).
        nnodes: N or "MIN:MAX" (check_nnodes).
        local_agents: agents on this machine; None: MAX.
        rdzv_conf: rendezvous settings (check_rdzv_conf).
        rdzv_endpoint: "HOST:PORT" of a job across machines (check_multinode).
        rdzv_id: that job's name.
        node_rank: this node's rank in it; None: c10d.
        warm: fork the run from a warm server where it applies; False: start cold.
    """
    if not whole_number(nproc) or nproc < 1:
        raise LaunchConfigError("nproc", expected="a whole number of ranks >= 1", given=nproc,
                                fix="pass e.g. nproc=2 (one process per rank)")
    if nproc > MAX_NPROC:
        raise LaunchConfigError(
            "nproc", expected=f"at most {MAX_NPROC} ranks on one machine", given=nproc,
            fix=f"this machine has {os.cpu_count()} cores; 2 to 4 ranks are plenty for the lessons",
        )
    if isinstance(args, (str, bytes)):
        raise LaunchConfigError("args", expected="a list of strings", given=args,
                                fix=f"split it, e.g. args={str(args).split()!r}")
    try:
        items = list(args)
    except TypeError:
        raise LaunchConfigError("args", expected="a list of strings", given=args,
                                fix='pass e.g. args=["--epochs", "2"]') from None
    odd = [a for a in items if isinstance(a, bool) or not isinstance(a, (str, int, float, os.PathLike))]
    if odd:  # None would reach the script as "None", True as "True"
        raise LaunchConfigError("args", expected="a list of strings (numbers and paths are "
                                "turned into strings)", given=odd[0],
                                fix='pass e.g. args=["--epochs", "2"]; leave out a flag that '
                                    "takes no value")
    arg_list = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in items]
    if backend not in BACKENDS:
        raise LaunchConfigError("backend", expected="'auto', 'gloo' or 'nccl'", given=backend,
                                fix="use backend='auto' to pick nccl on GPUs and gloo on CPU")
    hang = _number("hang_timeout", hang_timeout, allow_none=True, minimum=0.5,
                   fix="pass seconds of silence before a hang is reported, or None to disable")
    wall = _number("timeout", timeout, allow_none=True, minimum=0.1,
                   fix="pass the run's wall-clock limit in seconds, or None for no limit")
    if not whole_number(max_restarts) or max_restarts < 0:
        raise LaunchConfigError("max_restarts", expected="a whole number >= 0", given=max_restarts,
                                fix="pass max_restarts=0 to fail on the first error")
    if env is not None and not (isinstance(env, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise LaunchConfigError("env", expected="a dict of str to str", given=env,
                                fix='pass e.g. env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}')
    for name, value in (env or {}).items():
        if not name or "=" in name or "\0" in name + value:
            raise LaunchConfigError("env", expected="variable names without '=' and values "
                                    "without NUL", given=name,
                                    fix='pass e.g. env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}')
        if name in SET_FOR_EACH_RANK:
            raise LaunchConfigError(
                "env", expected="variables torchrun does not set itself", given=name,
                fix=f"torchrun sets {name} for each rank and would replace it; leave it out "
                    "(nproc and nnodes make the world)")
    if not isinstance(warm, bool):
        raise LaunchConfigError("warm", expected="True or False", given=warm,
                                fix="pass warm=False to start cold, or leave it out")
    multinode = rdzv_endpoint is not None
    min_nodes, max_nodes, agents = check_nnodes(nnodes, local_agents, multinode=multinode)
    endpoint, job, node = check_multinode(rdzv_endpoint, rdzv_id, node_rank, min_nodes, max_nodes)
    check_node_rank_restarts(node, max_restarts)
    faults = check_faults(fault, world_size=nproc * (max_nodes if multinode else agents),
                          max_restarts=max_restarts, local_agents=agents, min_nodes=min_nodes)
    conf = check_rdzv_conf(rdzv_conf)
    path = check_script(script)
    if backend == "nccl":
        gpus, here = gpu_count(), nproc * (1 if multinode else agents)
        if gpus < here:
            given = f"nproc={nproc}" + (f" x local_agents={agents}" if here > nproc else "")
            raise LaunchConfigError(
                "backend", expected=f"{here} GPUs for nccl with {given} on this machine",
                given=f"nccl with {gpus} GPU(s)",
                fix="use backend='gloo' or 'auto', or fewer ranks on this machine than GPUs",
            )
    return LaunchSpec(script=path, nproc=nproc, args=arg_list, backend=backend,
                      hang_timeout=hang or None, timeout=wall, max_restarts=max_restarts,
                      env=dict(env or {}), faults=faults, min_nodes=min_nodes,
                      max_nodes=max_nodes, local_agents=agents, rdzv_conf=conf,
                      rdzv_endpoint=endpoint, rdzv_id=job, node_rank=node, warm=warm)


# What torchrun's agent sets in each rank's environment, over whatever it was given
# (torch.distributed.elastic's LocalElasticAgent).
SET_FOR_EACH_RANK = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE"})


def runs_root(log_dir: str | os.PathLike | None = None) -> Path:
    """Where run folders go: log_dir, else $LABUTILS_RUNS_DIR, else ./runs.

    Args:
        log_dir: launch()'s log_dir.
    """
    return Path(log_dir or os.environ.get(ENV_RUNS_DIR) or "runs")


def new_run_dir(script: Path, log_dir: str | os.PathLike | None, *,
                job: str | None = None) -> Path:
    """A fresh run folder: <runs_root(log_dir)>/<time>-<script>-<id>.

    For a node of a multi-node job, <runs_root(log_dir)>/<job> (job = rdzv_id): every
    node of the job writes there, so a log folder shared between machines gives one
    run folder with every rank. It must not hold an earlier run that has ended.

    Args:
        script: the checked script (its stem names the folder).
        log_dir: launch()'s log_dir (runs_root).
        job: the rdzv_id of a multi-node job, else None.
    """
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise LaunchConfigError("log_dir", expected="a folder (a str or a Path) or None",
                                given=log_dir, fix="pass e.g. log_dir='runs', or leave it out")
    root = runs_root(log_dir)
    if job is not None:
        run_dir = (root / job).resolve()
        _make_folder(run_dir, log_dir, exist_ok=True)
        if any(run_dir.glob("summary*.json")):  # summary-<node>.json: a node has ended
            raise LaunchConfigError(
                "rdzv_id", expected="a job name not used before in this log folder",
                given=job, fix=f"pick a new rdzv_id, or remove {run_dir}")
        return run_dir
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{script.stem}-{uuid.uuid4().hex[:6]}"
    run_dir = (root / name).resolve()
    _make_folder(run_dir, log_dir, exist_ok=False)
    return run_dir


def _make_folder(run_dir: Path, log_dir: str | os.PathLike | None, *, exist_ok: bool) -> None:
    """mkdir the run folder; a log folder that cannot hold it (a file on its path, no
    permission, a read-only disk) is a one-line LaunchConfigError naming where that
    folder came from."""
    why = cannot_write(run_dir.parent)
    if why is None:
        try:
            run_dir.mkdir(exist_ok=exist_ok)
        except OSError as err:
            why = err.strerror or str(err)
    if why is None:
        return
    if log_dir:
        name, fix = "log_dir", "pass a folder this process can write into"
    elif os.environ.get(ENV_RUNS_DIR):
        name, fix = ENV_RUNS_DIR, f"set {ENV_RUNS_DIR} to a folder this process can write into"
    else:
        name, fix = "log_dir", "pass log_dir=, or run from a folder this process can write into"
    raise LaunchConfigError(name, expected="a folder the run's logs can be written into",
                            given=f"{runs_root(log_dir)} ({why})", fix=fix)


def torchrun_command(spec: LaunchSpec, *, port: int, run_id: str, agent: int = 0,
                     warm: bool = False, log_dir: Path | None = None) -> list[str]:
    """One agent's argument list (never a shell string).

    Every agent of a run on this machine gets the same rendezvous endpoint and id;
    agent 0 hosts the rendezvous store (is_host), so the others can come and go. A
    node of a multi-node job passes the job's endpoint and id through: with a node
    rank, torchrun's static rendezvous (node 0 hosts the store at the endpoint);
    without, c10d, where torchrun finds out itself whether the endpoint is this host.

    Args:
        spec: the checked request.
        port: the rendezvous port on this machine (runs on this machine only).
        run_id: the rendezvous id of a run on this machine.
        agent: which of this machine's agents (agent 0 hosts the rendezvous).
        warm: the agent is forked from a warm server (labutils.run.warm): it starts the
            ranks with torchrun's function entry point (--run-path, the worker bootstrap
            run by path) and start method fork instead of a new interpreter each.
        log_dir: torchrun's --log-dir (runfiles.elastic_dir of the run folder); without
            one torchrun makes a torchelastic_* folder in /tmp and leaves it there.
    """
    endpoint, rdzv_id, backend = f"127.0.0.1:{port}", run_id, "c10d"
    node = []
    if spec.multinode:
        # both set for a multi-node job (check_multinode)
        endpoint, rdzv_id = cast(str, spec.rdzv_endpoint), cast(str, spec.rdzv_id)
        if spec.node_rank is not None:
            backend, node = "static", ["--node-rank", str(spec.node_rank)]
    conf = {**ELASTIC_RDZV_CONF, **spec.rdzv_conf} if spec.elastic else dict(spec.rdzv_conf)
    if not spec.multinode:
        # Agent 0 hosts the store on the port its launcher claimed: said, not guessed. When
        # torchrun guesses and cannot bind the port, it joins whatever store listens there
        # as a client: another run's, whose end then ends this one (runtime/procs.py).
        conf["is_host"] = "true" if agent == 0 else "false"
    rdzv = ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())] if conf else []
    return [
        sys.executable, "-m", "labutils.runtime.agent",
        "--nnodes", spec.nnodes,
        *node,
        "--nproc-per-node", str(spec.nproc),
        "--rdzv-backend", backend,
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", rdzv_id,
        *rdzv,
        "--max-restarts", str(spec.max_restarts),
        "--monitor-interval", "0.1",
        *(["--log-dir", str(log_dir)] if log_dir is not None else []),
        *(["--run-path", "--start-method", "fork", WORKER_PATH] if warm
          else ["-m", "labutils.runtime.worker"]),
        str(spec.script), *spec.args,
    ]


@dataclass
class RunRequest:
    """What a run will start, known before anything starts (prepare(...).request).

    commands: each agent's argument list (none with a scheduler: its nodes start them);
    env: the variables the launcher sets on top of the caller's environment;
    run_dir: the run folder, already created;
    start: how the agents will start, "warm" or "cold (why)".
    """

    commands: list[list[str]]
    env: dict[str, str]
    run_dir: Path
    start: str = ""  # "warm", or "cold (why)" (run/warm.py)

    def __str__(self) -> str:
        lines = [f"run folder: {self.run_dir}"] + ([f"start: {self.start}"] if self.start else [])
        lines += [f"agent {i}: {' '.join(c)}" for i, c in enumerate(self.commands)]
        lines += [f"{k}={v}" for k, v in sorted(self.env.items())]
        return "\n".join(lines)
