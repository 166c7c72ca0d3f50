"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: rank 0, the rank that writes the
checkpoint, killed at step 2 (required: a run killed at any step must resume).

The world size stays 2: at more ranks a sum of gradients depends on its order, and DDP
reorders its gradient bucket after the first step of every run, the resumed one
included, so no resumed run is bitwise equal to an uninterrupted one."""

from checks import _killed, _plain, _resumed_like_plain

from labutils.grading import check

ELSEWHERE = {"rank": 0, "step": 2}


# Required: the notebook asks that a run killed at any step carries on from its checkpoint.
# A run that checkpoints every few steps only (step % 5 == 4) passes the public kill at
# step 5, which follows a checkpoint, and trains again from step 0 when killed at step 2:
# without this check it would pass the lab on the public checks' points.
@check(f"Rank {ELSEWHERE['rank']} killed at step {ELSEWHERE['step']}: the resumed run carries on "
       "from its checkpoint and ends with exactly the weights of an uninterrupted run", points=2,
       visibility="after_published", required=True)
def kill_elsewhere(c):
    plain, killed = _plain(c), _killed(c, ELSEWHERE)  # the first: the public checks' run
    if (c.completed(plain, "uninterrupted run") and
            c.completed(killed, "killed and resumed run", restarts=1)):
        _resumed_like_plain(c, plain, killed, ELSEWHERE)
