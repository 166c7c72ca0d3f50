"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in cases the public checks do not show: another --seed at 3 ranks (run twice:
the same seed, the same orders), and 4 ranks with 26 items, which they do not divide, for
4 epochs."""

from checks import EPOCHS, _cover_part, _order_part, _run, _trained_on

from labutils.grading import check

SEED = 5


def _orders(shares, nproc):
    """epoch -> the ranks' orders of that epoch, together."""
    return [tuple(tuple(shares.get(e, {}).get(r, ())) for r in range(nproc)) for e in range(EPOCHS)]


# Required: a seed that is the same on every rank only at --seed 0 (args.seed * rank)
# cuts overlapping shares at any other seed, and passes every check run at seed 0.
# The same case is run twice: --seed decides the order, so a second run trains on the
# same items in the same order (a sampler seeded with the time agrees across the ranks of
# one run, started within a second, and passes everything else).
@check(f"With --seed {SEED}, at 3 ranks: each item once per epoch, a new order every epoch, "
       "the same orders in a second run", points=1, visibility="after_published", required=True)
def another_seed(c):
    nproc = 3
    label = f"{nproc} ranks, --seed {SEED}"
    run = _run(c, nproc, seed=SEED)
    if not (c.completed(run, label) and (epochs := _trained_on(c, run, nproc, seed=SEED))):
        return
    _cover_part(c, epochs, nproc, label)
    orders = _orders(epochs, nproc)
    repeated = [e for e in range(1, EPOCHS) if orders[e] in orders[:e]]
    c.expect(not repeated, f"{label}: a new order every epoch",
             measured=f"epochs {repeated} repeat the order of an earlier epoch" if repeated
             else "every epoch in a new order",
             expected="a different order of the items in every epoch")
    again = _run(c, nproc, seed=SEED, repeat=1)
    if not (c.completed(again, f"{label}, a second run")
            and (others := _trained_on(c, again, nproc, seed=SEED))):
        return
    differ = [e for e in range(EPOCHS) if _orders(others, nproc)[e] != orders[e]]
    c.expect(not differ, f"{label}: the same orders in a second run",
             measured=f"epochs {differ} differ from the first run's" if differ
             else "the same items in the same order, every epoch, on every rank",
             expected="two runs with the same --seed train on the same items in the same "
                      "order: the shuffle comes from --seed, the same on every rank and in "
                      "every run")


# Not required: ignoring --seed (the sampler's default seed, 0) is a regression of its
# own, not this lab's bug (see wrong_fixes.py); it costs this check's point only.
@check(f"At 3 ranks: --seed {SEED} and --seed 0 shuffle differently", points=1,
       visibility="after_published")
def seed_picks_the_order(c):
    nproc = 3
    run, seed0 = _run(c, nproc, seed=SEED), _run(c, nproc)  # seed0: the public checks' run
    if not (c.completed(run, f"{nproc} ranks, --seed {SEED}")
            and c.completed(seed0, f"{nproc} ranks, --seed 0")):
        return
    epochs = _trained_on(c, run, nproc, seed=SEED)
    others = _trained_on(c, seed0, nproc)
    if epochs is None or others is None:
        return
    mine, theirs = _orders(epochs, nproc), _orders(others, nproc)
    same = [e for e in range(EPOCHS) if mine[e] == theirs[e]]
    c.expect(not same, f"{nproc} ranks: --seed {SEED} and --seed 0 shuffle differently",
             measured=f"epochs {same} have the same order with both seeds" if same
             else "other orders in every epoch",
             expected="--seed picks the shuffle: another seed, other orders")


# Required: 4 ranks do not divide 26 items. DistributedSampler gives each rank 7 (2 items
# twice); shares cut by hand without padding (7, 7, 6, 6) differ, and a fix that is right
# only where the ranks divide the items passes every other check. One epoch more than the
# other runs: an order that comes round again after 3 epochs (set_epoch(epoch % 3)) is
# new in every run of 3.
OTHER_ITEMS = 26
OTHER_EPOCHS = EPOCHS + 1


@check(f"At 4 ranks and {OTHER_ITEMS} items: each item once per epoch (at most "
       f"{-OTHER_ITEMS % 4} twice, as padding), in a new order in each of {OTHER_EPOCHS} "
       "epochs", points=2, visibility="after_published", required=True)
def at_four_ranks(c):
    nproc = 4
    run = _run(c, nproc, items=OTHER_ITEMS, epochs=OTHER_EPOCHS)
    if c.completed(run, f"{nproc} ranks") and (
            epochs := _trained_on(c, run, nproc, items=OTHER_ITEMS, count=OTHER_EPOCHS)):
        _cover_part(c, epochs, nproc, f"{nproc} ranks", items=OTHER_ITEMS, count=OTHER_EPOCHS)
        _order_part(c, epochs, nproc, f"{nproc} ranks", count=OTHER_EPOCHS)
