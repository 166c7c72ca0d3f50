"""A submitted SLURM job: submit, state, exit code, output, cancel (labutils.cluster.slurm
is the public face; the script comes from labutils.cluster.sbatch).

Exit codes without accounting (no slurmdbd): `scontrol show job` keeps a finished job,
its JobState and ExitCode, for MinJobAge seconds (300 by default); after that, sacct
answers where accounting runs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from labutils.errors import InputError, LabutilsError

#: States in which a job is still in the queue (it holds or waits for nodes).
ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING",
    "RESIZING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STAGE_OUT",
})


class SlurmError(LabutilsError):
    """A SLURM command failed or did not answer; carries the command, status and stderr."""

    def __init__(self, message: str, *, command: Sequence[str] | None = None,
                 returncode: int | None = None, stderr: str = "") -> None:
        self.command = list(command) if command else None
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(message)


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
    """Raise SlurmError (one line) unless SLURM's controller answers `scontrol ping`.

    Args:
        timeout: seconds scontrol may take.
    """
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

