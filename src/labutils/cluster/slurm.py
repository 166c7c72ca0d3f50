"""SLURM: write the sbatch script of a multi-node torchrun job, submit it, follow it, cancel it.

The script takes the rendezvous from SLURM's environment: the first node of the
allocation hosts torchrun's c10d store, one srun task per node runs one torchrun agent,
the job id is the rendezvous id, and each node's index ($SLURM_NODEID) is there as its
node rank for commands that want one::

    from labutils.cluster.slurm import SlurmJob, sbatch_script
    text = sbatch_script("train.py", nnodes=2, nproc_per_node=4, args=["--epochs", "2"])
    job = SlurmJob.submit(text, workdir=".")
    job.wait(timeout=600)            # "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", ...
    job.exit_code(), job.output_path

What each node runs is a function of the per-node values (NodeValues -> words):
torchrun_node_command by default; labutils' own launcher passes its own.

Exit codes without accounting (no slurmdbd): `scontrol show job` keeps a finished job,
its JobState and ExitCode, for MinJobAge seconds (300 by default); after that, sacct
answers where accounting runs. The command line is `labutils slurm` (add_subcommand).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from labutils.errors import InputError, LabutilsError

#: States in which a job is still in the queue (it holds or waits for nodes).
ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING",
    "RESIZING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STAGE_OUT",
})
_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_SHELL_REF = re.compile(r"^[A-Za-z0-9_${}:.-]+$")


class SlurmError(LabutilsError):
    """A SLURM command failed or did not answer; carries the command, status and stderr."""

    def __init__(self, message: str, *, command: Sequence[str] | None = None,
                 returncode: int | None = None, stderr: str = "") -> None:
        self.command = list(command) if command else None
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(message)


# --- the sbatch script --------------------------------------------------------------------

@dataclass(frozen=True)
class ShellRef:
    """A value the shell of each node expands when its task starts, e.g. "$SLURM_NODEID".

    Written in double quotes in the script; literal words are single-quoted as needed.
    """

    text: str

    def __post_init__(self) -> None:
        if not _SHELL_REF.match(self.text):
            raise InputError("ShellRef", expected="variables, letters, digits and :.-_",
                             given=self.text, fix="keep literal text in plain str words")


@dataclass(frozen=True)
class NodeValues:
    """What the command run on each node may use (the ShellRef ones differ per job or node)."""

    script: str
    args: tuple[str, ...]
    nproc_per_node: int
    python: str
    run_dir: str | None
    rdzv_endpoint: ShellRef
    nnodes: ShellRef = ShellRef("$SLURM_NNODES")
    node_rank: ShellRef = ShellRef("$SLURM_NODEID")
    rdzv_id: ShellRef = ShellRef("$SLURM_JOB_ID")


NodeCommand = Callable[[NodeValues], Sequence["str | ShellRef"]]


def torchrun_node_command(node: NodeValues) -> list[str | ShellRef]:
    """Plain torchrun on one node: its agent joins the c10d rendezvous at the head node.

    No --node-rank: with the c10d backend torchrun numbers the nodes itself as they join
    (it would warn that it ignores one); node.node_rank is there for commands that use it.

    Args:
        node: the per-node values; nnodes, endpoint and id come from SLURM.
    """
    return [node.python, "-m", "torch.distributed.run",
            "--nnodes", node.nnodes, "--nproc-per-node", str(node.nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", node.rdzv_endpoint,
            "--rdzv-id", node.rdzv_id,
            node.script, *node.args]


def _shell_words(words: Sequence[str | ShellRef]) -> str:
    """One command line: literals quoted for the shell, ShellRefs left to expand;
    a new line before each --option, so the script reads one option per line."""
    lines: list[list[str]] = [[]]
    for word in words:
        if isinstance(word, ShellRef):
            lines[-1].append(f'"{word.text}"')
            continue
        if word.startswith("--") and lines[-1]:
            lines.append([])
        lines[-1].append(shlex.quote(word))
    return " \\\n        ".join(" ".join(line) for line in lines)


def srun_command(node_command: Sequence[str | ShellRef], *, gpus_per_node: int | None = None) -> str:
    """The srun line of the batch script: one task per node runs node_command.

    Args:
        node_command: the words each node runs; ShellRef words are expanded on the node.
        gpus_per_node: passed on to srun too, so the step gets the job's GPUs.
    """
    if not node_command:
        raise InputError("node_command", expected="a non-empty list of words", given=node_command,
                         fix="return e.g. torchrun_node_command(node) from the node command")
    gpus = f" --gpus-per-node={gpus_per_node}" if gpus_per_node else ""
    inner = "exec " + _shell_words(node_command)
    return ("exec srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 "
            f"--cpus-per-task=\"$SLURM_CPUS_PER_TASK\"{gpus} \\\n"
            "    --kill-on-bad-exit=1 --label \\\n"
            f"    bash -c {shlex.quote(inner)}\n")


def _positive(name: str, value: object, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(name, expected="an integer >= 1", given=value, fix=f"pass e.g. {flag}=2")
    return value


def _one_line(name: str, value: str, fix: str) -> str:
    if not isinstance(value, str) or not value or any(c in value for c in "\n\r"):
        raise InputError(name, expected="one non-empty line", given=value, fix=fix)
    return value


def sbatch_script(
    script: str,
    *,
    nnodes: int,
    nproc_per_node: int,
    args: Sequence[str] = (),
    job_name: str = "torchrun",
    partition: str | None = None,
    time_limit: str = "00:30:00",
    cpus_per_task: int | None = None,
    gpus_per_node: int | None = None,
    output: str = "slurm-%j.out",
    run_dir: str | Path | None = None,
    rdzv_port: int = 29500,
    python: str = "python",
    node_command: NodeCommand = torchrun_node_command,
) -> str:
    """The text of an sbatch script that runs SCRIPT on nnodes x nproc_per_node ranks.

    Args:
        script: the training script, as the nodes see it (relative to run_dir, or absolute).
        nnodes: machines (#SBATCH --nodes); one torchrun agent runs on each.
        nproc_per_node: ranks per machine (torchrun --nproc-per-node).
        args: the script's own arguments.
        job_name: what squeue shows (letters, digits, _.+-).
        partition: the SLURM partition; None: the cluster's default.
        time_limit: SLURM's wall-clock limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
        cpus_per_task: CPUs per node for the agent and its ranks; None: nproc_per_node.
        gpus_per_node: GPUs per node (#SBATCH --gpus-per-node), for nccl; at least
            nproc_per_node, one GPU per rank. None: no GPU requested.
        output: where stdout and stderr of every node go; %j is the job id, %x its name;
            relative to run_dir.
        run_dir: the job's working folder (#SBATCH --chdir); None: where sbatch runs.
        rdzv_port: the port of the c10d store on the head node.
        python: the interpreter on the nodes.
        node_command: builds the words each node runs from NodeValues.
    """
    if not isinstance(script, str) or not script.endswith(".py"):
        raise InputError("script", expected="a Python file name ending in .py", given=script,
                         fix="pass the training script, e.g. 'train.py'")
    _positive("nnodes", nnodes, "nnodes")
    _positive("nproc_per_node", nproc_per_node, "nproc_per_node")
    if cpus_per_task is None:
        cpus_per_task = nproc_per_node
    _positive("cpus_per_task", cpus_per_task, "cpus_per_task")
    if gpus_per_node is not None:
        _positive("gpus_per_node", gpus_per_node, "gpus_per_node")
        if gpus_per_node < nproc_per_node:
            raise InputError("gpus_per_node", expected=f"at least nproc_per_node={nproc_per_node} "
                             "(nccl: one GPU per rank)", given=gpus_per_node,
                             fix=f"pass gpus_per_node={nproc_per_node} or fewer ranks per node")
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise InputError("args", expected="a list of strings", given=args,
                         fix="pass e.g. args=['--epochs', '2']")
    if not isinstance(job_name, str) or not _NAME.match(job_name):
        raise InputError("job_name", expected="letters, digits and _.+-", given=job_name,
                         fix="pass e.g. job_name='ddp-train'")
    if partition is not None and (not isinstance(partition, str) or not _NAME.match(partition)):
        raise InputError("partition", expected="a partition name (sinfo lists them)",
                         given=partition, fix="pass e.g. partition='gpu', or None for the default")
    if not isinstance(time_limit, str) or not _TIME.match(time_limit):
        raise InputError("time_limit", expected="MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS",
                         given=time_limit, fix="pass e.g. time_limit='00:30:00'")
    _one_line("output", output, "pass e.g. output='slurm-%j.out'")
    if isinstance(rdzv_port, bool) or not isinstance(rdzv_port, int) or not 1 <= rdzv_port <= 65535:
        raise InputError("rdzv_port", expected="a TCP port 1..65535", given=rdzv_port,
                         fix="pass e.g. rdzv_port=29500")
    _one_line("python", python, "pass e.g. python='python'")
    if run_dir is not None:
        run_dir = _one_line("run_dir", str(run_dir), "pass a folder the nodes can reach")

    node = NodeValues(script=script, args=tuple(args), nproc_per_node=nproc_per_node,
                      python=python, run_dir=run_dir,
                      rdzv_endpoint=ShellRef(f"$head_addr:{rdzv_port}"))
    directives = [
        f"--job-name={job_name}",
        f"--nodes={nnodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus_per_task}",
        *([f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []),
        *([f"--partition={partition}"] if partition else []),
        f"--time={time_limit}",
        f"--output={output}",
        *([f"--chdir={run_dir}"] if run_dir else []),
    ]
    sbatch_lines = "".join(f"#SBATCH {d}\n" for d in directives)
    return f"""\
#!/bin/bash
# {nnodes} node(s) x {nproc_per_node} rank(s) of {script}, written by labutils.cluster.slurm.
#   submit: sbatch THIS_FILE    follow: squeue --me; tail -f {output.replace('%j', 'JOBID')}
#   stop:   scancel JOBID (every node's agent and ranks get SIGTERM, then SIGKILL)
# One task per node: a torchrun agent that starts the node's ranks, with the CPUs for them.
{sbatch_lines}set -euo pipefail

# Rendezvous: the first node of the allocation hosts torchrun's c10d store,
# at its address as SLURM knows it (NodeAddr), in case node names do not resolve.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
head_addr=$(scontrol -o show node "$head_node" | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')
export head_addr=${{head_addr:-$head_node}}
echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s) $SLURM_JOB_NODELIST, rendezvous $head_addr:{rdzv_port}"

# exec srun: srun replaces this shell, so scancel's signals reach it directly.
# One task per node; --cpus-per-task is repeated because srun (SLURM 22.05) does not
# inherit it. --kill-on-bad-exit=1: a node that fails ends the others, no rank waits
# forever. --label: every output line starts with its node's index.
# bash -c '...': $SLURM_NODEID and friends are expanded on each node, then exec lets
# the command replace bash, so SLURM's signals reach it.
{srun_command(node_command(node), gpus_per_node=gpus_per_node)}"""


# --- the job ------------------------------------------------------------------------------

def _require(tool: str) -> None:
    if shutil.which(tool) is None:
        raise SlurmError(f"{tool} not found on PATH: SLURM's client commands are not installed "
                         "here (Debian: slurm-client; on a cluster, use a login node)")


def _run(command: list[str], *, timeout: float, stdin: str | None = None,
         cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run a SLURM command; a missing tool or no answer becomes a one-line SlurmError."""
    _require(command[0])
    try:
        return subprocess.run(command, input=stdin, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{shlex.join(command)} did not answer within {timeout:g} s: is "
                         "slurmctld up, and slurm.conf found (SLURM_CONF)?", command=command) from None


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def check_cluster(*, timeout: float = 10.0) -> None:
    """Raise SlurmError (one line) unless SLURM's controller answers `scontrol ping`."""
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        raise SlurmError(f"SLURM_CONF={conf} does not exist: point it at the cluster's "
                         "slurm.conf, or unset it to use /etc/slurm/slurm.conf")
    done = _run(["scontrol", "ping"], timeout=timeout)
    if done.returncode != 0:
        raise SlurmError(f"the SLURM cluster does not answer: "
                         f"{_first_line(done.stdout) or _first_line(done.stderr)} "
                         f"(is slurmctld running? SLURM_CONF={conf or 'unset'})",
                         command=["scontrol", "ping"], returncode=done.returncode,
                         stderr=done.stderr)


def _fields(record: str) -> dict[str, str]:
    """KEY=VALUE pairs of one `scontrol show job -o` line (values have no spaces we read)."""
    return dict(item.split("=", 1) for item in record.split() if "=" in item)


def _exit_status(text: str) -> int:
    """SLURM's ExitCode 'code:signal' as a shell reports it: code, or 128+signal."""
    code, _, sig = text.partition(":")
    return 128 + int(sig) if sig and int(sig) else int(code)


class SlurmJob:
    """One submitted SLURM job: its state, exit code, output file, and how to cancel it."""

    def __init__(self, job_id: str, *, timeout: float = 10.0) -> None:
        """Follow an existing job.

        Args:
            job_id: what sbatch printed.
            timeout: seconds each SLURM command may take.
        """
        if not str(job_id).isdigit():
            raise InputError("job_id", expected="a number, as sbatch prints it", given=job_id,
                             fix="pass the id from `sbatch --parsable` or squeue")
        self.job_id = str(job_id)
        self.timeout = timeout
        self._output: Path | None = None

    def __repr__(self) -> str:
        return f"SlurmJob({self.job_id})"

    @classmethod
    def submit(cls, script_text: str, workdir: str | Path, *, timeout: float = 30.0) -> SlurmJob:
        """Submit a batch script with `sbatch --parsable` from workdir; return the job.

        Args:
            script_text: the batch script (sbatch_script's text, or any '#!' script).
            workdir: where sbatch runs: the job's working folder unless --chdir says else.
            timeout: seconds sbatch may take.
        """
        if not isinstance(script_text, str) or not script_text.startswith("#!"):
            raise InputError("script_text", expected="a batch script starting with '#!'",
                             given=(script_text or "")[:40] if isinstance(script_text, str)
                             else script_text, fix="pass sbatch_script(...)'s text")
        if not Path(workdir).is_dir():
            raise InputError("workdir", expected="an existing folder", given=str(workdir),
                             fix="create it first, or pass the run folder")
        _require("sbatch")
        check_cluster(timeout=min(timeout, 10.0))
        command = ["sbatch", "--parsable"]
        done = _run(command, timeout=timeout, stdin=script_text, cwd=workdir)
        job_id = done.stdout.strip().split(";")[0]
        if done.returncode != 0 or not job_id.isdigit():
            raise SlurmError(f"sbatch refused the job: {_first_line(done.stderr) or done.stdout}",
                             command=command, returncode=done.returncode, stderr=done.stderr)
        return cls(job_id)

    def _scontrol(self) -> dict[str, str] | None:
        """The job's record from slurmctld, or None once it forgot the job (MinJobAge)."""
        done = _run(["scontrol", "-o", "show", "job", self.job_id], timeout=self.timeout)
        if done.returncode == 0 and "JobId=" in done.stdout:
            return _fields(done.stdout)
        if "Invalid job id" in done.stderr:
            return None
        raise SlurmError(f"scontrol show job {self.job_id} failed: {_first_line(done.stderr)}",
                         command=["scontrol"], returncode=done.returncode, stderr=done.stderr)

    def _sacct(self) -> tuple[str, str] | None:
        """(state, exit code) from accounting, where the cluster has it."""
        if shutil.which("sacct") is None:
            return None
        done = _run(["sacct", "-n", "-X", "-P", "-j", self.job_id, "-o", "State,ExitCode"],
                    timeout=self.timeout)
        line = _first_line(done.stdout) if done.returncode == 0 else ""
        if "|" not in line:
            return None
        state, exit_code = line.split("|", 1)
        return state.split()[0], exit_code  # "CANCELLED by 0" -> CANCELLED

    def state(self) -> str:
        """PENDING, RUNNING, COMPLETING, then COMPLETED, FAILED, CANCELLED, TIMEOUT, ...

        squeue while the job is queued, then `scontrol show job` (kept MinJobAge seconds),
        then sacct; SlurmError when none of them knows the job.
        """
        done = _run(["squeue", "-h", "-j", self.job_id, "-o", "%T"], timeout=self.timeout)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.split()[0]
        if done.returncode != 0 and "Invalid job id" not in done.stderr:
            raise SlurmError(f"squeue failed: {_first_line(done.stderr)}", command=["squeue"],
                             returncode=done.returncode, stderr=done.stderr)
        record = self._scontrol()
        if record is not None:
            return record["JobState"]
        accounted = self._sacct()
        if accounted is not None:
            return accounted[0]
        raise SlurmError(f"job {self.job_id} is unknown to squeue, scontrol and sacct "
                         "(finished longer ago than MinJobAge, and no accounting?)")

    def alive(self) -> bool:
        """True while the job is in the queue (pending, running or completing)."""
        return self.state() in ACTIVE_STATES

    def exit_code(self) -> int | None:
        """The batch script's exit status once the job ended (128+N: killed by signal N);
        None while it is queued or running."""
        record = self._scontrol()
        if record is not None:
            return None if record["JobState"] in ACTIVE_STATES else _exit_status(record["ExitCode"])
        accounted = self._sacct()
        return _exit_status(accounted[1]) if accounted else None

    @property
    def output_path(self) -> Path | None:
        """The file the job's output goes to (StdOut, %j filled in), as slurmctld knows it."""
        if self._output is None:
            record = self._scontrol()
            if record is not None and record.get("StdOut"):
                self._output = Path(record["StdOut"])
        return self._output

    def output_text(self) -> str:
        """What the job wrote so far ("" before it started)."""
        path = self.output_path
        try:
            return path.read_text(errors="replace") if path else ""
        except FileNotFoundError:
            return ""

    def wait(self, *, timeout: float, poll: float = 0.25) -> str:
        """Wait until the job left the queue; return its final state.

        Args:
            timeout: seconds to wait; SlurmError if it is still queued then.
            poll: seconds between looks.
        """
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if state not in ACTIVE_STATES:
                return state
            if time.monotonic() >= deadline:
                raise SlurmError(f"job {self.job_id} still {state} after {timeout:g} s")
            time.sleep(poll)

    def cancel(self, *, wait: bool = True, timeout: float = 60.0) -> str:
        """scancel the job (SIGTERM to every process, SIGKILL after KillWait); return its state.

        Args:
            wait: wait until it left the queue; SlurmError if it has not within timeout.
            timeout: seconds to wait.
        """
        command = ["scancel", self.job_id]
        done = _run(command, timeout=self.timeout)
        if done.returncode != 0:
            raise SlurmError(f"scancel {self.job_id} failed: {_first_line(done.stderr)}",
                             command=command, returncode=done.returncode, stderr=done.stderr)
        return self.wait(timeout=timeout) if wait else self.state()


# --- labutils slurm -----------------------------------------------------------------------

def add_subcommand(sub) -> argparse.ArgumentParser:
    """Register `labutils slurm` on the CLI's subparsers; the handler is in its defaults."""
    p = sub.add_parser(
        "slurm", help="write (and submit) an sbatch script for a multi-node torchrun job",
        description="Write the sbatch script that runs SCRIPT on NODES x NPROC ranks with "
        "torchrun (rendezvous taken from SLURM's environment) to --out or stdout; with "
        "--submit, submit it and print the job id. Exit status: 0 ok, 1 the submission "
        "failed, 2 usage error.",
        epilog="Arguments for the script go after --: labutils slurm train.py --nodes 2 "
        "--nproc 4 -- --epochs 2",
    )
    p.add_argument("script", help="the training script (.py), as the nodes see it")
    p.add_argument("--nodes", type=int, required=True, help="machines (one torchrun agent each)")
    p.add_argument("--nproc", type=int, required=True, help="ranks per machine")
    p.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's)")
    p.add_argument("--time", default="00:30:00", help="wall-clock limit, e.g. 00:30:00")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (nccl)")
    p.add_argument("--cpus-per-task", type=int, default=None, help="CPUs per node (default NPROC)")
    p.add_argument("--job-name", default="torchrun", help="the name squeue shows")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port on the head node")
    p.add_argument("--python", default="python", help="the interpreter on the nodes")
    p.add_argument("--run-dir", default=None, help="the job's working folder (default: here)")
    p.add_argument("--job-output", default="slurm-%j.out",
                   help="the job's output file, %%j: job id (default slurm-%%j.out)")
    p.add_argument("--out", default=None, help="write the script here (default: stdout)")
    p.add_argument("--submit", action="store_true", help="submit it with sbatch, print the job id")
    p.set_defaults(handler=run_subcommand)
    return p


def run_subcommand(ns: argparse.Namespace) -> int:
    """`labutils slurm`: write the script, submit it if asked; return the exit status."""
    try:
        text = sbatch_script(
            ns.script, nnodes=ns.nodes, nproc_per_node=ns.nproc,
            args=getattr(ns, "script_args", []), job_name=ns.job_name, partition=ns.partition,
            time_limit=ns.time, cpus_per_task=ns.cpus_per_task, gpus_per_node=ns.gpus_per_node,
            output=ns.job_output, run_dir=ns.run_dir, rdzv_port=ns.port, python=ns.python)
        if ns.out:
            Path(ns.out).write_text(text)
        elif not ns.submit:
            sys.stdout.write(text)
        if ns.submit:
            job = SlurmJob.submit(text, ns.run_dir or ".")
            print(job.job_id)
            print(f"labutils slurm: submitted job {job.job_id}; output: {job.output_path}; "
                  f"stop it with: scancel {job.job_id}", file=sys.stderr)
    except InputError as exc:
        print(f"labutils slurm: {exc}", file=sys.stderr)
        return 2
    except (SlurmError, OSError) as exc:
        print(f"labutils slurm: {exc}", file=sys.stderr)
        return 1
    return 0
