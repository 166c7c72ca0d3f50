"""One submission from start to end, in a process of its own.

The grader starts ``python -m labutils.grading.supervisor`` per submission, in a
session of its own, and sends the job as JSON on stdin. The supervisor

1. builds a private working copy: the lab's files, the submission's files on top,
   the lab's locked files and locked notebook cells put back (and reported);
2. runs the notebook with papermill inside the sandbox (execute.py), under the
   whole-notebook deadline, watching the process tree's memory, size and disk use;
3. ends every process of that phase (SIGKILL to the tree, the tagged processes and
   the orphans it adopted as a subreaper);
4. puts the locked files back again, then runs the lab's checks from a pristine
   copy, in the sandbox too (runner.py), under the checks' deadline, and ends
   every process again;
5. prints the graded tests as JSON on stdout and exits.

Results from the sandbox only count when they carry the nonce the supervisor sent
on the phase's stdin, which nothing the submission runs can read.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

import nbformat

from labutils.grading import procs
from labutils.grading.checks import CheckResult
from labutils.grading.notebook import read_notebook, restore_locked_cells
from labutils.grading.report import describe_outcome
from labutils.grading.runner import HIDDEN_CHECKS_FILE
from labutils.runtime import runfiles
from labutils.runtime.procs import Claim, become_subreaper, claim, die_with_parent, make_undumpable

SKIP_DIRS = {"runs", "__pycache__", ".ipynb_checkpoints", ".git"}
# the lab's, never copied into the learner's folder
GRADER_FILES = {"checks.py", "lab.json", "hidden_checks.py"}
MAX_FILE_BYTES = 5 << 20
MAX_SUBMISSION_BYTES = 20 << 20
MAX_RESULT_LINE = 8 << 20
POLL_S = 0.2          # how soon the end of a phase is noticed
TREE_EVERY_S = 1.0    # memory and process count of the tree
DISK_EVERY_S = 3.0    # bytes written in the working copy
MAX_FILES = 500
LEARNER_IDS = (40000, 60000)   # the submission's own uid and gid are drawn from this range
ENV_KEEP = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "VIRTUAL_ENV",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
            runfiles.ENV_START)


@dataclass
class Phase:
    """How one sandboxed phase ended and what it said with the nonce."""

    messages: list[dict] = field(default_factory=list)
    ended: str = "exited"      # exited | timeout | memory | processes | disk
    detail: str = ""
    exit_code: int | None = None
    duration_s: float = 0.0
    enforced: dict = field(default_factory=dict)


class Supervisor:
    def __init__(self, job: dict) -> None:
        self.job = job
        self.lab = job["lab"]
        self.config = self.lab["config"]
        self.files = {rel: base64.b64decode(data) for rel, data in self.lab["files"].items()}
        self.root = Path(job["root"])
        self.work = self.root / "work"
        self.private = self.root / "private"
        self.scratch = self.root / "scratch"
        self.notes: list[str] = []
        self.limits = job["limits"]
        self.stub = self.private / "hidden"   # what covers a hidden file in the sandbox
        self._uid_claim: Claim | None = None
        self.user, self.user_why = self._learner_user()

    # ------------------------------------------------------------------ files
    def _locked_files(self) -> dict[str, bytes]:
        """Lab files the learner's folder needs but must not change."""
        edit = set(self.config.get("edit", []))
        return {rel: data for rel, data in self.files.items()
                if rel not in edit and rel not in GRADER_FILES and rel != self.config["notebook"]}

    def _put_back_locked(self, *, when: str) -> None:
        """Rewrite every locked file of the working copy that differs from the lab's."""
        for rel, data in self._locked_files().items():
            path = self.work / rel
            if not path.is_symlink() and path.is_file() and path.read_bytes() == data:
                continue
            self.notes.append(f"{rel} was changed {when}; the lab's copy was put back")
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.is_symlink() or path.exists():
                path.unlink()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

    def _submission(self) -> tuple[Path, Path | None]:
        """The submission's folder and its notebook (None when there is none)."""
        source = Path(self.job["source"])
        if source.is_file():
            return source.parent, source
        wanted = source / self.config["notebook"]
        if wanted.is_file():
            return source, wanted
        found = sorted(source.glob("*.ipynb"))
        return source, (found[0] if len(found) == 1 else None)

    def prepare(self) -> tuple[Path | None, str]:
        """The working copy; returns (notebook to run, or None, and why not)."""
        for d in (self.work, self.private, self.scratch):
            d.mkdir(parents=True, exist_ok=True)
        self.stub.touch(mode=0o000)
        for rel, data in self.files.items():
            if rel not in GRADER_FILES and rel != self.config["notebook"]:
                (self.work / rel).parent.mkdir(parents=True, exist_ok=True)
                (self.work / rel).write_bytes(data)
        folder, notebook = self._submission()
        locked, total, copied, skipped = self._locked_files(), 0, 0, []
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder).as_posix()
            if any(part in SKIP_DIRS or part.startswith(".") for part in Path(rel).parts):
                continue
            if path.is_symlink():
                if rel not in self.files:
                    self.notes.append(f"{rel} is a symbolic link; it was not used")
                continue
            if not path.is_file() or path.suffix == ".ipynb":
                continue
            data_size = path.stat().st_size
            if rel in locked or rel in GRADER_FILES:
                lab_copy = self.files.get(rel, b"")
                if data_size != len(lab_copy) or path.read_bytes() != lab_copy:
                    what = "the checks" if rel == "checks.py" else rel
                    self.notes.append(f"{what} differ{'s' if what == rel else ''} from the lab's "
                                      "copy; the grader used its own")
                continue
            if data_size > MAX_FILE_BYTES or total + data_size > MAX_SUBMISSION_BYTES or \
                    copied >= MAX_FILES:
                skipped.append(rel)
                continue
            total, copied = total + data_size, copied + 1
            (self.work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, self.work / rel)
        if skipped:
            self.notes.append(f"{len(skipped)} file(s) were not used ({', '.join(skipped[:5])}"
                              f"{', ...' if len(skipped) > 5 else ''}): the grader takes {MAX_FILES} "
                              f"files of up to {MAX_FILE_BYTES >> 20} MB, "
                              f"{MAX_SUBMISSION_BYTES >> 20} MB in all")
        if notebook is None:
            return None, (f"no notebook found in {folder.name}/ (expected "
                          f"{self.config['notebook']})")
        read = read_notebook(notebook)
        if read.nb is None:
            return None, read.problem
        lab_nb = read_notebook_bytes(self.files[self.config["notebook"]])
        nb, notes = restore_locked_cells(read.nb, lab_nb)
        self.notes += notes
        target = self.work / self.config["notebook"]
        nbformat.write(nb, target)
        return target, ""

    # ----------------------------------------------------------------- phases
    def _env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k in ENV_KEEP or k.startswith("LC_")}
        home, temporary = self.scratch / "home", self.scratch / "tmp"
        for folder in (home, temporary):
            folder.mkdir(parents=True, exist_ok=True)
        env.update({
            # temporary files (the kernel's connection file, the learner's own) stay in
            # this grading's folder: counted by the disk limit, gone with the folder even
            # when a submission kills the process that would have removed them
            "TMPDIR": str(temporary),
            "HOME": str(home), "USER": "learner", "LOGNAME": "learner",
            "JUPYTER_RUNTIME_DIR": str(home / "jupyter-runtime"),
            "JUPYTER_DATA_DIR": str(home / "jupyter-data"),
            "IPYTHONDIR": str(home / "ipython"), "MPLCONFIGDIR": str(home / "matplotlib"),
            "XDG_CACHE_HOME": str(home / "cache"), "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1", runfiles.ENV_DISPLAY: "text",
            "JUPYTER_PLATFORM_DIRS": "1", procs.TAG_ENV: self.job["tag"],
        })
        return env

    def _learner_user(self) -> tuple[list[int] | None, str]:
        """The unprivileged user the submission's code runs as, when the grader is root:
        an id of its own per submission (the process limit counts a user's processes),
        or None and why not."""
        if os.geteuid() != 0:
            return None, "the grader is not root"
        import labutils

        needed = [Path(sys.prefix), Path(sys.base_prefix), Path(labutils.__file__).parent,
                  self.root]
        unreachable = [str(p) for p in needed if not _open_to_others(p)]
        if unreachable:
            return None, (f"{unreachable[0]} is not readable by other users, so the learner's "
                          "code runs as root without capabilities")
        # drawn from the job's tag, and claimed against the other submissions graded on this
        # machine at the same time: two sharing a user would share its process limit too
        span = LEARNER_IDS[1] - LEARNER_IDS[0]
        start = int(self.job["tag"][:6], 16)
        for k in range(64):
            uid = LEARNER_IDS[0] + (start + k) % span
            if (held := claim("uid", uid)) is not None:
                self._uid_claim = held  # held as long as this supervisor lives
                return [uid, uid], ""
        return None, "every learner user id tried is taken by another grading on this machine"

    def _hand_over(self) -> None:
        """The working copy and the scratch folder belong to the learner's user."""
        if self.user is None:
            return
        for top in (self.work, self.scratch):
            for folder, dirs, files in os.walk(top):
                for name in [folder, *(os.path.join(folder, f) for f in dirs + files)]:
                    os.lchown(name, *self.user)

    def run_phase(self, name: str, command: list[str], *, timeout: float, cwd: Path,
                  stdin_after: bytes = b"") -> Phase:
        """Run a command in the sandbox, watch it, end every process it started.
        stdin_after: sent on the command's stdin after the nonce's line."""
        nonce = secrets.token_hex(16)
        report = self.private / f"{name}-sandbox.json"
        env = self._env()   # makes the home folder, which _hand_over then gives away
        self._hand_over()
        spec = {
            "cwd": str(cwd), "isolate": self.job["isolate"], "env": env,
            "readonly": [*self.job["readonly"], str(self.private)],
            "hide": self.job.get("hide", []), "hide_stub": str(self.stub),
            "limits": {"memory_bytes": self.limits["memory_bytes"],
                       "file_bytes": self.limits["file_bytes"],
                       "processes": self.limits["processes"],
                       **({"memory_note": self.limits["memory_note"]}
                          if self.limits.get("memory_note") else {})},
            "report": str(report),
            **({"user": self.user} if self.user else {"user_why": self.user_why}),
        }
        phase = Phase()
        log = open(self.private / f"{name}.log", "wb")  # noqa: SIM115 - closed below
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "labutils.grading.sandbox", json.dumps(spec), "--", *command],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
        )
        reader = threading.Thread(target=_read_messages, args=(proc.stdout, nonce, phase.messages),
                                  daemon=True)
        reader.start()
        stdin = cast(IO[bytes], proc.stdin)  # stdin=PIPE
        try:
            stdin.write(nonce.encode() + b"\n" + stdin_after)
            stdin.close()
        except OSError:
            pass
        self._watch(proc, phase, t0 + timeout, timeout)
        # the phase's processes, and any orphans of it this subreaper adopted
        procs.kill_everything(roots=procs.own_children(), tag=self.job["tag"], keep={proc.pid})
        phase.exit_code = proc.wait()
        procs.kill_everything(roots=procs.own_children(), tag=self.job["tag"])
        reader.join(timeout=10)
        log.close()
        phase.duration_s = time.monotonic() - t0
        try:
            phase.enforced = json.loads(report.read_text())
        except (OSError, ValueError):
            phase.enforced = {}
        return phase

    def _watch(self, proc: subprocess.Popen, phase: Phase, deadline: float, timeout: float) -> None:
        last_tree = last_disk = 0.0
        while proc.poll() is None:
            time.sleep(POLL_S)
            now = time.monotonic()
            if now >= deadline:
                phase.ended, phase.detail = "timeout", f"did not finish within {timeout:g} s"
                return
            if now - last_tree < TREE_EVERY_S:
                continue
            last_tree = now
            size = procs.tree_size(proc.pid)
            if size.rss_bytes > self.limits["tree_memory_bytes"]:
                phase.ended = "memory"
                phase.detail = (f"used {size.rss_bytes / 2**30:.1f} GiB of memory, more than the "
                                f"{self.limits['tree_memory_bytes'] / 2**30:.1f} GiB allowed")
                return
            if size.processes > self.limits["processes"]:
                phase.ended = "processes"
                phase.detail = (f"ran {size.processes} processes at once, more than the "
                                f"{self.limits['processes']} allowed")
                return
            if now - last_disk > DISK_EVERY_S:
                last_disk = now
                limit = self.limits["disk_bytes"]
                used = procs.folder_bytes(self.work, limit=limit) + procs.folder_bytes(
                    self.scratch, limit=limit)
                if used > limit:
                    phase.ended = "disk"
                    phase.detail = f"wrote more than {limit >> 20} MB of files"
                    return
            procs.reap_children(keep={proc.pid})

    def _parameters(self) -> dict:
        """The lab's notebook parameters, its hang timeout scaled to the CPUs this grader
        has (labs are set for 2 cores; Gradescope's default container has half of one)."""
        parameters = dict(self.config.get("parameters", {}))
        if isinstance(parameters.get("hang_timeout"), (int, float)):
            parameters["hang_timeout"] = round(parameters["hang_timeout"] * procs.hang_scale(), 1)
        return parameters

    # ------------------------------------------------------------------ grade
    def _last_words(self, phase: str) -> str:
        """The last line a phase wrote to stderr (its log), as the learner reads it: the
        submission's folder left out of paths, at most 300 characters."""
        try:
            with open(self.private / f"{phase}.log", "rb") as log:
                log.seek(max(0, log.seek(0, 2) - 4096))
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        return last.replace(f"{self.work}/", "")[:300]

    def notebook_test(self, notebook: Path | None, problem: str) -> tuple[dict, dict]:
        points = float(self.config.get("notebook_points", 1))
        test = {"name": "The notebook runs from top to bottom", "max_score": points,
                "score": 0.0, "status": "failed", "visibility": "visible", "hidden": False}
        if notebook is None:
            test["output"] = problem
            return test, {"status": "not_run", "problem": problem}
        executed = self.work / ".executed.ipynb"
        python = sys.executable
        command = [python, "-m", "labutils.grading.execute", str(notebook), str(executed),
                   "--parameters", json.dumps(self._parameters()),
                   "--timeout", str(self.job["timeout"]),
                   "--max-output-bytes", str(self.limits["output_bytes"]), "--nonce-stdin"]
        phase = self.run_phase("notebook", command, timeout=self.job["timeout"] + 30,
                               cwd=notebook.parent)
        self.enforced = phase.enforced
        outcome = phase.messages[-1] if phase.messages else {}
        if phase.ended != "exited":
            outcome = {"status": phase.ended, "detail": phase.detail}
        elif not outcome:
            said = self._last_words("notebook")
            outcome = {"status": "crashed", "detail": f"the notebook runner ended with exit code "
                                                      f"{phase.exit_code} and no result"
                                                      + (f"; its last words: {said}" if said else "")}
        outcome["wall_s"] = round(phase.duration_s, 2)
        if executed.is_file() and not executed.is_symlink() and executed.stat().st_size <= 20 << 20:
            shutil.copyfile(executed, self.private / "executed.ipynb")
        test["output"] = describe_outcome(outcome, self.job["timeout"])
        if outcome.get("status") == "completed":
            test.update(score=points, status="passed")
        return test, outcome

    def check_tests(self) -> tuple[list[dict], list[dict], str]:
        checks = self.private / "checks"
        hidden = self.files.get(HIDDEN_CHECKS_FILE)
        for rel, data in self.files.items():
            if rel == HIDDEN_CHECKS_FILE:
                continue   # never a file the sandbox holds: the runner gets it on stdin
            (checks / rel).parent.mkdir(parents=True, exist_ok=True)
            (checks / rel).write_bytes(data)
        command = [sys.executable, "-m", "labutils.grading.runner", "--checks", str(checks),
                   "--learner", str(self.work), "--scratch", str(self.scratch / "checks"),
                   "--nonce-stdin", *(["--hidden-stdin"] if hidden is not None else [])]
        after = (json.dumps(hidden.decode()).encode() + b"\n") if hidden is not None else b""
        phase = self.run_phase("checks", command, timeout=self.job["checks_timeout"],
                               cwd=self.scratch, stdin_after=after)
        self.checks_enforced = phase.enforced
        done = {m["test"]["name"]: m["test"] for m in phase.messages if "test" in m}
        errors = [m for m in phase.messages if "error" in m]
        runs: list = next((m["runs"] for m in phase.messages if m.get("done")), [])
        grader_error = ""
        if errors:
            grader_error = f"the lab's checks failed to load: {errors[0]['error']}"
        tests = []
        for spec in self.job["checks"]:
            result = done.get(spec["name"])
            if result is None:
                why = grader_error or (
                    f"the checks {phase.detail}" if phase.ended != "exited" else
                    f"the checks ended (exit code {phase.exit_code}) before this one ran; "
                    "what they printed is in the instructor's grader.log")
                tests.append({"name": spec["name"], "max_score": spec["points"], "score": 0.0,
                              "status": "failed", "output": f"[FAIL] not measured: {why}",
                              "visibility": spec["visibility"], "hidden": spec["hidden"],
                              "required": spec.get("required", False)})
                continue
            check = CheckResult.from_json(result)
            tests.append({"name": check.name, "max_score": check.points, "score": check.score,
                          "status": "passed" if check.passed else "failed",
                          "output": check.output(), "visibility": spec["visibility"],
                          "hidden": spec["hidden"], "required": spec.get("required", False)})
        return tests, runs, grader_error

    def grade(self) -> dict:
        t0 = time.monotonic()
        become_subreaper()
        self.enforced = {}
        notebook, problem = self.prepare()
        nb_test, outcome = self.notebook_test(notebook, problem)
        self._put_back_locked(when="while the notebook ran")
        tests, runs, grader_error = self.check_tests()
        self.enforced = self.enforced or self.checks_enforced
        sandbox_error = self.enforced.get("error") or self.checks_enforced.get("error")
        if sandbox_error:
            grader_error = f"the sandbox could not be set up: {sandbox_error}"
        integrity = {
            "name": "Locked cells and lab files are unchanged", "max_score": 0.0, "score": 0.0,
            "status": "failed" if self.notes else "passed", "visibility": "visible", "hidden": False,
            "output": "\n".join(self.notes) or "nothing was changed",
        }
        return {
            "tests": [nb_test, *tests, integrity], "notebook": outcome, "runs": runs,
            "integrity": self.notes, "sandbox": self.enforced, "grader_error": grader_error,
            "executed_notebook": str(self.private / "executed.ipynb")
            if (self.private / "executed.ipynb").is_file() else None,
            # what each sandboxed phase wrote to stderr (the kernel's, the checks'), for
            # the instructor's grader.log: a check "not measured" or a dead kernel says why
            "phase_logs": {name: str(self.private / f"{name}.log") for name in ("notebook", "checks")
                           if (self.private / f"{name}.log").is_file()},
            "duration_s": round(time.monotonic() - t0, 2),
        }


def _open_to_others(path: Path) -> bool:
    """Every folder from / down to path can be entered by any user, and path itself read."""
    path = path.resolve()
    for folder in [*reversed(path.parents), path]:
        try:
            mode = folder.stat().st_mode
        except OSError:
            return False
        if folder.is_dir() and not mode & 0o001:
            return False
    return bool(path.stat().st_mode & 0o004)


def read_notebook_bytes(data: bytes):
    return nbformat.reads(data.decode(), as_version=4)


def _read_messages(stream, nonce: str, out: list) -> None:
    """Keep the lines that start with the nonce; drain and drop everything else."""
    prefix = nonce.encode()
    buffer = b""
    while True:
        chunk = stream.read1(1 << 16) if hasattr(stream, "read1") else stream.read(1 << 16)
        if not chunk:
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(prefix):
                try:
                    out.append(json.loads(line[len(prefix):]))
                except ValueError:
                    pass
        if len(buffer) > MAX_RESULT_LINE:
            buffer = b""  # no result line is this long: it is someone else's flood


def main() -> int:
    job = json.loads(sys.stdin.read())
    die_with_parent()
    make_undumpable()  # the nonce and the result pipe stay ours
    result = Supervisor(job).grade()
    sys.stdout.write(job["nonce"] + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
