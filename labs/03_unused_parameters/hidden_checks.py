"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: the weights at 3 ranks against one
process on the same 12 items a step."""

from checks import BATCH, _run, _same_weights

from labutils.grading import check


@check(f"At 3 ranks: the weights equal one process training on the whole batch (3 x {BATCH} items)",
       points=2, visibility="after_published")
def equals_big_batch_at_3(c):
    nproc = 3
    run = _run(c, nproc)  # the public checks' run
    if not c.completed(run, f"{nproc} ranks, batch {BATCH} each"):
        return
    reference = _run(c, 1, batch=nproc * BATCH)
    if not c.completed(reference, f"1 rank, batch {nproc * BATCH} (the reference)"):
        return
    _same_weights(c, run, reference, f"{nproc} ranks x batch {BATCH} = 1 rank x batch {nproc * BATCH}")
