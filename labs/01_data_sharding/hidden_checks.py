"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: another --seed, at 3 ranks."""

from collections import Counter

from checks import ARGS, EPOCHS, ITEMS, _epochs

from labutils.grading import check

SEED = 5


@check(f"With --seed {SEED}, at 3 ranks: each item once per epoch, a new order every epoch, "
       "other orders than with seed 0", points=2, visibility="after_published")
def another_seed(c):
    nproc = 3
    run = c.run("train.py", nproc, args=[*ARGS, "--seed", SEED])
    if not c.completed(run, f"{nproc} ranks, --seed {SEED}"):
        return
    epochs = _epochs(run)
    uncovered = [e for e in range(EPOCHS) if len(epochs.get(e, {})) != nproc or Counter(
        i for indices in epochs[e].values() for i in indices) != Counter(range(ITEMS))]
    c.expect(not uncovered, f"{nproc} ranks, --seed {SEED}: each of the {ITEMS} items once per epoch",
             measured=f"epochs {uncovered} miss items or repeat some" if uncovered
             else f"every epoch covers the {ITEMS} items once",
             expected="each epoch, the ranks' shares are disjoint and cover every item")

    def order(shares, e):
        return tuple(tuple(shares.get(e, {}).get(r, ())) for r in range(nproc))

    repeated = [e for e in range(1, EPOCHS) if order(epochs, e) == order(epochs, e - 1)]
    c.expect(not repeated, f"{nproc} ranks, --seed {SEED}: a new order every epoch",
             measured=f"epochs {repeated} repeat the order of the epoch before" if repeated
             else "every epoch in a new order",
             expected="a different order of the items in every epoch")

    seed0 = c.run("train.py", nproc, args=ARGS)  # the public checks' run: --seed 0
    if c.completed(seed0, f"{nproc} ranks, --seed 0"):
        same = [e for e in range(EPOCHS) if order(epochs, e) == order(_epochs(seed0), e)]
        c.expect(not same, f"{nproc} ranks: --seed {SEED} and --seed 0 shuffle differently",
                 measured=f"epochs {same} have the same order with both seeds" if same
                 else "other orders in every epoch",
                 expected="--seed picks the shuffle: another seed, other orders")
