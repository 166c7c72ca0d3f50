"""A launch request, checked before anything starts, and the torchrun command it becomes."""

from __future__ import annotations

import os
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from labutils.errors import LaunchConfigError, ScriptSyntaxError

MAX_NPROC = 64  # per node; more than this on one machine is a typo, not a plan
MAX_LOCAL_AGENTS = 8  # agents ("nodes") simulated on one machine
MAX_NODES = 1024  # machines in one multi-node job
BACKENDS = ("auto", "gloo", "nccl")
ENV_RUNS_DIR = "LABUTILS_RUNS_DIR"
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


def public_fault(fault: dict) -> dict:
    """A checked fault without the launcher's bookkeeping (what result.attempts shows)."""
    return {k: v for k, v in fault.items() if k != "restart"}


def _number(name: str, value, *, allow_none: bool, minimum: float, fix: str) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum \
            or value != value:
        expected = f"a number >= {minimum}" + (" or None" if allow_none else "")
        raise LaunchConfigError(name, expected=expected, given=value, fix=fix)
    return float(value)


def check_script(script: str | os.PathLike) -> Path:
    """The script as an absolute path, or a one-line error (missing, not .py, bad syntax)."""
    if not isinstance(script, (str, os.PathLike)) or not str(script):
        raise LaunchConfigError("script", expected="a path to a .py file", given=script,
                                fix='pass the training script, e.g. launch("train.py", nproc=2)')
    path = Path(script).expanduser()
    if not path.exists():
        raise LaunchConfigError(
            "script", expected="an existing file", given=str(script),
            fix=f"check the name; the current folder is {os.getcwd()}",
        )
    if not path.is_file() or path.suffix != ".py":
        raise LaunchConfigError(
            "script", expected="a Python file ending in .py", given=str(script),
            fix="pass the .py file that each rank should run",
        )
    source = path.read_bytes()
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise ScriptSyntaxError(str(script), exc.lineno, exc.msg) from None
    except ValueError as exc:  # null bytes
        raise ScriptSyntaxError(str(script), None, str(exc)) from None
    return path.resolve()


_FAULT_FIX = ('pass fault={"rank": 1, "step": 5}, {"rank": 1, "step": (3, 8), "seed": 0}, '
              '{"agent": 1, "step": 5} or a list of such dicts, one per attempt')


def _fault_step(fault: dict):
    step = fault["step"]
    if isinstance(step, (tuple, list)) and len(step) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in step) and 0 <= step[0] <= step[1]:
        import random

        step = random.Random(fault.get("seed", 0)).randint(step[0], step[1])
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise LaunchConfigError("fault step", expected="a step >= 0 or a (low, high) range",
                                given=fault["step"], fix=_FAULT_FIX)
    return step


def _one_fault(fault, world_size: int, local_agents: int, min_nodes: int) -> dict:
    """One fault as {"rank": R, "step": S[, "phase": P]} or {"agent": A, "step": S}."""
    keys = set(fault) if isinstance(fault, dict) else set()
    if not isinstance(fault, dict) or "step" not in fault or \
            len(keys & {"rank", "agent"}) != 1 or keys - {"rank", "agent", "step", "seed", "phase"}:
        raise LaunchConfigError("fault", expected="a dict with 'rank' and 'step' (or 'agent' and 'step')",
                                given=fault, fix=_FAULT_FIX)
    if "agent" in fault:
        agent = fault["agent"]
        if local_agents < 2:
            raise LaunchConfigError(
                "fault agent", expected="a run with several agents", given=f"local_agents={local_agents}",
                fix='pass e.g. nnodes="1:2", local_agents=2 to have an agent that can leave')
        if isinstance(agent, bool) or not isinstance(agent, int) or not 1 <= agent < local_agents:
            raise LaunchConfigError(
                "fault agent", expected=f"an agent in 1..{local_agents - 1} (agent 0 hosts the "
                "rendezvous: without it no agent can meet again)", given=agent, fix=_FAULT_FIX)
        if local_agents - 1 < min_nodes:
            raise LaunchConfigError(
                "fault agent", expected=f"nnodes MIN <= {local_agents - 1} so the agents left "
                "can carry on", given=f"MIN={min_nodes}",
                fix=f'pass nnodes="{local_agents - 1}:{local_agents}"')
        if "phase" in fault:
            raise LaunchConfigError("fault", expected="no 'phase' for an agent fault",
                                    given=fault, fix=_FAULT_FIX)
        return {"agent": agent, "step": _fault_step(fault)}
    rank = fault["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise LaunchConfigError("fault rank", expected=f"a rank in 0..{world_size - 1}",
                                given=rank, fix=_FAULT_FIX)
    checked = {"rank": rank, "step": _fault_step(fault)}
    if "phase" in fault:
        if not isinstance(fault["phase"], str) or not fault["phase"]:
            raise LaunchConfigError("fault phase", expected="a non-empty string", given=fault["phase"],
                                    fix='pass e.g. "phase": "save" to match report(step=S, phase="save")')
        checked["phase"] = fault["phase"]
    return checked


def check_faults(fault, *, world_size: int, max_restarts: int, local_agents: int = 1,
                 min_nodes: int = 1) -> list[dict]:
    """Fault-injection requests as a list of checked faults, the k-th for restart k.

    Accepts one fault (for the first attempt) or a list of faults, one per attempt:

    - {"rank": R, "step": S}: SIGKILL rank R inside its report(step=S);
    - {"rank": R, "step": (lo, hi), "seed": k}: a step drawn from lo..hi (inclusive)
      with that seed, so the run can be repeated;
    - "phase": P added to a rank fault matches only report(step=S, phase=P), e.g. a
      report made in the middle of writing a checkpoint;
    - {"agent": A, "step": S}: stop agent A and its ranks (SIGKILL, as when a machine
      dies) the moment one of A's ranks reports step S; needs several agents.

    Each entry of a list is for one attempt: the k-th fires when torchrun's restart
    count (TORCHELASTIC_RESTART_COUNT) is k. Every fault needs a restart to recover
    from, so max_restarts must be at least the number of faults.
    """
    if fault is None:
        return []
    faults = list(fault) if isinstance(fault, (list, tuple)) else [fault]
    if not faults:
        raise LaunchConfigError("fault", expected="a fault dict or a non-empty list of them",
                                given=fault, fix=_FAULT_FIX)
    checked = [{"restart": k, **_one_fault(f, world_size, local_agents, min_nodes)}
               for k, f in enumerate(faults)]
    if max_restarts < len(checked):
        raise LaunchConfigError(
            "fault", expected=f"max_restarts >= {len(checked)} so the run can recover",
            given=f"max_restarts={max_restarts}",
            fix=f"pass max_restarts={len(checked)} (or more) together with fault=...",
        )
    return checked


def check_fault(fault, world_size: int, max_restarts: int) -> dict | None:
    """One fault-injection request for the first attempt, checked (see check_faults)."""
    if fault is None:
        return None
    if isinstance(fault, (list, tuple)):
        raise LaunchConfigError("fault", expected="one fault dict", given=fault, fix=_FAULT_FIX)
    return public_fault(check_faults(fault, world_size=world_size, max_restarts=max_restarts)[0])


def check_nnodes(nnodes, local_agents, *, multinode: bool = False) -> tuple[int, int, int]:
    """(min_nodes, max_nodes, local_agents) from nnodes ("N", N or "MIN:MAX") and local_agents.

    Without a rendezvous endpoint every node of a launch() runs on this machine:
    local_agents agents (default: MAX) join one rendezvous on loopback, so
    MIN <= local_agents <= MAX. With one (multinode), this machine is one node.
    """
    fix = 'pass nnodes=1, nnodes=2 or nnodes="1:2" (MIN:MAX agents, each with nproc ranks)'
    lo = hi = None
    if isinstance(nnodes, int) and not isinstance(nnodes, bool):
        lo = hi = nnodes
    elif isinstance(nnodes, str):
        parts = nnodes.split(":")
        if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
            lo, hi = int(parts[0]), int(parts[-1])
    if lo is None or lo < 1 or hi < lo:
        raise LaunchConfigError("nnodes", expected="N >= 1 or 'MIN:MAX' with 1 <= MIN <= MAX",
                                given=nnodes, fix=fix)
    if multinode:
        if hi > MAX_NODES:
            raise LaunchConfigError("nnodes", expected=f"at most {MAX_NODES} nodes", given=nnodes,
                                    fix=fix)
        if local_agents not in (None, 1):
            raise LaunchConfigError(
                "local_agents", expected="one agent per machine in a multi-node job",
                given=local_agents, fix="leave local_agents out and start one launch per node")
        return lo, hi, 1
    if hi > MAX_LOCAL_AGENTS:
        raise LaunchConfigError("nnodes", expected=f"at most {MAX_LOCAL_AGENTS} nodes on one machine",
                                given=nnodes, fix=fix)
    agents = hi if local_agents is None else local_agents
    if isinstance(agents, bool) or not isinstance(agents, int) or not lo <= agents <= hi:
        raise LaunchConfigError(
            "local_agents", expected=f"a whole number of agents in {lo}..{hi} (nnodes {nnodes})",
            given=local_agents,
            fix="leave it out to start MAX agents, or pass a count between MIN and MAX")
    return lo, hi, agents


_RDZV_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_MULTINODE_FIX = ('pass e.g. nnodes=2, node_rank=0, rdzv_endpoint="10.0.0.1:29500", '
                  'rdzv_id="job1" on node 0 and node_rank=1 on node 1')


def check_multinode(rdzv_endpoint, rdzv_id, node_rank, min_nodes: int, max_nodes: int):
    """(endpoint, id, node_rank) of a job across machines, or (None, None, None).

    rdzv_endpoint "HOST:PORT" is where the nodes meet: node 0's address when node
    ranks are given (torchrun's static rendezvous: global rank = node_rank * nproc +
    local rank), else the host of a c10d rendezvous (ranks assigned as nodes join,
    MIN:MAX nodes allowed). rdzv_id names the job on every node, and names the run
    folder, so nodes that share the log folder (NFS, a SLURM cluster's home) write
    one run folder that every node's launcher follows.
    """
    if rdzv_endpoint is None:
        for name, value in (("node_rank", node_rank), ("rdzv_id", rdzv_id)):
            if value is not None:
                raise LaunchConfigError(name, expected="rdzv_endpoint with it (a multi-node job)",
                                        given=value, fix=_MULTINODE_FIX)
        return None, None, None
    host, sep, port = str(rdzv_endpoint).rpartition(":")
    if not isinstance(rdzv_endpoint, str) or not sep or not host or not port.isdigit() \
            or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
        raise LaunchConfigError("rdzv_endpoint", expected="'HOST:PORT' with a port in 1..65535",
                                given=rdzv_endpoint, fix=_MULTINODE_FIX)
    if not isinstance(rdzv_id, str) or not _RDZV_ID.fullmatch(rdzv_id):
        raise LaunchConfigError(
            "rdzv_id", expected="the job's name on every node: letters, digits, '.', '_', '-'",
            given=rdzv_id, fix=_MULTINODE_FIX)
    if node_rank is not None:
        if isinstance(node_rank, bool) or not isinstance(node_rank, int) \
                or not 0 <= node_rank < max_nodes:
            raise LaunchConfigError("node_rank", expected=f"a node rank in 0..{max_nodes - 1}",
                                    given=node_rank, fix=_MULTINODE_FIX)
        if min_nodes != max_nodes:
            raise LaunchConfigError(
                "nnodes", expected="a fixed node count N with node_rank (static rendezvous)",
                given=f"{min_nodes}:{max_nodes}",
                fix="pass nnodes=N with node ranks, or leave node_rank out for MIN:MAX (c10d)")
    return rdzv_endpoint, rdzv_id, node_rank


def check_rdzv_conf(rdzv_conf) -> dict[str, str]:
    """Rendezvous settings (torchrun --rdzv-conf), as strings; None: none."""
    if rdzv_conf is None:
        return {}
    if not isinstance(rdzv_conf, dict) or not all(
            isinstance(k, str) and k.isidentifier() and isinstance(v, (str, int, float))
            and not isinstance(v, bool) for k, v in rdzv_conf.items()):
        raise LaunchConfigError(
            "rdzv_conf", expected="a dict of setting name to number or string",
            given=rdzv_conf, fix='pass e.g. rdzv_conf={"last_call_timeout": 5}')
    return {k: str(v) for k, v in rdzv_conf.items()}


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
) -> LaunchSpec:
    """Check every input; raise LaunchConfigError with a one-line fix on the first bad one."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
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
        arg_list = [str(a) for a in args]
    except TypeError:
        raise LaunchConfigError("args", expected="a list of strings", given=args,
                                fix='pass e.g. args=["--epochs", "2"]') from None
    if backend not in BACKENDS:
        raise LaunchConfigError("backend", expected="'auto', 'gloo' or 'nccl'", given=backend,
                                fix="use backend='auto' to pick nccl on GPUs and gloo on CPU")
    hang = _number("hang_timeout", hang_timeout, allow_none=True, minimum=0.5,
                   fix="pass seconds of silence before a hang is reported, or None to disable")
    wall = _number("timeout", timeout, allow_none=True, minimum=0.1,
                   fix="pass the run's wall-clock limit in seconds, or None for no limit")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise LaunchConfigError("max_restarts", expected="a whole number >= 0", given=max_restarts,
                                fix="pass max_restarts=0 to fail on the first error")
    if env is not None and not (isinstance(env, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise LaunchConfigError("env", expected="a dict of str to str", given=env,
                                fix='pass e.g. env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}')
    multinode = rdzv_endpoint is not None
    min_nodes, max_nodes, agents = check_nnodes(nnodes, local_agents, multinode=multinode)
    endpoint, job, node = check_multinode(rdzv_endpoint, rdzv_id, node_rank, min_nodes, max_nodes)
    faults = check_faults(fault, world_size=nproc * (max_nodes if multinode else agents),
                          max_restarts=max_restarts, local_agents=agents, min_nodes=min_nodes)
    conf = check_rdzv_conf(rdzv_conf)
    path = check_script(script)
    if backend == "nccl":
        gpus = gpu_count()
        if gpus < nproc:
            raise LaunchConfigError(
                "backend", expected=f"{nproc} GPUs for nccl with nproc={nproc}",
                given=f"nccl with {gpus} GPU(s)",
                fix="use backend='gloo' or 'auto', or lower nproc to the number of GPUs",
            )
    return LaunchSpec(script=path, nproc=nproc, args=arg_list, backend=backend,
                      hang_timeout=hang or None, timeout=wall, max_restarts=max_restarts,
                      env=dict(env or {}), faults=faults, min_nodes=min_nodes,
                      max_nodes=max_nodes, local_agents=agents, rdzv_conf=conf,
                      rdzv_endpoint=endpoint, rdzv_id=job, node_rank=node)


def runs_root(log_dir: str | os.PathLike | None = None) -> Path:
    """Where run folders go: log_dir, else $LABUTILS_RUNS_DIR, else ./runs."""
    return Path(log_dir or os.environ.get(ENV_RUNS_DIR) or "runs")


def new_run_dir(script: Path, log_dir: str | os.PathLike | None, *,
                job: str | None = None) -> Path:
    """A fresh run folder: <runs_root(log_dir)>/<time>-<script>-<id>.

    For a node of a multi-node job, <runs_root(log_dir)>/<job> (job = rdzv_id): every
    node of the job writes there, so a log folder shared between machines gives one
    run folder with every rank. It must not hold an earlier run that has ended.
    """
    root = runs_root(log_dir)
    if job is not None:
        run_dir = (root / job).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        if any(run_dir.glob("summary*.json")):  # summary-<node>.json: a node has ended
            raise LaunchConfigError(
                "rdzv_id", expected="a job name not used before in this log folder",
                given=job, fix=f"pick a new rdzv_id, or remove {run_dir}")
        return run_dir
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{script.stem}-{uuid.uuid4().hex[:6]}"
    run_dir = (root / name).resolve()
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def torchrun_command(spec: LaunchSpec, *, port: int, run_id: str, agent: int = 0) -> list[str]:
    """One agent's argument list (never a shell string).

    Every agent of a run on this machine gets the same rendezvous endpoint and id;
    agent 0 hosts the rendezvous store (is_host), so the others can come and go. A
    node of a multi-node job passes the job's endpoint and id through: with a node
    rank, torchrun's static rendezvous (node 0 hosts the store at the endpoint);
    without, c10d, where torchrun finds out itself whether the endpoint is this host.
    """
    endpoint, rdzv_id, backend = f"127.0.0.1:{port}", run_id, "c10d"
    node = []
    if spec.multinode:
        endpoint, rdzv_id = spec.rdzv_endpoint, spec.rdzv_id
        if spec.node_rank is not None:
            backend, node = "static", ["--node-rank", str(spec.node_rank)]
    rdzv = []
    if spec.elastic:
        conf = {**ELASTIC_RDZV_CONF, **spec.rdzv_conf}
        if not spec.multinode:
            conf["is_host"] = "true" if agent == 0 else "false"
        rdzv = ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())]
    elif spec.rdzv_conf:
        rdzv = ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in spec.rdzv_conf.items())]
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
        "-m", "labutils.runtime.worker", str(spec.script), *spec.args,
    ]
