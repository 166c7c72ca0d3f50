"""The `labutils` command: launch, doctor, grade, debug, release, wrongfixes, autograder,
export, k8s, slurm."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Mapping
from typing import NoReturn

from labutils.errors import InputError, LabutilsError, cannot_write
from labutils.run.options import (
    add_launch_arguments,
    command_line_error,
    launch_kwargs,
    parser_error_line,
    split_script_args,
)
from labutils.run.result import EXIT_INTERRUPTED, EXIT_USAGE


def _launch_parser(sub) -> None:
    p = sub.add_parser(
        "launch", help="run a script on N ranks with torchrun",
        description="Run SCRIPT on N ranks; print '[rank N] line' as lines arrive and a "
        "summary at the end. Exit status: 0 ok, 1 a rank failed, 2 usage error, "
        "3 hang detected, 4 timeout, 130 interrupted (Ctrl-C), 143 SIGTERM, 129 SIGHUP.",
        epilog="Arguments for the script go after --: labutils launch -n 4 train.py -- --epochs 2",
    )
    add_launch_arguments(p)
    p.add_argument("--json", dest="json_file", default=None, help="write the run summary here")


_ended_by: list[int] = []  # the signals that ended this CLI's run, as they came


def _end_on(signum: int, frame) -> None:
    """SIGTERM or SIGHUP: stop the run the way Ctrl-C does."""
    _ended_by.append(signum)
    raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")


def _can_type() -> bool:
    """Whether this terminal can be a rank's debugger: not when stdin is the null device
    (nohup, a node of a virtual cluster or of a SLURM job), where pdb would read the end
    of its input at once and quit the rank (q) before anyone typed; the display then
    says how to attach from a terminal (labutils debug), as it does for a notebook's
    ranks on another node. A pipe or a file still types commands, as a user would."""
    try:
        return not os.path.samestat(os.fstat(0), os.stat(os.devnull))
    except OSError:  # stdin closed
        return False


def _cmd_launch(ns: argparse.Namespace) -> int:
    from labutils.notebook.display import TextDisplay
    from labutils.run.launcher import last_result, launch

    kwargs = launch_kwargs(ns)  # script, nproc and the rest; bad combinations raise here
    why = ns.json_file and cannot_write(ns.json_file, folder=False)
    if why:  # said before the run, not after it as a traceback
        raise InputError("--json", expected="a file in a folder this user can write",
                         given=f"{ns.json_file} ({why})",
                         fix="pass e.g. --json summary.json, or leave it out")
    # What `timeout`, systemd, schedulers and a closed terminal send: stop every rank,
    # write the summary, exit 128 + the signal (143, 129), as Ctrl-C exits 130.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _end_on)
    try:
        result = launch(display=TextDisplay(limit=None, console=_can_type()), **kwargs)
    except KeyboardInterrupt:
        last = last_result()
        if last is not None and ns.json_file:
            last.write_json(ns.json_file)
        return 128 + _ended_by[0] if _ended_by else EXIT_INTERRUPTED
    if ns.json_file:
        result.write_json(ns.json_file)
    return result.exit_status


def _cmd_doctor(ns: argparse.Namespace) -> int:
    from labutils.course.doctor import environment_report

    report = environment_report()
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        from labutils.course.doctor import format_report

        print(format_report(report))
    return 0


def _debug_parser(sub) -> None:
    p = sub.add_parser(
        "debug", help="attach this terminal to a rank that waits at a breakpoint",
        description="Attach this terminal to the debugger of a rank of RUN_FOLDER that "
        "stopped at breakpoint() or torch.distributed.breakpoint() (a run started from a "
        "notebook in text mode says which). pdb's c continues, q ends the run. Exit status: "
        "0 after the session, 2 when no rank of the run waits for a debugger.")
    p.add_argument("run_folder", help="the run's folder (runs/...)")
    p.add_argument("--rank", type=int, default=None, help="which rank (default: the one waiting)")


def _not_waiting(run_folder: str, rank: int | None, waiting: dict[int, str]) -> str:
    """Why `labutils debug RUN_FOLDER [--rank R]` has nothing to attach to ("" when it has)."""
    if not os.path.isdir(run_folder):
        there = "it is a file" if os.path.exists(run_folder) else "there is no such folder"
        return (f"{run_folder}: expected a run folder (runs/...), and {there}; "
                f"the current folder is {os.getcwd()}")
    if rank is None and waiting or rank in waiting:
        return ""
    if rank is None:
        head = f"no rank of {run_folder} waits for a debugger now"
    else:
        head = f"rank {rank} of {run_folder} does not wait for a debugger now"
    if not waiting:
        return f"{head}; expected a rank stopped at breakpoint()"
    ranks = ", ".join(map(str, sorted(waiting)))
    return (f"{head}; rank {ranks} {'does' if len(waiting) == 1 else 'do'}: leave out --rank "
            "or pick one of them")


def _cmd_debug(ns: argparse.Namespace) -> int:
    from labutils.runtime.debugger import bridge_terminal, waiting_sockets

    waiting = waiting_sockets(ns.run_folder)
    message = _not_waiting(ns.run_folder, ns.rank, waiting)
    if message:
        print(f"labutils debug: {message}", file=sys.stderr)
        return EXIT_USAGE
    rank, path = min((r, s) for r, s in waiting.items() if ns.rank in (None, r))
    print(f"[labutils] attached to rank {rank} (pdb: c continues, q ends the run)", flush=True)
    bridge_terminal(path)
    return 0


def _grade_parser(sub) -> None:
    p = sub.add_parser(
        "grade", help="grade submissions of a lab: run each notebook, then the checks",
        description="Grade SUBMISSIONs (notebooks, folders with one, or Canvas's Download "
        "Submissions zip) of the lab in LAB: "
        "run each notebook with papermill in a sandbox, then the lab's checks on the "
        "submitted scripts in a separate process. Writes DIR/<name>/results.json "
        "(Gradescope format), DIR/<name>/feedback.html and DIR/grades.csv. Exit status: 0 "
        "when grading worked, whatever the scores; 1 when the grader failed on a "
        "submission; 2 for a usage error; 130 when interrupted (Ctrl-C).",
    )
    p.add_argument("lab", help="the lab folder (lab.json, notebook, scripts, checks.py)")
    p.add_argument("submissions", nargs="+", metavar="SUBMISSION",
                   help="a submitted notebook (its folder holds the scripts), a folder, or a "
                   "Canvas zip")
    p.add_argument("--out", default="grades", help="where results go (default ./grades)")
    p.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default 1)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds for each whole notebook (default: the lab's, else 300)")
    p.add_argument("--no-isolation", dest="isolate", action="store_false",
                   help="no namespaces, only resource limits (for debugging the grader)")


def _cmd_grade(ns: argparse.Namespace) -> int:
    from labutils.grading.batch import GradingError, grade

    try:
        results = grade(ns.lab, ns.submissions, out_dir=ns.out, jobs=ns.jobs,
                        timeout=ns.timeout, isolate=ns.isolate)
    except GradingError as exc:
        print(f"labutils grade: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("labutils grade: interrupted; every submission still running was stopped",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"results in {ns.out}/ (grades.csv, checks.csv and checks.png: which checks fail "
          "most; per submission results.json, feedback.html)")
    return 1 if any(r.get("grader_error") for r in results) else 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with every refusal one line (options.parser_error_line) instead
    of the usage block and the message; subcommands' parsers are of this class too."""

    words: list[str] = []  # the command line being parsed (main sets it)
    commands: Mapping[str, argparse.ArgumentParser] = {}  # the subcommands' parsers (build_parser)

    def error(self, message: str) -> NoReturn:
        said = parser_error_line(self, message, help_says="--help", words=_Parser.words)
        print(f"{self.prog}: {said}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> _Parser:
    parser = _Parser(prog="labutils", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices
    _launch_parser(sub)
    d = sub.add_parser("doctor", help="report torch, backends, GPUs, cores and advice")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    _grade_parser(sub)
    _debug_parser(sub)
    from labutils.cluster import kubernetes, slurm
    from labutils.grading import export, gradescope, release, wrongfix

    for module in (release, wrongfix, gradescope, export, kubernetes, slurm):
        module.add_subcommand(sub)
    return parser


def _die_with_caller() -> None:
    """Started by a labutils process that asked for it (LABUTILS_DIE_WITH=pid, e.g. the
    other nodes of a job on virtual hosts): end with that process, whatever kills it."""
    import os

    from labutils.runtime.procs import die_with_parent
    from labutils.runtime.runfiles import ENV_DIE_WITH

    pid = os.environ.pop(ENV_DIE_WITH, "")
    if pid.isdigit():
        die_with_parent(int(pid))


def _script_args_hint(argv: list[str], ns: argparse.Namespace, extra: list[str]) -> str:
    """How to pass words that `labutils launch` did not know, when they come after the
    script (as torchrun takes them: `torchrun train.py --epochs 2`): after --. "" when
    some come before it (a misspelt option of the launcher's own)."""
    if ns.command != "launch" or ns.script not in argv:
        return ""
    after = argv[argv.index(ns.script) + 1:]
    if any(word not in after for word in extra):
        return ""
    return (f"the script's own arguments go after --: labutils launch [options] {ns.script} -- "
            f"{' '.join(extra)}")


def _option_hint(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """The options nearest to an unknown one ("--nprocs": -n/--nproc), and where all are listed."""
    unknown = next((word for word in extra if word.startswith("-")), None)
    if unknown is None:
        return f"{parser.prog} --help lists what it takes"
    import difflib

    names = [name for action in parser._actions for name in action.option_strings]
    near = difflib.get_close_matches(unknown.split("=", 1)[0], names, n=2, cutoff=0.6)
    said = f"did you mean {' or '.join(near)}? " if near else ""
    return f"{unknown} is no option of {parser.prog}; {said}{parser.prog} --help lists them"


def main(argv: list[str] | None = None) -> int:
    _die_with_caller()
    argv, script_args = split_script_args(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    _Parser.words = argv
    ns, extra = parser.parse_known_args(argv)
    if extra:
        hint = _script_args_hint(argv, ns, extra) or _option_hint(parser.commands[ns.command], extra)
        print(f"labutils {ns.command}: unrecognized arguments: {' '.join(extra)}; {hint}",
              file=sys.stderr)
        return EXIT_USAGE
    ns.script_args = script_args
    try:
        if ns.command == "launch":
            return _cmd_launch(ns)
        if ns.command == "doctor":
            return _cmd_doctor(ns)
        if ns.command == "grade":
            return _cmd_grade(ns)
        if ns.command == "debug":
            return _cmd_debug(ns)
        if getattr(ns, "handler", None):  # labutils k8s, labutils slurm
            return ns.handler(ns)
    except LabutilsError as exc:  # bad input, or a scheduler that does not answer
        said = command_line_error(exc) if ns.command == "launch" and isinstance(exc, InputError) else exc
        print(f"labutils {ns.command}: {said}", file=sys.stderr)
        return EXIT_USAGE
    parser.error(f"unknown command {ns.command}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
