"""Helpers for training scripts: init(), report(), print0().

They work the same under labutils.launch(), plain torchrun, and a plain
``python script.py`` (a world of one)::

    from labutils.dist import init, report, print0
    rank, world_size, device = init()
    report(step=step, loss=loss.item())   # reaches result.records in the notebook
    print0("only rank 0 prints this")
"""

from __future__ import annotations

import builtins
import math
import os
import time
from typing import Any, cast

from labutils.errors import LaunchConfigError, RecordError
from labutils.runtime import runfiles

__all__ = ["init", "report", "print0", "rank", "world_size", "pick_backend"]


def rank() -> int:
    """This process's global rank (0 outside a distributed run)."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """Number of ranks in the run (1 outside a distributed run)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_slot() -> tuple[int, int]:
    """(this rank's place among the ranks on this machine, how many there are).

    torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE count one agent's ranks; a run of several
    agents on one machine (launch(local_agents=N)) has N agents' ranks sharing its GPUs.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    per_agent = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    index, count = runfiles.local_agent(os.environ)
    return index * per_agent + local_rank, count * per_agent


def pick_backend(backend: str = "auto", *, local_world_size: int | None = None) -> str:
    """The backend to use: nccl when every rank on this machine can have its own GPU,
    else gloo.

    Args:
        backend: "auto", "gloo" or "nccl".
        local_world_size: ranks on this machine; defaults to every local agent's ranks.
    """
    import torch

    if backend not in ("auto", "gloo", "nccl"):
        raise LaunchConfigError(
            "backend", expected="'auto', 'gloo' or 'nccl'", given=backend,
            fix="pass backend='auto' to pick nccl on GPUs and gloo otherwise",
        )
    n_local = local_world_size or local_slot()[1]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= n_local and gpus > 0 and torch.distributed.is_nccl_available() else "gloo"
    if backend == "nccl" and gpus < n_local:
        raise LaunchConfigError(
            "backend", expected=f"at least {n_local} GPUs for nccl", given=f"{gpus} GPUs",
            fix="use backend='gloo' (or 'auto') on this machine",
        )
    return backend


def init(backend: str | None = None, *, timeout_s: float | None = None):
    """Join the process group and pick this rank's device.

    Args:
        backend: "auto" (nccl and a GPU of its own for each rank on this machine when
            there are enough GPUs, else gloo + cpu), "gloo" or "nccl"; None: what
            launch(backend=...) asked for, else "auto".
        timeout_s: collective timeout in seconds; torch's default when None.

    Returns:
        (rank, world_size, device). Calling it again returns the same values.
    """
    import datetime

    import torch
    import torch.distributed as dist

    chosen = pick_backend(backend or os.environ.get(runfiles.ENV_BACKEND) or "auto")
    device = torch.device("cpu")
    if chosen == "nccl":
        device = torch.device("cuda", local_slot()[0])
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": chosen}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        if "MASTER_ADDR" not in os.environ:  # plain `python script.py`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            from labutils.runtime.procs import free_port

            os.environ.setdefault("MASTER_PORT", str(free_port()))
            kwargs.update(rank=0, world_size=1)
        if chosen == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return dist.get_rank(), dist.get_world_size(), device


def _plain(name: str, value: Any) -> Any:
    """value as JSON-ready data, or RecordError."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "tolist") and callable(value.tolist):  # tensors and numpy values
        return _plain(name, value.tolist())
    if isinstance(value, (list, tuple)):
        return [_plain(name, v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(name, v) for k, v in value.items()}
    raise RecordError(name, value)


def report(**values: Any) -> None:
    """Send named values to the notebook; they arrive in result.records with this rank.

    Under plain torchrun (no launcher) the values are printed as one line instead.
    Values may be numbers, strings, bools, None, tensors, numpy values, or lists
    and dicts of those.
    """
    if not values:
        raise LaunchConfigError(
            "report()", expected="at least one name=value", given="nothing",
            fix="call report(step=step, loss=loss.item())",
        )
    plain = {name: _plain(name, v) for name, v in values.items()}
    writer = runfiles.event_writer()
    if writer is None:
        shown = " ".join(f"{k}={v}" for k, v in plain.items())
        builtins.print(f"[report rank {rank()}] {shown}", flush=True)
        return
    writer.write({"kind": "record", "t": time.time(), "rank": rank(), "values": plain})
    _maybe_inject_fault(plain)


def _maybe_inject_fault(values: dict) -> None:
    """Fault injection for launch(fault=...): SIGKILL at the chosen step, from inside it.

    The launcher passes the faults as JSON, each for one restart count. A rank fault
    kills rank R inside its report(step=S) (and phase=P, when the fault names one),
    right after the record is written, so the kill happens exactly there. An agent
    fault kills agent A (its torchrun process, and with it, through the parent-death
    signal, every rank it runs) when one of A's ranks reports step S: done here,
    inside the step, because the launcher reads records later than they are written,
    by which time a fast script may have finished. Each fault fires in its own
    attempt only, so the restarted run can get past that step.
    """
    spec = os.environ.get(runfiles.ENV_FAULT)
    if not spec or values.get("step") is None:
        return
    import json
    import signal
    import sys

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent = int(os.environ.get(runfiles.ENV_AGENT_INDEX, "0"))
    for fault in json.loads(spec):
        if fault.get("restart", 0) != restart or fault["step"] != values["step"] \
                or fault.get("phase") != values.get("phase"):
            continue
        if "agent" in fault and fault["agent"] == agent:
            writer = cast(runfiles.EventWriter, runfiles.event_writer())  # the launcher's run
            writer.write({"kind": "fault", "t": time.time(), "agent": agent,
                          "step": fault["step"], "restart": restart})
            agent_pid = os.environ.get(runfiles.ENV_AGENT_PID)
            if agent_pid:
                os.kill(int(agent_pid), signal.SIGKILL)
        elif fault.get("rank") != rank():
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def link_bytes() -> dict[str, int] | None:
    """Bytes sent and received so far through this host's link, when the rank runs on
    a virtual cluster (labutils.cluster names the link in LABUTILS_LINK); None
    elsewhere. /proc/net/dev lists the interfaces of the rank's own network namespace,
    i.e. of its host. Differences of two readings are what crossed the wire between."""
    name = os.environ.get(runfiles.ENV_LINK)
    if not name:
        return None
    with open("/proc/net/dev") as f:
        for line in f.read().splitlines()[2:]:
            interface, _, counters = line.partition(":")
            if interface.strip() == name:
                fields = counters.split()
                return {"received": int(fields[0]), "sent": int(fields[8])}
    raise RuntimeError(f"{runfiles.ENV_LINK}={name}, but this rank's network has no such interface")


def print0(*args: Any, **kwargs: Any) -> None:
    """print() on rank 0 only; other ranks stay quiet."""
    if rank() == 0:
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)
