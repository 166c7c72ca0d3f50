"""The session's check of the temporary folder (tests/conftest.py's pytest_sessionfinish):
what it counts as left behind by a run, and what it leaves alone."""

from __future__ import annotations

import os
import time

from helpers import LEFT_BEHIND_PREFIXES, left_behind


def test_a_runs_leftovers_made_since_the_start_are_found_and_nothing_else(tmp_path):
    since = time.time()
    old = tmp_path / "labutils-debug-older"   # before the session: not its doing
    old.mkdir()
    os.utime(old, (since - 60, since - 60))
    made = [tmp_path / f"{prefix}x" for prefix in LEFT_BEHIND_PREFIXES]
    for path in made:
        path.mkdir()
    (tmp_path / "tmpabc").mkdir()              # any other name: not a run's
    assert left_behind(since, str(tmp_path)) == sorted(str(p) for p in made)
    assert left_behind(since, str(tmp_path / "tmpabc")) == []
