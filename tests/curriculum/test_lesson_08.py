"""Lesson 08: the parameter server applies every pushed gradient exactly once, its log
replays bit for bit in one process, DDP replicas agree (a real torchrun run on 3 ranks),
and the notebook's pure helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import LESSONS

from labutils import launch
from labutils.course import lesson

LESSON = LESSONS / "08_async_data_parallel"


@pytest.fixture
def lesson08():
    return lesson.load(LESSON, "lesson08")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """Server + 2 workers (one slow), one phase of each mode, 40 gradients each."""
    runs = tmp_path_factory.mktemp("runs")
    result = launch(LESSON / "async_vs_sync.py", 3, display="none", hang_timeout=90, timeout=300,
                    log_dir=runs, args=["--phases", "async@0.1", "sync@0.1", "aware@0.5",
                                        "--gradients", "40", "--step-ms", "1", "--slow-ms", "4"])
    assert result.ok, result.summary()
    return result


def test_every_push_is_applied_exactly_once_and_replicas_agree(small_run, lesson08):
    text = lesson08.accounting(small_run)
    assert text.count("updates applied: 40 = gradients pushed by all workers: 40") == 2
    assert text.count("applied exactly once, in its own order: True (and no other: True)") == 2
    assert text.count("42 headers (= 40 pushes + 2 first pulls), 40 gradients;"
                      " sent: 40 parameter copies, 2 stops") == 2
    assert "20 steps, every worker computed [20] gradients, replicas identical: True" in text


def test_staleness_is_version_at_apply_minus_version_pulled(small_run, lesson08):
    server = lesson08.phases(small_run)[0]["server"]
    assert len(server["staleness"]) == 40
    # two workers: an update can have missed at most what the other pushed meanwhile
    assert all(0 <= s < 40 for s in server["staleness"])
    assert server["t"] == sorted(server["t"])


@pytest.mark.parametrize("phase", [0, 2])
def test_replay_of_the_server_log_is_bitwise_the_run(small_run, lesson08, phase):
    assert lesson08.replay(small_run, phase)["same_as_run"]
    fresh = lesson08.replay(small_run, phase, stale_workers=set())
    stale = sum(lesson08.phases(small_run)[phase]["server"]["staleness"])
    assert fresh["same_as_run"] == (stale == 0)


def test_replay_refuses_a_synchronous_phase(small_run, lesson08):
    with pytest.raises(ValueError, match="needs an async or aware phase"):
        lesson08.replay(small_run, 1)


def test_traffic_table_follows_the_formulas(lesson08):
    table = lesson08.traffic_table(param_bytes=100e6, workers=[4], link_gb_per_s=10)
    row = table.splitlines()[2].split()
    # PS: 4 * 100 MB = 0.4 GB into the server, 0.04 s; ring: 2 * 3/4 * 100 MB = 0.15 GB, 0.015 s
    assert row == ["4", "0.40", "GB", "0.040", "0.15", "GB", "0.015"]
    sharded = lesson08.traffic_table(param_bytes=100e6, workers=[4], link_gb_per_s=10, servers=4)
    assert sharded.splitlines()[2].split()[1:4] == ["0.10", "GB", "0.010"]


def test_self_check_accepts_the_right_answers(lesson08, capsys):
    lesson08.check_answers({name: want for name, (want, _) in lesson08.EXPECTED.items()})
    assert capsys.readouterr().out.count(": correct") == len(lesson08.EXPECTED)
    lesson08.check_answers({"q1_staleness": 2})
    assert "q1_staleness: not quite" in capsys.readouterr().out
