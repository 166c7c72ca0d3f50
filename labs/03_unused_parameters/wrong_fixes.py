"""Wrong fixes of lab 03 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/03_unused_parameters`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

DDP_LINE = "model = DDP(TwoHeadNet().to(device), find_unused_parameters=not use_aux)"
# The starter's step, and the same step with the default path through model.module,
# which bypasses DDP (its forward would wait for aux_head's gradient): the two wrong fixes
# below then keep the ranks in step by hand.
STARTER_STEP = ("    else:\n        loss = F.cross_entropy(model(x), y)\n"
                "    optimizer.zero_grad()\n    loss.backward()\n    optimizer.step()\n")
BYPASS = ("    else:\n        loss = F.cross_entropy(model.module(x), y)  # DDP's forward would wait for aux_head\n"
          "    optimizer.zero_grad()\n    loss.backward()\n")
# Every rank's batch gathered onto every rank, and the step taken on all of them.
GATHERED_STEP = ("        loss = F.cross_entropy(model(x), y)\n",
                 "        xs = [torch.empty_like(x) for _ in range(world_size)]\n"
                 "        ys = [torch.empty_like(y) for _ in range(world_size)]\n"
                 "        dist.all_gather(xs, x)  # every rank's batch, on every rank\n"
                 "        dist.all_gather(ys, y)\n"
                 "        loss = F.cross_entropy(model.module(torch.cat(xs)), torch.cat(ys))\n")
WITH_DIST = ("import torch.nn.functional as F\n",
             "import torch.distributed as dist\nimport torch.nn.functional as F\n")

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
    WrongFix(
        "model.module to dodge DDP, then rank 0's weights broadcast so the ranks agree",
        why="the ranks end identical, but no gradient is averaged: every step trains on rank "
            "0's batch alone and the other ranks' items are thrown away; the weights differ "
            "from one process training on the whole batch (a required check)",
        base="starter",
        edits={"train.py": [WITH_DIST, (STARTER_STEP, BYPASS + "    optimizer.step()\n"
            "    if not use_aux:  # keep the ranks in step: everyone takes rank 0's weights\n"
            "        for p in model.parameters():\n"
            "            dist.broadcast(p.data, src=0)\n")]}),
    WrongFix(
        "model.module to dodge DDP, gradients all-reduced by hand but not divided by the world size",
        why="the ranks end identical, but each step applies the sum of the ranks' gradients, "
            "world_size times the mean DDP applies: the weights differ from one process "
            "training on the whole batch (a required check)",
        base="starter",
        edits={"train.py": [WITH_DIST, (STARTER_STEP, BYPASS +
            "    if not use_aux:  # DDP did not average the gradients: do it by hand\n"
            "        for p in model.parameters():\n"
            "            if p.grad is not None:\n"
            "                dist.all_reduce(p.grad)\n"
            "    optimizer.step()\n")]}),
    WrongFix(
        "model.module to dodge DDP, gradients all-reduced by hand and halved, for 2 ranks",
        why="right at 2 ranks, where halving is dividing by the world size (and at 1, where "
            "the guard skips it); at 3 ranks each step is 3/2 of the mean: the weights differ "
            "from one process training on the whole batch (the required check at 3 ranks)",
        base="starter",
        edits={"train.py": [WITH_DIST, (STARTER_STEP, BYPASS +
            "    if not use_aux and world_size > 1:  # average the two ranks' gradients\n"
            "        for p in model.parameters():\n"
            "            if p.grad is not None:\n"
            "                dist.all_reduce(p.grad)\n"
            "                p.grad /= 2\n"
            "    optimizer.step()\n")]}),
    WrongFix(
        "model.module to dodge DDP, every rank gathers the global batch and trains on all of it",
        why="the ranks end identical and equal to one process on the whole batch, but each "
            "rank does the whole step's work on every rank's items: no data parallelism "
            "(each forward pass takes world_size x --batch-size items)",
        base="starter",
        edits={"train.py": [WITH_DIST, GATHERED_STEP]}),
    WrongFix(
        "the solution, with every rank gathering the global batch and feeding all of it to DDP",
        why="DDP averages gradients that are already the whole batch's, the same on every rank: "
            "the right weights, but each rank computes every rank's items (each forward pass "
            "takes world_size x --batch-size items), so adding ranks saves nothing",
        edits={"train.py": [WITH_DIST, (GATHERED_STEP[0], GATHERED_STEP[1].replace(
            "model.module(torch.cat(xs))", "model(torch.cat(xs))"))]}),
    WrongFix(
        "a tiny auxiliary weight by default, so aux_head always gets a gradient",
        why="--aux-weight defaults to 1e-8: aux_head gets a gradient too small to move it past "
            "float32 rounding, and the one-process reference (the same script) matched, but "
            "--aux-weight 0, as the docstring runs it, still fails at step 1 "
            "(found by an audit, 2026-11-30: it scored 1.000)",
        base="starter",
        edits={"train.py": [('parser.add_argument("--aux-weight", type=float, default=0.0)',
                             'parser.add_argument("--aux-weight", type=float, default=1e-8)')]}),
    WrongFix(
        "aux_head's parameters ignored by DDP, whether the auxiliary loss is on or off",
        why="no error and the default run is right, but with --aux-weight on, aux_head trains "
            "on each rank's batch alone (DDP averages no gradient of it): the ranks drift "
            "apart, and their weights are not one process's "
            "(found by an audit, 2026-11-30: it scored 0.929)",
        edits={"train.py": [(DDP_LINE,
            "net = TwoHeadNet().to(device)\n"
            "DDP._set_params_and_buffers_to_ignore_for_model(net, [\"aux_head.weight\", \"aux_head.bias\"])\n"
            "model = DDP(net)  # DDP expects no gradient from aux_head")]}),
]

# Not here (an audit, 2026-11-30, eleventh): the auxiliary output multiplied by zero and
# added to the loss (loss + 0.0 * aux.sum(), no detach, no find_unused_parameters), or the
# auxiliary loss always computed and weighted by --aux-weight, 0 by default (both 1.000).
# aux_head then takes part in the loss and gets a gradient of exact zeros, which DDP
# averages and plain SGD applies as no change: the run is the one-process run, at every
# world size. It is the usual workaround for DDP's error (it costs the head's forward and
# backward and an all-reduce of zeros, and under weight decay or AdamW the resting head
# would move), a correct fix written otherwise, like static_graph=True or
# aux_head.requires_grad_(use_aux). Multiplying a detached output by zero stays caught
# (above), as does zero times aux_head.weight alone (aux_head.bias still gets no gradient).
