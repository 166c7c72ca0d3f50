"""What the launcher says about a run, over the ways a rank can end, warm and cold.

Each ending is a branch of tests/scripts/endings.py: one rank (the failing rank) ends
that way while its peers go on into a collective. The JSON summary of a warm run and
of a cold run must both give the right verdict (root-cause rank, how it ended, its
exception or signal, its line, its victims, exit codes, hang) and must be equal apart
from times, pids, ports and paths.

The suite runs every ending with 2 ranks, the failing rank last, and the endings where
the position matters with 4 ranks, the failing rank first; `pytest --endings-all`
runs every ending in all four (2 or 4 ranks, failing rank first or last).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from labutils import launch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "endings.py"
SOURCE = SCRIPT.read_text().splitlines()

pytestmark = pytest.mark.slow


def tagged_line(how: str) -> int:
    """The line of endings.py tagged `# ending: HOW`."""
    return next(i for i, text in enumerate(SOURCE, 1) if text.endswith(f"# ending: {how}"))


# how -> what the summary must say of the failing rank: kind, exc_type, its exit code,
# whether the summary names its line (the tagged one), and a phrase of its message.
ENDINGS = {
    "exception": ("exception", "ValueError", 1, True, "the batch is empty"),
    "sys_exit": ("exit", "SystemExit", 3, True, "exit code 3"),
    "os_exit": ("exit", "exit", 3, False, "exit code 3 without a Python exception"),
    "abort": ("signal", "SIGABRT", -6, True, "killed by SIGABRT"),
    "segfault": ("signal", "SIGSEGV", -11, True, "killed by SIGSEGV"),
    "sigkill": ("signal", "SIGKILL", -9, False, "killed by SIGKILL"),
    "thread_error": ("exit", "SystemExit", 1, True, "raised RuntimeError: the loader thread failed"),
    "size_mismatch": ("signal", "SIGABRT", -6, True, "Received data size doesn't match"),
    "return_early": ("early_exit", "exit 0", 0, True, "while rank"),
    "init_error": ("exception", "AssertionError", 1, True, "Unknown backend type"),
    "syntax_error": ("exception", "SyntaxError", 1, True, "was never closed"),
    "dataloader_worker_killed": ("exception", "RuntimeError", 1, True, "DataLoader worker"),
    "breakpoint_peer": ("exception", "ValueError", 1, True, "the batch is empty"),
    "timeout_mismatch": ("mismatch", "RuntimeError", 1, True, "Timed out waiting"),
    "stuck": ("hang", None, None, True, None),
}
# endings whose line is another ending's: breakpoint_peer's failing rank raises as
# "exception" does, while its peers wait at breakpoint()
LINE_OF = {"breakpoint_peer": "exception"}
# (world size, failing rank) beyond (2, last) in the default suite: where the failing
# rank hosts the rendezvous store (rank 0) and peers are several.
FIRST_OF_FOUR = ("sys_exit", "os_exit", "sigkill", "segfault", "return_early", "init_error")
# gloo decides which rank of a size mismatch aborts: with 2 ranks, the one that gets
# more bytes than it expects (the failing rank, which passes fewer); with 4 it depends
# on the ring, so that ending runs with 2 ranks only.
TWO_RANKS_ONLY = ("size_mismatch",)


def cases(all_cases: bool) -> list:
    cases = []
    for how in ENDINGS:
        shapes = [(2, 1)]
        if how not in TWO_RANKS_ONLY and (all_cases or how in FIRST_OF_FOUR):
            shapes.append((4, 0))
        if how not in TWO_RANKS_ONLY and all_cases:
            shapes += [(2, 0), (4, 3)]
        cases += [pytest.param(how, n, f, id=f"{how}-{n}ranks-rank{f}") for n, f in shapes]
    return cases


def pytest_generate_tests(metafunc):
    if "how" in metafunc.fixturenames:
        metafunc.parametrize(("how", "nproc", "failing"),
                             cases(metafunc.config.getoption("--endings-all")))


_VOLATILE = (re.compile(r"\[[\d.]+\]:\d+"), re.compile(r"pid \d+"), re.compile(r"\d+ms"),
             # torch's DataLoader says "is killed by signal: Killed." or "(pid(s) N) exited
             # unexpectedly", whichever of its two checks sees the dead worker first
             re.compile(r"(?<=DataLoader worker ).*"))


def verdict(summary: dict) -> dict:
    """What a summary says, without times, pids, ports and paths; the victims' own
    exit codes are left out (torchrun's SIGTERM or their own lost-peer error, 1,
    whichever comes first), only that they did not end well."""
    failure, hang = summary["failure"], summary["hang"]
    out = {"ok": summary["ok"], "reason": summary["reason"], "failure": None, "hang": None}
    if failure:
        message = failure["message"]
        for pattern in _VOLATILE:
            message = pattern.sub("#", message)
        out["failure"] = {
            "rank": failure["rank"] if failure["kind"] != "mismatch" else None,
            "kind": failure["kind"], "exc_type": failure["exc_type"], "message": message,
            # a mismatch's own rank and line are whichever rank timed out first
            "where": f"{Path(failure['file']).name}:{failure['line']}"
            if failure["file"] and failure["kind"] != "mismatch" else None,
            "victims": failure["victims"], "also_failed": sorted(
                failure["also_failed"] + ([failure["rank"]] if failure["kind"] == "mismatch" else [])),
            "exit_code": failure["exit_code"] if failure["kind"] != "mismatch" else None,
            "mismatch": failure["mismatch"],
        }
    if hang:
        out["hang"] = {"stragglers": hang["stragglers"], "waiting": hang["waiting"],
                       "calls": hang["calls"]}
    out["ended_badly"] = sorted(r["rank"] for r in summary["ranks"] if r["exit_code"] != 0)
    return out


def expected(how: str, nproc: int, failing: int) -> dict:
    kind, exc_type, code, has_line, phrase = ENDINGS[how]
    others = [r for r in range(nproc) if r != failing]
    return {"kind": kind, "exc_type": exc_type, "exit_code": code, "victims": others,
            "where": f"endings.py:{tagged_line(LINE_OF.get(how, how))}" if has_line else None,
            "phrase": phrase}


def run_ending(how: str, nproc: int, failing: int, tmp_path: Path, *, warm: bool) -> dict:
    result = launch(SCRIPT, nproc=nproc, args=[how, str(failing)], display="none",
                    hang_timeout=4 if how == "stuck" else 30, timeout=90,
                    log_dir=tmp_path, warm=warm)
    assert result.to_json()["start"] == ("warm" if warm else "cold")
    return result.to_json()


def test_the_launcher_names_the_rank_that_ended_first_and_its_victims(
        how, nproc, failing, tmp_path, monkeypatch):
    monkeypatch.delenv("LABUTILS_START", raising=False)
    warm = run_ending(how, nproc, failing, tmp_path, warm=True)
    cold = run_ending(how, nproc, failing, tmp_path, warm=False)
    assert verdict(warm) == verdict(cold), f"warm and cold differ:\n{verdict(warm)}\n{verdict(cold)}"
    check_verdict(warm, how, nproc, failing)


def check_verdict(summary: dict, how: str, nproc: int, failing: int) -> None:
    got, want = verdict(summary), expected(how, nproc, failing)
    assert got["reason"] == ("hang" if how == "stuck" else "failed"), got
    if how == "stuck":
        assert got["failure"] is None
        assert got["hang"]["stragglers"] == [failing], got
        assert set(got["hang"]["calls"].values()) == {"barrier", ""}, got
        assert summary["hang"]["waiting"][str(failing)].endswith(f":{tagged_line(how)}")
    elif how == "timeout_mismatch":
        f = got["failure"]
        assert (f["kind"], f["victims"], f["also_failed"]) == ("mismatch", [], list(range(nproc)))
        calls = {int(r): (m["collective"], m["where"].rsplit(":", 1)[1]) for r, m in f["mismatch"].items()}
        barrier = next(i for i, t in enumerate(SOURCE, 1) if t == "dist.barrier()")
        assert calls == {r: ("all_reduce", str(tagged_line(how))) if r == failing
                         else ("barrier", str(barrier)) for r in range(nproc)}
    else:
        f = got["failure"]
        assert (f["rank"], f["kind"], f["exc_type"], f["exit_code"]) == \
            (failing, want["kind"], want["exc_type"], want["exit_code"]), got
        assert f["where"] == want["where"], got
        assert want["phrase"] in f["message"], got
        assert (f["victims"], f["also_failed"]) == (want["victims"], []), got
        ended_badly = [r for r in range(nproc) if r != failing or want["exit_code"] != 0]
        assert got["ended_badly"] == ended_badly, got
