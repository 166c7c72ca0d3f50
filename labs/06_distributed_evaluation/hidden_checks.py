"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: 13 items at 3 ranks, where
DistributedSampler would pad 2 items, not 1."""

from evalset import single_process_accuracy

from labutils.grading import check

ITEMS = 13


@check(f"{ITEMS} items at 3 ranks: each counted once, and the single-process accuracy", points=2,
       visibility="after_published")
def other_item_count(c):
    nproc = 3
    run = c.run("evaluate.py", nproc, args=["--items", ITEMS])
    if not c.completed(run, f"{nproc} ranks, --items {ITEMS}"):
        return
    rows = [r for r in run.rows("accuracy", "predictions") if r["rank"] == 0]
    got = rows[-1]["predictions"] if rows else "no report from rank 0"
    c.expect(got == ITEMS, f"{nproc} ranks, {ITEMS} items: predictions counted",
             measured=f"{got} predictions counted", expected=f"{ITEMS}, each item once")
    correct, items = single_process_accuracy(ITEMS)
    accuracy = rows[-1]["accuracy"] if rows else None
    c.expect(accuracy is not None and abs(accuracy - correct / items) < 1e-9,
             f"{nproc} ranks, {ITEMS} items: accuracy", measured=f"accuracy {accuracy}",
             expected=f"{correct / items} ({correct}/{items}), what one process computes")
