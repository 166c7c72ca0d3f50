"""Checks for lab 07: a run that resumes after a worker is killed.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py
"""

from labutils.grading import check

STEPS = 10
KILL = {"rank": 1, "step": 5}


def _plain(c):
    return c.run("train.py", 2, args=["--steps", STEPS], measure=["weights"])


def _killed(c):
    return c.run("train.py", 2, args=["--steps", STEPS], measure=["weights"],
                 fault=KILL, max_restarts=1)


@check(f"Rank {KILL['rank']} killed at step {KILL['step']}: the run restarts once and finishes",
       points=2)
def survives_the_kill(c):
    run = _killed(c)
    if c.completed(run, "2 ranks, SIGKILL, --max-restarts 1", restarts=1):
        injected = run.result.attempts[0].get("injected")
        c.expect(injected == KILL, "2 ranks, SIGKILL, --max-restarts 1",
                 measured=f"killed {injected}, finished after {run.restarts} restart",
                 expected=f"the kill {KILL} happened and the run finished after one restart")


@check("The resumed run ends with exactly the weights of an uninterrupted run", points=5)
def bitwise_resume(c):
    plain, killed = _plain(c), _killed(c)
    if not (c.completed(plain, "uninterrupted run") and
            c.completed(killed, "killed and resumed run", restarts=1)):
        return
    want, got = plain.probe("weights"), killed.probe("weights")
    same = all(got.get(r, {}).get("sha256") == want[r]["sha256"] for r in want)
    diff = max((abs(a - b) for r in want if r in got
                for a, b in zip(got[r]["values"], want[r]["values"])), default=float("nan"))
    c.expect(same, f"kill rank {KILL['rank']} at step {KILL['step']}, resume, finish {STEPS} steps",
             measured="bitwise equal" if same else f"weights differ, by up to {diff:.3g}",
             expected="bitwise equal weights on every rank (sha256)")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
