"""Helpers for the lesson 00 notebook: readable commands, last lines, the self-check.

The rank scripts (env_report.py, first_allreduce.py, failing_rank.py, hang.py) do
not import this module; only the notebook does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from labutils.course import selfcheck
from labutils.runtime.runfiles import short_path, shorten_paths


def readable_command(command: Sequence[str]) -> str:
    """A launcher command line with this machine's paths shortened (python, relative paths)."""
    def short(arg: str) -> str:
        if arg == sys.executable:
            return "python"
        if os.path.isabs(arg):
            rel = os.path.relpath(arg)
            return short_path(arg) if rel.startswith("..") else rel
        return arg
    return " ".join(short(a) for a in command)


def last_line(text: str) -> str:
    """The last non-empty line of a rank's output: for a traceback, the exception.

    Paths of torch's build machine in the message (gloo quotes its source file) are
    cut as the launcher's display cuts them.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return shorten_paths(lines[-1]) if lines else "(nothing)"


# The self-check: question -> (expected answer, hint shown for a wrong answer).
def _expected(hang_waiting_in_collective: int | None) -> dict:
    return {
        "q1_world_size": (8, "2 machines x 4 workers each"),
        "q1_local_world_size": (4, "workers on one machine"),
        "q1_rank": (5, "RANK = node rank x LOCAL_WORLD_SIZE + LOCAL_RANK"),
        "q2_mean": (2.5, "sum 1+2+3+4, then divide by the world size"),
        "q3_rank_to_debug": (2, "the victims' connection errors are consequences"),
        "q4_ranks_in_collective": (hang_waiting_in_collective,
                                   "count the ranks whose waiting line has a collective: "
                                   "hang_run.hang.calls"),
        "q5_restart_variable": ("TORCHELASTIC_RESTART_COUNT", "one of the variables in the table"),
    }


def check_answers(answers: dict, *, hang_calls: dict[int, str] | None = None) -> None:
    """Print, per question, whether the answer is right (answers left as None are skipped).

    Args:
        answers: question name -> your answer.
        hang_calls: result.hang.calls of the hang run (rank -> collective it waits in).
    """
    in_collective = None if hang_calls is None else sum(1 for c in hang_calls.values() if c)
    expected = _expected(in_collective)
    selfcheck.check_answers(answers, expected)