"""Checks for lab 06: a distributed evaluation must give the single-process metric.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py

evaluate.py runs under scored_items.py, which records the items each rank's model
really scored: a rank that scores more than its share (rank 0 scoring every item while
the others idle) gets the right metric without a distributed evaluation, and the
counts and accuracy of such a run do not count.
"""

from evalset import single_process_accuracy

from labutils.grading import check

ITEMS = 11            # the notebook's case: DistributedSampler pads 1 item at 2 and 3 ranks
PADDED_TWICE = 13     # at 3 ranks DistributedSampler pads 2 items (at 2 ranks, item 0: a right one)
NONE_PADDED = 12      # at 2 ranks nothing is padded: a fix must not drop items then either
HARNESS = "scored_items.py"


def _run(c, nproc, items):
    return c.run(c.lab_file(HARNESS), nproc, measure=["signed"],
                 args=["--", c.learner_file("evaluate.py"), "--items", items])


def _shared(c, run, nproc: int, items: int, label: str) -> bool:
    """True when every rank scored its own share of the items: at least one item, and at
    most an even share (items // nproc) plus the items left over (items % nproc), which one
    rank may score on top of its share (drop_last=True, then rank 0 scores the rest); else a
    failed part saying how many items each rank scored."""
    scored = {rank: len(set(record["items"])) for rank, record in run.probe("scored").items()}
    most = items // nproc + items % nproc
    if len(scored) == nproc and all(0 < n <= most for n in scored.values()):
        return True
    c.expect(False, f"{label}: the ranks share the items",
             measured="items scored per rank (read from the model): "
                      + (", ".join(f"rank {r}: {n}" for r, n in sorted(scored.items())) or "none"),
             expected=f"each of the {nproc} ranks scores its own share of the {items} items "
                      f"(1 to {most}: an even share of {items // nproc}, plus at most the "
                      f"{items % nproc} left over), not one rank all of them")
    return False


def _result(c, nproc, items, label):
    """Rank 0's last report of a run whose ranks shared the work; None (and a failed part)
    when the run did not finish or did not share the items, {} when rank 0 reported nothing."""
    run = _run(c, nproc, items)
    if not c.completed(run, label) or not _shared(c, run, nproc, items, label):
        return None
    rows = [r for r in run.rows("accuracy", "predictions") if r["rank"] == 0]
    return rows[-1] if rows else {}


def _counted_once(c, nproc, items, label) -> None:
    row = _result(c, nproc, items, label)
    if row is not None:
        got = row.get("predictions")
        c.expect(got == items, label, measured=f"{got} predictions counted" if got is not None
                 else "rank 0 reported no prediction count (report(predictions=...))",
                 expected=f"{items}: padded duplicates from DistributedSampler must not count")


def _same_accuracy(c, nproc, items, label, *, weight: float = 1.0) -> None:
    correct, _ = single_process_accuracy(items)
    row = _result(c, nproc, items, label)
    if row is not None:
        got = row.get("accuracy")
        counted = f" ({row['predictions']} predictions counted)" if "predictions" in row else ""
        # 1e-6: an accuracy divided in float32 is off by about 1e-8; a wrong count of at
        # most 13 items by at least 1/156
        c.expect(got is not None and abs(got - correct / items) < 1e-6, label,
                 measured=f"accuracy {got}{counted}" if got is not None
                 else "rank 0 reported no accuracy (report(accuracy=...))", weight=weight,
                 expected=f"{correct / items} ({correct}/{items}, to 1e-6), what one process computes")


# Required: the padded duplicates counted is the symptom the lab is about; a fix that
# divides by len(dataset) and reports one rank's count gets the accuracy right, and
# would pass on it.
@check(f"Each of the {ITEMS} items is counted exactly once, at 2 and 3 ranks", points=2,
       required=True)
def counted_once(c):
    for nproc in (2, 3):
        _counted_once(c, nproc, ITEMS, f"{nproc} ranks")


# Required: the metric is what the lab is about. A fix that drops padding by a rule that
# fits some cases only (the last items of the concatenated shares, every rank's last item
# from len(dataset) % world_size on) gets the others wrong, and would pass on its points.
@check("The accuracy equals the single-process accuracy, at 2 and 3 ranks", points=5,
       required=True)
def same_metric(c):
    _same_accuracy(c, 3, ITEMS, f"3 ranks, {ITEMS} items")
    _same_accuracy(c, 2, PADDED_TWICE, f"2 ranks, {PADDED_TWICE} items")
    # nothing padded: a fix that drops each rank's last item anyway counts 10 of 12
    _same_accuracy(c, 2, NONE_PADDED, f"2 ranks, {NONE_PADDED} items (none padded)")
    # a fix tuned to one padded item gets this case wrong: it counts double
    _same_accuracy(c, 3, PADDED_TWICE, f"3 ranks, {PADDED_TWICE} items (two padded)", weight=2)


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
