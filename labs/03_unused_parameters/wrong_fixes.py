"""Wrong fixes of lab 03 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/03_unused_parameters`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

DDP_LINE = "model = DDP(TwoHeadNet().to(device), find_unused_parameters=not use_aux)"

WRONG_FIXES = [
    WrongFix(
        "find_unused_parameters with the condition turned round",
        why="the flag is on only when every parameter is used: the default run still fails",
        edits={"train.py": [(DDP_LINE, DDP_LINE.replace("not use_aux", "use_aux"))]}),
    WrongFix(
        "calls model.module, so DDP no longer complains",
        why="the inner module bypasses DDP: no gradient is all-reduced and the ranks drift apart",
        edits={"train.py": [("        loss = F.cross_entropy(model(x), y)",
                             "        loss = F.cross_entropy(model.module(x), y)")]}),
    WrongFix(
        "the starter's forward under no_sync(), so DDP waits for no gradient",
        why="no error, since no_sync skips the reduction that waits for aux_head, but no "
            "gradient is averaged either: the ranks drift apart",
        base="starter",
        edits={"train.py": [("        loss = F.cross_entropy(model(x), y)\n",
                             "        with model.no_sync():  # no reduction, no error\n"
                             "            loss = F.cross_entropy(model(x), y)\n")]}),
    WrongFix(
        "the head's loss added and detached",
        why="with_aux always, but the auxiliary output detached: aux_head still gets no "
            "gradient, and without find_unused_parameters the run fails as before",
        edits={"train.py": [(DDP_LINE, "model = DDP(TwoHeadNet().to(device))"),
                            ("        loss = F.cross_entropy(model(x), y)",
                             "        logits, aux = model(x, with_aux=True)\n"
                             "        loss = F.cross_entropy(logits, y) + 0.0 * aux.detach().sum()")]}),
    WrongFix(
        "aux_head frozen for good, so DDP expects no gradient from it",
        why="the default run trains and matches one process, but with --aux-weight the "
            "auxiliary loss no longer trains its head: the required hidden check fails",
        base="starter",
        edits={"train.py": [("model = DDP(TwoHeadNet().to(device))",
                             "net = TwoHeadNet().to(device)\n"
                             "net.aux_head.requires_grad_(False)  # DDP skips what needs no grad\n"
                             "model = DDP(net)")]}),
    WrongFix(
        "the auxiliary loss on by default, so aux_head always gets a gradient",
        why="DDP no longer waits for a gradient, but the default run now trains the auxiliary "
            "task the user turned off: the classifier's weights are no longer those of training "
            "it alone (the checks' reference is the same script, so it trains it too)",
        base="starter",
        edits={"train.py": [('parser.add_argument("--aux-weight", type=float, default=0.0)',
                             'parser.add_argument("--aux-weight", type=float, default=0.1)')]}),
]
