"""Checks only the grader runs (never in a learner's copy of the lab): the other way
round, saved at 2 ranks after 6 steps (two checkpoints, after steps 5 and 6: the
resumed run must take the newest finished one, past a step-7 save cut short), resumed at
4, a world size the public checks do not use. Required, as the public trajectory: a
position in the data that holds only for a checkpoint saved at 3 ranks, or a resume from
the oldest checkpoint, passes every public check."""

from checks import _data_parts, _stop_and_resume, _trajectory_parts

from labutils.grading import check


@check("Saved at 2 ranks after 6 steps, resumed at 4: every step runs once, on the same items, "
       "with the losses and final weights of an uninterrupted run", points=3,
       visibility="after_published", required=True)
def other_way_round(c):
    first, second = _stop_and_resume(c, 2, 4, stop=6)
    if second is not None:
        _data_parts(c, first, second, 2, 4, stop=6)
        _trajectory_parts(c, first, second, 2, 4, stop=6)
