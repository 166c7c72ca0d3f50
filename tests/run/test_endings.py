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

from pathlib import Path

import pytest
from endings_table import ENDINGS, SCRIPT, check_verdict, verdict

from labutils import launch

# (world size, failing rank) beyond (2, last) in the default suite: where the failing
# rank hosts the rendezvous store (rank 0) and peers are several.
FIRST_OF_FOUR = ("sys_exit", "os_exit", "sigkill", "segfault", "return_early", "init_error")
# gloo decides which rank of a size mismatch aborts: with 2 ranks, the one that gets
# more bytes than it expects (the failing rank, which passes fewer); with 4 it depends
# on the ring, so that ending runs with 2 ranks only.
TWO_RANKS_ONLY = ("size_mismatch",)


def cases(all_cases: bool) -> list:
    params = []
    for how in ENDINGS:
        shapes = [(2, 1)]
        if how not in TWO_RANKS_ONLY and (all_cases or how in FIRST_OF_FOUR):
            shapes.append((4, 0))
        if how not in TWO_RANKS_ONLY and all_cases:
            shapes += [(2, 0), (4, 3)]
        params += [pytest.param(how, n, f, id=f"{how}-{n}ranks-rank{f}") for n, f in shapes]
    return params


def pytest_generate_tests(metafunc):
    if "how" in metafunc.fixturenames:
        metafunc.parametrize(("how", "nproc", "failing"),
                             cases(metafunc.config.getoption("--endings-all")))


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
    assert verdict(warm, how) == verdict(cold, how), \
        f"warm and cold differ:\n{verdict(warm, how)}\n{verdict(cold, how)}"
    check_verdict(warm, how, nproc, failing)
