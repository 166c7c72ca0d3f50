"""Checks for lab 02: a collective that only rank 0 calls.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py

The losses each rank reports are checked against one process replaying the run (the
same batches, model and steps), so a log line is compared with losses really trained.
"""

import re
from decimal import Decimal

import torch
import torch.nn as nn
import torch.nn.functional as F

from labutils.grading import check

STEPS, LOG_EVERY = 12, 4
ARGS = ["--steps", STEPS, "--log-every", LOG_EVERY]
BATCH = 8  # train.py's --batch-size
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+)(?:[eE][-+]?\d+)?")  # a printed decimal number


def _printed(text: str) -> list[str]:
    """The lines of a rank's stdout that look like log lines: a loss, or a decimal number."""
    return [line for line in text.splitlines() if "loss" in line or NUMBER.search(line)]


def _shows(text: str, value: float) -> bool:
    """Whether a decimal number printed in text is value, to the digits it was printed with."""
    for number in NUMBER.findall(text):
        tolerance = max(0.5 * 10.0 ** Decimal(number).as_tuple().exponent, 1e-4 * max(1.0, abs(value)))
        if abs(float(number) - value) <= tolerance:
            return True
    return False


@check("Training finishes at 2 and 3 ranks (no hang)", points=4)
def finishes(c):
    for nproc in (2, 3):
        run = c.run("train.py", nproc, args=ARGS)
        if c.completed(run, f"{nproc} ranks"):
            c.expect(True, f"{nproc} ranks", measured=f"finished in {run.result.duration_s:.1f} s")


@check("Every log line shows the loss averaged over all ranks", points=3)
def global_loss(c):
    for nproc in (2, 3):
        run = c.run("train.py", nproc, args=ARGS)
        if c.completed(run, f"{nproc} ranks"):
            _logged_means(c, run, nproc, STEPS, LOG_EVERY, f"{nproc} ranks")


@check("Only rank 0 prints the log lines, at 2 and 3 ranks", points=1, required=True)
def only_rank_zero_prints(c):
    # every rank calls the collective, but the log is rank 0's: a fix that lets every rank
    # log (the condition dropped, or master_process made True) ends the hang too
    for nproc in (2, 3):
        run = c.run("train.py", nproc, args=ARGS)
        if not c.completed(run, f"{nproc} ranks"):
            continue
        printed = {r.rank: _printed(r.stdout) for r in run.result.ranks}
        others = sorted(rank for rank, lines in printed.items() if rank != 0 and lines)
        c.expect(not others and bool(printed.get(0)), f"{nproc} ranks: log lines from rank 0 only",
                 measured=f"log lines from ranks {[0, *others] if printed.get(0) else others}"
                 if others or not printed.get(0) else f"rank 0 only ({len(printed[0])} lines)",
                 expected="rank 0 prints the log (on stdout); the other ranks call the collective "
                          "and print nothing")
        # the log line moved to stderr on the other ranks still logs it once per rank (a job's
        # log holds both streams): a line of theirs with "loss" showing a mean rank 0 logged
        means = [r["global_loss"] for r in run.rows("log_step", "global_loss") if r["rank"] == 0]
        echoed = {r.rank: line for r in run.result.ranks if r.rank != 0
                  for line in reversed(r.stderr.splitlines())
                  if "loss" in line and any(_shows(line, mean) for mean in means)}
        if echoed:
            c.expect(False, f"{nproc} ranks: the log line on the other ranks' stderr",
                     measured="; ".join(f"rank {rank} wrote {line.strip()[:80]!r} to stderr"
                                        for rank, line in sorted(echoed.items())),
                     expected="the log line from rank 0 only: on another rank's stderr it is "
                              "still logged once per rank")


def _replayed_losses(nproc: int, steps: int) -> dict:
    """(step, rank) -> the loss of that rank's batch, from one process replaying the run:
    train.py's batches and model, each step the gradient of the mean over the ranks (DDP's)."""
    target = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = {}
    for step in range(steps):
        per_rank = []
        for rank in range(nproc):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(BATCH, 4, generator=g)
            y = x @ target + 0.1 * torch.randn(BATCH, 1, generator=g)
            per_rank.append(F.mse_loss(model(x), y))
            losses[step, rank] = per_rank[-1].item()
        optimizer.zero_grad()
        (sum(per_rank) / nproc).backward()
        optimizer.step()
    return losses


def _logged_means(c, run, nproc: int, steps: int, log_every: int, label: str) -> None:
    """One part: every loss rank 0 logged is the mean of the losses all ranks trained on,
    and the losses the ranks reported are those of the replayed run."""
    local = {(r["step"], r["rank"]): r["loss"] for r in run.rows("step", "loss")}
    replayed = _replayed_losses(nproc, steps)
    forged = [f"step {s} rank {r}: reported {local.get((s, r))}, trained {v:.6f}"
              for (s, r), v in sorted(replayed.items())
              if not isinstance(local.get((s, r)), (int, float))
              or abs(local[s, r] - v) > 1e-4 * max(1.0, abs(v))]
    if forged:
        c.expect(False, f"{label}: the losses reported are the losses trained",
                 measured=f"{len(forged)} of {len(replayed)} differ; " + "; ".join(forged[:3]),
                 expected="report(step=..., loss=...) on every rank, each step, with the loss "
                          "of its batch (one process replaying the run computes them)")
        return
    logged = {r["log_step"]: r["global_loss"] for r in run.rows("log_step", "global_loss")
              if r["rank"] == 0}
    printed = "\n".join(_printed(next((r.stdout for r in run.result.ranks if r.rank == 0), "")))
    wrong = []
    for step in range(0, steps, log_every):
        expected = sum(replayed[step, r] for r in range(nproc)) / nproc
        got = logged.get(step)
        if got is None or abs(got - expected) > 1e-4 * max(1.0, abs(expected)):
            wrong.append(f"step {step}: logged {got}, mean of the ranks' losses {expected:.6f}")
        elif not _shows(printed, expected):
            wrong.append(f"step {step}: logged {got}, but no line rank 0 printed shows "
                         f"{expected:.4f}, the mean of the ranks' losses")
    c.expect(not wrong, f"{label}: logged loss = mean of every rank's loss",
             measured="; ".join(wrong) or f"{len(logged)} log lines, each the mean over {nproc} ranks",
             expected=f"rank 0 logs, at steps {list(range(0, steps, log_every))}, "
                      "the mean of the losses all ranks reported, in report(log_step=..., "
                      "global_loss=...) and in the line it prints")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
