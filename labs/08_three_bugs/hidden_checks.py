"""Checks only the grader runs (never in a learner's copy of the lab): the same three
fixes, measured in a case the public checks do not show: 4 ranks (the public checks run
2 and 3), another dataset size, batch size, learning rate, seed and number of epochs.
26 items do not divide by 4 ranks: DistributedSampler repeats 2 of them so that each
rank takes 7 (batches of 2, 2, 2 and 1), where shares cut by hand without padding
(7, 7, 6, 6) take 4 steps on some ranks and 3 on others, and a DataLoader with
drop_last=True never trains on the last item of each rank. The data of that case is
run twice: the same --seed gives each rank the same items at each step (a sampler
seeded with the time agrees across the ranks of one run, not across runs). Every check here is
required: each one's points alone (1 of 15) are fewer than the pass mark leaves (1.5), so
a fix right only in the public checks' case (a plain model made without --seed, the
learning rate written as 0.1, the checkpoint saved after a third epoch) would pass."""

from checks import _checkpoint_part, _data_parts, _run, _same_order_part, _weights_part

from labutils.grading import check

NPROC = 4
OTHER = {"items": 26, "epochs": 2, "batch_size": 2, "lr": 0.05, "seed": 5}


@check(f"Data, in another case: {NPROC} ranks, 26 items, batch 2, seed 5, run twice", points=1,
       visibility="after_published", required=True)
def data_sharding_elsewhere(c):
    run = _run(c, NPROC, OTHER)
    if c.completed(run, f"{NPROC} ranks", weight=2):
        _data_parts(c, run, NPROC, OTHER)
        again = _run(c, NPROC, OTHER, repeat=1)  # the same case once more, seconds later
        if c.completed(again, f"{NPROC} ranks, the same case again"):
            _same_order_part(c, run, again, NPROC)


@check(f"Gradients, in another case: {NPROC} ranks, batch 2, learning rate 0.05", points=1,
       visibility="after_published", required=True)
def same_as_one_process_elsewhere(c):
    run = _run(c, NPROC, OTHER)
    if c.completed(run, f"{NPROC} ranks"):
        _weights_part(c, run, NPROC, OTHER)


@check(f"Checkpoint, at {NPROC} ranks", points=1, visibility="after_published", required=True)
def checkpoint_loads_elsewhere(c):
    run = _run(c, NPROC, OTHER)
    if c.completed(run, f"{NPROC} ranks"):
        _checkpoint_part(c, run, NPROC)
