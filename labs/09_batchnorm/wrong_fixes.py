"""Wrong fixes of lab 09 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/09_batchnorm`); never in a
learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

STATS = ("        total = AllReduceSum.apply(torch.cat([x.sum(0), (x * x).sum(0), count]))\n"
         "        n = total[-1]\n"
         "        mean = total[:self.num_features] / n\n"
         "        var = total[self.num_features:-1] / n - mean * mean  # biased, as normalisation uses\n")
REPORT = "report(val_loss=val_loss, running_mean=norm.running_mean, running_var=norm.running_var)"

WRONG_FIXES = [
    WrongFix(
        "turns DDP's buffer broadcast back on: every rank gets rank 0's statistics",
        why="the statistics agree across ranks, but they are rank 0's shard's, not the "
            "global batch's",
        base="starter",
        edits={"train.py": [("DDP(model, **{NO_SYNC: False})", "DDP(model)")]}),
    WrongFix(
        "averages the ranks' running statistics once, at the end",
        why="identical on every rank, but the training normalised with each shard's own "
            "statistics, and the variance of a union is not the mean of the variances",
        base="starter",
        edits={"train.py": [("norm = plain[1]\n", '''norm = plain[1]
for buffer in (norm.running_mean, norm.running_var):
    dist.all_reduce(buffer)
    buffer /= world_size
''')]}),
    WrongFix(
        "reports the one-process reference's statistics instead of its own",
        why="report what the check wants: the model keeps each rank's own statistics",
        base="starter",
        edits={"train.py": [(REPORT, '''from shards import reference_model

wanted = reference_model(world_size=world_size, steps=args.steps, batch_size=args.batch_size,
                         lr=args.lr, seed=args.seed)[1]
report(val_loss=val_loss, running_mean=wanted.running_mean, running_var=wanted.running_var)''')]}),
    WrongFix(
        "synchronised statistics whose backward skips the all-reduce",
        why="the forward is the global batch's, but each rank's gradient ignores how its items "
            "moved the other ranks' statistics, so the weights drift from the reference",
        edits={"train.py": [('''        total = grad.clone()
        dist.all_reduce(total)
        return total''', '''        return grad  # the forward already summed''')]}),
    WrongFix(
        "synchronised BatchNorm that averages the ranks' means and variances",
        why="the mean of the ranks' means is the global mean (equal batches), but the mean of "
            "their variances leaves out how far the ranks' means lie apart: on shards that "
            "differ, the global variance is larger",
        edits={"train.py": [('''        total = AllReduceSum.apply(torch.cat([x.sum(0), (x * x).sum(0), count]))
        n = total[-1]
        mean = total[:self.num_features] / n
        var = total[self.num_features:-1] / n - mean * mean  # biased, as normalisation uses
''', '''        world = dist.get_world_size()
        stats = AllReduceSum.apply(torch.cat([x.mean(0), x.var(0, unbiased=False)])) / world
        n = AllReduceSum.apply(count)[0]
        mean, var = stats[:self.num_features], stats[self.num_features:]  # the ranks' average
''')]}),
    WrongFix(
        "every rank trains on the global batch: reads every shard, no synchronisation",
        why="each rank's plain BatchNorm would see every rank's items, so the statistics and "
            "weights would be the reference's exactly; but every rank would do the whole step's "
            "work and the shards are not shared out: global_batch refuses another rank's items "
            "in a distributed run (and each forward would take world size x batch size items)",
        base="starter",
        edits={"train.py": [
            ("from shards import held_out, make_model, shard_batch",
             "from shards import global_batch, held_out, make_model"),
            ("    x, y = shard_batch(step, rank=rank, size=args.batch_size, seed=args.seed)",
             "    x, y = global_batch(step, world_size=world_size, size=args.batch_size, "
             "seed=args.seed)")]}),
    WrongFix(
        "no collective: each rank computes the global batch's statistics from every shard",
        why="each rank reads the other ranks' items (global_batch) and runs them through the "
            "first layer to take the whole batch's mean and variance, with their gradient: the "
            "numbers are the reference's, with every rank doing the work of all and no rank "
            "learning anything from another; global_batch refuses another rank's items in a "
            "distributed run",
        edits={"train.py": [(STATS,
                             "        from shards import global_batch\n"
                             "        gx, _ = global_batch(step, world_size=world_size, "
                             "size=args.batch_size, seed=args.seed)\n"
                             "        full = model.module[0](gx.to(x.device))\n"
                             "        n = torch.tensor(float(full.shape[0]))\n"
                             "        var, mean = torch.var_mean(full, 0, unbiased=False)\n")]}),
    WrongFix(
        "no collective: each rank rebuilds the other ranks' batches with shards' private _shard",
        why="the same numbers as the reference, with every rank reading every shard and no "
            "rank learning anything from another: _shard refuses another rank's training items "
            "in a distributed run too (found by an audit, 2026-11-30: it scored 1.000 when only "
            "shard_batch and global_batch refused)",
        edits={"train.py": [(STATS,
                             "        from shards import _shard\n"
                             "        gx = torch.cat([_shard(step, rank=r, size=args.batch_size, "
                             "seed=args.seed)[0] for r in range(world_size)])\n"
                             "        full = model.module[0](gx.to(x.device))\n"
                             "        n = torch.tensor(float(full.shape[0]))\n"
                             "        var, mean = torch.var_mean(full, 0, unbiased=False)\n")]}),
    WrongFix(
        "hard-codes the notebook's 8 items per rank in the global count",
        why="right at --batch-size 8, the public case; with 5 items a rank (the hidden case) "
            "the mean and variance are divided by the wrong count: identical on every rank, "
            "but not the global batch's",
        edits={"train.py": [("        n = total[-1]\n",
                             "        n = 8 * dist.get_world_size()  # 8 items a rank\n")]}),
    WrongFix(
        "hard-codes the global batch as two ranks' worth of items",
        why="right at 2 ranks, the notebook's; at 3 or 4 the statistics are identical on every "
            "rank but divided by the wrong count",
        edits={"train.py": [("        n = total[-1]\n", "        n = 2 * x.shape[0]  # two ranks\n")]}),
    WrongFix(
        "evaluation normalises the held-out batch with its own statistics",
        why="the running statistics are right but never used: in eval mode the layer still "
            "normalises with the batch's (synchronised) statistics, so the held-out loss is "
            "not the model's",
        edits={"train.py": [('''        if not self.training:
            return super().forward(x)  # evaluation: the running statistics
''', ""), ('''        with torch.no_grad():
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)  # unbiased, as torch keeps
''', '''        if self.training:  # only training updates the running statistics
            with torch.no_grad():
                self.num_batches_tracked += 1
                self.running_mean.lerp_(mean, self.momentum)
                self.running_var.lerp_(var * n / (n - 1), self.momentum)
''')]}),
    WrongFix(
        "no collective: shards.py's recipe copied into train.py to rebuild the other ranks' items",
        why="each rank regenerates every rank's batch with shards.py's generator seeds, copied "
            "by hand, and takes the whole batch's statistics from them: the numbers are the "
            "reference's, but no rank learns anything from another (on a cluster a rank cannot "
            "read another's shard) and every rank does the first layer's work for all; the "
            "traffic probe sees no collective (found by an audit, 2026-11-30, eleventh audit: "
            "it scored 1.000)",
        edits={"train.py": [(STATS,
                             "        parts = []\n"
                             "        for r in range(dist.get_world_size()):  # shards.py's recipe, copied\n"
                             "            g = torch.Generator().manual_seed(1_000_003 * args.seed + 1000 * step + r)\n"
                             "            parts.append(torch.randn(args.batch_size, 6, generator=g) * (1 + r) + 2 * r)\n"
                             "        full = model.module[0](torch.cat(parts).to(x.device))\n"
                             "        n = torch.tensor(float(full.shape[0]))\n"
                             "        var, mean = torch.var_mean(full, 0, unbiased=False)\n")]}),
    WrongFix(
        "a plain copy of the model trained by hand on the all-gathered batch, copied into DDP's at the end",
        why="the DDP model trains as the starter does, each shard normalised with its own "
            "statistics, while every rank all-gathers the global batch and trains a plain "
            "copy on all of it (SGD by hand), whose state replaces the DDP model's before the "
            "evaluation: the final statistics and weights are the reference's, but every rank "
            "does the whole batch's work and the model DDP trained is thrown away; each rank's "
            "loss during training is not the reference's (found by an audit, 2026-11-30, "
            "eleventh audit: it scored 1.000)",
        base="starter",
        edits={"train.py": [
            ("optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)\n",
             "optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)\n"
             "from shards import make_model\n"
             "shadow = make_model(args.seed).to(device)  # plain BatchNorm, the whole batch\n"),
            ("    report(step=step, loss=loss.item())\n",
             "    report(step=step, loss=loss.item())\n"
             "    xs = [torch.empty_like(x) for _ in range(world_size)]\n"
             "    ys = [torch.empty_like(y) for _ in range(world_size)]\n"
             "    dist.all_gather(xs, x)\n"
             "    dist.all_gather(ys, y)\n"
             "    shadow.zero_grad()\n"
             "    F.mse_loss(shadow(torch.cat(xs)), torch.cat(ys)).backward()\n"
             "    with torch.no_grad():\n"
             "        for p in shadow.parameters():\n"
             "            p -= args.lr * p.grad  # plain SGD, by hand\n"),
            ("# Evaluation: in eval mode",
             "model.module.load_state_dict(shadow.state_dict())  # the whole batch's model\n"
             "# Evaluation: in eval mode")]}),
]

# Not here (an audit, 2026-11-30, eleventh): the same plain copy trained with an optimizer
# of its own (torch.optim.SGD) is caught by the forwards probe already (its optimizer's
# steps come with no forward pass through DDP). Correct fixes written otherwise score
# 1.000: torch.distributed.nn.functional.all_reduce or all_gather (differentiable) in
# place of AllReduceSum, the sums all-reduced one by one, or the functional collectives
# (torch.distributed._functional_collectives) inside the autograd Function, which the
# traffic probe logs too.
