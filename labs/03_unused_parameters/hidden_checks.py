"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: the weights at 3 ranks against one
process on the same 12 items a step."""

from checks import BATCH, _run, _weights

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
    names, values, _ = _weights(run)[0]
    ref_names, ref_values, _ = _weights(reference)[0]
    if names != ref_names:
        c.expect(False, "same parameters", measured=f"{names} vs {ref_names}")
        return
    diff = max(abs(a - b) for a, b in zip(values, ref_values))
    c.expect(diff <= 1e-5, f"{nproc} ranks x batch {BATCH} = 1 rank x batch {nproc * BATCH}",
             measured=f"largest weight difference {diff:.2e}", expected="at most 1e-5")
