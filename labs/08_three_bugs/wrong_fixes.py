"""Wrong fixes of lab 08 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/08_three_bugs`); never in
a learner's copy. The lab is three bugs: a fix of two of them is a wrong fix.
"""

from labutils.grading.wrongfix import WrongFix

ZERO_GRAD = "        optimizer.zero_grad()  # backward() adds to .grad: clear last step's gradients\n"
SET_EPOCH = "    sampler.set_epoch(epoch)  # a new permutation each epoch, the same on every rank\n"
SAMPLER = "sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)"
SAVE = '''if rank == 0:  # one copy of the weights is enough: every rank holds the same
    os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
    # the plain model's weights: DDP's own state_dict names them "module.0.weight", ...,
    # which the plain model (keys "0.weight", ...) refuses to load with strict=True
    torch.save(model.module.state_dict(), args.ckpt)
'''

LOADER = "loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)"

WRONG_FIXES = [
    WrongFix(
        "each epoch's permutation cut in strided shares by hand, without padding",
        why="right where the ranks divide the items; at 4 ranks x 26 items the shares are "
            "7, 7, 6 and 6, and the ranks take 4 steps or 3 (found by an audit, 2026-11-29: "
            "it scored 1.000 when every case divided)",
        edits={"train.py": [
            ("from torch.utils.data import DataLoader, DistributedSampler",
             "from torch.utils.data import DataLoader, DistributedSampler, Subset"),
            (SAMPLER, ""), (LOADER, ""),
            (SET_EPOCH, "    g = torch.Generator().manual_seed(args.seed + epoch)  # the same on every rank\n"
                        "    perm = torch.randperm(len(dataset), generator=g)\n"
                        "    loader = DataLoader(Subset(dataset, perm[rank::world_size].tolist()),\n"
                        "                        batch_size=args.batch_size)\n")]}),
    WrongFix(
        "DistributedSampler seeded with the time, for a fresh order every run",
        why="the ranks agree only when they build their samplers within the same second, and "
            "--seed no longer decides the data: a second run of the same case trains on "
            "other items (found by an audit, 2026-11-30: it scored 1.000 in nearly every "
            "grading)",
        edits={"train.py": [("import argparse\n", "import argparse\nimport time\n"),
                            (SAMPLER, SAMPLER.replace("seed=args.seed", "seed=int(time.time())"))]}),
    WrongFix(
        "DataLoader(drop_last=True), to keep the batches even",
        why="each rank's short last batch is never trained on (found by an audit, 2026-11-29: "
            "it scored 1.000 when no case had a short batch)",
        edits={"train.py": [(LOADER, LOADER.replace("sampler=sampler)", "sampler=sampler, drop_last=True)"))]}),
    WrongFix(
        "two of three: the data and the gradients fixed, DDP's state_dict still saved",
        why="the checkpoint's keys start with 'module.': the plain model refuses it",
        edits={"train.py": [("torch.save(model.module.state_dict(), args.ckpt)",
                             "torch.save(model.state_dict(), args.ckpt)")]}),
    WrongFix(
        "two of three: the data and the checkpoint fixed, no zero_grad()",
        why="backward() adds to .grad: every step also applies all the earlier gradients",
        edits={"train.py": [(ZERO_GRAD, "")]}),
    WrongFix(
        "two of three: the gradients and the checkpoint fixed, every rank on the whole dataset",
        why="without DistributedSampler each rank trains on every item, in the same order",
        base="starter",
        edits={"train.py": [
            ("        loss.backward()\n", "        optimizer.zero_grad()\n        loss.backward()\n"),
            ("torch.save(model.state_dict(), args.ckpt)",
             "torch.save(model.module.state_dict(), args.ckpt)")]}),
    WrongFix(
        "DistributedSampler without set_epoch: the same order every epoch",
        why="the sampler shuffles with seed + epoch, and its epoch stays 0",
        edits={"train.py": [(SET_EPOCH, "")]}),
    WrongFix(
        "DistributedSampler seeded with the rank: the shares overlap",
        why="each rank cuts its share of another permutation: items twice, others never",
        edits={"train.py": [(SAMPLER, "sampler = DistributedSampler(dataset, shuffle=True, seed=rank)")]}),
    WrongFix(
        "zero_grad() after backward(): every step applies a zero gradient",
        why="the gradients are cleared between backward() and step(): the weights never move",
        edits={"train.py": [(ZERO_GRAD, ""),
                            ("        loss.backward()\n",
                             "        loss.backward()\n        optimizer.zero_grad()\n")]}),
    WrongFix(
        "model.module saved, but before training",
        why="the checkpoint loads with strict=True, and holds the initial weights",
        edits={"train.py": [(SAVE, ""), ("step = 0\n", SAVE + "\nstep = 0\n")]}),
    WrongFix(
        "no set_epoch, and reports the items a set_epoch would have given",
        why="the checks read the batches from each rank's DataLoader, not from report()",
        edits={"train.py": [
            (SAMPLER, SAMPLER + "\nclaimed = DistributedSampler(dataset, shuffle=True, seed=args.seed)"),
            (SET_EPOCH, "    claimed.set_epoch(epoch)  # what the report will say\n"
                        "    said = list(claimed)\n"),
            ("    for x, y, index in loader:\n", "    for k, (x, y, index) in enumerate(loader):\n"),
            ("indices=index.tolist()", "indices=said[k * args.batch_size:(k + 1) * args.batch_size]")]}),
    WrongFix(
        "the plain model kept before wrapping it in DDP, but made without --seed",
        why="saving net.state_dict() fixes the checkpoint, but make_model() starts every run "
            "from seed 0's weights: right where --seed is 0, as in the public checks; the "
            "hidden case (--seed 5) is worth 1 point of 15 and the pass mark leaves 1.5 "
            "(found by an audit, 2026-11-30: it scored 0.933)",
        edits={"train.py": [
            ("model = DDP(make_model(args.seed).to(device))  # same seed, same initial weights everywhere\n",
             "net = make_model().to(device)  # the plain model, for the checkpoint\nmodel = DDP(net)\n"),
            ("    torch.save(model.module.state_dict(), args.ckpt)\n",
             "    torch.save(net.state_dict(), args.ckpt)\n")]}),
    WrongFix(
        "the learning rate written as 0.1",
        why="the default of --lr, written into the optimizer: right in the public checks, which "
            "train with 0.1, and the hidden case (0.05) is worth 1 point of 15 "
            "(found by an audit, 2026-11-30: it scored 0.933)",
        edits={"train.py": [("optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)",
                             "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)")]}),
    WrongFix(
        "the checkpoint saved after the third epoch, inside the loop",
        why="epoch == 2 is the last epoch at the default --epochs 3: the hidden case trains 2 "
            "epochs and no model.pt is written, which costs 1 point of 15 "
            "(found by an audit, 2026-11-30: it scored 0.933)",
        edits={"train.py": [(SAVE, ""),
                            ('    print0(f"epoch {epoch}',
                             '    if rank == 0 and epoch == 2:  # the last epoch\n'
                             '        torch.save(model.module.state_dict(), args.ckpt)\n'
                             '    print0(f"epoch {epoch}')]}),
    WrongFix(
        "set_epoch(epoch % 2): two orders, taken in turn",
        why="each epoch's order differs from the one before, but epoch 2 repeats epoch 0's: "
            "over many epochs the data comes in two orders only (found by an audit, "
            "2026-11-30, eleventh audit: it scored 1.000 when only consecutive epochs were "
            "compared)",
        edits={"train.py": [(SET_EPOCH, "    sampler.set_epoch(epoch % 2)  # a new permutation each epoch\n")]}),
]
