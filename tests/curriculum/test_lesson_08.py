"""Lesson 08: the parameter server applies every pushed gradient exactly once, its log
replays bit for bit in one process, DDP replicas agree (a real torchrun run on 3 ranks),
and the notebook's pure helpers."""

from __future__ import annotations

import json
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


class _Records:
    """A run as the claims read it: the records of async_vs_sync.py, made up."""

    def __init__(self, records):
        self.records = records


def _phase(number, mode, lr, *, wall_s, reach, final, staleness=(2, 2, 2), slow_ms=10):
    """A phase of 3 workers (rank 3 the slow one when slow_ms > 10) whose loss falls to
    0.011 after `reach` updates (None: never), ending at `final`."""
    updates = list(range(0, 301, 10))
    loss = [1.0 if reach is None or u < reach else 0.01 for u in updates]
    loss[-1] = final
    records = [{"kind": "phase", "phase": number, "mode": mode, "lr": lr, "slow_rank": 3,
                "slow_ms": slow_ms, "step_ms": 10},
               {"kind": "curve", "phase": number, "updates": updates, "loss": loss, "wall_s": wall_s,
                "t": [wall_s * u / 300 for u in updates]}]
    records += [{"kind": "worker", "phase": number, "rank": r, "gradients": 100, "wall_s": wall_s,
                 "computing_s": wall_s / 2} for r in (1, 2, 3)]
    if mode != "sync":
        records.append({"kind": "server", "phase": number, "worker": [1, 2, 3] * 100,
                        "staleness": list(staleness) * 100, "seq": [k for k in range(100) for _ in range(3)]})
    return records


def _runs(*, async_05_final=float("inf"), even_async_wall=1.25, even_staleness=(2, 2, 2)):
    straggler = _Records(
        _phase(0, "sync", 0.1, wall_s=4.4, reach=30, final=0.009, slow_ms=40)
        + _phase(1, "async", 0.1, wall_s=1.6, reach=30, final=0.009, slow_ms=40)
        + _phase(2, "sync", 0.5, wall_s=4.4, reach=10, final=0.009, slow_ms=40)
        + _phase(3, "async", 0.5, wall_s=1.6, reach=None, final=async_05_final, slow_ms=40)
        + _phase(4, "aware", 0.5, wall_s=1.6, reach=30, final=0.009, slow_ms=40))
    even = _Records(
        _phase(0, "sync", 0.1, wall_s=1.5, reach=30, final=0.009)
        + _phase(1, "async", 0.1, wall_s=even_async_wall, reach=30, final=0.009, staleness=even_staleness)
        + _phase(2, "sync", 0.5, wall_s=1.5, reach=10, final=0.009)
        + _phase(3, "async", 0.5, wall_s=1.25, reach=None, final=float("inf")))
    return straggler, even


def test_the_claims_hold_on_runs_that_show_them_and_fail_where_a_run_does_not(lesson08):
    straggler, even = _runs()
    for text in (lesson08.convergence_claims(straggler, 0.1), lesson08.convergence_claims(straggler, 0.5),
                 lesson08.even_claims(straggler, even)):
        assert text.count(": True") == len(text.splitlines()), text
    # the server at 0.5 trained: the lesson's claim that it diverges prints False
    trained, _ = _runs(async_05_final=0.009)
    assert "the parameter server diverges: False" in lesson08.convergence_claims(trained, 0.5)
    # without the straggler the server kept its lead, and the workers' staleness is not n - 1
    _, lead = _runs(even_async_wall=0.4, even_staleness=(1, 1, 4))
    claims = lesson08.even_claims(straggler, lead)
    assert "within 0.5 of n - 1 = 2: False" in claims
    assert "smaller than with the straggler, at both learning rates: False" in claims


def _logged_phase(lr):
    """The server's log of a real 4-rank async phase at lr 0.5 (2026-12-01, busy machine)
    as a one-phase run, replayed at `lr`. Replayed with nobody stale at 0.5, its last
    update lands at 0.023, the top of the plateau the loss bounces on (0.008 to 0.023)."""
    log = json.loads((Path(__file__).parents[1] / "data" / "lesson08_async_lr05_log.json").read_text())
    phase = {"phase": 0, "mode": "async", "lr": lr, "slow_rank": 3, "slow_ms": 80, "step_ms": 20}
    return _Records([{"kind": "phase", **phase},
                     {"kind": "curve", "phase": 0, "updates": [0], "t": [0.0], "loss": [1.0], "wall_s": 1.0},
                     {"kind": "server", "phase": 0, "params_sha": "", **{k: log[k] for k in
                                                                         ("worker", "seq", "staleness")}}]
                    + [{"kind": "worker", "phase": 0, "rank": r, "gradients": log["worker"].count(r),
                        "wall_s": 1.0, "computing_s": 0.9} for r in (1, 2, 3)])


def test_replay_claims_read_the_plateau_not_where_the_last_step_lands(lesson08):
    run = _logged_phase(0.5)
    fresh = lesson08.replay(run, 0, stale_workers=set())
    assert fresh["final_loss"] > 0.02 and fresh["reached"] is not None
    claims = lesson08.replay_claims(run, 0)
    assert claims.count(": True") == 2, claims
    # at a learning rate sequential SGD cannot use, the first claim says so
    diverging = lesson08.replay_claims(_logged_phase(3.0), 0)
    assert "nobody stale: the loss reaches 0.011 and ends below 0.05: False" in diverging
