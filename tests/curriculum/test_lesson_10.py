"""Lesson 10: the notebook's pure helpers (lesson10.py: lesson 02's formulas on counted
collectives, the tables of buckets and graphs, checkpoints, timings, FSDP2's traffic,
the self-check) on synthetic records, and one real torchrun run of comm_count's
CollectiveCounter against collectives of known sizes."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import LESSONS

from labutils import launch
from labutils.course import lesson

LESSON = LESSONS / "10_current_stack"
MiB = 2**20


@pytest.fixture
def lesson10():
    return lesson.load(LESSON, "lesson10")


def run_of(*records):
    return SimpleNamespace(records=list(records))


def call(op, nbytes, n, dim="shard", dtype="float32"):
    return {"op": op, "name": op, "dtype": dtype, "nbytes": nbytes, "group_size": n, "mesh_dim": dim}


# ------------------------------------------------------------------ formulas and labels

@pytest.mark.parametrize("op, n, nbytes, sent", [
    ("all_gather", 2, 4 * MiB, 2 * MiB),
    ("all_gather", 4, 4 * MiB, 3 * MiB),
    ("reduce_scatter", 2, 4 * MiB, 2 * MiB),
    ("all_reduce", 2, 4 * MiB, 4 * MiB),
    ("all_reduce", 8, 100, 175),
    ("all_to_all", 4, 400, 300),
])
def test_sent_per_rank_follows_lesson_02(lesson10, op, n, nbytes, sent):
    assert lesson10.sent_per_rank(call(op, nbytes, n)) == pytest.approx(sent)


@pytest.mark.parametrize("groups, label", [
    ([["head", "layers.7"], ["layers.0", "layers.1", "layers.2"]], "[0-2] [7 head]"),
    ([["layers.3"]], "[3]"),
    ([["head", "layers.0", "layers.1"]], "[0-1 head]"),
    ([["layers.0", "layers.2"]], "[0,2]"),
    ([["head"]], "[head]"),
    ([], ""),
])
def test_groups_label_lists_layers_in_forward_order(lesson10, groups, label):
    assert lesson10.layers_label(groups) == label


@pytest.mark.parametrize("text, shown", [
    ("(Shard(dim=0), Replicate())", "(Shard(0), Replicate())"),
    ("(Replicate(), Partial(sum))", "(Replicate(), Partial())"),
])
def test_placements_are_shown_as_written(lesson10, text, shown):
    assert lesson10.short_placements(text) == shown


# ------------------------------------------------------------------ tables

def test_layout_table_names_each_ranks_block(lesson10):
    recs = [{"part": "layout", "rank": r, "coords": [r // 2, r % 2], "placements": "(Shard(dim=0), Replicate())",
             "holds": f"rows {512 * (r // 2)}-{512 * (r // 2) + 511}, cols 0-1023"} for r in range(4)]
    row = lesson10.layout_table(run_of(*recs)).splitlines()[2].split()
    assert row == ["(Shard(0),", "Replicate())", "X[0:512,", "0:1024]", "X[0:512,", "0:1024]",
                   "X[512:1024,", "0:1024]", "X[512:1024,", "0:1024]"]


def test_redistribute_table_prices_each_collective(lesson10):
    recs = [{"part": "redistribute", "rank": 0, "source": "(Shard(dim=0), Shard(dim=1))",
             "target": "(Replicate(), Replicate())", "correct": True, "counts": {"all_gather_into_tensor": 2},
             "calls": [call("all_gather", 2 * MiB, 2, "1"), call("all_gather", 4 * MiB, 2, "0")]},
            {"part": "redistribute", "rank": 0, "source": "(Replicate(), Replicate())",
             "target": "(Shard(dim=0), Shard(dim=1))", "correct": True, "counts": {}, "calls": []}]
    lines = lesson10.redistribute_table(run_of(*recs)).splitlines()[2:]
    assert lines[0].split()[-5:] == ["(2", "ranks)", "2.00", "1.00", "True"]
    assert lines[1].split()[-4:] == ["(2", "ranks)", "4.00", "2.00"]
    assert lines[2].split()[-3:] == ["none", "0", "True"]
    assert "all_gather_into_tensor: 2" in lesson10.commdebug_counts(run_of(*recs))


def test_graphs_table_counts_buckets_graphs_and_shows_errors(lesson10):
    recs = [{"part": "graphs", "rank": 0, "bucket_cap_mb": 25, "optimize_ddp": True, "error": None,
             "ddp_buckets": [["head", "layers.0", "layers.1"]], "graphs": [["layers.0"], ["head", "layers.1"]]},
            {"part": "graphs", "rank": 0, "bucket_cap_mb": 0.5, "optimize_ddp": True, "graphs": [],
             "ddp_buckets": [["layers.0"]], "error": "AssertionError: First bucket should be smaller"}]
    text = lesson10.graphs_table(run_of(*recs))
    rows = text.splitlines()
    assert rows[2].split() == ["25", "1", "[0-1", "head]", "2", "[0]", "[1", "head]"]
    assert rows[3].split()[:4] == ["0.5", "1", "[0]", "error"]
    assert rows[-1] == "bucket_cap_mb=0.5: AssertionError: First bucket should be smaller"


def test_loaded_table_compares_every_tensor(lesson10):
    saved = {"a": "1", "b": "2"}
    save = run_of({"part": "saved", "rank": 0, "checkpoint": "fsdp", "wrapper": "FSDP2", "fingerprints": saved,
                   "after_step": {"a": "3", "b": "4"}, "files": []})
    load = run_of({"part": "loaded", "rank": 0, "checkpoint": "fsdp", "wrapper": "DDP", "local_shape": [4, 4],
                   "fingerprints": {"a": "1", "b": "9"}},
                  {"part": "loaded", "rank": 0, "checkpoint": "fsdp", "wrapper": "FSDP2", "local_shape": [2, 4],
                   "fingerprints": dict(saved)},
                  {"part": "loaded", "rank": 1, "checkpoint": "fsdp", "wrapper": "FSDP2", "local_shape": [2, 4],
                   "fingerprints": None})
    rows = lesson10.loaded_table(save, load).splitlines()[2:]
    assert rows[0].split()[-4:] == ["1", "of", "2", "False"]
    assert rows[1].split()[-5:] == ["2x4", "2", "of", "2", "True"]
    assert lesson10.async_consistency(save, load).splitlines() == [
        "loaded == state when async_save was called: True",
        "loaded == state after the training step taken meanwhile: False"]


def test_save_timing_table_takes_the_slowest_rank_and_the_median_round(lesson10):
    recs = []
    for rnd, (slow, async_blocked) in enumerate([(0.4, 0.02), (0.6, 0.04), (0.5, 0.03)]):
        for rank in (0, 1):
            recs += [{"part": "timing", "rank": rank, "round": rnd, "way": "torch.save on rank 0",
                      "blocked_s": slow - 0.1 * rank, "durable_s": slow - 0.1 * rank, "step_s": []},
                     {"part": "timing", "rank": rank, "round": rnd, "way": "dcp.save",
                      "blocked_s": 0.1, "durable_s": 0.1, "step_s": []},
                     {"part": "timing", "rank": rank, "round": rnd, "way": "dcp.async_save",
                      "blocked_s": async_blocked, "durable_s": 0.2, "step_s": [0.3, 0.2]},
                     {"part": "timing", "rank": rank, "round": rnd, "way": "no checkpoint",
                      "blocked_s": 0.0, "durable_s": None, "step_s": [0.2, 0.2]}]
    rows = lesson10.save_timing_table(run_of(*recs)).splitlines()
    assert rows[2].split()[-4:] == ["0.500", "0.500", "1.00", "2.50"]
    assert rows[3].split()[-4:] == ["0.100", "0.100", "0.20", "0.50"]
    assert rows[4].split()[-4:] == ["0.030", "0.200", "0.06", "0.15"]
    assert rows[-1].split()[-2:] == ["0.300", "s"]
    assert lesson10.save_claims(run_of(*recs)).count(": True") == 3
    # dcp.save no quicker than torch.save, async_save blocking as long as a step and on
    # disk when it returns: each line says False
    slow = [{**r, "blocked_s": 0.6, "durable_s": 0.6} if r["way"] in ("dcp.save", "dcp.async_save") else r
            for r in recs]
    assert [line.rsplit(": ", 1)[1] for line in lesson10.save_claims(run_of(*slow)).splitlines()] == \
        ["False", "False", "False"]


def test_precision_and_hsdp_tables_price_fsdp2s_collectives(lesson10):
    fp32 = [call("all_gather", MiB, 4), call("reduce_scatter", MiB, 4)]
    bf16 = [call("all_gather", MiB // 2, 4, dtype="bfloat16"), call("reduce_scatter", MiB, 4)]
    hsdp = [call("all_gather", MiB, 2), call("reduce_scatter", MiB, 2), call("all_reduce", MiB // 2, 2, "replicate")]
    dtypes = {"parameters": "float32", "gradients": "float32", "output": "float32"}
    run = run_of({"part": "precision", "rank": 0, "policy": "float32", "calls": fp32, "losses": [1.0, 0.5],
                  "dtypes": dtypes},
                 {"part": "precision", "rank": 0, "policy": "bf16", "calls": bf16, "losses": [1.001, 0.5],
                  "dtypes": {**dtypes, "output": "bfloat16"}},
                 {"part": "hsdp", "rank": 0, "calls": hsdp, "losses": [1.0, 0.5], "vs_fsdp": "equal (assert_close)"},
                 *({"part": "held 1-D", "rank": r, "held_bytes": 10} for r in range(4)),
                 *({"part": "held", "rank": r, "held_bytes": 20} for r in range(4)))
    rows = lesson10.precision_table(run).splitlines()[2:]
    assert [r.split()[-4:] for r in rows] == [["float32", "1", "0.75", "1.00"], ["float32", "1", "0.75", "1.00"],
                                               ["bfloat16", "1", "0.38", "0.50"], ["float32", "1", "0.75", "1.00"]]
    assert "1.0e-03" in lesson10.precision_losses(run)
    assert lesson10.precision_dtypes(run).splitlines()[3].split() == ["bf16", "float32", "float32", "bfloat16"]
    hsdp_rows = [r.split() for r in lesson10.hsdp_table(run).splitlines()[2:]]
    assert hsdp_rows[2][-2:] == ["together", "1.50"]
    assert hsdp_rows[5][-5:] == ["(2", "ranks)", "all_reduce", "1", "0.50"]
    assert hsdp_rows[6][-2:] == ["together", "1.50"]
    assert "FSDP2 over 4 ranks 10, 10, 10, 10; HSDP 20, 20, 20, 20" in lesson10.hsdp_lines(run)


def test_self_check_accepts_the_right_answers(lesson10, capsys):
    lesson10.check_answers({name: want for name, (want, _) in lesson10.EXPECTED.items()})
    assert capsys.readouterr().out.count(": correct") == len(lesson10.EXPECTED)
    lesson10.check_answers({"q3_graphs": 2, "q4_async_waits_for_disk": True})
    out = capsys.readouterr().out
    assert "q3_graphs: not quite" in out and "q4_async_waits_for_disk: not quite" in out


# ------------------------------------------------------------------ a real run

COUNTED = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, DTensor, distribute_tensor
    from labutils.course.comm_count import CollectiveCounter
    from labutils.dist import init, report

    rank, world, device = init()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    x = torch.ones(256, dtype=torch.bfloat16)                           # 512 B
    d = distribute_tensor(torch.ones(8, 8), mesh, (Replicate(), Shard(0)))  # broadcasts: not counted
    with CollectiveCounter(mesh) as comm:
        dist.all_reduce(x)                                              # c10d, whole world
        out = torch.empty(1024, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, x)                             # c10d: output 2 KiB
        dist.reduce_scatter_tensor(torch.empty(64, dtype=torch.bfloat16), x)
        d.redistribute(mesh, (Replicate(), Replicate()))                # functional, 256 B
        p = DTensor.from_local(torch.ones(8, 8), mesh, (Partial(), Replicate()))
        p.redistribute(mesh, (Shard(0), Replicate()))                   # functional, 256 B
    report(calls=comm.calls, counts=sum(comm.get_comm_counts().values()))
""")


def test_collective_counter_sizes_and_groups(runs_dir, tmp_path):
    script = tmp_path / "counted.py"
    script.write_text(COUNTED)
    result = launch(script, 4, display="none", hang_timeout=60, timeout=120)
    assert result.ok, result.summary()
    rec = next(r for r in result.records if r["rank"] == 0)
    got = [(c["op"], c["dtype"], c["nbytes"], c["group_size"], c["mesh_dim"]) for c in rec["calls"]]
    assert got == [("all_reduce", "bfloat16", 512, 4, "[0, 1, 2, 3]"),
                   ("all_gather", "bfloat16", 2048, 4, "[0, 1, 2, 3]"),
                   ("reduce_scatter", "bfloat16", 512, 4, "[0, 1, 2, 3]"),
                   ("all_gather", "float32", 256, 2, "inner"),
                   ("reduce_scatter", "float32", 256, 2, "outer")]
    assert rec["counts"] == 5  # CommDebugMode's own count agrees


def test_comm_debug_mode_counts_dtensors_collectives_but_not_a_barrier(tmp_path):
    """Section 1's caveat, on a world of one in a process of its own: CommDebugMode
    counts all_reduce and broadcast, and a barrier goes uncounted."""
    import subprocess
    import sys

    code = """
import torch, torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(4)
with CommDebugMode() as mode:
    dist.barrier()
    dist.all_reduce(t)
    dist.broadcast(t, 0)
print(sorted(map(str, mode.get_comm_counts())), mode.get_total_counts())
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "['c10d.allreduce_', 'c10d.broadcast_'] 2"


def _shape_calls(**changes):
    """Part 3 of compile_ddp.py as rank 0 reports it: (when, rows) -> the call's record,
    with changes[(when, rows)] merged in."""
    calls = {("first", 8): (1, 0, 0.72), ("first", 12): (1, 0, 0.6), ("first", 20): (0, 0, 0.0002),
             ("after reset", 8): (1, 1, 0.04), ("after reset", 12): (1, 1, 0.05),
             ("after reset", 20): (0, 0, 0.0001)}
    records = []
    for (when, rows), (graphs, hits, seconds) in calls.items():
        rec = {"rank": 0, "part": "shapes", "when": when, "rows": rows, "new_graphs": graphs,
               "cache_hits": hits, "seconds": seconds}
        rec.update(changes.get(f"{when.replace(' ', '_')}_{rows}", {}))
        records.append(rec)
    return run_of(*records)


def test_part_3s_claims_hold_on_its_calls_and_each_turns_false_by_the_fact_it_claims(lesson10):
    def claims(run):
        return [line.rstrip().endswith("True") for line in lesson10.shapes_claims(run).splitlines()]

    assert claims(_shape_calls()) == [True, True, True]
    table = lesson10.shapes_table(_shape_calls()).splitlines()
    assert len(table) == 2 + 6 and table[2].split() == ["first", "8", "1", "0", "720.0"]
    assert claims(_shape_calls(first_20={"new_graphs": 1})) == [False, True, True]   # no dynamic graph
    assert claims(_shape_calls(first_12={"new_graphs": 0})) == [False, True, True]
    assert claims(_shape_calls(after_reset_12={"cache_hits": 0})) == [True, False, True]  # compiled again
    assert claims(_shape_calls(after_reset_20={"new_graphs": 1})) == [True, False, True]
    assert claims(_shape_calls(after_reset_8={"seconds": 0.2})) == [True, True, False]  # no quicker
    assert lesson10.shapes_claims(run_of({"rank": 0, "part": "kernels"})) == "part 3 did not run"
