"""Checks for lab 06: a distributed evaluation must give the single-process metric.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py
"""

from evalset import single_process_accuracy

from labutils.grading import check

ITEMS = 11


def _result(c, nproc):
    run = c.run("evaluate.py", nproc, args=["--items", ITEMS])
    rows = [r for r in run.rows("accuracy", "predictions") if r["rank"] == 0]
    return run, (rows[-1] if rows else None)


@check(f"Each of the {ITEMS} items is counted exactly once, at 2 and 3 ranks", points=3)
def counted_once(c):
    for nproc in (2, 3):
        run, row = _result(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        got = row["predictions"] if row else "no report from rank 0"
        c.expect(got == ITEMS, f"{nproc} ranks", measured=f"{got} predictions counted",
                 expected=f"{ITEMS}: padded duplicates from DistributedSampler must not count")


@check("The accuracy equals the single-process accuracy, at 2 and 3 ranks", points=4)
def same_metric(c):
    correct, items = single_process_accuracy(ITEMS)
    reference = correct / items
    for nproc in (2, 3):
        run, row = _result(c, nproc)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        got = row["accuracy"] if row else None
        c.expect(got is not None and abs(got - reference) < 1e-9, f"{nproc} ranks",
                 measured=f"accuracy {got}", expected=f"{reference} ({correct}/{items}), "
                                                      "what one process computes")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
