"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in cases the public checks do not show: other corrupt readings, at 3 ranks and
at 4 (the public checks run 2 and 3).

--seed 8 --corrupt 3 puts the corrupt readings at items 52, 57 and 74 (12 readings a
step): at 3 ranks, ranks 1 and 0 both hold one in step 4, and rank 2 alone in step 6; at
4 ranks, ranks 0 and 1 in step 4, and rank 2 alone in step 6.
"""

import math

from checks import STEPS, _finished, _same_steps_skipped, _weights

from labutils.grading import check

OTHER = ["--seed", 8, "--corrupt", 3]
SKIPPED = [4, 6]


# Required: the public cases have one corrupt reading per step, so a fix that skips a step
# only when exactly one rank votes for it passes them all.
@check("Other corrupt readings (two ranks in one step, then rank 2), at 3 and 4 ranks: the same "
       "steps skipped and the same weights on every rank", points=2, visibility="after_published",
       required=True)
def other_corrupt_readings(c):
    for nproc in (3, 4):
        run = _finished(c, nproc, *OTHER)
        if run is not None:
            _same_in_every_rank(c, run, nproc)


def _same_in_every_rank(c, run, nproc: int) -> None:
    _same_steps_skipped(c, run, nproc, SKIPPED)
    weights = _weights(run)
    digests = {rank: digest[:12] for rank, (_, digest) in sorted(weights.items())}
    finite = all(math.isfinite(v) for values, _ in weights.values() for v in values)
    c.expect(len(digests) == nproc and len(set(digests.values())) == 1 and finite,
             f"{nproc} ranks: identical, finite weights after {STEPS} steps",
             measured=f"sha256 per rank {digests}" + ("" if finite else "; some weights are NaN"),
             expected="bitwise identical weights on every rank, none NaN (no corrupt reading "
                      "trained on)")

