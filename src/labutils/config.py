"""A launch request, checked before anything starts, and the torchrun command it becomes."""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from labutils.errors import LaunchConfigError, ScriptSyntaxError

MAX_NPROC = 64  # per node; more than this on one machine is a typo, not a plan
BACKENDS = ("auto", "gloo", "nccl")
ENV_RUNS_DIR = "LABUTILS_RUNS_DIR"


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
    nnodes: int = 1
    env: dict[str, str] = field(default_factory=dict)
    fault: dict | None = None  # {"rank": R, "step": S}: SIGKILL rank R when it reports step S

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


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


def check_fault(fault, world_size: int, max_restarts: int) -> dict | None:
    """A fault-injection request as {"rank": R, "step": S}, resolving a random step.

    Accepts {"rank": R, "step": S} or {"rank": R, "step": (lo, hi), "seed": k}: a step
    drawn from lo..hi (inclusive) with that seed, so the run can be repeated.
    """
    if fault is None:
        return None
    fix = 'pass fault={"rank": 1, "step": 5} or {"rank": 1, "step": (3, 8), "seed": 0}'
    if not isinstance(fault, dict) or set(fault) - {"rank", "step", "seed"} or \
            "rank" not in fault or "step" not in fault:
        raise LaunchConfigError("fault", expected="a dict with 'rank' and 'step'", given=fault,
                                fix=fix)
    rank, step = fault["rank"], fault["step"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise LaunchConfigError("fault rank", expected=f"a rank in 0..{world_size - 1}",
                                given=rank, fix=fix)
    if isinstance(step, (tuple, list)) and len(step) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in step) and 0 <= step[0] <= step[1]:
        import random

        step = random.Random(fault.get("seed", 0)).randint(step[0], step[1])
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise LaunchConfigError("fault step", expected="a step >= 0 or a (low, high) range",
                                given=fault["step"], fix=fix)
    if max_restarts < 1:
        raise LaunchConfigError(
            "fault", expected="max_restarts >= 1 so the run can recover", given="max_restarts=0",
            fix="pass max_restarts=1 (or more) together with fault=...",
        )
    return {"rank": rank, "step": step}


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
    fault: dict | None = None,
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
    checked_fault = check_fault(fault, nproc, max_restarts)
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
                      env=dict(env or {}), fault=checked_fault)


def runs_root(log_dir: str | os.PathLike | None = None) -> Path:
    """Where run folders go: log_dir, else $LABUTILS_RUNS_DIR, else ./runs."""
    return Path(log_dir or os.environ.get(ENV_RUNS_DIR) or "runs")


def new_run_dir(script: Path, log_dir: str | os.PathLike | None) -> Path:
    """A fresh run folder: <runs_root(log_dir)>/<time>-<script>-<id>."""
    root = runs_root(log_dir)
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{script.stem}-{uuid.uuid4().hex[:6]}"
    run_dir = (root / name).resolve()
    run_dir.mkdir(parents=True, exist_ok=False)
    return run_dir


def torchrun_command(spec: LaunchSpec, *, port: int, run_id: str) -> list[str]:
    """The agent's argument list (never a shell string)."""
    return [
        sys.executable, "-m", "labutils._agent",
        "--nnodes", str(spec.nnodes),
        "--nproc-per-node", str(spec.nproc),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", run_id,
        "--max-restarts", str(spec.max_restarts),
        "--monitor-interval", "0.1",
        "-m", "labutils.worker", str(spec.script), *spec.args,
    ]
