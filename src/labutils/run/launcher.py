"""launch(): run a script on N ranks with torchrun and own the run's whole lifetime.

This module is the launcher's front: launch() and prepare() check every input
(LaunchConfigError on the first bad one, before anything starts), make the display
and the run folder, and hand over to run/follow.py, which starts the run through
its back end (run/backends.py: torchrun agents here, or a SLURM job), follows it
and builds the RunResult.

A run may have several agents on this machine (launch(nnodes="1:2")), each one a
"node" of the same c10d rendezvous on loopback, all writing into one run folder;
it can also be one node of a job across machines (launch(nnodes=2, node_rank=K,
rdzv_endpoint=..., rdzv_id=...)), one launch() per machine, the nodes meeting in a
shared run folder (run/nodes.py).
"""

from __future__ import annotations

import os
from typing import cast

from labutils.errors import LaunchConfigError
from labutils.run.backends import SCHEDULERS, scheduler_backend
from labutils.run.display import Display, make_display
from labutils.run.follow import Run, last_result
from labutils.run.result import RunResult
from labutils.run.spec import make_spec, new_run_dir

__all__ = ["launch", "prepare", "last_result"]


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
    warm: bool = True,
) -> RunResult:
    """Run ``script`` on ``nproc`` ranks with torchrun and return what happened.

    Each rank's output streams into the cell as it arrives (live panes in
    JupyterLab, ``[rank N] line`` text elsewhere) and is kept complete in the run
    folder. Bad input raises LaunchConfigError before any process starts.

    Args:
        script: the training script, run unchanged in every rank.
        nproc: number of ranks (processes) per agent; with one agent, on this machine.
        args: command-line arguments for the script, a list of strings (numbers and
            paths are turned into strings).
        backend: "auto" (nccl with a GPU per rank, else gloo), "gloo" or "nccl";
            scripts read it through labutils.dist.init().
        hang_timeout: seconds without progress from any rank before the run is
            declared hung, every stack is read and the run is stopped; None: never.
        timeout: wall-clock limit for the whole run in seconds; None: no limit.
        max_restarts: how often torchrun restarts all ranks after a failure.
        log_dir: folder for run folders (default $LABUTILS_RUNS_DIR or ./runs).
        display: "auto", "widgets", "text", "terminal", "none" or a Display.
        env: extra environment variables for the ranks; not those torchrun sets for each
            rank (RANK, WORLD_SIZE, MASTER_ADDR, ...: run/spec.py, SET_FOR_EACH_RANK).
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
            (labutils.run.spec.ELASTIC_RDZV_CONF), e.g. {"last_call_timeout": 5}.
        node_rank, rdzv_endpoint, rdzv_id: make this launch() one node of a job
            across machines, one launch() (or `labutils launch`) per machine, each
            with the same nnodes, nproc, rdzv_endpoint "HOST:PORT" (node 0's
            address) and rdzv_id (the job's name). With node_rank (0..nnodes-1),
            torchrun's static rendezvous: global rank = node_rank * nproc + local
            rank; without, c10d (nnodes may be "MIN:MAX"), which a job with
            max_restarts needs (node_rank with it is refused). The run folder is
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
        warm: fork the run's torchrun agents from this caller's warm server, which
            has imported torch once, and let them fork the ranks (a run in about a
            second instead of several); False starts cold, a new interpreter each.
            Runs where it does not apply start cold by themselves (GPUs, a SLURM
            job's nodes, LABUTILS_START=cold); result.start and .start_reason say
            which and why.

    Returns:
        RunResult. A Ctrl-C or Jupyter interrupt stops every rank, prints the
        summary and re-raises KeyboardInterrupt; last_result() still has the result.
    """
    return prepare(script, nproc, args=args, backend=backend, hang_timeout=hang_timeout,
                   timeout=timeout, max_restarts=max_restarts, log_dir=log_dir, display=display,
                   env=env, fault=fault, nnodes=nnodes, local_agents=local_agents,
                   rdzv_conf=rdzv_conf, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                   rdzv_id=rdzv_id, scheduler=scheduler, slurm=slurm, warm=warm).run()




def prepare(script, nproc: int = 2, *, log_dir=None, display="auto", scheduler=None,
            slurm: dict | None = None, **kwargs) -> Run:
    """launch() up to the moment processes start: every input checked (LaunchConfigError
    on the first bad one), the display made, the run folder created. ``.request`` says
    what will start (each agent's command, the variables set, the run folder: print it);
    ``.run()`` starts it."""
    if scheduler is not None and scheduler not in SCHEDULERS:
        raise LaunchConfigError("scheduler", expected="None (this machine) or 'slurm'",
                                given=scheduler, fix='pass scheduler="slurm" or leave it out')
    if scheduler is None and slurm is not None:
        raise LaunchConfigError("slurm", expected='scheduler="slurm" with it', given=slurm,
                                fix='pass scheduler="slurm", slurm={"partition": ...}')
    spec = make_spec(script, nproc, **kwargs)
    if scheduler is not None:
        scheduler_backend(scheduler).check_request(spec, slurm)
    if spec.multinode:
        from labutils.run.network import check_endpoint_host

        check_endpoint_host(cast(str, spec.rdzv_endpoint))  # set for a multi-node job
    if not isinstance(display, Display):
        display = make_display(display)
    run_dir = new_run_dir(spec.script, log_dir, job=spec.rdzv_id)
    return Run(spec, run_dir, display, scheduler=scheduler, slurm=slurm)


