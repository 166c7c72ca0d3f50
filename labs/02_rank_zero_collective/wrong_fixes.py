"""Wrong fixes of lab 02 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/02_rank_zero_collective`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

REDUCE = "        dist.all_reduce(global_loss)\n"
MEAN = "        global_loss /= world_size\n"
PRINT = '            print(f"step {step}: loss {global_loss.item():.4f} (mean over {world_size} ranks)")\n'
S_END = "        report(log_step=step, global_loss=global_loss.item())\n"  # the starter's log block ends

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
    WrongFix(
        "the log line prints rank 0's own loss; only report() gets the mean",
        why="every rank calls the all_reduce and the reported global_loss is the mean, but "
            "the printed log line, what the task is about, shows rank 0's loss (found by an "
            "audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [(PRINT, PRINT.replace("global_loss.item()", "loss.item()"))]}),
    WrongFix(
        "the other ranks join the all_reduce in an else branch, every 4 steps hard-coded",
        why="right at the public checks' --log-every 4; at --log-every 3 rank 0 waits at "
            "step 3 in an all_reduce the others call at step 4: a hang (found by an audit, "
            "2026-11-30: it scored 0.846)",
        base="starter",
        edits={"train.py": [(S_END, S_END + "    elif step % 4 == 0:\n"
                                            "        dist.all_reduce(loss.detach().clone())\n")]}),
    WrongFix(
        "the starter's all_reduce made asynchronous, so that rank 0 does not wait",
        why="rank 0 alone still starts a collective the others never call (an audit, "
            "2026-11-30: caught)",
        base="starter",
        edits={"train.py": [(REDUCE, "        dist.all_reduce(global_loss, async_op=True)  # no waiting\n")]}),
    WrongFix(
        "the other ranks join the all_reduce when rank in (1, 2), the ranks the notebook shows",
        why="right at 2 and 3 ranks; at 4, rank 3 never calls the all_reduce that ranks 0 to 2 "
            "wait in: a hang (found by an audit, 2026-11-30: it scored 0.846)",
        base="starter",
        edits={"train.py": [(S_END, S_END + "    elif rank in (1, 2) and step % args.log_every == 0:\n"
                                            "        dist.all_reduce(loss.detach().clone())\n")]}),
    WrongFix(
        "divides the sum by 2 or 3, the world sizes the notebook shows",
        why="every rank calls the all_reduce, but the mean is right at 2 and 3 ranks only: at 4 "
            "the log shows 4/3 of it (found by an audit, 2026-11-30: it scored 0.846)",
        edits={"train.py": [(MEAN, "        global_loss /= 2 if world_size == 2 else 3\n")]}),
    WrongFix(
        "every rank prints the log line, the other ranks on stderr",
        why="the log line moved to stderr on the ranks other than 0, so that stdout shows one "
            "rank's log; a job's log holds both streams, and every rank still logs it (found by "
            "an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [("        if master_process:\n" + PRINT,
                             "        if True:  # the other ranks' copy goes to stderr\n"
                             + PRINT.replace('ranks)")', 'ranks)", file=None if master_process else sys.stderr)')),
                            ("import argparse\n", "import argparse\nimport sys\n")]}),
]
