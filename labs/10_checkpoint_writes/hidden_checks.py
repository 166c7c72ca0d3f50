"""Checks only the grader runs (never in a learner's copy of the lab): a kill in the
middle of another checkpoint, step 7's, its writer's.

The kills stay at 2 ranks, where a resumed run can be bitwise equal to an uninterrupted
one: at 3 ranks a sum of three gradients depends on its order, and DDP reorders its
gradient bucket after the first step of every run, the resumed one included.
"""

from checks import CKPT, _kill_while_saving

from labutils.grading import check

ELSEWHERE = {"rank": 0, "step": 7, "phase": "saving"}


@check(f"The writing rank killed halfway through writing {CKPT} at step 7: the run resumes and "
       "ends with exactly the weights of an uninterrupted run", points=3, visibility="after_published")
def kill_while_saving_elsewhere(c):
    _kill_while_saving(c, 2, ELSEWHERE)
