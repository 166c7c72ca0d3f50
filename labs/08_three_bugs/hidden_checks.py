"""Checks only the grader runs (never in a learner's copy of the lab): the same three
fixes, measured in a case the public checks do not show: 3 ranks, another dataset
size, batch size, learning rate, seed and number of epochs."""

from checks import _checkpoint_part, _data_parts, _run, _weights_part

from labutils.grading import check

OTHER = {"items": 30, "epochs": 2, "batch_size": 2, "lr": 0.05, "seed": 5}


@check("Data, in another case: 3 ranks, 30 items, batch 2, seed 5", points=1,
       visibility="after_published")
def data_sharding_elsewhere(c):
    run = _run(c, 3, OTHER)
    if c.completed(run, "3 ranks", weight=2):
        _data_parts(c, run, 3, OTHER)


@check("Gradients, in another case: 3 ranks, batch 2, learning rate 0.05", points=1,
       visibility="after_published")
def same_as_one_process_elsewhere(c):
    run = _run(c, 3, OTHER)
    if c.completed(run, "3 ranks"):
        _weights_part(c, run, 3, OTHER)


@check("Checkpoint, at 3 ranks", points=1, visibility="after_published")
def checkpoint_loads_elsewhere(c):
    run = _run(c, 3, OTHER)
    if c.completed(run, "3 ranks"):
        _checkpoint_part(c, run, 3)
