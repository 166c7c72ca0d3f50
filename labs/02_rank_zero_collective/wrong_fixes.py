"""Wrong fixes of lab 02 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/02_rank_zero_collective`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

REDUCE = "        dist.all_reduce(global_loss)\n"
MEAN = "        global_loss /= world_size\n"

WRONG_FIXES = [
    WrongFix(
        "every rank calls the all_reduce, and every rank logs",
        why="the hurried fix: drops master_process from the condition, so the hang ends and "
            "each rank prints the log line; the log is rank 0's (found by an audit, "
            "2026-11-29: it scored 1.000)",
        base="starter",
        edits={"train.py": [("    if master_process and step % args.log_every == 0:",
                             "    if step % args.log_every == 0:")]}),
    WrongFix(
        "removes the all_reduce and logs rank 0's own loss",
        why="no hang, but the log shows one rank's loss, not the mean",
        edits={"train.py": [(REDUCE, ""), (MEAN, "")]}),
    WrongFix(
        "divides by a hard-coded 2",
        why="right at 2 ranks only",
        edits={"train.py": [(MEAN, "        global_loss /= 2\n")]}),
    WrongFix(
        "all_reduce on every rank, but logs the sum",
        why="the collective is fixed; the division by the world size is forgotten",
        edits={"train.py": [(MEAN, "")]}),
    WrongFix(
        "all_reduce of the maximum on every rank",
        why="every rank calls the collective, but it reduces the wrong value",
        edits={"train.py": [(REDUCE, "        dist.all_reduce(global_loss, op=dist.ReduceOp.MAX)\n"),
                            (MEAN, "")]}),
    WrongFix(
        "reports what the check compares: zero losses, no collective",
        why="the starter without its all_reduce, reporting 0 as every rank's loss and as "
            "the logged mean: consistent, and false",
        base="starter",
        edits={"train.py": [("report(step=step, loss=loss.item())", "report(step=step, loss=0.0)"),
                            ("        dist.all_reduce(global_loss)\n        global_loss /= world_size\n",
                             "        global_loss.zero_()\n")]}),
]
