"""The `labutils` command: launch, doctor, grade, k8s, slurm."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from labutils.errors import LabutilsError, LaunchConfigError
from labutils.run.result import EXIT_INTERRUPTED, EXIT_USAGE


def _launch_parser(sub) -> None:
    p = sub.add_parser(
        "launch", help="run a script on N ranks with torchrun",
        description="Run SCRIPT on N ranks; print '[rank N] line' as lines arrive and a "
        "summary at the end. Exit status: 0 ok, 1 a rank failed, 2 usage error, "
        "3 hang detected, 4 timeout, 130 interrupted.",
    )
    p.add_argument("-n", "--nproc", type=int, default=2,
                   help="ranks per agent; with one agent, on this machine (default 2)")
    p.add_argument("script", help="the training script (.py)")
    p.add_argument("--hang-timeout", type=float, default=30.0,
                   help="seconds without progress before a hang is reported (0: never)")
    p.add_argument("--timeout", type=float, default=None, help="wall-clock limit in seconds")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a failure")
    p.add_argument("--nnodes", default="1",
                   help="torchrun --nnodes, N or MIN:MAX; the nodes are agents on this machine "
                   "joining one c10d rendezvous (default 1)")
    p.add_argument("--local-agents", type=int, default=None,
                   help="agents started on this machine, each with -n ranks (default: MAX)")
    p.add_argument("--rdzv-conf", default=None,
                   help="rendezvous settings KEY=VALUE,... e.g. last_call_timeout=5")
    node = p.add_argument_group(
        "one node of a job across machines",
        "run the same command on every machine with its own --node-rank; with a log "
        "folder the machines share, each node shows every rank")
    node.add_argument("--node-rank", type=int, default=None,
                      help="this machine's node rank, 0..N-1 (static rendezvous)")
    node.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                      help="where the nodes meet: node 0's address and a free port")
    node.add_argument("--rdzv-id", default=None, metavar="ID",
                      help="the job's name, the same on every node (names the run folder)")
    sched = p.add_argument_group(
        "through a scheduler", "submit the run as a batch job of --nnodes nodes x -n ranks "
        "and follow it here; stop, Ctrl-C, timeout and hang cancel it")
    sched.add_argument("--scheduler", choices=["slurm"], default=None,
                       help="slurm: sbatch, then follow the job (the run folder must be shared)")
    sched.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's)")
    sched.add_argument("--time-limit", default=None, metavar="HH:MM:SS",
                       help="SLURM time limit (default 00:30:00)")
    fault = p.add_argument_group(
        "fault injection", "kill something at a step the script reports with "
        "labutils.dist.report(step=...); needs --max-restarts >= 1")
    who = fault.add_mutually_exclusive_group()
    who.add_argument("--kill-rank", type=int, default=None,
                     help="SIGKILL this rank inside its report(step=STEP) in the first attempt")
    who.add_argument("--kill-agent", type=int, default=None,
                     help="SIGKILL this agent and its ranks when one of them reports STEP "
                     "(a node leaves; needs --nnodes MIN:MAX with several agents)")
    fault.add_argument("--kill-at-step", default=None, metavar="STEP",
                       help="the step, or LO:HI for a step drawn with --fault-seed")
    fault.add_argument("--fault-seed", type=int, default=0, help="seed for a LO:HI step (default 0)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--log-dir", default=None, help="where run folders go (default ./runs)")
    p.add_argument("--json", dest="json_file", default=None, help="write the run summary here")
    p.epilog = "Arguments for the script go after --: labutils launch -n 4 train.py -- --epochs 2"


def _fault(ns: argparse.Namespace) -> dict | None:
    """The fault= argument of launch() from --kill-rank/--kill-agent and --kill-at-step."""
    who = ("rank", ns.kill_rank) if ns.kill_rank is not None else \
        ("agent", ns.kill_agent) if ns.kill_agent is not None else None
    if who is None and ns.kill_at_step is None:
        return None
    if who is None or ns.kill_at_step is None:
        raise LaunchConfigError(
            "fault", expected="--kill-rank R (or --kill-agent A) together with --kill-at-step S",
            given=f"--kill-at-step {ns.kill_at_step}" if who is None else f"--kill-{who[0]} {who[1]}",
            fix="pass both, e.g. --kill-rank 1 --kill-at-step 5 --max-restarts 1")
    text = ns.kill_at_step
    try:
        lo, _, hi = text.partition(":")
        step = (int(lo), int(hi)) if hi else int(lo)
    except ValueError:
        raise LaunchConfigError("--kill-at-step", expected="a step S or a range LO:HI", given=text,
                                fix="pass e.g. --kill-at-step 5 or --kill-at-step 3:8") from None
    fault = {who[0]: who[1], "step": step}
    if isinstance(step, tuple):
        fault["seed"] = ns.fault_seed
    return fault


def _rdzv_conf(text: str | None) -> dict | None:
    if not text:
        return None
    pairs = [item.partition("=") for item in text.split(",") if item]
    if any(not k or not sep for k, sep, _ in pairs):
        raise LaunchConfigError("--rdzv-conf", expected="KEY=VALUE pairs separated by commas",
                                given=text, fix="pass e.g. --rdzv-conf last_call_timeout=5")
    return {k: v for k, _, v in pairs}


def launch_kwargs(ns: argparse.Namespace) -> dict:
    """launch()'s keyword arguments from the parsed command line (display aside)."""
    return dict(
        args=ns.script_args, backend=ns.backend, hang_timeout=ns.hang_timeout or None,
        timeout=ns.timeout, max_restarts=ns.max_restarts, log_dir=ns.log_dir,
        nnodes=int(ns.nnodes) if ns.nnodes.isdigit() else ns.nnodes,
        local_agents=ns.local_agents, fault=_fault(ns), rdzv_conf=_rdzv_conf(ns.rdzv_conf),
        node_rank=ns.node_rank, rdzv_endpoint=ns.rdzv_endpoint, rdzv_id=ns.rdzv_id,
        **_scheduler(ns),
    )


def _scheduler(ns: argparse.Namespace) -> dict:
    slurm = {k: v for k, v in (("partition", ns.partition), ("time_limit", ns.time_limit))
             if v is not None}
    if ns.scheduler is None:
        if slurm:
            raise LaunchConfigError("--partition/--time-limit", expected="--scheduler slurm with them",
                                    given=slurm, fix="add --scheduler slurm")
        return {}
    return {"scheduler": ns.scheduler, "slurm": slurm or None}


_ended_by: list[int] = []  # the signals that ended this CLI's run, as they came


def _end_on(signum: int, frame) -> None:
    """SIGTERM or SIGHUP: stop the run the way Ctrl-C does."""
    _ended_by.append(signum)
    raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")


def _cmd_launch(ns: argparse.Namespace) -> int:
    from labutils.notebook.display import TextDisplay
    from labutils.run.launcher import last_result, launch

    kwargs = launch_kwargs(ns)
    # What `timeout`, systemd, schedulers and a closed terminal send: stop every rank,
    # write the summary, exit 128 + the signal (143, 129), as Ctrl-C exits 130.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _end_on)
    try:
        result = launch(ns.script, ns.nproc, display=TextDisplay(limit=None), **kwargs)
    except KeyboardInterrupt:
        result = last_result()
        if result is not None and ns.json_file:
            result.write_json(ns.json_file)
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


def _grade_parser(sub) -> None:
    p = sub.add_parser(
        "grade", help="grade submissions of a lab: run each notebook, then the checks",
        description="Grade SUBMISSIONs (notebooks, or folders with one) of the lab in LAB: "
        "run each notebook with papermill in a sandbox, then the lab's checks on the "
        "submitted scripts in a separate process. Writes DIR/<name>/results.json "
        "(Gradescope format), DIR/<name>/feedback.html and DIR/grades.csv. Exit status: 0 "
        "when grading worked, whatever the scores; 1 when the grader failed on a "
        "submission; 2 for a usage error.",
    )
    p.add_argument("lab", help="the lab folder (lab.json, notebook, scripts, checks.py)")
    p.add_argument("submissions", nargs="+", metavar="SUBMISSION",
                   help="a submitted notebook (its folder holds the scripts) or a folder")
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
    print(f"results in {ns.out}/ (grades.csv, and per submission results.json, feedback.html)")
    return 1 if any(r.get("grader_error") for r in results) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labutils", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _launch_parser(sub)
    d = sub.add_parser("doctor", help="report torch, backends, GPUs, cores and advice")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    _grade_parser(sub)
    from labutils.cluster import kubernetes, slurm

    kubernetes.add_subcommand(sub)
    slurm.add_subcommand(sub)
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


def main(argv: list[str] | None = None) -> int:
    _die_with_caller()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # everything after the first -- belongs to the script
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.script_args = script_args
    try:
        if ns.command == "launch":
            return _cmd_launch(ns)
        if ns.command == "doctor":
            return _cmd_doctor(ns)
        if ns.command == "grade":
            return _cmd_grade(ns)
        if getattr(ns, "handler", None):  # labutils k8s, labutils slurm
            return ns.handler(ns)
    except LabutilsError as exc:  # bad input, or a scheduler that does not answer
        print(f"labutils {ns.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser.error(f"unknown command {ns.command}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
