"""Wrong fixes of lab 06 that a learner in a hurry would submit; each must fail the lab.

Kept for instructors and the tests (`labutils wrongfixes labs/06_distributed_evaluation`);
never in a learner's copy.
"""

from labutils.grading.wrongfix import WrongFix

STARTER_LOADER = '''loader = DataLoader(dataset, batch_size=args.batch_size,
                    sampler=DistributedSampler(dataset, shuffle=False))'''
STARTER_IMPORT = "from torch.utils.data import DataLoader, DistributedSampler"
WITH_SUBSET = "from torch.utils.data import DataLoader, DistributedSampler, Subset"
# The solution's loop and sums, which the all_gather wrong fix below replaces.
LOOP_AND_SUM = """correct = torch.zeros((), dtype=torch.long, device=device)
counted = torch.zeros((), dtype=torch.long, device=device)
with torch.no_grad():
    for x, y in loader:
        predictions = model(x.to(device)).argmax(dim=1)
        correct += (predictions == y.to(device)).sum()
        counted += len(y)

dist.all_reduce(correct)  # sums over the ranks
dist.all_reduce(counted)
"""


def _drops_the_last_item_of(who: str) -> dict:
    """The starter's padded shares, with one rank's last item dropped."""
    return {"evaluate.py": [(STARTER_IMPORT, WITH_SUBSET), (STARTER_LOADER, f'''share = list(DistributedSampler(dataset, shuffle=False))
if {who}:  # 11 items on 3 ranks become 12: the padded duplicate is the last item
    share = share[:-1]
loader = DataLoader(Subset(dataset, share), batch_size=args.batch_size)''')]}


WRONG_FIXES = [
    WrongFix(
        "rank 0 evaluates every item and every rank reports the share it should have scored",
        why="the records a script writes are its own: the items each rank scored are read "
            "from its model by the grader's harness, under a name the script cannot sign",
        edits={"evaluate.py": [
            ("Subset(dataset, range(rank, len(dataset), world_size))",
             "dataset if rank == 0 else Subset(dataset, [])"),
            ("if rank == 0:\n    report(accuracy=accuracy, predictions=counted.item())",
             "report(probe=\"scored\", items=list(range(rank, len(dataset), world_size)))\n"
             "report(scored=list(range(rank, len(dataset), world_size)))\n"
             "if rank == 0:\n    report(accuracy=accuracy, predictions=counted.item())")]}),
    WrongFix(
        "rank 0 evaluates every item, the other ranks idle",
        why="the metric is right, but nothing is shared: on a real held-out set the other "
            "GPUs wait while one does all the work",
        edits={"evaluate.py": [("Subset(dataset, range(rank, len(dataset), world_size))",
                                "dataset if rank == 0 else Subset(dataset, [])")]}),
    WrongFix(
        "padded shares kept, and rank 0 scores the whole set again with model.forward",
        why="one process's metric, computed by rank 0 on every item, with the ranks' padded "
            "shares run for show: model.forward(x) skips the model's own hooks, but not its "
            "layers', which see every item too (found by an audit, 2026-11-30: it scored 1.000 "
            "when only the model's hook noted the items)",
        base="starter",
        edits={"evaluate.py": [("if rank == 0:\n    report(accuracy=accuracy, predictions=counted.item())",
            "if rank == 0:  # one process's number, on the whole set\n"
            "    with torch.no_grad():\n"
            "        hits = model.forward(dataset.tensors[0]).argmax(dim=1) == dataset.tensors[1]\n"
            "    accuracy = hits.float().mean().item()\n"
            "    report(accuracy=accuracy, predictions=len(dataset))")]}),
    WrongFix(
        "rank 0 scores every item in float64, the other ranks their shares",
        why="rank 0 does the whole evaluation alone; cast to float64, its items no longer "
            "matched the features the harness knew them by, and counted as one unknown item "
            "(found by an audit, 2026-11-30: it scored 1.000 when items were known by their "
            "bytes as given)",
        edits={"evaluate.py": [
            ("loader = DataLoader(Subset(dataset, range(rank, len(dataset), world_size)),",
             "loader = DataLoader(Subset(dataset, [] if rank == 0 else range(rank, len(dataset), world_size)),"),
            ("if rank == 0:\n    report(accuracy=accuracy, predictions=counted.item())",
             "if rank == 0:  # exact, in float64\n"
             "    with torch.no_grad():\n"
             "        hits = model.double()(dataset.tensors[0].double()).argmax(dim=1) == dataset.tensors[1]\n"
             "    report(accuracy=hits.double().mean().item(), predictions=len(dataset))")]}),
    WrongFix(
        "drop_last=True: the padding goes, and real items with it",
        why="DistributedSampler(drop_last=True) trims the shares to equal length: 11 items "
            "at 2 ranks score 10",
        base="starter",
        edits={"evaluate.py": [("DistributedSampler(dataset, shuffle=False))",
                                "DistributedSampler(dataset, shuffle=False, drop_last=True))")]}),
    WrongFix(
        "counts every item once, then averages the ranks' accuracies",
        why="the mean of per-rank accuracies is the accuracy only when the shares are equal; "
            "11 items at 3 ranks are 4, 4 and 3",
        edits={"evaluate.py": [(
            "dist.all_reduce(correct)  # sums over the ranks\ndist.all_reduce(counted)\n"
            "accuracy = correct.item() / counted.item()",
            "share = torch.tensor(correct.item() / max(1, counted.item()))\n"
            "dist.all_reduce(share)\ndist.all_reduce(counted)\naccuracy = share.item() / world_size")]}),
    WrongFix(
        "divides by the dataset's size: the padded duplicates are still scored",
        why="the count is right by construction, and the accuracy too while the duplicated "
            "items happen to be predicted wrong",
        base="starter",
        edits={"evaluate.py": [
            ("accuracy = correct.item() / counted.item()", "accuracy = correct.item() / len(dataset)"),
            ("report(accuracy=accuracy, predictions=counted.item())",
             "report(accuracy=accuracy, predictions=len(dataset))")]}),
    WrongFix(
        "the last rank drops its last item: right only when one item is padded",
        why="11 items at 2 or 3 ranks pad one duplicate; 13 items at 3 ranks pad two",
        base="starter", edits=_drops_the_last_item_of("rank == world_size - 1")),
    WrongFix(
        "rank 1 drops its last item: right only at 2 ranks",
        why="at 2 ranks the padded duplicate is rank 1's last item; at 3 ranks it is rank 2's",
        base="starter", edits=_drops_the_last_item_of("rank == 1")),
    WrongFix(
        "every rank from len % world_size on drops its last item, even when nothing is padded",
        why="DistributedSampler pads the shares of the ranks from len(dataset) % world_size on, "
            "but only when the world size does not divide the set: 12 items at 2 ranks pad "
            "nothing, and every rank drops a real item (10 predictions of 12)",
        base="starter", edits=_drops_the_last_item_of("rank >= len(dataset) % world_size")),
    WrongFix(
        "all_gather each item's hit, concatenate, keep the first len(dataset)",
        why="the gathered shares follow each other rank by rank, not in item order: the "
            "padding is the last item of several ranks, not the tail of the concatenation "
            "(13 items at 3 ranks count item 0 twice and drop item 11)",
        base="starter",
        edits={"evaluate.py": [(LOOP_AND_SUM, """hits = []
with torch.no_grad():
    for x, y in loader:
        predictions = model(x.to(device)).argmax(dim=1)
        hits.append((predictions == y.to(device)).long())
hits = torch.cat(hits)
gathered = [torch.empty_like(hits) for _ in range(world_size)]
dist.all_gather(gathered, hits)  # every share has the same length, padding included
hits = torch.cat(gathered)[:len(dataset)]  # drop the padding at the end
correct, counted = hits.sum(), torch.tensor(len(hits))
""")]}),
    WrongFix(
        "divides by len(dataset), and reports rank 0's own count of predictions",
        why="the accuracy is right, but the count it reports is rank 0's share, not the "
            "11 predictions the ranks made together",
        edits={"evaluate.py": [("dist.all_reduce(counted)\n", ""),
                               ("accuracy = correct.item() / counted.item()",
                                "accuracy = correct.item() / len(dataset)")]}),
    WrongFix(
        "DistributedSampler(drop_last=True), and rank 0 scores the dropped items, taken from the start",
        why="drop_last leaves out the last len % world items, but rank 0 adds the first ones "
            "again: those are counted twice and the last never (found by an audit, 2026-11-30: "
            "it failed a required check)",
        base="starter",
        edits={"evaluate.py": [(STARTER_IMPORT, WITH_SUBSET), (STARTER_LOADER,
            '''share = list(DistributedSampler(dataset, shuffle=False, drop_last=True))
if rank == 0:  # the items drop_last left out
    share += list(range(len(dataset) % world_size))
loader = DataLoader(Subset(dataset, share), batch_size=args.batch_size)''')]}),
    WrongFix(
        "a rule for the padding seen in the public cases: the last rank's last item, and the "
        "one before's when two are padded",
        why="DistributedSampler pads -len % world items, one on each of the last ranks; a rule "
            "for one or two counts the third of 13 items at 4 ranks twice, where the hidden "
            "check's 2 points were all it cost (found by an audit, 2026-11-30, eleventh audit: "
            "it scored 0.800)",
        base="starter",
        edits=_drops_the_last_item_of("(rank == world_size - 1 and -len(dataset) % world_size >= 1)"
                                      " or (rank == world_size - 2 and -len(dataset) % world_size == 2)")),
    WrongFix(
        "rank 0 scores every item in bfloat16, the other ranks their shares",
        why="rank 0 does the whole evaluation alone; rounded to bfloat16, its items matched "
            "no item's float32 features and counted as one unknown item (found by an audit, "
            "2026-11-30, eleventh audit: it scored 1.000; the harness now knows a rounded "
            "copy by the one item it is near)",
        edits={"evaluate.py": [
            ("loader = DataLoader(Subset(dataset, range(rank, len(dataset), world_size)),",
             "loader = DataLoader(Subset(dataset, [] if rank == 0 else range(rank, len(dataset), world_size)),"),
            ("if rank == 0:\n    report(accuracy=accuracy, predictions=counted.item())",
             "if rank == 0:  # fast, in bfloat16\n"
             "    with torch.no_grad():\n"
             "        x16 = dataset.tensors[0].bfloat16()\n"
             "        hits = model.bfloat16()(x16).argmax(dim=1) == dataset.tensors[1]\n"
             "    report(accuracy=hits.double().mean().item(), predictions=len(dataset))")]}),
]
