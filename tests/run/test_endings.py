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

import tempfile
from pathlib import Path

import pytest
from endings_table import ENDINGS, SCRIPT, attempts_verdict, check_verdict, verdict
from slurm_fixture import slurm_cluster, slurm_queue  # noqa: F401  (a local SLURM cluster)

from labutils import launch
from labutils.run import warm as warm_start

# (world size, failing rank) beyond (2, last) in the default suite: where the failing
# rank hosts the rendezvous store (rank 0) and peers are several.
FIRST_OF_FOUR = ("sys_exit", "os_exit", "sigkill", "segfault", "return_early", "init_error",
                 "stuck_timeout")
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


# on a machine without a GPU, nothing: the runs share the warm server of the other tests
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""} if warm_start.ranks_see_a_gpu({}) else {}


def run_ending(how: str, nproc: int, failing: int, tmp_path: Path, *, warm: bool,
               max_restarts: int = 0) -> dict:
    # gloo named and the GPUs hidden: a run whose ranks can see a GPU starts cold by
    # itself (run/warm.py), and the endings are the CPU's, the same on any machine. The
    # ranks' temporary folder is the test's: a DataLoader worker killed after it sent a
    # batch leaves its multiprocessing folder (pymp-*) behind, as it does without the
    # launcher; a short path, since that folder holds a Unix socket (108 bytes at most).
    with tempfile.TemporaryDirectory(prefix="endings-") as tmp:
        result = launch(SCRIPT, nproc=nproc, args=[how, str(failing)], display="none",
                        backend="gloo", hang_timeout=4 if how == "stuck" else 30, timeout=90,
                        log_dir=tmp_path, warm=warm, max_restarts=max_restarts,
                        env={"TMPDIR": tmp, **HIDE_GPUS})
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


# With a restart, each ending twice: the first attempt's entry and the last's, warm and
# cold alike. A restarted rank writes to its stderr.log again: the thread's failure once
# lent the first attempt the second's half-written traceback (seen warm; the fake back
# end of test_follow_order.py replays it).
@pytest.mark.parametrize("ending", ["sys_exit", "thread_error", "segfault"])
def test_a_restarted_run_says_the_same_of_each_attempt_warm_and_cold(ending, tmp_path, monkeypatch):
    monkeypatch.delenv("LABUTILS_START", raising=False)
    warm = run_ending(ending, 2, 1, tmp_path, warm=True, max_restarts=1)
    cold = run_ending(ending, 2, 1, tmp_path, warm=False, max_restarts=1)
    assert (verdict(warm, ending), attempts_verdict(warm)) == (verdict(cold, ending), attempts_verdict(cold))
    check_verdict(warm, ending, 2, 1)
    first, last = attempts_verdict(warm)
    assert (first["outcome"], last["outcome"]) == ("restarted", "failed")
    assert first == {**last, "outcome": "restarted", "restart_count": 0}
    assert last["exit_code"] == ENDINGS[ending][2] and ENDINGS[ending][4] in last["why"]


# The same contract through the SLURM back end: the six endings that once named the wrong
# rank (the table), a SIGTERM from outside (once read there as torchrun's,
# blaming rank 0's lost connection) and an error in init_process_group (rank 0, stopped
# by its node, once showed no exit code and was no victim: the keeper ended the agent
# before it wrote how rank 0 ended), each of the 2 ranks on a SLURM node of its own (a
# labutils node launcher each, cold, following one shared run folder), the failing rank
# last; and a rank that fails while its peer waits at a breakpoint (every node's
# launcher read the end of srun's input as its terminal's, one quit the peer's debugger);
# and a rank outside any collective until its peer's barrier timed out (its line read
# from the stacks it dumped as its node stopped it).
# All the endings pass there (checked once, 2026-11-28).
SLURM_ENDINGS = ("sys_exit", "os_exit", "abort", "segfault", "sigkill", "thread_error", "sigterm",
                 "init_error", "breakpoint_peer", "stuck_timeout")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ending", SLURM_ENDINGS)
def test_the_verdict_is_the_same_through_slurm(slurm_cluster, tmp_path, ending):  # noqa: F811
    result = launch(SCRIPT, args=[ending, "1"], scheduler="slurm", log_dir=tmp_path / "runs",
                    display="none", hang_timeout=30, timeout=120,
                    nnodes=slurm_cluster.nodes, nproc=2 // slurm_cluster.nodes)
    check_verdict(result.to_json(), ending, 2, 1)
    assert not slurm_queue().strip(), slurm_queue()


def test_a_mismatch_reads_the_same_whichever_rank_timed_out_in_a_send_or_a_recv():
    """The full table once found warm and cold differing in the message alone: the first
    rank whose gloo clock ran out was in a receive in one run, in a send in the other."""
    def summary(message):
        return {"ok": False, "reason": "failed", "hang": None, "ranks": [{"rank": 0, "exit_code": 1}],
                "failure": {"message": message, "kind": "mismatch", "rank": 1, "exc_type": "RuntimeError",
                            "file": "endings.py", "line": 98, "victims": [], "also_failed": [0],
                            "exit_code": 1, "mismatch": {}}}

    gloo = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:{}] Timed out waiting 3000ms"
    recv = verdict(summary(gloo.format(78) + " for recv operation to complete"))
    send = verdict(summary(gloo.format(129) + " for send operation to complete"))
    assert recv == send and "Timed out waiting" in recv["failure"]["message"]
