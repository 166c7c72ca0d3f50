"""Checks only the grader runs (never in a learner's copy of the lab): a kill in the
middle of another checkpoint, step 7's, its writer's; and one writer on a cluster of two
nodes (two torchrun agents on this machine), where LOCAL_RANK is 0 once per node.

The kills stay at 2 ranks, where a resumed run can be bitwise equal to an uninterrupted
one: at 3 ranks a sum of three gradients depends on its order, and DDP reorders its
gradient bucket after the first step of every run, the resumed one included.
"""

from checks import CKPT, STEPS, _expect_one_writer, _kill_while_saving

from labutils.grading import check

ELSEWHERE = {"rank": 0, "step": 7, "phase": "saving"}


@check(f"The writing rank killed halfway through writing {CKPT} at step 7: the run resumes and "
       "ends with exactly the weights of an uninterrupted run", points=3, visibility="after_published")
def kill_while_saving_elsewhere(c):
    _kill_while_saving(c, 2, ELSEWHERE)


# Required: a writer picked by LOCAL_RANK == 0 (or by anything else that is 0 once per
# machine) is one writer on one machine, where every check above runs, and one per node
# on a cluster, where the nodes share the checkpoint's storage: every node's first rank
# writes the same checkpoint.pt.partial at once, the lab's bug again. Two torchrun agents
# ("nodes") of one rank each on this machine show it: LOCAL_RANK is 0 on both ranks.
# One point: the fixes that fail the kills only (a write in place, os.remove before the
# rename, shutil.move from /tmp) stay as far below the pass mark as they can.
@check(f"On a cluster of 2 nodes of 1 rank each, sharing the checkpoint's folder, one rank "
       f"writes {CKPT}", points=1, required=True, visibility="after_published")
def one_writer_on_two_nodes(c):
    run = c.run("train.py", 1, args=["--steps", STEPS], measure=["weights", "files"], nnodes=2)
    label = "2 nodes x 1 rank (LOCAL_RANK is 0 on both; RANK 0 and 1)"
    # A race of two writers may end the run itself (one rank renames the temporary file
    # the other is still writing): the failure, named by the launcher, says so then.
    if c.completed(run, label):
        _expect_one_writer(c, run, label, others="the other node's ranks (LOCAL_RANK 0 there too)")
