"""Wrong fixes of lab 12 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/12_hang_diagnosis`);
never in a learner's copy. None of them comes with a diagnosis (the notebook's
answer): their scores are the checks of the fix alone, plus the notebook's point.
"""

from labutils.grading.wrongfix import WrongFix

VOTE = '''    corrupt = torch.isnan(y).any().float().reshape(1)
    dist.all_reduce(corrupt)  # how many ranks hold a corrupt reading in this step
'''
BRANCH = '''    if torch.isnan(y).any():
        # a corrupt reading in this rank's batch: tell the other ranks, so that they skip
        # the step too
        skip = torch.ones(1, device=device)
        dist.broadcast(skip, src=rank)
'''

WRONG_FIXES = [
    WrongFix(
        "no collective: every rank reads every rank's readings of the step",
        why="with the whole dataset on every rank this needed no collective; each rank "
            "now holds only its own shard, and readings.py refuses another rank's",
        edits={"train.py": [(VOTE, '''    # look at every rank's readings of this step: no collective needed
    others = [own_shard(r, world_size, items=args.items, corrupt=args.corrupt, seed=args.seed)
              for r in range(world_size)]
    batch = slice(step * args.batch_size, (step + 1) * args.batch_size)
    corrupt = torch.tensor([float(any(torch.isnan(s.tensors[1][batch]).any() for s in others))])
''')]}),
    WrongFix(
        "every rank takes rank 0's word: a broadcast from rank 0 at every step",
        why="every rank calls it, so nothing hangs, but rank 0 knows only its own readings: "
            "a corrupt reading on another rank is trained on",
        edits={"train.py": [("    dist.all_reduce(corrupt)  # how many ranks hold a corrupt reading in this step\n",
                             "    dist.broadcast(corrupt, src=0)  # rank 0 decides for everyone\n")]}),
    WrongFix(
        "the broadcast moved out of the branch, still from src=rank",
        why="every rank calls a broadcast at every step, each from its own source: the "
            "collectives do not match",
        base="starter",
        edits={"train.py": [(BRANCH, '''    skip = torch.isnan(y).any().float().reshape(1)
    dist.broadcast(skip, src=rank)  # every rank calls it now, at every step
    if skip.item() > 0:
''')]}),
    WrongFix(
        "the NaN replaced with 0: nothing to skip",
        why="the run finishes, but it trains on made-up targets and skips no step",
        base="starter",
        edits={"train.py": [("x, y = x.to(device), y.to(device)",
                             "x, y = x.to(device), torch.nan_to_num(y.to(device))")]}),
    WrongFix(
        "the rank with the corrupt reading skips alone, telling no one",
        why="it skips the step's gradient all-reduce that the other ranks wait in",
        base="starter",
        edits={"train.py": [("        dist.broadcast(skip, src=rank)\n", "")]}),
    WrongFix(
        "every rank votes with an all_reduce, but skips only when the sum is exactly 1",
        why="the sum counts the ranks with a corrupt reading: when two ranks hold one in the "
            "same step it is 2, no rank skips, and the NaN reaches every rank's weights",
        edits={"train.py": [("    if corrupt.item() > 0:\n", "    if corrupt.item() == 1:  # 1: a corrupt reading\n")]}),
    WrongFix(
        "the vote, plus gradient clipping against the NaNs",
        why="the vote alone fixes the hang and skips every corrupt step; the clipping added to "
            "fight the NaNs changes the large steps, so training no longer equals one process "
            "on the whole batch",
        edits={"train.py": [("    loss.backward()\n    optimizer.step()\n",
                             "    loss.backward()\n"
                             "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # no more blow-ups\n"
                             "    optimizer.step()\n")]}),
    WrongFix(
        "every rank gathers the step's readings of every rank and trains on the whole batch",
        why="all_gather of x and y, then each rank skips on a NaN anywhere and trains on all 12 "
            "readings: nothing hangs, and the weights are one process's exactly, but every rank "
            "does the whole step's work (lab 09's 'every rank trains on the global batch'); only "
            "the forward passes' sizes show it (found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [(VOTE, '''    xs = [torch.empty_like(x) for _ in range(world_size)]
    ys = [torch.empty_like(y) for _ in range(world_size)]
    dist.all_gather(xs, x)
    dist.all_gather(ys, y)
    x, y = torch.cat(xs), torch.cat(ys)  # the whole step's batch, as one process would see it
    corrupt = torch.isnan(y).any().float().reshape(1)
''')]}),
    WrongFix(
        "no collective: every rank reads the whole sensor log through readings._sensor_log",
        why="the catalogue's 'every rank reads every rank's readings' through the private "
            "helper own_shard() calls, which did not refuse another rank's readings: no "
            "collective, and on a cluster no rank holds another's sensor (found by an audit, "
            "2026-11-30: it scored 1.000)",
        edits={"train.py": [(VOTE, '''    from readings import _sensor_log  # every sensor's readings: no collective
    _, every_target = _sensor_log(args.items, args.corrupt, args.seed)
    whole = world_size * args.batch_size
    corrupt = torch.isnan(every_target[step * whole:(step + 1) * whole]).any().float().reshape(1)
''')]}),
]
