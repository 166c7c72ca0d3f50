"""Checks only the grader runs (never in a learner's copy of the lab): the same three
fixes, measured in a case the public checks do not show: 4 ranks (the public checks run
2 and 3), another dataset size, batch size, learning rate, seed and number of epochs.
32 items divide by 4 ranks: DistributedSampler pads none, so each item is trained on
exactly once per epoch."""

from checks import _checkpoint_part, _data_parts, _run, _weights_part

from labutils.grading import check

NPROC = 4
OTHER = {"items": 32, "epochs": 2, "batch_size": 2, "lr": 0.05, "seed": 5}


@check(f"Data, in another case: {NPROC} ranks, 32 items, batch 2, seed 5", points=1,
       visibility="after_published")
def data_sharding_elsewhere(c):
    run = _run(c, NPROC, OTHER)
    if c.completed(run, f"{NPROC} ranks", weight=2):
        _data_parts(c, run, NPROC, OTHER)


@check(f"Gradients, in another case: {NPROC} ranks, batch 2, learning rate 0.05", points=1,
       visibility="after_published")
def same_as_one_process_elsewhere(c):
    run = _run(c, NPROC, OTHER)
    if c.completed(run, f"{NPROC} ranks"):
        _weights_part(c, run, NPROC, OTHER)


@check(f"Checkpoint, at {NPROC} ranks", points=1, visibility="after_published")
def checkpoint_loads_elsewhere(c):
    run = _run(c, NPROC, OTHER)
    if c.completed(run, f"{NPROC} ranks"):
        _checkpoint_part(c, run, NPROC)
