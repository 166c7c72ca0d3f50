"""Lesson 04's persistent_workers section (lessons/04_sampler_pitfalls/lesson04.py) on
hand-made records of workers.py: each claim turned False by the fact it claims."""

from __future__ import annotations

import copy

from helpers import LESSONS

from labutils.course import lesson

L = lesson.load(LESSONS / "04_sampler_pitfalls", "lesson04")


def epoch(loader: str, rank: int, n: int, *, pids, seeds, draw: float, first_ms: float) -> dict:
    """One rank's epoch as workers.py reports it (JSON: the workers' keys are text)."""
    return {"loader": loader, "rank": rank, "epoch": n, "first_batch_ms": first_ms,
            "rows": [[rank, 0, draw, draw / 2], [rank + 2, 1, draw + 0.1, draw / 3]],
            "workers": {str(w): {"pid": pid, "seed": seed} for w, (pid, seed) in enumerate(zip(pids, seeds))}}


def records() -> list[dict]:
    """Two ranks; the fixed loader starts new workers with new seeds in epoch 1, the
    persistent one keeps both and draws on, its second first batch far sooner."""
    out = []
    for rank in (0, 1):
        base = 100 * rank
        fresh, kept = L.PERSISTENCE
        out += [epoch(fresh, rank, 0, pids=[base + 1, base + 2], seeds=["11", "12"], draw=0.1, first_ms=40),
                epoch(fresh, rank, 1, pids=[base + 3, base + 4], seeds=["21", "22"], draw=0.2, first_ms=41),
                epoch(kept, rank, 0, pids=[base + 5, base + 6], seeds=["31", "32"], draw=0.3, first_ms=39),
                epoch(kept, rank, 1, pids=[base + 5, base + 6], seeds=["31", "32"], draw=0.4, first_ms=3),
                {"timed_loader": fresh, "rank": rank, "first_batches_ms": [40, 41, 43, 39, 42]},
                {"timed_loader": kept, "rank": rank, "first_batches_ms": [39, 3, 2, 4, 3]}]
    return out


def timed(recs, loader: str, rank: int) -> list[float]:
    return next(r for r in recs if r.get("timed_loader") == loader and r["rank"] == rank)["first_batches_ms"]


def claims(recs) -> list[bool]:
    return [line.rstrip().endswith("True") for line in L.persistence_claims(recs).splitlines()]


def find(recs, loader: str, rank: int, n: int) -> dict:
    return next(r for r in recs if r.get("loader") == loader and r["rank"] == rank and r["epoch"] == n)


def test_the_records_of_a_run_that_shows_it_make_every_claim_true_and_the_table_says_so():
    assert claims(records()) == [True, True, True]
    table = L.persistence_table(records()).splitlines()
    assert len(table) == 2 + 4
    assert "new" in table[2] and "drawn again" in table[2]
    assert "the same" in table[4] and "kept" in table[4] and table[4].split()[-2:] == ["39.0", "3.0"]
    assert table[2].split()[-2:] == ["40.0", "41.5"]   # epoch 0, then the median of epochs 1-4


def test_each_claim_is_false_where_the_run_contradicts_it():
    fresh, kept = L.PERSISTENCE
    recs = records()   # a rank's fixed loader that kept its workers
    find(recs, fresh, 1, 1)["workers"] = copy.deepcopy(find(recs, fresh, 1, 0)["workers"])
    assert claims(recs) == [False, True, True]
    recs = records()   # persistent workers seeded again
    find(recs, kept, 0, 1)["workers"]["1"]["seed"] = "99"
    assert claims(recs) == [True, False, True]
    recs = records()   # persistent workers whose streams started over (the same draws)
    find(recs, kept, 1, 1)["rows"] = copy.deepcopy(find(recs, kept, 1, 0)["rows"])
    assert claims(recs) == [True, False, True]
    recs = records()   # one rank's first batches after epoch 0 no sooner, in most epochs
    timed(recs, kept, 1)[1:4] = [50, 45, 48]
    assert claims(recs) == [True, True, False]
    recs = records()   # no epochs timed after epoch 0
    for rec in recs:
        rec.pop("first_batches_ms", None)
    assert claims([r for r in recs if "timed_loader" not in r]) == [True, True, False]
    assert claims([]) == [False, False, False]


def test_one_slow_first_batch_does_not_decide_the_claim():
    """A busy machine once delayed one persistent worker's epoch-1 batch past a fresh
    start (lessons/04 under the parallel pass): the median of epochs 1-4 holds."""
    _, kept = L.PERSISTENCE
    recs = records()
    timed(recs, kept, 1)[1] = 80
    find(recs, kept, 1, 1)["first_batch_ms"] = 80
    assert claims(recs) == [True, True, True]
