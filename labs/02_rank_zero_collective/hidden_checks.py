"""Checks only the grader runs (never in a learner's copy of the lab): the same fix,
measured in a case the public checks do not show: other --steps and --log-every, at 3
ranks."""

from checks import ARGS, _logged_means

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
    if c.completed(run, label):
        _logged_means(c, run, nproc, STEPS, LOG_EVERY, label)
