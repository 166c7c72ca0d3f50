"""Wrong fixes of lab 01 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/01_data_sharding`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

SAMPLER = "sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)"
SET_EPOCH = "    sampler.set_epoch(epoch)  # a new permutation each epoch, the same on every rank\n"
LOADER = "loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)"

WRONG_FIXES = [
    WrongFix(
        "each epoch's permutation cut in strided shares by hand, without padding",
        why="right where the ranks divide the items; at 4 ranks x 26 items the shares are 7, "
            "7, 6 and 6 items, so the last batches differ in size (and at other sizes the "
            "ranks take different numbers of steps: a hang) (found by an audit, 2026-11-29: "
            "it scored 1.000 when every case divided)",
        edits={"train.py": [
            ("from torch.utils.data import DataLoader, DistributedSampler, TensorDataset",
             "from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset"),
            (SAMPLER, ""), (LOADER, ""),
            (SET_EPOCH, "    g = torch.Generator().manual_seed(args.seed + epoch)  # the same on every rank\n"
                        "    perm = torch.randperm(len(dataset), generator=g)\n"
                        "    loader = DataLoader(Subset(dataset, perm[rank::world_size].tolist()),\n"
                        "                        batch_size=args.batch_size)\n")]}),
    WrongFix(
        "set_epoch added, but each rank still shuffles with its own seed",
        why="half the fix: a new order every epoch, but the ranks' slices of different "
            "permutations overlap and miss items",
        edits={"train.py": [(SAMPLER, SAMPLER.replace("seed=args.seed", "seed=args.seed + rank"))]}),
    WrongFix(
        "one seed on every rank, but no set_epoch",
        why="the other half: an exact cover, in the same order every epoch",
        edits={"train.py": [(SET_EPOCH, "")]}),
    WrongFix(
        "hard-codes 2 ranks: DistributedSampler(num_replicas=2, rank=rank)",
        why="right at 2 ranks; at 3 ranks rank 2 is refused by the sampler",
        edits={"train.py": [(SAMPLER, SAMPLER.replace("(dataset,", "(dataset, num_replicas=2, rank=rank,"))]}),
    WrongFix(
        "drop_last=True in the DataLoader, to keep the batches even",
        why="loses each rank's last, short batch: those items are never trained on",
        edits={"train.py": [(LOADER, LOADER.replace("sampler=sampler)", "sampler=sampler, drop_last=True)"))]}),
    WrongFix(
        "no sampler: DataLoader(shuffle=True) with the same torch seed on every rank",
        why="a new order every epoch, but every rank trains on the whole dataset",
        edits={"train.py": [(LOADER, "loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)"),
                            (SET_EPOCH, "")]}),
    WrongFix(
        "reports the indices the checks want, trains as the starter does",
        why="the starter's sampler (a seed per rank, no set_epoch) with a report() that "
            "sends one rank's slice of a fresh permutation each epoch: only the weights "
            "tell what was trained on",
        base="starter",
        edits={"train.py": [("report(epoch=epoch, indices=seen,",
                             "report(epoch=epoch, indices=torch.randperm(args.items, generator="
                             "torch.Generator().manual_seed(epoch))[rank::world_size].tolist(),")]}),
    WrongFix(
        "seed=args.seed * rank: one seed on every rank at --seed 0 only",
        why="right at the checks' --seed 0, where every rank's seed is 0; at --seed 5 the "
            "ranks shuffle with seeds 0, 5 and 10 and their shares overlap again (found by an "
            "audit, 2026-11-30: it scored 0.939)",
        edits={"train.py": [(SAMPLER, SAMPLER.replace("seed=args.seed)", "seed=args.seed * rank)"))]}),
    WrongFix(
        "set_epoch(epoch % 2): two permutations, taken in turn",
        why="each epoch differs from the one before, but epoch 2 repeats epoch 0's order "
            "(found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [(SET_EPOCH, "    sampler.set_epoch(epoch % 2)\n")]}),
    WrongFix(
        "DistributedSampler seeded with the time, for a fresh order every run",
        why="the ranks agree only when they build their samplers within the same second, and "
            "--seed no longer decides the data: a second run of the same case trains on "
            "other items (found by an audit, 2026-11-30: it scored 1.000 in nearly every "
            "grading)",
        edits={"train.py": [("import argparse\n", "import argparse\nimport time\n"),
                            (SAMPLER, SAMPLER.replace("seed=args.seed", "seed=int(time.time())"))]}),
    WrongFix(
        "set_epoch(epoch % 3): three permutations, taken in turn",
        why="every run of 3 epochs has a new order each epoch, but the fourth repeats the "
            "first's: right only at the number of epochs the public checks run "
            "(found by an audit, 2026-11-30: it scored 1.000 when every run had 3 epochs)",
        edits={"train.py": [(SET_EPOCH, "    sampler.set_epoch(epoch % 3)\n")]}),
]

# Not here: deleting the sampler's seed argument (every rank then uses DistributedSampler's
# default seed, 0). It fixes the lab's bug, the shares are disjoint and new each epoch, and
# only --seed stops reaching the data order, which a hidden check measures (2026-11-28:
# 0.939 of the lab's points; 0.909 since that check is a point of its own, 2026-11-30).
# Ignoring a flag is a regression of its own, not a wrong fix of this lab's bug.
# Nor: each rank keeping one padded share of DistributedSampler's (shuffle=False) and
# shuffling inside it every epoch (an audit, 2026-11-30: 1.000). The shares are disjoint,
# cover every item and come in a new order each epoch, as the task asks; that a rank's
# share itself changes every epoch is not asked.
# Nor (an audit, 2026-11-30, eleventh): set_epoch(epoch % 4), four permutations taken in
# turn (1.000). It is wrong past the fourth epoch, as % 3 is past the third, but nothing a
# learner sees runs 4 epochs (the public checks run 3), so it is no tuning to a visible
# case, and any fixed number of epochs in the hidden check is outrun by a larger modulus.
