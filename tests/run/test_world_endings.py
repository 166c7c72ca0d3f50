"""A persistent world's cell and a one-shot run say the same of the same ending.

Two code paths give a verdict: a run's ending (run/outcome.py, from the ranks' events,
exit statuses and stderr) and a cell's (run/world.py, from each rank's reply to the
cell, falling back on the run's own ending when a rank's process died). Endings of
tests/scripts/endings.py, one for each of those paths, run both ways here, rank 1 of 2 failing
while rank 0 goes on into a barrier, and the two verdicts must name the same root
cause: the rank, its exception or signal, the line it ended at, and the same victims
(or the same hang). What differs by design: a cell that raises SystemExit ends the
cell, not the rank's process, so it has no exit code and its message is the exit
code alone (with the thread that failed before it, as a run says).
"""

from __future__ import annotations

import pytest
from endings_table import LINE_OF, SCRIPT, tagged_line, verdict

from labutils import launch
from labutils.run.world import World

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FAILING = 1
# how -> the statement rank 1 ends with, as endings.py has it (None: the whole line is
# a collective every rank calls). One ending for each way a cell's verdict is made: the
# cell raised (an exception; SystemExit, alone or after a thread's exception), the
# rank's process ended (an exit without an exception; a fatal signal at a line; a
# SIGTERM nobody on our side sent; a C++ std::terminate), or the cell hung. The endings
# table (test_endings.py) checks the rest of them, which take these same paths, for runs.
IN_A_CELL = {
    "exception": "raise ValueError('the batch is empty')",
    "sys_exit": "sys.exit(3)",
    "thread_error": "worker = threading.Thread(target=fail_in_a_thread); worker.start(); "
                    "worker.join(); sys.exit(1)",
    "os_exit": "os._exit(3)",
    "segfault": "ctypes.string_at(0)",
    "sigterm": "subprocess.run(['kill', '-TERM', str(os.getpid())]); time.sleep(60)",
    "size_mismatch": None,
    "stuck": "while True: time.sleep(0.2)",
}
# endings that end the rank's process: the whole verdict is the run's
PROCESS_ENDS = {"os_exit", "segfault", "sigterm", "size_mismatch"}
EXITS = {"sys_exit": 3, "thread_error": 1}
HEAD = """import ctypes, os, subprocess, sys, threading, time
def fail_in_a_thread():
    raise RuntimeError('the loader thread failed')
dist.all_reduce(torch.ones(4))
"""


def cell_code(how: str) -> str:
    if IN_A_CELL[how] is None:
        return HEAD + f"dist.all_reduce(torch.ones(1 if rank == {FAILING} else 8))\ndist.barrier()\n"
    return HEAD + f"if rank == {FAILING}:\n    {IN_A_CELL[how]}\ndist.barrier()\n"


@pytest.fixture
def world(tmp_path):
    """A world of its own for each ending: the cell that fails restarts it, and every
    process of it must be gone when the test ends (conftest's check)."""
    made = World(2, display="none", hang_timeout=4, log_dir=tmp_path / "world")
    made.start()
    yield made
    made.stop()


@pytest.mark.parametrize("how", list(IN_A_CELL))
def test_a_cell_and_a_run_name_the_same_root_cause(how, world, tmp_path):
    run = launch(SCRIPT, 2, args=[how, str(FAILING)], display="none", log_dir=tmp_path,
                 hang_timeout=4 if how == "stuck" else 30, timeout=90).to_json()
    cell = world.run_cell(cell_code(how), hang_timeout=4)
    got, want = verdict(cell.result.to_json(), how), verdict(run, how)
    assert cell.restarted, "a failed or hung cell leaves the world unusable: it is restarted"
    assert (got["ok"], got["reason"]) == (want["ok"], want["reason"]), (got, want)
    code_line = 5 if IN_A_CELL[how] is None else 6  # after HEAD's 4 lines (and the if)
    if how == "stuck":
        assert (got["hang"]["stragglers"], got["hang"]["calls"]) == \
            (want["hang"]["stragglers"], want["hang"]["calls"]), (got, want)
        waits = {r: int(w.rsplit(":", 1)[1]) for r, w in got["hang"]["waiting"].items()}
        assert waits == {"0": code_line + 1, "1": code_line}, got
        return
    f, w = got["failure"], want["failure"]
    assert (f["rank"], f["victims"], f["also_failed"]) == (w["rank"], w["victims"], w["also_failed"])
    assert f["exc_type"] == (w["exc_type"] if how not in EXITS else "SystemExit"), (f, w)
    # the same statement: endings.py's tagged line, and that line of the cell
    assert (w["where"], f["where"]) == ((None, None) if w["where"] is None else
                                        (f"endings.py:{tagged_line(LINE_OF.get(how, how))}",
                                         f"cell-{cell.seq}.py:{code_line}")), (f, w)
    if how in PROCESS_ENDS:
        assert {k: v for k, v in f.items() if k != "where"} == \
            {k: v for k, v in w.items() if k != "where"}, (f, w)
    elif how in EXITS:
        code = EXITS[how]
        after = w["message"].partition(f"exit code {code}")[2]
        assert (f["message"], f["exit_code"]) == (f"{code}{after}", None), (f, w)
    else:
        assert (f["kind"], f["message"]) == (w["kind"], w["message"]), (f, w)
