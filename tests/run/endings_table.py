"""The endings table: how a rank of tests/scripts/endings.py ends, and what the launcher
must say about it. Shared by the real runs (test_endings.py, warm and cold) and the
replays of recorded runs through a fake back end (test_replay.py)."""

from __future__ import annotations

import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "endings.py"
SOURCE = SCRIPT.read_text().splitlines()

# how -> what the summary must say of the failing rank: kind, exc_type, its exit code,
# whether the summary names its line (the tagged one), and a phrase of its message.
ENDINGS = {
    "exception": ("exception", "ValueError", 1, True, "the batch is empty"),
    # str() of the exception raises: the rank was once taken for a victim, its peer blamed
    "unprintable_exception": ("exception", "UnprintableError", 1, True,
                              "<UnprintableError: its __str__ raised TypeError>"),
    "sys_exit": ("exit", "SystemExit", 3, True, "exit code 3"),
    "os_exit": ("exit", "exit", 3, False, "exit code 3 without a Python exception"),
    "abort": ("signal", "SIGABRT", -6, True, "killed by SIGABRT"),
    "segfault": ("signal", "SIGSEGV", -11, True, "killed by SIGSEGV"),
    "sigkill": ("signal", "SIGKILL", -9, False, "killed by SIGKILL"),
    "sigterm": ("signal", "SIGTERM", -15, True, "which neither torchrun nor the launcher sent"),
    "thread_error": ("exit", "SystemExit", 1, True, "raised RuntimeError: the loader thread failed"),
    "size_mismatch": ("signal", "SIGABRT", -6, True, "Received data size doesn't match"),
    "return_early": ("early_exit", "exit 0", 0, True, "while rank"),
    "init_error": ("exception", "AssertionError", 1, True, "Unknown backend type"),
    "syntax_error": ("exception", "SyntaxError", 1, True, "was never closed"),
    "dataloader_worker_killed": ("exception", "RuntimeError", 1, True, ""),
    # the summary names the line in the Dataset, where the worker raised, and its message
    "dataloader_worker_error": ("exception", "KeyError", 1, True,
                                "'item 2 is missing' (in DataLoader worker process 0)"),
    "breakpoint_peer": ("exception", "ValueError", 1, True, "the batch is empty"),
    "timeout_mismatch": ("mismatch", "RuntimeError", 1, True, "Timed out waiting"),
    "timeout_one_side": ("mismatch", "RuntimeError", 1, True, "Timed out waiting"),
    "stuck": ("hang", None, None, True, None),
    "stuck_timeout": ("straggler", "SIGTERM", -15, True, "ran outside any collective"),
}
# What torch itself words differently from run to run, for the same ending: a DataLoader
# whose worker was killed raises "DataLoader worker (pid N) is killed by signal: Killed."
# from its SIGCHLD handler, "DataLoader worker (pid(s) N) exited unexpectedly" from its
# status check, or ConnectionResetError or EOFError from the worker's pipe (reset, or
# closed with nothing in it), whichever comes first.
VARIES = {"dataloader_worker_killed": {"exc_type": {"RuntimeError", "ConnectionResetError",
                                                    "EOFError"}}}
# endings whose line is another ending's: breakpoint_peer's failing rank raises as
# "exception" does, while its peers wait at breakpoint(); sigterm's is sigkill's line
# with another signal (the summary names it: the rank dumps its stacks on SIGTERM);
# stuck_timeout's is stuck's, its peers' process-group timeout running out first
LINE_OF = {"breakpoint_peer": "exception", "sigterm": "sigkill", "stuck_timeout": "stuck"}


def tagged_line(how: str) -> int:
    """The line of endings.py tagged `# ending: HOW`."""
    return next(i for i, text in enumerate(SOURCE, 1) if text.endswith(f"# ending: {how}"))


_VOLATILE = (re.compile(r"\[[\d.]+\]:\d+"), re.compile(r"pid \d+"), re.compile(r"\d+ms"))
# A mismatch's message is the gloo timeout of whichever rank's clock ran out first, in a
# send or in a receive (gloo's source line differs with it): the same verdict either way
_EITHER_WAY = ((re.compile(r"\.cc:\d+\]"), ".cc:#]"),
               (re.compile(r"for (send|recv) operation"), "for a send or a recv operation"))


def verdict(summary: dict, how: str = "") -> dict:
    """What a summary says, without times, pids, ports and paths; the victims' own
    exit codes are left out (torchrun's SIGTERM or their own lost-peer error, 1,
    whichever comes first), only that they did not end well; and for ending `how`,
    what torch words differently from run to run (VARIES: exc_type and message)."""
    failure, hang = summary["failure"], summary["hang"]
    out = {"ok": summary["ok"], "reason": summary["reason"], "failure": None, "hang": None}
    if failure:
        message = failure["message"]
        for pattern in _VOLATILE:
            message = pattern.sub("#", message)
        mismatch = failure["kind"] == "mismatch"  # its rank: whichever timed out first
        if mismatch:
            for pattern, said in _EITHER_WAY:
                message = pattern.sub(said, message)
        out["failure"] = {
            "rank": None if mismatch else failure["rank"],
            "kind": failure["kind"], "exc_type": failure["exc_type"], "message": message,
            "where": f"{Path(failure['file']).name}:{failure['line']}"
            if failure["file"] and not mismatch else None,
            "victims": failure["victims"],
            "also_failed": sorted(failure["also_failed"] + ([failure["rank"]] if mismatch else [])),
            "exit_code": None if mismatch else failure["exit_code"],
            "mismatch": {r: {**m, "where": m["where"].rsplit("/", 1)[-1]}
                         for r, m in failure["mismatch"].items()},
        }
        if how in VARIES:
            out["failure"].update(exc_type="varies", message="varies")
    if hang:
        out["hang"] = {"stragglers": hang["stragglers"], "calls": hang["calls"],
                       "waiting": {r: w.rsplit("/", 1)[-1] for r, w in hang["waiting"].items()}}
    out["ended_badly"] = sorted(r["rank"] for r in summary["ranks"] if r["exit_code"] != 0)
    return out


def attempts_verdict(summary: dict) -> list[dict]:
    """What a summary says of each attempt, without times, pids and ports: who failed,
    why, and how that rank ended (its victims' exit codes left out, as verdict() does)."""
    out = []
    for attempt in summary["attempts"]:
        why = attempt.get("why") or ""
        for pattern in _VOLATILE:
            why = pattern.sub("#", why)
        failed = attempt.get("failed_rank")
        out.append({"outcome": attempt["outcome"], "failed_rank": failed, "why": why,
                    "exit_code": attempt["exit_codes"].get(str(failed)),
                    "world_size": attempt["world_size"], "restart_count": attempt["restart_count"]})
    return out


def check_verdict(summary: dict, how: str, nproc: int, failing: int) -> None:
    """The summary gives the right verdict for ending HOW of rank `failing` of `nproc`."""
    kind, exc_type, code, has_line, phrase = ENDINGS[how]
    got = verdict(summary)
    others = [r for r in range(nproc) if r != failing]
    assert got["reason"] == ("hang" if how == "stuck" else "failed"), got
    if how == "stuck":
        assert got["failure"] is None
        assert got["hang"]["stragglers"] == [failing], got
        assert set(got["hang"]["calls"].values()) == {"barrier", ""}, got
        assert got["hang"]["waiting"][str(failing)] == f"endings.py:{tagged_line(how)}", got
        return
    f = got["failure"]
    if how in VARIES:
        assert summary["failure"]["exc_type"] in VARIES[how]["exc_type"], summary["failure"]
        f = {**f, "exc_type": exc_type}
    if how in ("timeout_mismatch", "timeout_one_side"):
        assert (f["kind"], f["victims"], f["also_failed"]) == ("mismatch", [], list(range(nproc)))
        barrier = next(i for i, t in enumerate(SOURCE, 1) if t == "dist.barrier()")
        calls = {int(r): (m["collective"], m["where"]) for r, m in f["mismatch"].items()}
        assert calls == {r: ("all_reduce", f"endings.py:{tagged_line(how)}") if r == failing
                         else ("barrier", f"endings.py:{barrier}") for r in range(nproc)}, got
        return
    assert (f["rank"], f["kind"], f["exc_type"], f["exit_code"]) == \
        (failing, kind, exc_type, code), got
    assert f["where"] == (f"endings.py:{tagged_line(LINE_OF.get(how, how))}" if has_line
                          else None), got
    assert phrase in f["message"], got
    assert (f["victims"], f["also_failed"]) == (others, []), got
    assert got["ended_badly"] == [r for r in range(nproc) if r != failing or code != 0], got
