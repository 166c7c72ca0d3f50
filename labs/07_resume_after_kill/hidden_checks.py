"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: rank 0, the rank that writes the
checkpoint, killed at step 2 (required: a run killed at any step must resume); and, in
both killed runs, that every rank resumes from the same checkpoint file (required).

The world size stays 2: at more ranks a sum of gradients depends on its order, and DDP
reorders its gradient bucket after the first step of every run, the resumed one
included, so no resumed run is bitwise equal to an uninterrupted one."""

from checks import KILL, _killed, _plain, _resumed_like_plain

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


# Required: every rank saving and loading a checkpoint file of its own (checkpoint.pt.rank0,
# .rank1, each replaced whole) resumes bitwise right in every kill above, which land after
# both ranks have saved; but the ranks write their files at different moments, so a kill
# between two ranks' saves leaves their checkpoints a step apart, and the resumed ranks start
# at different steps (mismatched collectives: a hang, or ranks training different weights).
# Measured, not read from the script: the files each rank's torch.load read (probe "files").
@check("Every rank resumes from the same checkpoint file (the one a single rank writes)", points=1,
       visibility="after_published", required=True)
def one_checkpoint(c):
    for fault in (KILL, ELSEWHERE):
        label = f"kill rank {fault['rank']} at step {fault['step']}, resume"
        killed = _killed(c, fault)  # the runs of the checks above
        if not c.completed(killed, label, restarts=1):
            continue
        loaded = {rank: sorted({call["file"] for call in seen["loads"] if call.get("file")})
                  for rank, seen in sorted(killed.probe("files").items())}
        loaded = {rank: paths for rank, paths in loaded.items() if paths}
        if not loaded:  # a resume that loads nothing is failed by the checks above
            continue
        files = sorted({tuple(paths) for paths in loaded.values()})
        c.expect(len(files) == 1, label,
                 measured="; ".join(f"rank {rank} loaded {', '.join(paths)}"
                                    for rank, paths in loaded.items()),
                 expected="every rank that loads a checkpoint loads the same file, the one "
                          "a single rank writes: checkpoints that each rank writes for itself, at its "
                          "own moment, can be a step apart after a kill, and the ranks would "
                          "resume at different steps")
