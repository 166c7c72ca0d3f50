"""Checks for lab 01: who trains on which items, epoch after epoch.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py
"""

from collections import Counter

from labutils.grading import check

ITEMS = 24
EPOCHS = 3
ARGS = ["--epochs", EPOCHS, "--items", ITEMS]


def _epochs(run):
    """epoch -> rank -> the indices that rank trained on."""
    seen = {}
    for row in run.rows("epoch", "indices"):
        seen.setdefault(row["epoch"], {})[row["rank"]] = row["indices"]
    return seen


@check("Every item is trained on exactly once per epoch, at 2 and 3 ranks", points=4)
def exact_cover(c):
    for nproc in (2, 3):
        run = c.run("train.py", nproc, args=ARGS)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        epochs = _epochs(run)
        problems = []
        for epoch in range(EPOCHS):
            counts = Counter(i for indices in epochs.get(epoch, {}).values() for i in indices)
            twice = sum(1 for n in counts.values() if n > 1)
            never = ITEMS - len(counts)
            if twice or never or len(epochs.get(epoch, {})) != nproc:
                problems.append(f"epoch {epoch}: {twice} items seen more than once, "
                                f"{never} never seen, reports from {len(epochs.get(epoch, {}))} ranks")
        c.expect(not problems, f"{nproc} ranks: each of the {ITEMS} items once per epoch",
                 measured="; ".join(problems) or f"every epoch covers the {ITEMS} items once",
                 expected=f"each epoch, the ranks' shares are disjoint and cover all {ITEMS} items")


@check("The order of the items changes from epoch to epoch", points=3)
def new_order_each_epoch(c):
    for nproc in (2, 3):
        run = c.run("train.py", nproc, args=ARGS)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        epochs = _epochs(run)
        repeats = []
        for rank in range(nproc):
            orders = [tuple(epochs.get(e, {}).get(rank, ())) for e in range(EPOCHS)]
            same = sum(1 for e in range(1, EPOCHS) if orders[e] == orders[e - 1])
            if same:
                repeats.append(f"rank {rank} repeated the previous epoch's order {same} time(s)")
        c.expect(not repeats, f"{nproc} ranks: a new order in each of {EPOCHS} epochs",
                 measured="; ".join(repeats) or "every epoch in a new order",
                 expected="a different order of items in every epoch, on every rank")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
