"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in cases the public checks do not show: another --seed at 3 ranks, and 4 ranks
with 26 items, which they do not divide."""

from checks import EPOCHS, _cover_part, _order_part, _run, _trained_on

from labutils.grading import check

SEED = 5


@check(f"With --seed {SEED}, at 3 ranks: each item once per epoch, a new order every epoch, "
       "other orders than with seed 0", points=2, visibility="after_published")
def another_seed(c):
    nproc = 3
    label = f"{nproc} ranks, --seed {SEED}"
    run = _run(c, nproc, seed=SEED)
    if not (c.completed(run, label) and (epochs := _trained_on(c, run, nproc, seed=SEED))):
        return
    _cover_part(c, epochs, nproc, label)

    def order(shares, e):
        return tuple(tuple(shares.get(e, {}).get(r, ())) for r in range(nproc))

    repeated = [e for e in range(1, EPOCHS) if order(epochs, e) == order(epochs, e - 1)]
    c.expect(not repeated, f"{label}: a new order every epoch",
             measured=f"epochs {repeated} repeat the order of the epoch before" if repeated
             else "every epoch in a new order",
             expected="a different order of the items in every epoch")

    seed0 = _run(c, nproc)  # the public checks' run: --seed 0
    if c.completed(seed0, f"{nproc} ranks, --seed 0"):
        others = _trained_on(c, seed0, nproc) or {}
        same = [e for e in range(EPOCHS) if order(epochs, e) == order(others, e)]
        c.expect(not same, f"{nproc} ranks: --seed {SEED} and --seed 0 shuffle differently",
                 measured=f"epochs {same} have the same order with both seeds" if same
                 else "other orders in every epoch",
                 expected="--seed picks the shuffle: another seed, other orders")


# Required: 4 ranks do not divide 26 items. DistributedSampler gives each rank 7 (2 items
# twice); shares cut by hand without padding (7, 7, 6, 6) differ, and a fix that is right
# only where the ranks divide the items passes every other check.
OTHER_ITEMS = 26


@check(f"At 4 ranks and {OTHER_ITEMS} items: each item once per epoch (at most "
       f"{-OTHER_ITEMS % 4} twice, as padding), in a new order every epoch", points=2,
       visibility="after_published", required=True)
def at_four_ranks(c):
    nproc = 4
    run = _run(c, nproc, items=OTHER_ITEMS)
    if c.completed(run, f"{nproc} ranks") and (
            epochs := _trained_on(c, run, nproc, items=OTHER_ITEMS)):
        _cover_part(c, epochs, nproc, f"{nproc} ranks", items=OTHER_ITEMS)
        _order_part(c, epochs, nproc, f"{nproc} ranks")
