"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: 4 ranks (a world size they do not
use) with 5 items each, 9 steps, another learning rate and seed. Required, as the public
check of the statistics: a fix that holds only for the public case (8 items a rank
hard-coded in the global count) has identical statistics on every rank, which earn points."""

from checks import _identical_part, _reference_part, _run

from labutils.grading import check

OTHER = {"steps": 9, "batch_size": 5, "lr": 0.05, "seed": 4}


@check("In another case (4 ranks x batch 5, 9 steps, seed 4): the same statistics on every "
       "rank, equal to BatchNorm on the whole batch", points=2, visibility="after_published",
       required=True)
def whole_batch_elsewhere(c):
    run = _run(c, 4, OTHER)
    if c.completed(run, "4 ranks", weight=2):
        _identical_part(c, run, 4)
        _reference_part(c, run, 4, OTHER)
