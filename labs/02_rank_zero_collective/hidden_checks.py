"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: other --steps and --log-every, at 3
ranks."""

from checks import ARGS

from labutils.grading import check

STEPS, LOG_EVERY = 10, 3


@check(f"With --steps {STEPS} --log-every {LOG_EVERY}, at 3 ranks: the run finishes and every "
       "log line shows the loss averaged over all ranks", points=2, visibility="after_published")
def other_log_interval(c):
    nproc = 3
    label = f"{nproc} ranks, --steps {STEPS} --log-every {LOG_EVERY}"
    if not c.run("train.py", 2, args=ARGS).ok:  # the public checks' run: a hang costs seconds
        c.expect(False, label, measured="not tried, since it did not finish at 2 ranks",
                 expected="the run finishes")
        return
    run = c.run("train.py", nproc, args=["--steps", STEPS, "--log-every", LOG_EVERY])
    if not c.completed(run, label):
        return
    local = {(r["step"], r["rank"]): r["loss"] for r in run.rows("step", "loss")}
    logged = {r["log_step"]: r["global_loss"] for r in run.rows("log_step", "global_loss")
              if r["rank"] == 0}
    wrong = []
    for step in range(0, STEPS, LOG_EVERY):
        expected = sum(local.get((step, r), float("nan")) for r in range(nproc)) / nproc
        got = logged.get(step)
        if got is None or abs(got - expected) > 1e-5 * max(1.0, abs(expected)):
            wrong.append(f"step {step}: logged {got}, mean of the ranks' losses {expected:.6f}")
    c.expect(not wrong, f"{label}: logged loss = mean of every rank's loss",
             measured="; ".join(wrong) or f"{len(logged)} log lines, each the mean over {nproc} ranks",
             expected=f"rank 0 logs, at steps {list(range(0, STEPS, LOG_EVERY))}, the mean of the "
                      "losses all ranks reported")
