"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in cases the public checks do not show: the weights at 3 ranks against one
process on the same 12 items a step (a required check: gradients summed and divided by
a hard-coded 2 are right at 2 ranks only); 4 ranks with the auxiliary loss on, where the
auxiliary head must still train (a required check: a fix that freezes the head for
good loses only its points, and would pass the lab without it), and the ranks keep
identical weights, those of one process (required too: a head DDP leaves out trains on
each rank's batch alone)."""

from checks import AUX_HEAD, BATCH, OFF, _own_batches, _run, _same_weights, _weights

from labutils.grading import check

AUX_WEIGHT = 0.5


# Required: the public required check runs 2 ranks, where dividing the summed gradients
# by 2 is dividing by the world size.
@check(f"At 3 ranks: the weights equal one process training on the whole batch (3 x {BATCH} items)",
       points=2, visibility="after_published", required=True)
def equals_big_batch_at_3(c):
    nproc = 3
    run = _run(c, nproc)  # the public checks' run
    if not c.completed(run, f"{nproc} ranks, batch {BATCH} each"):
        return
    reference = _run(c, 1, batch=nproc * BATCH, args=OFF)
    if not c.completed(reference, f"1 rank, batch {nproc * BATCH}, --aux-weight 0 (the reference)"):
        return
    _same_weights(c, run, reference, f"{nproc} ranks x batch {BATCH} = 1 rank x batch {nproc * BATCH}")
    _own_batches(c, run, nproc)


AUX_ARGS = ["--aux-weight", AUX_WEIGHT]
AUX_LABEL = f"4 ranks, --aux-weight {AUX_WEIGHT}"


@check(f"At 4 ranks with --aux-weight {AUX_WEIGHT}: the auxiliary head trains", points=1,
       visibility="after_published", required=True)
def the_auxiliary_head_trains_at_4(c):
    # Trained by the auxiliary loss, the head ends elsewhere under another weight of that
    # loss; left out of training (frozen, detached), it ends as initialised under both.
    # Both runs use the head at every step, so the starter runs them too.
    other = AUX_WEIGHT / 2
    run = _run(c, 4, args=AUX_ARGS)
    again = _run(c, 4, args=["--aux-weight", other])
    if not (c.completed(run, AUX_LABEL) and c.completed(again, f"4 ranks, --aux-weight {other}")):
        return
    names, values, _ = _weights(run)[0]
    _, others, _ = _weights(again)[0]
    size = AUX_HEAD[1] if names[-2:] == AUX_HEAD[0] else 0
    moved = max((abs(a - b) for a, b in zip(values[-size:], others[-size:])), default=0.0) if size else 0.0
    c.expect(moved > 1e-4, f"{AUX_LABEL}: aux_head trains",
             measured=(f"aux_head differs by up to {moved:.2e} between --aux-weight {AUX_WEIGHT} "
                       f"and {other}") if size else f"parameters {names}",
             expected=f"{AUX_HEAD[0]} (the model's last parameters) trained by the auxiliary "
                      "loss: different under another weight of it")


# Required: a head that trains but that DDP leaves out (its parameters ignored, or a module
# of its own beside the DDP model) trains on each rank's own batch: the ranks drift apart
# under the auxiliary loss, and only this check runs it on more than one rank.
@check(f"At 4 ranks with --aux-weight {AUX_WEIGHT}: the weights are identical on every rank "
       "and equal one process on the whole batch", points=1, visibility="after_published",
       required=True)
def with_the_auxiliary_loss_at_4(c):
    nproc, args, label = 4, AUX_ARGS, AUX_LABEL
    run = _run(c, nproc, args=args)
    if not c.completed(run, label):
        return
    weights = _weights(run)
    digests = {rank: w[2][:12] for rank, w in sorted(weights.items())}
    c.expect(len(digests) == nproc and len(set(digests.values())) == 1, f"{label}: identical weights",
             measured=f"sha256 of the weights per rank: {digests}",
             expected=f"bitwise identical on all {nproc} ranks")
    reference = _run(c, 1, batch=nproc * BATCH, args=args)
    if c.completed(reference, f"1 rank, batch {nproc * BATCH}, --aux-weight {AUX_WEIGHT} (the reference)"):
        _same_weights(c, run, reference, f"{label}: {nproc} ranks x batch {BATCH} = 1 rank x batch {nproc * BATCH}")
