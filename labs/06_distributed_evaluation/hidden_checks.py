"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: 13 items at 4 ranks, where
DistributedSampler pads 3 items."""

from checks import PADDED_TWICE, _counted_once, _same_accuracy

from labutils.grading import check

NPROC = 4


# Required: its 2 points alone leave a fix tuned to the public cases above the pass mark
# (a rule for one or two padded items, the most the public checks pad: at 4 ranks x 13
# items DistributedSampler pads three, on ranks 1, 2 and 3).
@check(f"{NPROC} ranks, {PADDED_TWICE} items: each counted once, and the single-process accuracy",
       points=2, visibility="after_published", required=True)
def other_world_size(c):
    label = f"{NPROC} ranks, {PADDED_TWICE} items"
    _counted_once(c, NPROC, PADDED_TWICE, f"{label}: predictions counted")
    _same_accuracy(c, NPROC, PADDED_TWICE, f"{label}: accuracy")
