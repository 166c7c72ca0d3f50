"""Run a lab's checks in a process of their own and hand back the results.

The grader runs, inside the sandbox of one submission::

    python -m labutils.grading.runner --checks DIR --learner DIR --scratch DIR --nonce-stdin

It imports the lab's checks.py from DIR (the grader's pristine copy, never the
learner's), and with --hidden the lab's hidden_checks.py too (checks kept out of the
learner's copy of the lab), runs every @check against the learner's scripts and prints one line
per finished check, then a last one: each is the nonce the grader sent on stdin
followed by JSON. Anything the learner's code prints cannot carry that nonce, so
it cannot pose as a result.

Learners run the same checks from their notebook or a terminal::

    from labutils.grading import run_checks
    run_checks()            # the checks of the lab in this folder, on its scripts
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import linecache
import os
import subprocess
import sys
import threading
import time
import types
from importlib.abc import Loader
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import IO, cast

from labutils.grading.checks import Checker, CheckResult, collect_checks, run_check
from labutils.runtime.procs import make_undumpable

CHECKS_FILE = "checks.py"
HIDDEN_CHECKS_FILE = "hidden_checks.py"   # the grader's only: never in a learner's copy


def load_checks(checks_dir: Path, file: str = CHECKS_FILE, *, source: str | None = None):
    """Import DIR/checks.py (or another file of checks) under a private name, with DIR
    first on the import path; with `source`, the file's text as given (the grader hands
    the hidden checks over that way, so the sandbox never holds them as a file)."""
    path = Path(checks_dir) / file
    folder = str(Path(checks_dir).resolve())
    if source is not None:
        if folder not in sys.path[:1]:
            sys.path.insert(0, folder)
        module = types.ModuleType(f"labutils_lab_{Path(file).stem}")
        module.__file__ = str(path)
        # inspect (the checks' order and lines) reads the text from linecache, not the file
        linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
        exec(compile(source, str(path), "exec"), module.__dict__)   # the lab's own checks
        return module
    if not path.is_file():
        raise FileNotFoundError(f"no {file} in {checks_dir}")
    if folder not in sys.path[:1]:
        sys.path.insert(0, folder)
    # a .py file that exists: a spec with a loader
    spec = cast(ModuleSpec,
                importlib.util.spec_from_file_location(f"labutils_lab_{Path(file).stem}", path))
    module = importlib.util.module_from_spec(spec)
    cast(Loader, spec.loader).exec_module(module)
    return module


_LOADING = threading.Lock()  # one lab's checks at a time: they share sys.modules["checks"]


def lab_checks(checks_dir: Path, *, hidden: bool, hidden_source: str | None = None) -> list:
    """The lab's @check functions: checks.py's, then (hidden=True) hidden_checks.py's
    (from hidden_source when given), each marked hidden."""
    with _LOADING:
        public = load_checks(checks_dir)
        found = collect_checks(public)
        if hidden and (hidden_source is not None
                       or (Path(checks_dir) / HIDDEN_CHECKS_FILE).is_file()):
            secret = collect_checks(_load_hidden(checks_dir, public, hidden_source))
            for fn in secret:
                fn.__labutils_check__.hidden = True  # type: ignore[attr-defined]  # @check's
            found += secret
    return found


def _load_hidden(checks_dir: Path, public, source: str | None = None):
    """hidden_checks.py, whose `from checks import ...` must get this lab's checks.py
    (a process that loads several labs, as the grader does, has seen other labs' too)."""
    before = sys.modules.get("checks")
    sys.modules["checks"] = public
    try:
        return load_checks(checks_dir, HIDDEN_CHECKS_FILE, source=source)
    finally:
        if before is None:
            sys.modules.pop("checks", None)
        else:
            sys.modules["checks"] = before


def hidden_summary(folder: Path) -> dict:
    """{"count", "points", "required"} of the checks only the grader runs (required: how
    many must pass for the lab to pass): counted from hidden_checks.py when it is there,
    else as lab.json records them (a learner's copy)."""
    folder = Path(folder)
    if (folder / HIDDEN_CHECKS_FILE).is_file():
        saved = list(sys.path)
        try:
            with _LOADING:
                specs = [fn.__labutils_check__ for fn in  # type: ignore[attr-defined]
                         collect_checks(_load_hidden(folder, load_checks(folder)))]
        finally:
            sys.path[:] = saved
        return {"count": len(specs), "points": sum(s.points for s in specs),
                "required": sum(s.required for s in specs)}
    config = folder / "lab.json"
    recorded = json.loads(config.read_text()).get("hidden_checks", {}) if config.is_file() else {}
    return {"count": int(recorded.get("count", 0)), "points": float(recorded.get("points", 0)),
            "required": int(recorded.get("required", 0))}


def run_lab_checks(checks_dir: Path, learner_dir: Path, scratch: Path, *,
                   hidden: bool = False, hidden_source: str | None = None,
                   on_result=None, skip: tuple[str, ...] = (),
                   required_first: bool = False) -> tuple[list, list]:
    """Every check of the lab against the learner's scripts: (CheckResults, run summaries).

    hidden: run hidden_checks.py's checks too (the grader does), from hidden_source
    when given. on_result(CheckResult) is called as each check finishes. skip: the
    checks whose names start with one of these are not run (the wrong fixes' scoring
    leaves out the checks of the notebook's answers). required_first: the required
    checks before the others (each in the files' order): a caller that stops at the
    first failed required check (the wrong fixes' scoring) gets there sooner.
    """
    checks = [fn for fn in lab_checks(checks_dir, hidden=hidden, hidden_source=hidden_source)
              if not any(fn.__labutils_check__.name.startswith(p) for p in skip)]
    if required_first:
        checks.sort(key=lambda fn: not fn.__labutils_check__.required)
    config = Path(checks_dir).resolve() / "lab.json"
    edit = json.loads(config.read_text()).get("edit", []) if config.is_file() else []
    checker = Checker(learner_dir=learner_dir, checks_dir=checks_dir, scratch=scratch, edit=edit)
    results = []
    for fn in checks:
        results.append(run_check(fn, checker))
        if on_result is not None:
            on_result(results[-1])
    return results, [run.summary() for run in checker.cache.values()]


def format_result(r: CheckResult) -> str:
    """One check as text: its score and title, then its parts."""
    return "\n".join([f"{r.score:g}/{r.points:g}  {r.name}{'  (hidden check)' if r.hidden else ''}"
                      f"{'  (required)' if r.required else ''}",
                      *("    " + line for line in r.output().splitlines())])


def format_total(results: list[CheckResult]) -> str:
    return f"total: {sum(r.score for r in results):g}/{sum(r.points for r in results):g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labutils.grading.runner")
    p.add_argument("--checks", required=True, help="folder with the lab's checks.py")
    p.add_argument("--learner", required=True, help="folder with the learner's scripts")
    p.add_argument("--scratch", required=True, help="folder for runs")
    p.add_argument("--hidden", action="store_true",
                   help=f"run the lab's {HIDDEN_CHECKS_FILE} too (what the grader does)")
    p.add_argument("--nonce-stdin", action="store_true",
                   help="read a nonce from stdin and prefix the result line with it")
    p.add_argument("--hidden-stdin", action="store_true",
                   help=f"then read {HIDDEN_CHECKS_FILE}'s text from stdin, as one JSON string "
                   "(implies --hidden)")
    ns = p.parse_args(argv)
    make_undumpable()   # what it reads from stdin stays in this process
    nonce = sys.stdin.readline().strip() if ns.nonce_stdin else ""
    hidden_source = json.loads(sys.stdin.readline()) if ns.hidden_stdin else None
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the checks or the scripts print goes to stderr
    sys.stdout = sys.stderr

    def send(payload: dict) -> None:
        result_out.write(nonce + json.dumps(payload) + "\n")
        result_out.flush()

    t0 = time.monotonic()
    try:
        _, runs = run_lab_checks(Path(ns.checks), Path(ns.learner), Path(ns.scratch),
                                 hidden=ns.hidden or ns.hidden_stdin, hidden_source=hidden_source,
                                 on_result=lambda r: send({"test": r.to_json()}))
        send({"done": True, "runs": runs, "duration_s": round(time.monotonic() - t0, 2)})
    except Exception as exc:  # noqa: BLE001 - reported to the grader as a checks error
        import traceback

        send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    return 0


def run_checks(folder: str | os.PathLike = ".", *, quiet: bool = False,
               hidden: bool = False) -> list[CheckResult]:
    """Run the lab's public checks on the scripts in ``folder`` and print the results.

    The checks run in a separate process (never in the notebook's kernel), exactly as
    the grader runs them, minus the notebook itself and the hidden checks (the grader
    runs those too; the total says how many).

    Args:
        folder: the lab folder (with checks.py and your scripts).
        quiet: return the results without printing them.
        hidden: run the hidden checks too (an instructor's copy of the lab has them).
    """
    folder = Path(folder).resolve()
    if hidden and not (folder / HIDDEN_CHECKS_FILE).is_file():
        raise FileNotFoundError(f"hidden=True: no {HIDDEN_CHECKS_FILE} in {folder} (a learner's "
                                "copy has none; run the hidden checks from the lab's own folder)")
    scratch = folder / "runs" / f"checks-{time.strftime('%Y%m%d-%H%M%S')}"
    scratch.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "labutils.grading.runner", "--checks", str(folder),
               "--learner", str(folder), "--scratch", str(scratch), *(["--hidden"] if hidden else [])]
    results, errors = [], []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) as proc:
        for line in cast(IO[str], proc.stdout):  # stdout=PIPE
            message = json.loads(line) if line.startswith("{") else {}
            if "test" in message:
                results.append(CheckResult.from_json(message["test"]))
                if not quiet:
                    print(format_result(results[-1]), flush=True)
            errors += [message["error"]] if "error" in message else []
    if errors or proc.returncode:
        raise RuntimeError(f"the checks could not run: {errors[0] if errors else proc.returncode}")
    if not quiet:
        print(format_total(results))
        more = hidden_summary(folder)
        if more["count"] and not hidden:
            print(f"The grader also runs {more['count']} hidden check"
                  f"{'s' if more['count'] > 1 else ''} worth {more['points']:g} points, not in "
                  "this copy: they measure the same fix in other cases"
                  + (f"; {more['required']} of them must pass for the lab to pass."
                     if more["required"] else "."))
    return results


if __name__ == "__main__":
    sys.exit(main())
