"""grade(): many submissions of one lab, in parallel, each in its own supervisor.

The lab is read once, before any submission runs: its files are kept in memory and
handed to every supervisor, so nothing a submission writes can change what the
next one is graded against. Each submission is graded by its own supervisor process
(supervisor.py) in its own session; a thread per job slot waits for it under a
hard deadline and ends every process it left. Results are written atomically as
each submission finishes, and all of them once more at the end, from memory.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labutils.errors import GradingError, cannot_write, real_number, whole_number
from labutils.grading import procs, report

LAB_CONFIG = "lab.json"
DEFAULT_LIMITS = {
    "memory_bytes": 4 << 30,        # address space per process (RLIMIT_AS)
    "tree_memory_bytes": 4 << 30,   # resident memory of every process of the submission
    "processes": 64,                # processes of the submission at once
    "file_bytes": 256 << 20,        # largest file a process may write (RLIMIT_FSIZE)
    "disk_bytes": 1 << 30,          # everything written in the working copy
    "output_bytes": 2 << 20,        # notebook output kept
}
NO_ADDRESS_LIMIT = ("memory per process: no address-space limit (a CUDA build of torch "
                    "reserves far more than it uses); the resident memory of every process "
                    "is watched")
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_CHECKS_TIMEOUT_S = 300.0
SUPERVISOR_SLACK_S = 120.0
MAX_LAB_BYTES = 20 << 20
_SKIP = {"runs", "__pycache__", ".ipynb_checkpoints", ".git"}
WRONG_FIXES_FILE = "wrong_fixes.py"   # the instructor's catalogue (grading/wrongfix.py)


@dataclass
class Lab:
    """A lab as the grader holds it: its folder, its lab.json, its files, its checks."""

    folder: Path
    config: dict
    files: dict[str, bytes]
    checks: list[dict]

    @property
    def title(self) -> str:
        return self.config.get("title", self.folder.name)

    @property
    def pass_mark(self) -> float:
        return float(self.config.get("pass_mark", 0.6))

    @property
    def notebook_checks(self) -> tuple[str, ...]:
        """lab.json's "notebook_checks": the starts of the names of the checks that grade
        what the notebook saves (lab 12's diagnosis), not the files a learner edits; the
        wrong fixes, which are edits of those files, are scored as if they passed, as they
        are for the notebook's own points (grading/wrongfix.py)."""
        return tuple(self.config.get("notebook_checks", ()))


def lab_files(folder: Path) -> dict[str, bytes]:
    """Every file of a lab folder (no run folders, caches or hidden files)."""
    files, total = {}, 0
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if any(part in _SKIP or part.startswith(".") for part in rel.parts) or not path.is_file() \
                or rel.as_posix() == WRONG_FIXES_FILE:  # the instructor's: the grader needs none
            continue
        data = path.read_bytes()
        total += len(data)
        if total > MAX_LAB_BYTES:
            raise GradingError(f"lab {folder}: more than {MAX_LAB_BYTES >> 20} MB of files; "
                               "keep data out of the lab folder")
        files[rel.as_posix()] = data
    return files


def load_lab(folder: str | os.PathLike) -> Lab:
    """Read and check a lab folder: lab.json, its notebook, the files learners edit, checks.py."""
    folder = Path(folder).resolve()
    config_path = folder / LAB_CONFIG
    if not config_path.is_file():
        raise GradingError(f"{folder} is not a lab: expected {LAB_CONFIG} there "
                           "(see labs/01_data_sharding for an example)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise GradingError(f"{config_path}: not valid JSON ({exc})") from None
    files = lab_files(folder)
    needed = [config.get("notebook", "<notebook>"), *config.get("edit", []), "checks.py"]
    missing = [name for name in needed if name not in files]
    if missing or not isinstance(config.get("edit"), list):
        raise GradingError(f"lab {folder.name}: {LAB_CONFIG} must name the notebook and the "
                           f"files learners edit ('edit': [...]), all in the folder, next to "
                           f"checks.py; missing: {missing or ['edit']}")
    from labutils.grading.runner import lab_checks

    saved = list(sys.path)
    try:
        checks = [vars(fn.__labutils_check__).copy() for fn in lab_checks(folder, hidden=True)]
    except Exception as exc:  # noqa: BLE001 - a broken checks.py is the lab's problem
        raise GradingError(f"lab {folder.name}: checks.py does not load: "
                           f"{type(exc).__name__}: {exc}") from None
    finally:
        sys.path[:] = saved
    if not checks:
        raise GradingError(f"lab {folder.name}: checks.py declares no @check function")
    prefixes = config.get("notebook_checks", [])
    if not isinstance(prefixes, list) or not all(
            isinstance(p, str) and p and any(c["name"].startswith(p) for c in checks) for p in prefixes):
        raise GradingError(f"lab {folder.name}: {LAB_CONFIG}'s \"notebook_checks\" must be a list "
                           f"of the starts of its checks' names, got {prefixes!r}; e.g. "
                           f"[{checks[0]['name'][:20]!r}]")
    return Lab(folder=folder, config=config, files=files, checks=checks)


def submission_names(paths: list[Path]) -> list[str]:
    """A short, unique, file-system-safe name per submission (its folder's name if unique)."""
    def clean(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "submission"

    folders = [p.parent if p.suffix == ".ipynb" else p for p in paths]
    names = [clean(f.name) for f in folders]
    clash = [names.count(n) > 1 for n in names]
    names = [clean(f"{f.parent.name}-{f.name}") if c else n for f, n, c in zip(folders, names, clash)]
    clash = [names.count(n) > 1 for n in names]
    names = [clean(f"{n}-{p.stem}") if c else n for p, n, c in zip(paths, names, clash)]
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(f"{name}-{seen[name]}" if names.count(name) > 1 else name)
    return unique


def restore_lab(lab: Lab) -> list[str]:
    """Put back lab files that changed on disk since the lab was read; returns their names."""
    changed = []
    for rel, data in lab.files.items():
        path = lab.folder / rel
        try:
            same = not path.is_symlink() and path.read_bytes() == data
        except OSError:
            same = False
        if not same:
            changed.append(rel)
            if path.is_symlink():
                path.unlink()
            report.write_atomic(path, data)
    return changed


def max_score(lab: Lab) -> float:
    """The points a submission of the lab can get: the notebook's and every check's."""
    return report.totals(_failed_tests(lab, ""))[1]


def _failed_tests(lab: Lab, why: str) -> list[dict]:
    return [{"name": "The notebook runs from top to bottom",
             "max_score": float(lab.config.get("notebook_points", 1)), "score": 0.0,
             "status": "failed", "output": why, "visibility": "visible", "hidden": False}] + [
        {"name": c["name"], "max_score": c["points"], "score": 0.0, "status": "failed",
         "output": f"[FAIL] not measured: {why}", "visibility": c["visibility"],
         "hidden": c["hidden"], "required": c.get("required", False)} for c in lab.checks]


def torch_is_gpu_build() -> bool:
    """The installed torch is a CUDA (or ROCm) build: its library folder holds the GPU
    part of libtorch. Found without importing torch."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(folder) / "lib"
        if any(lib.glob("libtorch_cuda*.so*")) or any(lib.glob("libtorch_hip*.so*")):
            return True
    return False


class Batch:
    def __init__(self, lab: Lab, *, out_dir: Path, timeout: float | None, isolate: bool) -> None:
        self.lab = lab
        self.out_dir = out_dir
        # the lab's deadlines are for 2 cores: longer on a grader with fewer (procs.hang_scale)
        scale = procs.hang_scale()
        self.timeout = float(timeout or lab.config.get("timeout", DEFAULT_TIMEOUT_S) * scale)
        self.checks_timeout = float(lab.config.get("checks_timeout", DEFAULT_CHECKS_TIMEOUT_S)) * scale
        self.isolate = isolate
        self.limits = {**DEFAULT_LIMITS, **lab.config.get("limits", {})}
        if self.limits["memory_bytes"] and torch_is_gpu_build():
            # CUDA's driver reserves far more address space than it uses: under RLIMIT_AS
            # its start fails ("out of memory"), and a kernel or checks process that touches
            # it dies. The resident size of the submission's tree is still watched.
            self.limits["memory_bytes"] = 0
            self.limits["memory_note"] = NO_ADDRESS_LIMIT
        self.tmp = Path(tempfile.mkdtemp(prefix="labutils-grade-"))
        self.tmp.chmod(0o711)   # a submission's own user reaches its folder, lists none
        self.lock = threading.Lock()
        self.results: dict[str, dict] = {}
        self.executed: dict[str, bytes | None] = {}
        self.order: list[str] = []
        self.live: dict[str, tuple[subprocess.Popen, str]] = {}  # name -> (supervisor, tag)

    def hidden_paths(self) -> list[str]:
        """What a submission's code must not read: the lab folder (hidden checks, the
        wrong-fix catalogue; the grader sends the sandbox what it needs) and the course's
        solutions, unless one holds what the sandbox runs on (Python, labutils)."""
        import labutils

        needed = [Path(sys.prefix).resolve(), Path(labutils.__file__).resolve().parent,
                  self.tmp.resolve()]
        course = self.lab.folder.parent.parent
        return [str(p) for p in (self.lab.folder, course / "solutions")
                if p.exists() and not any(n == p or p in n.parents for n in needed)]

    def readonly_paths(self, sources: list[Path]) -> list[str]:
        import labutils

        return [str(p) for p in (self.lab.folder, self.out_dir, Path(labutils.__file__).parent,
                                 Path(sys.prefix), Path(sys.base_prefix),
                                 *[s.parent if s.is_file() else s for s in sources])]

    def grade_one(self, source: Path, name: str, readonly: list[str]) -> dict:
        t0 = time.monotonic()
        tag, nonce = secrets.token_hex(8), secrets.token_hex(16)
        root = self.tmp / "jobs" / name
        root.mkdir(parents=True)
        job = {
            "name": name, "tag": tag, "nonce": nonce, "source": str(source), "root": str(root),
            "lab": {"config": self.lab.config, "files": {
                rel: base64.b64encode(data).decode() for rel, data in self.lab.files.items()}},
            "checks": self.lab.checks, "limits": self.limits, "timeout": self.timeout,
            "checks_timeout": self.checks_timeout, "isolate": self.isolate, "readonly": readonly,
            "hide": self.hidden_paths(),
        }
        log_path = self.tmp / "jobs" / f"{name}.supervisor.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "labutils.grading.supervisor"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, start_new_session=True,
            )
            self.live[name] = (proc, tag)
            limit = self.timeout + self.checks_timeout + SUPERVISOR_SLACK_S
            out, overran = b"", False
            try:
                out, _ = proc.communicate(json.dumps(job).encode(), timeout=limit)
            except subprocess.TimeoutExpired:
                overran = True
            finally:
                procs.kill_everything(roots=[proc.pid], tag=tag, keep={proc.pid})
                proc.wait()
                self.live.pop(name, None)
        payload = next((json.loads(line[len(nonce):])
                        for line in out.decode(errors="replace").splitlines()
                        if line.startswith(nonce)), None)
        result: dict[str, Any]
        result = {"name": name, "source": str(source), "lab": self.lab.folder.name,
                  "lab_title": self.lab.title, "pass_mark": self.lab.pass_mark,
                  "tag": tag}  # LABUTILS_GRADE_TAG of every process this submission ran
        if payload is None:
            tail = log_path.read_text(errors="replace")[-2000:]
            if overran:
                why, result["grader_error"] = f"grading took longer than {limit:g} s and was stopped", ""
            elif proc.returncode is not None and proc.returncode < 0:
                why = f"grading was cut short: its supervisor was killed (signal {-proc.returncode})"
                result["grader_error"] = ""
            else:
                why = f"the grader failed on this submission (exit code {proc.returncode})"
                result["grader_error"] = f"{why}: {tail.strip().splitlines()[-1] if tail.strip() else ''}"
            result.update(tests=_failed_tests(self.lab, why), notebook={"status": "not_run"})
        else:
            result.update(payload)
        result["passed"] = report.passes(result["tests"], self.lab.pass_mark)
        result["duration_s"] = round(time.monotonic() - t0, 2)
        executed = result.pop("executed_notebook", None)
        result["has_executed_notebook"] = bool(executed and Path(executed).is_file())
        executed_bytes = Path(executed).read_bytes() if result["has_executed_notebook"] else None
        grader_log = report.grader_log(result.pop("phase_logs", {}), log_path)
        with self.lock:
            report.write_submission(self.out_dir, result, executed_bytes, grader_log)
            self.results[name], self.executed[name] = result, executed_bytes
            report.write_atomic(self.out_dir / "grades.csv", report.grades_csv(
                [self.results[n] for n in self.order if n in self.results]))
        shutil.rmtree(root, ignore_errors=True)
        return result

    def stop(self) -> None:
        """End every submission still being graded (the grader was interrupted)."""
        for proc, tag in list(self.live.values()):
            procs.kill_everything(roots=[proc.pid], tag=tag, keep={proc.pid})

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def grade(
    lab: str | os.PathLike,
    submissions: list[str | os.PathLike],
    *,
    out_dir: str | os.PathLike = "grades",
    jobs: int = 1,
    timeout: float | None = None,
    isolate: bool = True,
    progress=print,
) -> list[dict]:
    """Grade submissions of one lab; write DIR/<name>/results.json, feedback, grades.csv
    and the per-check summary (checks.csv, checks.png).

    Args:
        lab: the lab folder (lab.json, the notebook, the scripts, checks.py).
        submissions: notebooks (their folder holds the scripts), folders, or Canvas's
            "Download Submissions" zip (one folder per learner, named by user id).
        out_dir: where results go.
        jobs: submissions graded at the same time.
        timeout: wall-clock seconds for each notebook, start to end (default: the
            lab's "timeout", else 300).
        isolate: use namespaces where the machine allows them (False: rlimits only).
        progress: called with one line per finished submission (None: silent).

    Returns:
        One result per submission, in the order given: name, tests, passed, ...
    """
    the_lab = load_lab(lab)
    paths = [Path(s).resolve() for s in submissions]
    missing = [str(s) for s, p in zip(submissions, paths) if not p.exists()]
    if missing:
        raise GradingError(f"submission not found: {', '.join(missing)}; expected notebooks "
                           f"(.ipynb), folders or a Canvas zip; the current folder is {os.getcwd()}")
    odd = [str(s) for s, p in zip(submissions, paths) if p.is_file() and p.suffix not in (".ipynb", ".zip")]
    if odd:
        raise GradingError(f"cannot grade {', '.join(odd)}: expected notebooks (.ipynb), folders "
                           "(a learner's copy of the lab) or Canvas's Download Submissions zip")
    if not whole_number(jobs) or jobs < 1:
        raise GradingError(f"jobs: expected a whole number >= 1, got {jobs!r}; pass e.g. --jobs 2 "
                           "(submissions graded at the same time)")
    if timeout is not None and not (real_number(timeout) and timeout > 0):
        raise GradingError(f"timeout: expected seconds > 0 for each notebook, got {timeout!r}; pass "
                           "e.g. --timeout 600, or leave it out for the lab's own deadline")
    why = cannot_write(Path(out_dir).resolve())
    if why:
        raise GradingError(f"--out {out_dir}: cannot write there ({why}); expected a "
                           "folder this user can write, e.g. --out grades")
    if any(p.suffix == ".zip" for p in paths):  # Canvas's Download Submissions zip
        from labutils.grading.export import unpack_canvas

        expected = [the_lab.config["notebook"], *the_lab.config.get("edit", [])]
        paths = [q for p in paths for q in (
            unpack_canvas(p, Path(out_dir).resolve() / "submissions" / p.stem, expected,
                          Path(out_dir).resolve())
            if p.suffix == ".zip" else [p])]
    if not paths:
        raise GradingError("no submission given")
    out = Path(out_dir).resolve()
    batch = Batch(the_lab, out_dir=out, timeout=timeout, isolate=isolate)
    names = submission_names(paths)
    batch.order = names
    readonly = batch.readonly_paths(paths)
    done = [0]

    def one(source: Path, name: str) -> dict:
        result = batch.grade_one(source, name, readonly)
        if progress is not None:
            with batch.lock:
                done[0] += 1
                score, max_score = report.totals(result["tests"])
                verdict = report.verdict(result)
                extra = " [grader error]" if result.get("grader_error") else ""
                progress(f"[{done[0]}/{len(paths)}] {name}: {score:g}/{max_score:g} {verdict} "
                         f"({result['duration_s']:.0f} s){extra}")
        return result

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(one, path, name) for path, name in zip(paths, names)]
            try:
                results = [future.result() for future in futures]
            except KeyboardInterrupt:  # end the submissions now, not after they finish
                for future in futures:
                    future.cancel()
                batch.stop()
                raise
        for result in results:  # a last write from memory: whatever ran meanwhile, these stand
            report.write_submission(out, result, batch.executed[result["name"]])
        report.write_atomic(out / "grades.csv", report.grades_csv(results))
        from labutils.grading.export import write_summary

        write_summary(out, [report.gradescope_results(r) for r in results], the_lab.title)
        changed = restore_lab(the_lab)
        if changed and progress is not None:
            progress(f"warning: a submission changed the lab's files {changed} (this machine "
                     "allows no read-only sandbox); they were put back as they were")
    finally:
        batch.close()
    return results
