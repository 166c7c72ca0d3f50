"""Helpers for the lesson 04 notebook: index lists, coverage verdicts, tables, the self-check.

The rank scripts (ownership.py, evaluate.py, uneven.py, workers.py) do not import
this module; only the notebook does.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from labutils.course import selfcheck
from labutils.course.sharding import coverage, ownership
from labutils.course.tables import text_table


def index_lists(records: Iterable[dict], setup: str) -> str:
    """The items every rank saw, per epoch, for one set-up of ownership.py."""
    own = ownership(records, setup=setup)
    lines = []
    for epoch, shards in own.items():
        cells = "  ".join(f"rank {r}: {items}" for r, items in shards.items())
        lines.append(f"epoch {epoch}:  {cells}")
    return "\n".join(lines)


def verdict(records: Iterable[dict], setup: str, *, n_items: int) -> str:
    """The checks a correct data-parallel epoch passes, for one set-up."""
    own = ownership(records, setup=setup)
    lines = [f"epoch {epoch}: {coverage(shards, n_items=n_items)}" for epoch, shards in own.items()]
    ranks = sorted({r for shards in own.values() for r in shards})
    same_rank_order = all(len({tuple(own[e][r]) for e in own}) == 1 for r in ranks)
    same_across_ranks = all(len({tuple(shards[r]) for r in ranks}) == 1 for shards in own.values())
    lines.append(f"every rank sees the same items as the others: {same_across_ranks}")
    lines.append(f"every epoch repeats the previous order:        {same_rank_order}")
    return "\n".join(lines)


def eval_table(records: Iterable[dict]) -> str:
    """Per evaluation: each rank's shard, the predictions counted and the accuracy."""
    rows = []
    ways = []
    for rec in records:
        if rec.get("way") and rec["way"] not in ways:
            ways.append(rec["way"])
    for way in ways:
        recs = sorted((r for r in records if r.get("way") == way), key=lambda r: r["rank"])
        shards = " ".join(str(r["shard"]) for r in recs if "shard" in r) or "all 10 items, one process"
        first = recs[0]
        rows.append([way, shards, first["predictions"], first["correct"], f"{first['accuracy']:g}"])
    return text_table(["evaluation", "shards of ranks 0..3", "predictions", "correct", "accuracy"],
                      rows, right=[2, 3, 4])


def worker_table(records: Iterable[dict], loader: str) -> str:
    """What each rank's workers drew for each item, per epoch, for one loader of workers.py."""
    rows = []
    for rec in sorted((r for r in records if r.get("loader") == loader),
                      key=lambda r: (r["epoch"], r["rank"])):
        for item, worker, t, n in rec["rows"]:
            rows.append([rec["epoch"], rec["rank"], item, worker, f"{t:.4f}", f"{n:.4f}"])
    return text_table(["epoch", "rank", "item", "worker", "torch.rand", "np.random.rand"], rows,
                      right=[0, 1, 2, 3, 4, 5])


def repeated_draws(records: Iterable[dict], loader: str) -> int:
    """How many (epoch, position) draws are identical on every rank."""
    by_key: dict[tuple, set] = {}
    for rec in records:
        if rec.get("loader") == loader:
            for pos, (_, _, t, n) in enumerate(rec["rows"]):
                by_key.setdefault((rec["epoch"], pos), set()).add((t, n))
    return sum(1 for draws in by_key.values() if len(draws) == 1)


def _epochs(records: Iterable[dict], loader: str) -> dict[int, dict[int, dict]]:
    """rank -> epoch -> that epoch's record, for one loader of workers.py."""
    out: dict[int, dict[int, dict]] = {}
    for rec in records:
        if rec.get("loader") == loader and "workers" in rec:
            out.setdefault(rec["rank"], {})[rec["epoch"]] = rec
    return out


def _epoch_1(epochs: dict[int, dict]) -> tuple[bool, bool, bool]:
    """Epoch 1 against epoch 0 on one rank: the same worker processes, the same seeds,
    the same draws."""
    first, second = epochs[0], epochs[1]
    pids = [{w["pid"] for w in e["workers"].values()} for e in (first, second)]
    seeds = [sorted(w["seed"] for w in e["workers"].values()) for e in (first, second)]
    draws = [[row[2:] for row in e["rows"]] for e in (first, second)]
    return pids[0] == pids[1], seeds[0] == seeds[1], draws[0] == draws[1]


PERSISTENCE = ("generator seeded with the rank", "persistent workers")


def _later_first_batch_ms(records: Iterable[dict], loader: str) -> dict[int, float]:
    """rank -> the median time to the first batch of epochs 1-4 (workers.py times five
    epochs per loader), in ms."""
    return {rec["rank"]: statistics.median(rec["first_batches_ms"][1:]) for rec in records
            if rec.get("timed_loader") == loader and len(rec["first_batches_ms"]) > 1}


def persistence_table(records: Iterable[dict]) -> str:
    """Per loader and rank: whether epoch 1 had new worker processes and new seeds, and
    how long the first batch took to come in epoch 0 and, the median, in epochs 1-4."""
    records = list(records)
    rows = []
    for loader in PERSISTENCE:
        later = _later_first_batch_ms(records, loader)
        for rank, epochs in sorted(_epochs(records, loader).items()):
            same_pids, same_seeds, _ = _epoch_1(epochs)
            rows.append([loader, rank, "the same" if same_pids else "new",
                         "kept" if same_seeds else "drawn again",
                         f"{epochs[0]['first_batch_ms']:.1f}",
                         f"{later[rank]:.1f}" if rank in later else "-"])
    return text_table(["loader", "rank", "epoch 1's workers", "their seeds",
                       "epoch 0 first batch (ms)", "epochs 1-4 first batch, median (ms)"], rows,
                      right=[1, 4, 5])


def persistence_claims(records: Iterable[dict]) -> str:
    """The section's claims about persistent_workers, each True or False. "Sooner" compares
    each rank's median over epochs 1-4: a single slow moment of a busy machine does not
    decide it."""
    records = list(records)
    fresh, kept = (_epochs(records, loader) for loader in PERSISTENCE)
    fresh_ms, kept_ms = (_later_first_batch_ms(records, loader) for loader in PERSISTENCE)
    restarted = all(not any(_epoch_1(e)[:2]) for e in fresh.values())
    went_on = all(_epoch_1(e) == (True, True, False) for e in kept.values())
    sooner = bool(kept_ms) and set(kept_ms) == set(fresh_ms) == set(kept) \
        and all(kept_ms[r] < fresh_ms[r] for r in kept_ms)
    return "\n".join([
        f"without persistent_workers, epoch 1 starts new workers with new seeds: {bool(fresh) and restarted}",
        f"with it, the same workers and seeds, whose streams go on (new draws):  {bool(kept) and went_on}",
        f"with it, the first batch of epochs 1-4 comes sooner, on every rank:    {bool(kept) and sooner}"])


def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (answers left as None are skipped)."""
    expected = {
        "q1_rank3_items_10_on_4": ([3, 7, 1], "stride 4 from 3; the list is padded with its first items to 12"),
        "q2_predictions_10_on_4_padded": (12, "ceil(10 / 4) = 3 per rank"),
        "q3_rank2_items_drop_last_10_on_4": ([2, 6], "floor(10 / 4) = 2 per rank, no padding"),
        "q4_epochs_same_order_without_set_epoch": (True, "the shuffle is seeded with seed + epoch"),
        "q5_join_context": ("join", "with ddp.join(): around the training loop"),
    }
    selfcheck.check_answers(answers, expected, text="contains")

__all__ = ["index_lists", "verdict", "eval_table", "worker_table", "repeated_draws",
           "persistence_table", "persistence_claims", "check_answers"]
