"""Writing a lab's checks: functions that launch the learner's scripts and measure.

A lab's ``checks.py`` (public) and ``hidden_checks.py`` (the grader's only) declare
checks with ``@check``; each receives a Checker ``c`` that launches scripts through
labutils.launch (runs are cached, so checks can share one) and records what was
measured against what was expected (labs/README.md has an example)::

    run = c.run("train.py", nproc=3, args=["--epochs", "2"])
    if c.completed(run, "3 ranks"):
        c.expect(dup == 0, "3 ranks: no item seen twice", measured=dup, expected=0)

A check scores ``points`` times the share of its parts that passed: partial credit,
one part per world size or case. A check that raises scores 0 and says why. Nothing
the learner's notebook computed counts: only what fresh runs of the scripts do.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from labutils.errors import real_number
from labutils.runtime.frames import Frame, dump_frames, traceback_frames

if TYPE_CHECKING:
    from labutils.run.hang import Hang

DEFAULT_HANG_TIMEOUT = 10.0
DEFAULT_RUN_TIMEOUT = 90.0
REPEAT_APART_S = 1.5   # seconds between the end of a launch and a repeat= run of the checks
# When a learner sees a check's result, in Gradescope's words: at once, never, after the
# due date, after the grades are published.
VISIBILITY = ("visible", "hidden", "after_due_date", "after_published")


@dataclass
class CheckSpec:
    """What @check attached to a function: its title and its worth."""

    name: str
    points: float
    visibility: str = "visible"
    hidden: bool = False   # declared in hidden_checks.py, outside the learner's copy
    required: bool = False  # the lab is not passed unless this check passes


def check(name: str, *, points: float, visibility: str = "visible",
          required: bool = False) -> Callable:
    """Declare a lab check worth ``points``; the title is what learners read.

    Args:
        name: one line saying what is being checked (shown in the feedback).
        points: the check's maximum score (> 0).
        visibility: when the learner sees its result (Gradescope's levels): "visible"
            (at once), "after_due_date" or "after_published". Not "hidden" (never): a
            check always carries points, and points a learner can never see explained
            are refused.
        required: the lab is not passed unless this check passes, whatever the score:
            for what a fix must not break, where losing the check's points alone would
            leave the submission above the pass mark (lab 03: the auxiliary head must
            still train). The score is unchanged; the verdict says which required
            check failed.
    """
    if not isinstance(required, bool):
        raise ValueError(f"check {name!r}: required must be True or False, got {required!r}")
    if not real_number(points) or points <= 0:
        raise ValueError(f"check {name!r}: points must be a number > 0, got {points!r}")
    if visibility == "hidden":
        raise ValueError(f"check {name!r}: visibility 'hidden' means the learner never sees the "
                         "result, and a check carries points; use 'after_due_date' or "
                         "'after_published'")
    if visibility not in VISIBILITY:
        raise ValueError(f"check {name!r}: visibility must be one of {', '.join(VISIBILITY)}, "
                         f"got {visibility!r}")

    def mark(fn: Callable) -> Callable:
        # a function attribute, which Callable cannot declare; collect_checks finds it
        fn.__labutils_check__ = CheckSpec(  # type: ignore[attr-defined]
            name=name, points=float(points), visibility=visibility, required=required)
        return fn

    return mark


def collect_checks(module) -> list[Callable]:
    """The @check functions a checks module defines (not imports), in the order defined."""
    found = [fn for fn in vars(module).values()
             if callable(fn) and hasattr(fn, "__labutils_check__")
             and getattr(fn, "__module__", None) == module.__name__]
    return sorted(found, key=lambda fn: inspect.getsourcelines(fn)[1])


# --------------------------------------------------------------------------- parts

@dataclass
class Part:
    """One measured case of a check: what was measured, what was expected, passed or not."""

    label: str
    passed: bool
    measured: str = ""
    expected: str = ""
    weight: float = 1.0

    def line(self) -> str:
        mark = "PASS" if self.passed else "FAIL"
        text = f"[{mark}] {self.label}"
        if self.measured or self.expected:
            text += f"\n       measured: {self.measured or '-'}"
            if not self.passed and self.expected:
                text += f"\n       expected: {self.expected}"
        return text


@dataclass
class CheckResult:
    """A check's outcome: score out of points, its parts, or the error that stopped it."""

    name: str
    points: float
    parts: list[Part] = field(default_factory=list)
    error: str = ""
    duration_s: float = 0.0
    visibility: str = "visible"
    hidden: bool = False
    required: bool = False

    @property
    def score(self) -> float:
        total = sum(p.weight for p in self.parts)
        if self.error or total <= 0:
            return 0.0
        return round(self.points * sum(p.weight for p in self.parts if p.passed) / total, 2)

    @property
    def passed(self) -> bool:
        return not self.error and bool(self.parts) and all(p.passed for p in self.parts)

    def output(self) -> str:
        lines = [p.line() for p in self.parts]
        if self.error:
            lines.append(f"[FAIL] the check stopped: {self.error}")
        if not lines:
            lines.append("[FAIL] nothing was measured")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "name": self.name, "points": self.points, "score": self.score,
            "passed": self.passed, "error": self.error,
            "duration_s": round(self.duration_s, 2),
            "visibility": self.visibility, "hidden": self.hidden, "required": self.required,
            "parts": [vars(p) for p in self.parts],
        }

    @classmethod
    def from_json(cls, data: dict) -> CheckResult:
        return cls(name=str(data["name"]), points=float(data["points"]),
                   parts=[Part(**p) for p in data.get("parts", [])],
                   error=str(data.get("error", "")), duration_s=float(data.get("duration_s", 0)),
                   visibility=str(data.get("visibility", "visible")),
                   hidden=bool(data.get("hidden", False)),
                   required=bool(data.get("required", False)))


# ---------------------------------------------------------------------------- runs

class Run:
    """One launch of a learner's script, as the checks see it."""

    def __init__(self, *, label: str, result=None, error: str = "", skipped: str = "",
                 learner_dir: Path, edit: tuple[str, ...] = ()) -> None:
        self.label = label
        self.edit = edit              # names of the files the learner edits
        self.result = result          # labutils.RunResult, or None if it did not start
        self.error = error            # why it could not start
        self.skipped = skipped        # why it was not even tried
        self.learner_dir = learner_dir

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok

    @property
    def records(self) -> list[dict]:
        return self.result.records if self.result is not None else []

    def values(self, name: str, *, rank: int | None = None) -> list:
        """Values the script sent with report(name=...), in order (optionally of one rank)."""
        return [r[name] for r in self.records
                if name in r and "probe" not in r and (rank is None or r["rank"] == rank)]

    def rows(self, *names: str) -> list[dict]:
        """Records that carry every one of names (the script's own, not the probe's)."""
        return [r for r in self.records if "probe" not in r and all(n in r for n in names)]

    def probe(self, kind: str) -> dict[int, dict]:
        """rank -> the probe's last record of this kind (weights, allreduce)."""
        return {r["rank"]: r for r in self.records if r.get("probe") == kind}

    def shared_writes(self) -> dict[str, list[int]]:
        """Files that several ranks opened for writing (probe "files"): path -> those ranks."""
        ranks: dict[str, set[int]] = {}
        for rank, seen in self.probe("files").items():
            for path in seen["writes"]:
                ranks.setdefault(path, set()).add(rank)
        return {path: sorted(r) for path, r in sorted(ranks.items()) if len(r) > 1}

    def renames_from_outside(self, targets: set[str]) -> list[int]:
        """Ranks that rename onto one of `targets` a file from outside that target's
        folder (probe "files"). A rename is atomic only within one file system; across
        two (the system's temporary folder is often one of its own), os.replace fails
        and shutil.move copies, writing the target in place. A file in the target's
        folder, or in a folder inside it (checkpoints/.tmp/), counts as on its file
        system. The probe writes a path inside the working directory relative to it,
        and any other absolute."""
        def outside(src: str, dst: str) -> bool:
            up = os.path.relpath(src, os.path.dirname(dst) or os.curdir)
            return os.path.isabs(src) != os.path.isabs(dst) or up == os.pardir \
                or up.startswith(os.pardir + os.sep)
        return sorted(rank for rank, seen in self.probe("files").items()
                      if any(dst in targets and outside(src, dst) for src, dst in seen["renames"]))

    def steps_taken(self) -> list[dict[int, int]]:
        """Per attempt, in order: rank -> optimizer steps it took (probe "steps"); an
        attempt killed halfway counts the steps taken before the kill."""
        taken: dict[int, dict[int, int]] = {}
        for r in self.records:
            if r.get("probe") == "steps":
                attempt = taken.setdefault(int(r["restart"]), {})
                attempt[r["rank"]] = max(attempt.get(r["rank"], 0), int(r["taken"]))
        return [taken[k] for k in sorted(taken)]

    @property
    def restarts(self) -> int:
        return max(0, len(self.result.attempts) - 1) if self.result is not None else 0

    @property
    def problem(self) -> str:
        """One paragraph saying how the run went wrong ('' when it went well)."""
        if self.result is None:
            return self.skipped or f"could not start: {self.error}"
        res = self.result
        if res.ok:
            return ""
        if res.reason == "hang" and res.hang is not None:
            where = self._positions(res.hang, "waits")
            for rank, code in sorted(res.hang.exited.items()):
                where.append(f"rank {rank}'s script {res.hang.lingering[rank]}, but its process "
                             "runs on (a thread that is not a daemon)" if rank in res.hang.lingering
                             else f"rank {rank} had already exited (code {code})")
            return (f"hung: no rank made progress for {res.hang.silent_s:.0f} s; "
                    + "; ".join(where))
        if res.reason == "timeout":
            where = self._positions(res.at_stop, "was") if res.at_stop is not None else []
            return f"timed out after {res.duration_s:.0f} s" + "".join(f"; {w}" for w in where)
        if res.failure is not None and res.failure.mismatch:
            calls = [f"rank {r} in {m['collective'] or 'a collective'}() at {m['where']}"
                     for r, m in sorted(res.failure.mismatch.items())]
            return "collectives did not match (each rank timed out): " + "; ".join(calls)
        if res.failure is not None:
            f = res.failure
            spot = self._learner_frame_from_traceback(f.traceback) or f.where
            message = f.message.strip().splitlines()[0] if f.message.strip() else ""
            return f"failed: {f.ended_how()}: {message[:200]} (at {spot})"
        return f"ended with '{res.reason}'"

    # The launcher names the innermost line of any file outside the libraries: in a
    # lab's folder that may be a harness of the lab's. The learner wants the innermost
    # line of the files they edit (any of their folder's files if the lab does not say
    # which).
    def _spot(self, frames: list[Frame]) -> str:
        """'file:line' of the innermost frame in the learner's files; frames innermost first."""
        mine = [f for f in frames if self._is_learner_file(f.file)]
        edited = [f for f in mine if Path(f.file).name in self.edit] if self.edit else []
        for f in edited or mine:
            return f"{Path(f.file).name}:{f.line}"
        return ""

    def _is_learner_file(self, filename: str) -> bool:
        try:
            return Path(filename).resolve().is_relative_to(self.learner_dir.resolve())
        except (OSError, ValueError):
            return False

    def _positions(self, hang: Hang, verb: str) -> list[str]:
        """'rank R waits at FILE:LINE in CALL()' (or 'was at', at a timeout) for each rank
        of a hang report, at the innermost line of the learner's own files."""
        where = []
        for rank in sorted(hang.stacks):
            spot = self._learner_frame(hang.stacks[rank]) or hang.waiting.get(rank, "?")
            call = hang.calls.get(rank)
            where.append(f"rank {rank} {verb} at {spot}" + (f" in {call}()" if call else ""))
        return where

    def _learner_frame(self, stack_text: str) -> str:
        """From a faulthandler dump (every thread, innermost frame first)."""
        return self._spot(dump_frames(stack_text))

    def _learner_frame_from_traceback(self, tb: str) -> str:
        """From a Python traceback (outermost frame first)."""
        return self._spot(list(reversed(traceback_frames(tb))))

    def summary(self) -> dict:
        res = self.result
        return {
            "label": self.label,
            "ok": self.ok,
            "reason": res.reason if res is not None else ("skipped" if self.skipped else "not started"),
            "duration_s": round(res.duration_s, 2) if res is not None else 0.0,
            "restarts": self.restarts,
            "problem": self.problem,
        }


class Checker:
    """What a check function receives: launch the learner's scripts and record parts.

    Args:
        learner_dir: the folder with the learner's scripts (a private copy).
        checks_dir: the folder of the lab's own files (checks.py and its helpers).
        scratch: a folder for run folders and each run's working directory.
        edit: the names of the files learners edit (failures point into these first).
    """

    def __init__(self, learner_dir: Path, checks_dir: Path, scratch: Path, *,
                 edit: Sequence[str] = ()) -> None:
        self.learner_dir = Path(learner_dir)
        self.edit = tuple(edit)
        self.checks_dir = Path(checks_dir)
        self.scratch = Path(scratch)
        self.cache: dict = {}  # (launch, nproc) -> Run, shared by the checks of one grading
        self.parts: list[Part] = []
        self._launched_until = 0.0  # time.monotonic() when the last launch ended

    def learner_file(self, name: str) -> Path:
        """A file of the learner's copy of the lab."""
        return self.learner_dir / name

    def lab_file(self, name: str) -> Path:
        """A file of the lab itself (a harness script the checks launch)."""
        return self.checks_dir / name

    def run(
        self,
        script: str | os.PathLike,
        nproc: int = 2,
        *,
        args=(),
        measure=(),
        fault: dict | None = None,
        max_restarts: int = 0,
        timeout: float = DEFAULT_RUN_TIMEOUT,
        hang_timeout: float = DEFAULT_HANG_TIMEOUT,
        repeat: int = 0,
        nnodes: int = 1,
    ) -> Run:
        """Launch a script on nproc ranks in a fresh working directory; cached.

        Args:
            script: a learner's file name (str) or a lab file (a Path from lab_file()).
            nproc: ranks.
            args: the script's command-line arguments.
            measure: probes to run inside each rank (labutils.grading.probe): "weights"
                (the final parameters of every DDP model), "buffers" (the running
                statistics of their layers that keep them, BatchNorm's or the script's
                own), "allreduce" (DDP all-reduces per optimizer step), "steps"
                (optimizer steps per attempt that had a gradient and a learning rate to
                take), "traffic" (process-group operations and
                their bytes), "files" (writes, renames, loads); or ["signed"] alone: the
                script is the lab's own harness, whose probe.signer() records count as
                measured and the learner's script cannot forge.
            fault: {"rank": R, "step": S}: SIGKILL rank R when it reports step S.
            max_restarts: torchrun restarts allowed (>= 1 with fault).
            timeout: wall-clock limit of this run in seconds.
            hang_timeout: seconds without progress before the run counts as hung.
            repeat: 0 for the launch's run that every check shares; 1, 2, ...: the same
                launch run again, later and apart, for a check that compares runs (two
                runs with the same --seed train on the same data).
            nnodes: torchrun agents ("nodes"), each with nproc ranks, all on this machine
                (launch()'s local agents): the run has nproc x nnodes ranks, and
                LOCAL_RANK counts each node's ranks from 0, as on a cluster.
        """
        path = script if isinstance(script, Path) else self.learner_file(str(script))
        args = [str(a) for a in args]
        measure = tuple(sorted(measure))
        if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 0:
            raise ValueError(f"repeat must be a whole number >= 0, got {repeat!r}")
        if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1:
            raise ValueError(f"nnodes must be a whole number >= 1, got {nnodes!r}")
        family = json.dumps([str(path), args, measure, fault, max_restarts]
                            + ([repeat] if repeat else [])
                            + ([{"nnodes": nnodes}] if nnodes > 1 else []))
        if (family, nproc) in self.cache:
            return self.cache[family, nproc]
        label = f"{path.name} on {nproc} rank{'s' if nproc > 1 else ''}"
        if nnodes > 1:
            label += f" per node x {nnodes} nodes"
        if args:
            label += " " + " ".join(args)
        if repeat:
            label += f" (run {repeat + 1} of the same)"
        # World sizes are tried smallest first; a script that crashed or hung at fewer
        # ranks is not launched again at more (it saves a hang timeout per world size).
        broken = [(n, run) for (f, n), run in self.cache.items()
                  if f == family and n < nproc and run.result is not None
                  and run.result.reason in ("failed", "hang", "timeout")]
        if broken:
            n, run = min(broken, key=lambda item: item[0])
            run = self._run(label, skipped=f"not tried, since it did not finish at {n} ranks")
        else:
            if repeat:
                # apart: runs forked from a warm server can start within the second the
                # last one ended, and a script that seeds with the clock's seconds
                # (int(time.time())) would get the same seed in both
                time.sleep(max(0.0, self._launched_until + REPEAT_APART_S - time.monotonic()))
            run = self._launch(path, nproc, args, measure, fault, max_restarts, timeout,
                               hang_timeout, label, **({"nnodes": nnodes} if nnodes > 1 else {}))
            self._launched_until = time.monotonic()
        self.cache[family, nproc] = run
        return run

    def _launch(self, path, nproc, args, measure, fault, max_restarts, timeout,
                hang_timeout, label, nnodes=1) -> Run:
        from labutils.errors import LaunchConfigError
        from labutils.grading.probe import launch_measured, own_records
        from labutils.grading.procs import hang_scale
        from labutils.run.launcher import launch

        if not Path(path).exists():
            return self._run(label, error=f"{Path(path).name} is missing")
        workdir = self.scratch / f"run{len(self.cache) + 1}"
        workdir.mkdir(parents=True, exist_ok=True)
        scale = hang_scale()   # the lab's timeouts are for 2 cores; longer with fewer
        # One intra-op thread per rank at every world size, 1 included (torchrun sets it
        # for 2 ranks and more only): a grader runs submissions side by side on few
        # cores, and one value lets every run of the checks fork from one warm server
        # (a run whose OMP_NUM_THREADS differs needs a server of its own, run/warm.py).
        options = dict(args=args, hang_timeout=hang_timeout * scale, timeout=timeout * scale,
                       max_restarts=max_restarts, fault=fault, display="none",
                       log_dir=workdir / "runs", backend="gloo", env={"OMP_NUM_THREADS": "1"})
        if nnodes > 1:
            options["nnodes"] = nnodes
        here = os.getcwd()
        os.chdir(workdir)  # files a script writes (checkpoints) stay with its run
        try:
            if measure:
                result = launch_measured(path, nproc, measure=measure, **options)
            else:  # no probe ran: records that claim one are the script's
                result = launch(path, nproc, **options)
                result.records = own_records(result.records)
        except LaunchConfigError as exc:  # paths in the learner's folder, as they name them
            return self._run(label, error=str(exc).replace(f"{self.learner_dir.resolve()}/", ""))
        finally:
            os.chdir(here)
        return self._run(label, result=result)

    def _run(self, label: str, **outcome) -> Run:
        return Run(label=label, learner_dir=self.learner_dir, edit=self.edit, **outcome)

    # ------------------------------------------------------------------ recording
    def expect(self, passed: bool, label: str, *, measured: Any = "", expected: Any = "",
               weight: float = 1.0) -> bool:
        """Record one part of the check; returns passed so checks can branch on it."""
        self.parts.append(Part(label=label, passed=bool(passed), measured=str(measured),
                               expected=str(expected), weight=float(weight)))
        return bool(passed)

    def completed(self, run: Run, label: str, *, weight: float = 1.0, restarts: int = 0) -> bool:
        """True when the run ended well (with ``restarts`` restarts); else record a failed part."""
        if run.ok and run.restarts == restarts:
            return True
        measured = f"finished after {run.restarts} restart(s)" if run.ok else run.problem
        self.expect(False, label, measured=measured,
                    expected=f"the run finishes{f' after {restarts} restart(s)' if restarts else ''}",
                    weight=weight)
        return False


    def each_step_once(self, runs: Sequence[Run], steps: int, label: str) -> bool:
        """A gate before a check's parts about a resume: over the runs and their attempts,
        ``steps`` optimizer steps in all (probe "steps"), so an attempt or a run that resumes
        carries on after its checkpoint's step instead of training from step 0 again (each
        restart may retrain the one step in flight when the kill landed). A run that starts
        over says nothing about resuming: records a failed part and returns False then,
        records nothing and returns True otherwise."""
        counts = []  # (run, restart count, steps): the most any rank took in that attempt
        for run in runs:
            attempts = run.steps_taken()
            if not attempts:
                return self.expect(False, label, measured=f"no optimizer step seen in {run.label}",
                                   expected="torch.optim optimizer steps, seen by the probe")
            counts += [(run, k, max(taken.values())) for k, taken in enumerate(attempts)]
        total, retrained = sum(n for _, _, n in counts), sum(run.restarts for run in runs)
        if steps <= total <= steps + retrained:
            return True
        taken = ", ".join((f"{n} steps" + (f" after restart {k}" if k else "")
                           + (f" in {run.label}" if len(runs) > 1 else "")) for run, k, n in counts)
        return self.expect(False, label, measured=f"optimizer steps taken: {taken}",
                           expected=f"{steps} steps in all: a resumed run carries on after its "
                                    "checkpoint's step" + (f", retraining at most {retrained} "
                                    "step(s) in flight at a kill" if retrained else ""))


    def one_forward_per_step(self, run: Run, nproc: int, size: int, steps: int, label: str,
                             source: str = "") -> bool:
        """One part: on every one of the nproc ranks, one forward pass of the rank's own
        ``size`` items per optimizer step, ``steps`` steps (probe "forwards", on the model
        DDP wraps). Every rank training on the whole global batch (every shard read, or
        gathered) matches a one-process reference too, with nproc x size items a pass.
        source: where the rank's items come from, for the message (" (shard_batch)")."""
        forwards = {rank: record["per_step"] for rank, record in run.probe("forwards").items()}
        want = [[size]] * steps
        good = sorted(forwards) == list(range(nproc)) and all(
            per_step == want for per_step in forwards.values())
        shown = {rank: per_step for rank, per_step in forwards.items() if per_step != want} \
            or forwards
        return self.expect(
            good, label,
            measured="; ".join(f"rank {rank}: {per_step[:3]}{' ...' if len(per_step) > 3 else ''}"
                               for rank, per_step in sorted(shown.items())[:2])
            + " (items in each forward pass through the model, per optimizer step)"
            if forwards else "no forward pass through a DDP model",
            expected=f"{[[size]] * 3} ... on every rank, {steps} steps: one forward pass of the "
                     f"rank's own --batch-size {size} items{source} a step; {nproc * size} is "
                     "every rank's batch, which DDP's averaged gradients stand for")

def run_check(fn: Callable, checker: Checker) -> CheckResult:
    """Run one check function; a crash in it scores 0 with the reason."""
    spec: CheckSpec = fn.__labutils_check__  # type: ignore[attr-defined]  # set by @check
    checker.parts = []
    t0 = time.monotonic()
    result = CheckResult(name=spec.name, points=spec.points, visibility=spec.visibility,
                         hidden=spec.hidden, required=spec.required)
    try:
        fn(checker)
    except Exception as exc:  # noqa: BLE001 - a broken measurement must not stop the other checks
        result.error = f"{type(exc).__name__}: {exc}"
    result.parts = list(checker.parts)
    result.duration_s = time.monotonic() - t0
    return result
