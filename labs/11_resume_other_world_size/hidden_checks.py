"""Checks only the grader runs (never in a learner's copy of the lab): the other way
round from the public checks' first resume, saved at 2 ranks after 6 steps (two
checkpoints of one run, after steps 5 and 6: the resumed run must take the newest
finished one, past a step-7 save cut short), resumed at 4 for the 6 steps left.
Required, as the public trajectory: a fix tuned to the public case's numbers must not
pass the lab."""

from checks import STEPS, _data_parts, _label, _stop_and_resume, _trajectory_parts

from labutils.grading import check

OTHER_WAY_ROUND = ((2, 6), (4, STEPS))


@check(f"{_label(OTHER_WAY_ROUND).capitalize()}: every step runs once, on the same items, "
       "with the losses and final weights of an uninterrupted run", points=3,
       visibility="after_published", required=True)
def other_way_round(c):
    runs = _stop_and_resume(c, OTHER_WAY_ROUND)
    if runs is not None:
        _data_parts(c, runs, OTHER_WAY_ROUND)
        _trajectory_parts(c, runs, OTHER_WAY_ROUND)
