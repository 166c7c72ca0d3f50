"""Checks for lab 01: who trains on which items, epoch after epoch.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py

The items each rank reports are checked against what it trained on: the final weights
(read by the grader's probe) must equal one process taking, step after step, the batch
the ranks reported together.
"""

from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from labutils.grading import check

ITEMS = 24
EPOCHS = 3
BATCH = 5   # divides no rank's share at 2, 3 or 4 ranks: each epoch ends on a short batch


def _run(c, nproc, *, seed=0, items=ITEMS, epochs=EPOCHS, repeat=0):
    return c.run("train.py", nproc, args=["--epochs", epochs, "--items", items, "--batch-size",
                                          BATCH, "--seed", seed], measure=["weights"], repeat=repeat)


def _epochs(run):
    """epoch -> rank -> the indices that rank reported it trained on."""
    seen = {}
    for row in run.rows("epoch", "indices"):
        seen.setdefault(row["epoch"], {})[row["rank"]] = row["indices"]
    return seen


def _reference_weights(batches: list[list[int]], *, seed: int, items: int = ITEMS) -> list[float]:
    """One process taking each global batch at once, as train.py builds its data and model."""
    g = torch.Generator().manual_seed(1234)
    features = torch.randn(items, 8, generator=g)
    labels = (features.sum(dim=1) > 0).long()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches:
        loss = F.cross_entropy(model(features[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


def _trained_on(c, run, nproc: int, *, seed: int = 0, items: int = ITEMS, count: int = EPOCHS):
    """The reported shares (as _epochs) when the weights show they are what the ranks
    trained on; else None, with a failed part saying why."""
    epochs = _epochs(run)
    label = f"{nproc} ranks: the items reported are the items trained on"
    batches, odd = [], []
    for epoch in range(count):
        shares = [epochs.get(epoch, {}).get(r) for r in range(nproc)]
        if any(s is None for s in shares) or len({len(s) for s in shares}) != 1:
            odd.append(f"epoch {epoch}: shares of {[len(s) if s else 0 for s in shares]} items")
            continue
        # the global batch of a step: every rank's batch of that step, together
        batches += [[i for s in shares for i in s[k:k + BATCH]] for k in range(0, len(shares[0]), BATCH)]
    if odd:
        c.expect(False, label, measured="; ".join(odd),
                 expected=f"each epoch, report(epoch=..., indices=...) from all {nproc} ranks, "
                          "as many items each (shares of different sizes give the ranks batches "
                          "of different sizes, or different numbers of steps)")
        return None
    expected = _reference_weights(batches, seed=seed, items=items)
    got = run.probe("weights").get(0, {}).get("values", [])
    diff = max((abs(a - b) for a, b in zip(got, expected)), default=float("inf"))
    if len(got) != len(expected) or diff > 1e-5:
        c.expect(False, label,
                 measured=f"the final weights differ by up to {diff:.2e} from one process "
                          f"taking the {len(batches)} batches the ranks reported",
                 expected="the weights of training on exactly the reported items (within 1e-5)")
        return None
    return epochs


def _cover_part(c, epochs, nproc: int, label: str, items: int = ITEMS, count: int = EPOCHS) -> None:
    """One part: each epoch the ranks' shares are disjoint and cover every item; where the
    ranks do not divide the items, each rank takes as many, so a few items come twice
    (DistributedSampler's padding), no more."""
    padding = -items % nproc
    problems = []
    for epoch in range(count):
        counts = Counter(i for indices in epochs.get(epoch, {}).values() for i in indices)
        twice = sum(1 for n in counts.values() if n > 1)
        never = items - len(counts)
        if twice > padding or max(counts.values(), default=0) > 2 or never \
                or len(epochs.get(epoch, {})) != nproc:
            problems.append(f"epoch {epoch}: {twice} items seen more than once, "
                            f"{never} never seen, reports from {len(epochs.get(epoch, {}))} ranks")
    padded = "" if not padding else f", at most {padding} of them twice (padding)"
    c.expect(not problems, f"{label}: each of the {items} items once per epoch{padded}",
             measured="; ".join(problems) or f"every epoch covers the {items} items once{padded}",
             expected=f"each epoch, the ranks' shares are disjoint and cover all {items} items"
             + ("" if not padding else f" ({nproc} equal shares repeat {padding})"))


def _order_part(c, epochs, nproc: int, label: str, count: int = EPOCHS) -> None:
    """One part: no rank repeats the order of an earlier epoch."""
    repeats = []
    for rank in range(nproc):
        orders = [tuple(epochs.get(e, {}).get(rank, ())) for e in range(count)]
        same = sum(1 for e in range(1, count) if orders[e] in orders[:e])
        if same:
            repeats.append(f"rank {rank} repeated an earlier epoch's order {same} time(s)")
    c.expect(not repeats, f"{label}: a new order in each of {count} epochs",
             measured="; ".join(repeats) or "every epoch in a new order",
             expected="a different order of items in every epoch, on every rank")


@check("Every item is trained on exactly once per epoch, at 2 and 3 ranks", points=3)
def exact_cover(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if c.completed(run, f"{nproc} ranks") and (epochs := _trained_on(c, run, nproc)):
            _cover_part(c, epochs, nproc, f"{nproc} ranks")


@check("The order of the items changes from epoch to epoch", points=3)
def new_order_each_epoch(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if c.completed(run, f"{nproc} ranks") and (epochs := _trained_on(c, run, nproc)):
            _order_part(c, epochs, nproc, f"{nproc} ranks")


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
