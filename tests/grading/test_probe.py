"""The grader's probe (labutils.grading.probe): its records, and the checks' reading of them.

The pure parts run without processes; one real 2-rank run checks what the probe measures
inside the ranks against what the script did, and that the script cannot sign a record
as the probe's.
"""

from __future__ import annotations

import os
import tempfile
import textwrap
from pathlib import Path

import pytest

from labutils.grading.checks import Checker, Run
from labutils.grading.probe import TAG, launch_measured, own_records
from labutils.run.result import RankResult, RunResult

SECRET = "s3cret"


@pytest.mark.parametrize(
    ("record", "kept"),
    [
        ({"rank": 0, "step": 1, "loss": 0.5}, {"rank": 0, "step": 1, "loss": 0.5}),  # the script's
        ({"rank": 0, "probe": "weights", "sha256": "ab", TAG: SECRET},
         {"rank": 0, "probe": "weights", "sha256": "ab"}),                           # the probe's
        ({"rank": 0, "probe": "weights", "sha256": "ab"}, None),                     # claimed, unsigned
        ({"rank": 0, "probe": "weights", "sha256": "ab", TAG: "guess"}, None),       # wrong secret
        ({"rank": 0, "loss": 1.0, TAG: SECRET}, None),                               # a tag, no probe
    ],
)
def test_only_the_probe_signs_probe_records(record, kept):
    assert own_records([record], SECRET) == ([kept] if kept else [])
    # a run without the probe: nothing is the probe's
    assert own_records([record]) == ([record] if "probe" not in record and TAG not in record else [])


def _run(steps_records, *, attempts=1, tmp_path=Path(".")) -> Run:
    records = [{"rank": rank, "probe": "steps", "restart": restart, "taken": taken}
               for restart, rank, taken in steps_records]
    result = RunResult(ok=True, world_size=2, duration_s=1.0, log_dir=tmp_path,
                       ranks=[RankResult(rank=0), RankResult(rank=1)], reason="ok",
                       attempts=[{}] * attempts, records=records)
    return Run(label="train.py on 2 ranks", result=result, learner_dir=tmp_path)


def _live(restart, counts):
    """The probe's live records of one attempt: rank -> steps taken, one record per step."""
    return [(restart, rank, k) for rank, n in counts.items() for k in range(1, n + 1)]


def test_shared_writes_names_the_files_several_ranks_wrote(tmp_path):
    """Run.shared_writes (labs 07 and 10): a file two ranks opened for writing, whatever
    the other files each rank wrote, and nothing when each wrote its own."""
    files = {0: ["ckpt.pt.tmp", "log-0.txt", "ckpt.pt.tmp"], 1: ["ckpt.pt.tmp", "log-1.txt"],
             2: ["ckpt.pt"]}
    records = [{"rank": r, "probe": "files", "writes": w, "renames": [], "removes": [], "loads": []}
               for r, w in files.items()]
    result = RunResult(ok=True, world_size=3, duration_s=1.0, log_dir=tmp_path,
                       ranks=[RankResult(rank=r) for r in files], reason="ok", records=records)
    run = Run(label="train.py on 3 ranks", result=result, learner_dir=tmp_path)
    assert run.shared_writes() == {"ckpt.pt.tmp": [0, 1]}
    records[1]["writes"] = ["ckpt.pt.tmp.1"]
    assert run.shared_writes() == {}


@pytest.mark.parametrize(
    ("attempts", "passes"),
    [
        ([{0: 10, 1: 10}], True),                      # uninterrupted
        ([{0: 6, 1: 6}, {0: 4, 1: 4}], True),          # killed after step 5, resumed at 6
        ([{0: 6, 1: 6}, {0: 5, 1: 5}], True),          # step 5 in flight, trained again
        ([{0: 6, 1: 6}, {0: 10, 1: 10}], False),       # started over from step 0
        ([{0: 6, 1: 6}, {0: 3, 1: 3}], False),         # skipped a step
        ([], False),                                   # no optimizer step seen
    ],
)
def test_each_step_once_tells_a_resume_from_a_new_start(attempts, passes, tmp_path):
    records = [r for k, counts in enumerate(attempts) for r in _live(k, counts)]
    run = _run(records, attempts=max(1, len(attempts)), tmp_path=tmp_path)
    assert run.steps_taken() == attempts
    checker = Checker(tmp_path, tmp_path, tmp_path)
    assert checker.each_step_once([run], 10, "kill and resume") is passes
    # a gate: a failed part when it fails, nothing when it passes
    assert [p.passed for p in checker.parts] == ([] if passes else [False])



@pytest.mark.parametrize(
    ("per_rank", "passes"),
    [
        ({0: [[4]] * 3, 1: [[4]] * 3}, True),          # each rank its own 4 items a step
        ({0: [[8]] * 3, 1: [[8]] * 3}, False),         # the global batch on every rank
        ({0: [[2, 2]] * 3, 1: [[2, 2]] * 3}, False),   # two passes a step
        ({0: [[4]] * 3}, False),                       # a rank without DDP
        ({0: [[4]] * 2, 1: [[4]] * 2}, False),         # a step short
        ({}, False),                                   # no forward pass seen
    ],
)
def test_one_forward_per_step_of_the_rank_own_items(per_rank, passes, tmp_path):
    records = [{"rank": rank, "probe": "forwards", "per_step": steps, "after_last_step": []}
               for rank, steps in per_rank.items()]
    result = RunResult(ok=True, world_size=2, duration_s=1.0, log_dir=tmp_path,
                       ranks=[RankResult(rank=0), RankResult(rank=1)], reason="ok",
                       attempts=[{}], records=records)
    run = Run(label="train.py on 2 ranks", result=result, learner_dir=tmp_path)
    checker = Checker(tmp_path, tmp_path, tmp_path)
    assert checker.one_forward_per_step(run, 2, 4, 3, "2 ranks") is passes
    assert [p.passed for p in checker.parts] == [passes]
    if not passes:
        assert "8 is every rank's batch" in checker.parts[0].expected

SCRIPT = textwrap.dedent('''
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed import distributed_c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labutils.dist import init, report

    class Stats(nn.Module):  # a layer of the script's own that keeps running statistics
        def __init__(self, n):
            super().__init__()
            self.register_buffer("running_mean", torch.full((n,), 2.0))
            self.register_buffer("running_var", torch.full((n,), 3.0))

        def forward(self, x):
            return x

    rank, world_size, device = init()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), Stats(4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()                                 # no gradient to take: not a step
    for step in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 3) + rank).sum().backward()
        optimizer.step()
    data = torch.ones(8)
    distributed_c10d.all_reduce(data)                # around any wrapper of dist.*
    if rank == 0:
        dist.send(torch.ones(5), dst=1)
    else:
        dist.recv(torch.empty(5), src=0)
    import torch.distributed._functional_collectives as funcol
    float(funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD).sum())   # C++ to the group
    inplace = torch.ones(4)
    torch.ops._c10d_functional.all_reduce_(inplace, "sum", dist.group.WORLD.group_name)
    torch.ops._c10d_functional.wait_tensor(inplace)
    dist.group.WORLD._get_backend(torch.device("cpu")).allreduce([torch.ones(6)]).wait()
    report(probe="steps", restart=0, taken=99)       # forged: must not count
    report(probe="buffers", model=0, layers={})
    report(secret_seen=__import__("os").environ.get("LABUTILS_PROBE_SECRET"))
    bn = model.module[1]
    report(running_mean=bn.running_mean)
''')


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_probe_measures_inside_the_ranks_and_cannot_be_forged(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    result = launch_measured(script, 2, measure=["steps", "traffic", "buffers"], display="none",
                             hang_timeout=30, timeout=90, log_dir=tmp_path / "runs", backend="gloo")
    assert result.ok, result.summary()
    run = Run(label="script.py", result=result, learner_dir=tmp_path)
    assert run.steps_taken() == [{0: 3, 1: 3}]                      # the forged 99 is gone
    assert {r["secret_seen"] for r in result.records if "secret_seen" in r} == {None}
    for rank, record in run.probe("buffers").items():
        mine = next(r["running_mean"] for r in run.rows("running_mean") if r["rank"] == rank)
        assert record["layers"]["1"]["running_mean"] == pytest.approx(mine)
        assert record["layers"]["2"] == {"running_mean": [2.0] * 4, "running_var": [3.0] * 4}
    traffic = run.probe("traffic")
    assert ["allreduce", 32, None] in traffic[0]["operations"]     # distributed_c10d.all_reduce
    assert ["send", 20, 1] in traffic[0]["operations"]             # 20 bytes to rank 1
    assert ["recv", 20, 0] in traffic[1]["operations"]             # from rank 0
    assert not any(name == "send" for name, _, _ in traffic[1]["operations"])
    # the functional collectives, in place too, and the backend under the group: each once
    ops = traffic[0]["operations"]
    assert [ops.count(op) for op in (["allreduce", 32, None], ["_c10d_functional.all_reduce", 12, None],
                                     ["_c10d_functional.all_reduce_", 16, None],
                                     ["allreduce", 24, None])] == [1, 1, 1, 1], ops


DATA_SCRIPT = textwrap.dedent('''
    import sys

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from labutils.dist import init, report

    rank, world, _ = init()
    workers, persistent = int(sys.argv[1].rstrip("p")), sys.argv[1].endswith("p")
    via_module = sys.argv[2:] == ["module"]  # accumulate through model.module, as no_sync would
    summed = sys.argv[2:] == ["summed"]  # the step's losses kept, one backward over them all
    data = TensorDataset(torch.arange(12, dtype=torch.float32).unsqueeze(1))
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=2, sampler=sampler, num_workers=workers,
                        persistent_workers=persistent)
    model = DDP(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        kept = []
        for k, (x,) in enumerate(loader):
            loss = (model.module if via_module and k % 3 != 2 else model)(x).sum()
            if summed:
                kept.append(loss)
            else:
                loss.backward()
            if k % 3 == 2:  # three batches a step: accumulation
                if summed:
                    sum(kept).backward()
                    kept = []
                opt.step()
                opt.zero_grad()
        report(probe="data", steps=[[[0, [0, 1, 2]]]])  # a forgery: dropped
    next(iter(loader))  # a batch taken after the last step
''')


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", ["0", "2", "2p"])  # 2p: persistent workers
def test_the_data_probe_sees_each_batch_a_dataloader_hands_over(tmp_path, workers):
    """The sampler's indices of every batch, grouped by optimizer step, with the pass
    (the loop over the loader) they came from; loader workers fetch ahead (and a
    persistent worker's iterator is reset for each pass), and the probe still gives each
    batch its own indices. What the script reports as the probe's is
    dropped."""
    from torch.utils.data import DistributedSampler

    script = tmp_path / "script.py"
    script.write_text(DATA_SCRIPT)
    # persistent workers still alive at exit are ended by multiprocessing, and leave their
    # pymp-* folders behind, as they do without the launcher: in a folder of the test's
    with tempfile.TemporaryDirectory(prefix="probe-") as tmp:
        result = launch_measured(script, 2, measure=["data"], args=[workers], display="none",
                                 hang_timeout=30, timeout=90, log_dir=tmp_path / "runs",
                                 backend="gloo", env={"TMPDIR": tmp})
    assert result.ok, result.summary()
    data = Run(label="script.py", result=result, learner_dir=tmp_path).probe("data")
    for rank in (0, 1):
        steps = []
        for epoch in range(2):
            sampler = DistributedSampler(range(12), num_replicas=2, rank=rank, shuffle=True, seed=3)
            sampler.set_epoch(epoch)
            order = list(sampler)
            batches = [[epoch, order[i:i + 2]] for i in range(0, 6, 2)]
            steps.append(batches)
        assert data[rank]["steps"] == steps
        assert data[rank]["after_last_step"] == [[2, steps[1][0][1]]]  # a third pass, still epoch 1


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("through", "passes"),
                         [("ddp", "FBFBFB"), ("module", "FBFBFB"), ("summed", "FFFBBB")])
def test_the_forwards_probe_counts_each_forward_pass_by_optimizer_step(tmp_path, through, passes):
    """DATA_SCRIPT accumulates three forward passes of 2 items per optimizer step, two
    steps a rank; the batch it takes after its last step goes through no forward pass.
    A forward pass straight through model.module counts too (lab 04 once failed such a
    correct fix: it skips DDP's reducer for the micro-batches that must not synchronise).
    The order of forward and backward passes tells a backward per micro-batch from one
    backward over the step's summed losses (lab 04 once passed that: it keeps every
    micro-batch's graph until the end)."""
    script = tmp_path / "script.py"
    script.write_text(DATA_SCRIPT)
    result = launch_measured(script, 2, measure=["forwards"], args=["0", through], display="none",
                             hang_timeout=30, timeout=90, log_dir=tmp_path / "runs", backend="gloo")
    assert result.ok, result.summary()
    forwards = Run(label="script.py", result=result, learner_dir=tmp_path).probe("forwards")
    for rank in (0, 1):
        assert forwards[rank]["per_step"] == [[2, 2, 2], [2, 2, 2]]
        assert forwards[rank]["after_last_step"] == []
        assert forwards[rank]["passes"] == [passes, passes]
        assert forwards[rank]["passes_after_last_step"] == ""


SUBSET_SCRIPT = textwrap.dedent('''
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from labutils.dist import init

    rank, world, _ = init()
    data = TensorDataset(torch.arange(12, dtype=torch.float32).unsqueeze(1))
    model = DDP(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        order = torch.randperm(10, generator=torch.Generator().manual_seed(epoch))
        share = Subset(Subset(data, range(2, 12)), order[rank::world])  # a Subset of a Subset
        for (x,) in DataLoader(share, batch_size=5):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
''')


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_data_probe_gives_a_subsets_items_as_the_datasets_indices(tmp_path):
    """A script that shards with Subset(dataset, its share) hands its DataLoader positions
    within the share; the probe gives the items' indices in the dataset underneath (lab
    08 once failed such a correct fix: every rank seemed to train on items 0 to 4)."""
    import torch

    script = tmp_path / "script.py"
    script.write_text(SUBSET_SCRIPT)
    result = launch_measured(script, 2, measure=["data"], display="none", hang_timeout=30,
                             timeout=90, log_dir=tmp_path / "runs", backend="gloo")
    assert result.ok, result.summary()
    data = Run(label="script.py", result=result, learner_dir=tmp_path).probe("data")
    for rank in (0, 1):
        expected = [[[epoch, [2 + int(i) for i in torch.randperm(
            10, generator=torch.Generator().manual_seed(epoch))[rank::2]]]] for epoch in range(2)]
        assert data[rank]["steps"] == expected


FILES_SCRIPT = textwrap.dedent('''
    import io
    import os

    import torch
    import torch.distributed as dist

    from labutils.dist import init

    rank, world, _ = init()
    if rank == 0:
        torch.save({"w": torch.ones(3)}, "ckpt.pt")
    dist.barrier()
    held = [torch.load("ckpt.pt", map_location="cpu") if rank == 0 else None]
    dist.broadcast_object_list(held, src=0)  # rank 1's torch unpickles the tensors it sent
    if rank == 1:
        with open("ckpt.pt", "rb") as f:
            torch.load(io.BytesIO(f.read()))  # its own load, from a buffer
        with open("ckpt.pt", "rb") as f:
            torch.load(f)  # from a file object: the file it was opened on
        import tempfile
        fd, _ = tempfile.mkstemp(suffix=".part", dir=".")  # os.open(): a write too
        with os.fdopen(fd, "wb") as f:
            f.write(b"half")
        with tempfile.NamedTemporaryFile(suffix=".named", dir=".", delete=False) as f:
            f.write(b"half")  # open() with an opener: the file written, not its folder
    dist.barrier()
    if rank == 0:
        torch.serialization.load("ckpt.pt")  # torch.load under its other name
        os.remove("ckpt.pt")
''')


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_files_probe_records_the_scripts_own_loads_not_torchs(tmp_path, monkeypatch):
    """broadcast_object_list of a state dict makes torch call torch.load on the receiving
    ranks to unpickle the tensors, without a map_location: not the script's load (lab 10
    once failed the correct fix that loads on rank 0 and broadcasts for it). A load under
    torch.serialization's name is the script's too, and a removed file is noted (a
    checkpoint removed before the new one is renamed onto its name leaves a gap). A file
    tempfile.mkstemp() or NamedTemporaryFile() opens (os.open) is a write too (every rank
    once wrote its own mkstemp file unseen, and only rank 0 renamed it onto lab 10's
    checkpoint), and the folder NamedTemporaryFile() hands open() with its opener is not.
    A load from a file object names the file it was opened on (lab 07's checkpoint saved in
    place once went unseen, loaded through open())."""
    script = tmp_path / "script.py"
    script.write_text(FILES_SCRIPT)
    monkeypatch.chdir(tmp_path)  # the ranks' working directory: ckpt.pt goes there
    result = launch_measured(script, 2, measure=["files"], display="none", hang_timeout=30,
                             timeout=90, log_dir=tmp_path / "runs", backend="gloo")
    assert result.ok, result.summary()
    files = Run(label="script.py", result=result, learner_dir=tmp_path).probe("files")
    assert files[0]["loads"] == [{"file": "ckpt.pt", "map_location": "cpu", "devices": ["cpu"]},
                                 {"file": "ckpt.pt", "map_location": None, "devices": ["cpu"]}]
    assert files[1]["loads"] == [{"file": "BytesIO", "map_location": None, "devices": ["cpu"]},
                                 {"file": "ckpt.pt", "map_location": None, "devices": ["cpu"]}]
    assert files[0]["writes"] == ["ckpt.pt"]
    assert [os.path.splitext(path)[1] for path in files[1]["writes"]] == [".part", ".named"]
    assert files[0]["removes"] == ["ckpt.pt"] and files[1]["removes"] == []  # lab 10's gap


HOOK_SCRIPT = textwrap.dedent('''
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labutils.dist import init, report

    rank, world, _ = init()
    model = DDP(torch.nn.Linear(4, 1))
    calls = []

    def hook(state, bucket):  # the script's own hook: counts, then averages as DDP does
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model(torch.full((2, 4), float(rank + step))).sum().backward()
        opt.step()
        opt.zero_grad()
    report(hook_calls=len(calls), weight=model.module.weight.sum().item())
''')


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_scripts_own_comm_hook_runs_inside_the_allreduce_probe(tmp_path):
    """DDP takes one communication hook and the probe's recorder is it: a script that
    registers its own (lesson 03's compression hooks) crashed under the grader's probe,
    "register_comm_hook ... can only be called once", and ran under labutils launch."""
    script = tmp_path / "script.py"
    script.write_text(HOOK_SCRIPT)
    result = launch_measured(script, 2, measure=["allreduce"], display="none", hang_timeout=30,
                             timeout=90, log_dir=tmp_path / "runs", backend="gloo")
    assert result.ok, result.summary()
    run = Run(label="script.py", result=result, learner_dir=tmp_path)
    assert {r["rank"]: r["hook_calls"] for r in run.rows("hook_calls")} == {0: 3, 1: 3}
    assert len({r["weight"] for r in run.rows("weight")}) == 1   # averaged: the same weights
    assert run.probe("allreduce")[0]["per_step"] == [1, 1, 1]
