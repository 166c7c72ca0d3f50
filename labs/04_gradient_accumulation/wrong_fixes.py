"""Wrong fixes of lab 04 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/04_gradient_accumulation`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

SCALED = "            loss = F.mse_loss(model(x.to(device)), y.to(device)) / args.accum\n"
STARTER_LOOP = """    for micro in range(args.accum):
        x, y = next(micro_batches)
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()  # gradients add up in .grad until the optimizer step
        step_loss += loss.item() / args.accum
"""
SYNC_BLOCK = """        with nullcontext() if sync else model.no_sync():
            # the mean over the micro-batches, not their sum: divide by accum
            loss = F.mse_loss(model(x.to(device)), y.to(device)) / args.accum
            loss.backward()  # gradients add up in .grad until the optimizer step
"""

WRONG_FIXES = [
    WrongFix(
        "no_sync on the wrong micro-batch: the first one synchronises",
        why="one all-reduce per step, but of the first micro-batch's gradient only",
        edits={"train.py": [("sync = micro == args.accum - 1", "sync = micro == 0")]}),
    WrongFix(
        "no_sync right, but the loss is not divided by the number of micro-batches",
        why="the sum of the micro-batch gradients: steps accum times too large",
        edits={"train.py": [(SCALED, SCALED.replace(" / args.accum", ""))]}),
    WrongFix(
        "the loss divided, but no no_sync: every micro-batch synchronises",
        why="the starter's half fix: the right weights with accum times the all-reduces",
        edits={"train.py": [("with nullcontext() if sync else model.no_sync():",
                             "with nullcontext():")]}),
    WrongFix(
        "no_sync around the backward only",
        why="DDP decides in forward whether backward all-reduces: every micro-batch still does",
        edits={"train.py": [(SYNC_BLOCK, """        # the mean over the micro-batches, not their sum: divide by accum
        loss = F.mse_loss(model(x.to(device)), y.to(device)) / args.accum
        with nullcontext() if sync else model.no_sync():
            loss.backward()  # gradients add up in .grad until the optimizer step
""")]}),
    WrongFix(
        "divides by accum x world_size, on top of DDP's average",
        why="DDP already averages over the ranks: the steps are world_size times too small",
        edits={"train.py": [(SCALED, SCALED.replace("/ args.accum", "/ (args.accum * world_size)"))]}),
    WrongFix(
        "the micro-batches concatenated into one batch: no accumulation at all",
        why="one forward and one backward over accum x batch_size items: one all-reduce and the "
            "right weights, but the whole step's activations are in memory at once, which is "
            "what accumulating micro-batches was for",
        base="starter",
        edits={"train.py": [(STARTER_LOOP, """\
    # the step's micro-batches as one batch: one backward, one all-reduce, the mean loss
    parts = [next(micro_batches) for _ in range(args.accum)]
    x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    loss = F.mse_loss(model(x.to(device)), y.to(device))
    loss.backward()
    step_loss = loss.item()
""")]}),
    WrongFix(
        "the synchronising micro-batch hard-coded for the notebook's --accum 4",
        why="right at --accum 4 only: with 2 or 3 micro-batches a step no micro-batch "
            "synchronises, the ranks never average their gradients and drift apart",
        edits={"train.py": [("        sync = micro == args.accum - 1\n",
                             "        sync = micro == 3  # the last of the 4 micro-batches\n")]}),
    WrongFix(
        "the micro-batch losses kept in a list, one backward over their mean per step",
        why="accum forward passes of one micro-batch each, one all-reduce and the right weights "
            "without no_sync, but every micro-batch's graph is kept until the one backward: "
            "the step's activations are all in memory at once, as with one big batch",
        base="starter",
        edits={"train.py": [(STARTER_LOOP, """    losses = []
    for micro in range(args.accum):
        x, y = next(micro_batches)
        losses.append(F.mse_loss(model(x.to(device)), y.to(device)))
    loss = sum(losses) / args.accum
    loss.backward()  # one backward, one all-reduce
    step_loss = loss.item()
""")]}),
    WrongFix(
        "only the forward under no_sync, the losses added up and one backward after the loop",
        why="DDP's all-reduce comes once, in the backward after the last forward, but that "
            "backward runs through every micro-batch's graph, all kept alive until then: no "
            "memory saved over one big batch",
        edits={"train.py": [(SYNC_BLOCK + "        step_loss += loss.item()\n",
                             """        with nullcontext() if sync else model.no_sync():
            loss = F.mse_loss(model(x.to(device)), y.to(device)) / args.accum
        total = loss if micro == 0 else total + loss  # one backward for them all, below
        step_loss += loss.item()
    total.backward()
""")]}),
    WrongFix(
        "the loss divided by accum, and the starter's report of it divided again",
        why="the training is right, but each step's logged loss is its mean over the "
            "micro-batches divided by accum once more: accum times too small "
            "(found by an audit, 2026-11-30: it scored 1.000)",
        edits={"train.py": [("        step_loss += loss.item()\n",
                             "        step_loss += loss.item() / args.accum\n")]}),
    WrongFix(
        "the loss divided by a hard-coded 4",
        why="right at --accum 4 only (an audit, 2026-11-30: caught)",
        edits={"train.py": [(SCALED, SCALED.replace("/ args.accum", "/ 4"))]}),
    WrongFix(
        "every micro-batch under no_sync, the gradients all-reduced by hand once per step",
        why="trains right, with one all-reduce a step, but not DDP's: each parameter's own "
            "all_reduce after the backward, none overlapped with it and none bucketed; only the "
            "required hidden check's count of DDP's all-reduces keeps it at the pass mark "
            "(an audit, 2026-11-30: it scored 0.600, caught by that required check)",
        edits={"train.py": [("        with nullcontext() if sync else model.no_sync():",
                             "        with model.no_sync():"),
                            ("    optimizer.step()\n",
                             "    import torch.distributed as dist\n"
                             "    for p in model.parameters():\n"
                             "        dist.all_reduce(p.grad)\n"
                             "        p.grad /= world_size\n"
                             "    optimizer.step()\n")]}),
]
