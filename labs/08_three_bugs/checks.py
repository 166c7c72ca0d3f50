"""Checks for lab 08: three bugs in one training script, each measured on its own.

Run them yourself from this folder (the grader runs the same ones):

    python checks.py

Each check measures one bug, whatever the state of the other two: the data each rank
trained on; the weights against one process taking the same steps (built from the
items each rank's DataLoader handed it, so the data bug does not change it); the saved
checkpoint. What the script reports is for you to read: the checks measure the data
themselves (the grader's "data" probe reads each batch's indices from the DataLoader).
"""

import hashlib
from collections import Counter
from pathlib import Path

import torch

from labutils.grading import check
from regression import make_model, reference_model

CKPT = "model.pt"
CASE = {"items": 24, "epochs": 3, "batch_size": 4, "lr": 0.1, "seed": 0}


def _args(case: dict) -> list:
    return ["--items", case["items"], "--epochs", case["epochs"], "--batch-size",
            case["batch_size"], "--lr", case["lr"], "--seed", case["seed"], "--ckpt", CKPT]


def _run(c, nproc, case=CASE, repeat=0):
    return c.run("train.py", nproc, args=_args(case), measure=["weights", "data"], repeat=repeat)


def _batches(run) -> dict:
    """step -> (epoch, rank -> the items of that rank's batch), as the grader's probe saw
    each rank's DataLoader hand them over, whatever the script reports. A step trains on
    the batches its rank took from the pass over the loader it took its last batch from;
    batches of another pass taken since the step before (a look at one batch, an
    evaluation loop over the loader) trained nothing, and are left out. The passes that
    trained, in order, are the epochs."""
    items, epochs = {}, {}   # step -> rank -> its items, and the epoch of its batches
    for rank, record in run.probe("data").items():
        passes: list = []
        for step, batches in enumerate(record["steps"]):
            last = batches[-1][0] if batches else None
            if last is not None and last not in passes:
                passes.append(last)
            items.setdefault(step, {})[rank] = [i for p, indices in batches if p == last
                                                for i in indices]
            epochs.setdefault(step, {})[rank] = passes.index(last) if last is not None else -1
    # a step's epoch: rank 0's (the ranks agree, or the data parts say what differs)
    return {step: (epochs[step].get(0, min(epochs[step].values())), ranks)
            for step, ranks in items.items()}


def _data_parts(c, run, nproc: int, case: dict) -> None:
    """Two parts: each epoch the ranks' items are a disjoint cover; each epoch a new order."""
    items, epochs = case["items"], case["epochs"]
    shares = {}  # epoch -> rank -> the items it trained on, in order
    for step, (epoch, ranks) in sorted(_batches(run).items()):
        for rank, indices in ranks.items():
            shares.setdefault(epoch, {}).setdefault(rank, []).extend(indices)
    # where the ranks do not divide the items, DistributedSampler repeats a few of them so
    # that every rank takes the same number of steps: at most that many twice
    padding = -items % nproc
    problems = []
    for epoch in range(epochs):
        counts = Counter(i for share in shares.get(epoch, {}).values() for i in share)
        twice, never = sum(n > 1 for n in counts.values()), items - len(counts)
        if twice > padding or max(counts.values(), default=0) > 2 or never \
                or len(shares.get(epoch, {})) != nproc:
            problems.append(f"epoch {epoch}: {twice} items trained on more than once, "
                            f"{never} never, batches from {len(shares.get(epoch, {}))} ranks")
    once = (f"each of the {items} items once per epoch" if not padding else
            f"each of the {items} items once per epoch, at most {padding} twice (padding)")
    c.expect(not problems, f"{nproc} ranks: {once}",
             measured="; ".join(problems[:2]) or f"every epoch covers the {items} items"
             + (" once" if not padding else f", at most {padding} of them twice"),
             expected=f"each epoch, the ranks' shares are disjoint and cover all {items} items"
             + ("" if not padding else f" (DistributedSampler's padding of {nproc} equal "
                f"shares repeats {padding} items)"))
    repeats = []
    for rank in range(nproc):
        # any earlier epoch, not only the one before: set_epoch(epoch % 2) takes two
        # orders in turn, and epoch 2 repeats epoch 0's
        orders = [shares.get(e, {}).get(rank) for e in range(epochs)]
        again = [(e, orders.index(orders[e])) for e in range(1, epochs)
                 if orders[e] in orders[:e]]
        if again:
            repeats.append(f"rank {rank}: " + ", ".join(f"epoch {e} repeated epoch {first}'s order"
                                                         for e, first in again))
    c.expect(not repeats, f"{nproc} ranks: a new order in each of {epochs} epochs",
             measured="; ".join(repeats[:3]) or "every epoch in an order no earlier epoch had",
             expected="a different order of items in every epoch, on every rank: one no earlier "
                      "epoch had")


def _same_order_part(c, run, again, nproc: int) -> None:
    """One part: a second run of the same case trains each rank on the same items in the
    same order, step by step: the order comes from --seed, not from the clock or the
    process (a sampler seeded with the time agrees across ranks started within one
    second, and covers the data in that run)."""
    first = {step: ranks for step, (_, ranks) in _batches(run).items()}
    second = {step: ranks for step, (_, ranks) in _batches(again).items()}
    differ = [step for step in sorted(set(first) | set(second))
              if first.get(step) != second.get(step)]
    where = ""
    if differ:
        one, other = first.get(differ[0], {}), second.get(differ[0], {})
        rank = next(r for r in sorted(set(one) | set(other)) if one.get(r) != other.get(r))
        where = (f"step {differ[0]}, rank {rank}: items {one.get(rank)} in one run, "
                 f"{other.get(rank)} in the other")
    c.expect(not differ, f"{nproc} ranks: the same --seed, the same items in the same order "
             "in a second run",
             measured=(f"{len(differ)} of {len(first)} steps differ; first at {where}" if differ
                       else "the same items at every step"),
             expected="two runs with the same --seed train each rank on the same items at each "
                      "step: the permutation comes from --seed, the same on every rank and in "
                      "every run")


def _weights_part(c, run, nproc: int, case: dict) -> None:
    """One part: the final weights equal one process taking the same steps, batch by batch."""
    steps = _batches(run)
    short = [s for s, (_, ranks) in steps.items() if len(ranks) != nproc]
    empty = all(not items for _, ranks in steps.values() for items in ranks.values())
    if not steps or short or empty:
        c.expect(False, f"{nproc} ranks: the steps each rank took",
                 measured=f"steps {short[:5]} taken by fewer than {nproc} ranks" if short
                 else "no optimizer step taken on a batch from a DataLoader",
                 expected="every rank takes each step on a batch from its DataLoader (the "
                          "checks read the items from the DataLoader's sampler)")
        return
    # the global batch of step k: every rank's batch of step k, together
    batches = [[i for rank in sorted(ranks) for i in ranks[rank]]
               for _, (_, ranks) in sorted(steps.items())]
    reference = reference_model(batches, items=case["items"], lr=case["lr"], seed=case["seed"])
    expected = [v for p in reference.parameters() for v in p.detach().flatten().tolist()]
    got = run.probe("weights").get(0, {}).get("values", [])
    if len(got) != len(expected):
        c.expect(False, f"{nproc} ranks: the model", measured=f"{len(got)} weights",
                 expected=f"{len(expected)} weights, the model of regression.py")
        return
    diff = max(abs(a - b) for a, b in zip(got, expected))
    c.expect(diff <= 1e-5, f"{nproc} ranks, {len(batches)} steps: the same weights as one process "
             "taking each step's whole batch at once",
             measured=f"largest weight difference {diff:.2e}",
             expected="at most 1e-5 (float rounding); a larger gap means the steps were not "
                      "the gradient of each step's batch")


def _checkpoint_part(c, run, nproc: int) -> None:
    """One part: rank 0's checkpoint loads with strict=True into the plain model and
    holds the final weights, bit for bit."""
    label = (f"{nproc} ranks: {CKPT} loads into the plain model (strict=True), "
             "with the trained weights")
    # Checker.run starts each run in a working directory of its own, with the run's logs
    # in <that directory>/runs/<run>: the checkpoint is two levels above the logs.
    path = Path(run.result.log_dir).parents[1] / CKPT
    if not path.is_file():
        c.expect(False, label, measured=f"no {CKPT} after the run",
                 expected=f"rank 0 saves the weights to --ckpt {CKPT}")
        return
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model = make_model()
        model.load_state_dict(state, strict=True)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the measured result
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        c.expect(False, label, measured=f"{type(exc).__name__}: {' '.join(lines)[:300]}",
                 expected="keys the plain model has: " + ", ".join(make_model().state_dict()))
        return
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().contiguous().numpy().tobytes())
    trained = run.probe("weights").get(0, {}).get("sha256")
    c.expect(digest.hexdigest() == trained, label,
             measured="loads, and holds the trained weights" if digest.hexdigest() == trained
             else "loads, but its weights are not the trained ones",
             expected="the weights of the model at the end of training, bit for bit")


@check("Data: each epoch the ranks share the dataset exactly, in a new order, at 2 and 3 ranks",
       points=4)
def data_sharding(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if c.completed(run, f"{nproc} ranks", weight=2):
            _data_parts(c, run, nproc, CASE)


@check("Gradients: the weights equal one process taking each step's whole batch, at 2 and 3 ranks",
       points=4)
def same_as_one_process(c):
    for nproc in (2, 3):
        run = _run(c, nproc)
        if c.completed(run, f"{nproc} ranks"):
            _weights_part(c, run, nproc, CASE)


@check(f"Checkpoint: {CKPT} loads with strict=True into the plain model", points=3)
def checkpoint_loads(c):
    run = _run(c, 2)
    if c.completed(run, "2 ranks"):
        _checkpoint_part(c, run, 2)


if __name__ == "__main__":
    from labutils.grading import run_checks

    run_checks()
