"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in cases the public checks do not show: the weights at 3 ranks against one
process on the same 12 items a step; 4 ranks with the auxiliary loss on."""

from checks import BATCH, _run, _same_weights, _weights

from labutils.grading import check

AUX_WEIGHT = 0.5
AUX_HEAD = (["aux_head.weight", "aux_head.bias"], 32 + 1)  # names, values: the model's last


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


@check(f"At 4 ranks with --aux-weight {AUX_WEIGHT}: the auxiliary head trains, and the weights "
       "are identical on every rank and equal one process on the whole batch", points=2,
       visibility="after_published")
def with_the_auxiliary_loss_at_4(c):
    nproc, args = 4, ["--aux-weight", AUX_WEIGHT]
    label = f"{nproc} ranks, --aux-weight {AUX_WEIGHT}"
    run = _run(c, nproc, args=args)
    if not c.completed(run, label):
        return
    weights = _weights(run)
    digests = {rank: w[2][:12] for rank, w in weights.items()}
    c.expect(len(digests) == nproc and len(set(digests.values())) == 1, f"{label}: identical weights",
             measured=f"sha256 of the weights per rank: {digests}",
             expected=f"bitwise identical on all {nproc} ranks")
    # the public checks' run has no auxiliary loss: its aux_head is as initialised (when
    # that run failed, the public checks say why and this part is left out)
    untrained = _run(c, 2)
    names, values, _ = weights[0]
    if untrained.ok:
        before = _weights(untrained)[0][1][-AUX_HEAD[1]:] if names[-2:] == AUX_HEAD[0] else []
        moved = max((abs(a - b) for a, b in zip(values[-AUX_HEAD[1]:], before)), default=0.0)
        c.expect(moved > 1e-4, f"{label}: aux_head trains",
                 measured=f"aux_head moved by up to {moved:.2e}" if before else f"parameters {names}",
                 expected=f"{AUX_HEAD[0]} (the model's last parameters) change: the auxiliary "
                          "loss trains them")
    reference = _run(c, 1, batch=nproc * BATCH, args=args)
    if c.completed(reference, f"1 rank, batch {nproc * BATCH}, --aux-weight {AUX_WEIGHT} (the reference)"):
        _same_weights(c, run, reference, f"{label}: {nproc} ranks x batch {BATCH} = 1 rank x batch {nproc * BATCH}")
