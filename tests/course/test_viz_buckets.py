"""labutils.course.ddp_probes and spans, and lesson 03's plots (lessons/03_bucketing_and_overlap/
plots.py): DDP's bucket rule, the logging-data parsers, overlap arithmetic, trace reading,
the plots, and one real torchrun run that checks the bucket reading against DDP's own
logging data."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from helpers import LESSONS

from labutils import launch  # noqa: E402
from labutils.course import lesson  # noqa: E402
from labutils.course.ddp_probes import BackwardTimer, parse_index_lists, parse_sizes, predict_buckets  # noqa: E402
from labutils.course.spans import busy_seconds, overlap_seconds, trace_spans  # noqa: E402
from labutils.errors import InputError  # noqa: E402

PLOTS = lesson.load(LESSONS / "03_bucketing_and_overlap", "plots")
plot_bucket_sizes, plot_bucket_sweep, plot_overlap_timeline = (
    PLOTS.plot_bucket_sizes, PLOTS.plot_bucket_sweep, PLOTS.plot_overlap_timeline)

MiB = 2**20


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


# ----------------------------------------------------------------------- the bucket rule

@pytest.mark.parametrize(
    ("sizes", "cap", "first", "buckets"),
    [
        ([], 4, None, []),
        ([1], 4, None, [[0]]),
        ([4], 4, None, [[0]]),                              # exactly the cap closes the bucket
        ([5], 4, None, [[0]]),                              # one tensor over the cap: its own bucket
        ([3, 3, 3, 3], 4, None, [[0, 1], [2, 3]]),          # buckets exceed the cap
        ([1, 1, 1, 1, 1], 2, None, [[0, 1], [2, 3], [4]]),  # the rest forms a last bucket
        ([1, 1, 3, 3], 4, 1, [[0], [1, 2], [3]]),           # a smaller first bucket
        ([0, 0, 4], 4, None, [[0, 1, 2]]),                  # empty tensors join the open bucket
        # The lesson's MLP in gradient-ready order (fc5.bias ... fc1.weight), cap 4 MiB:
        ([40, 20480, 2048, 2 * MiB, 4096, 4 * MiB, 4096, 4 * MiB, 4096, MiB], 4 * MiB, None,
         [[0, 1, 2, 3, 4, 5], [6, 7], [8, 9]]),
        # ... and with bucket_cap_mb unset: 1 MiB first bucket, then 25 MiB.
        ([40, 20480, 2048, 2 * MiB, 4096, 4 * MiB, 4096, 4 * MiB, 4096, MiB], 25 * MiB, MiB,
         [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]),
    ],
)
def test_predict_buckets(sizes, cap, first, buckets):
    assert predict_buckets(sizes, cap_bytes=cap, first_cap_bytes=first) == buckets


@pytest.mark.parametrize(
    ("sizes", "cap", "first", "fragment"),
    [
        ("1 2", 4, None, "sizes: expected a list of byte counts"),
        ([1, -1], 4, None, "sizes: expected whole numbers of bytes >= 0"),
        ([1.5], 4, None, "whole numbers"),
        ([1], 0, None, "cap_bytes: expected a whole number of bytes >= 1"),
        ([1], 4.0, None, "cap_bytes"),
        ([1], True, None, "cap_bytes"),
        ([1], 4, 0, "first_cap_bytes"),
    ],
)
def test_predict_buckets_rejects(sizes, cap, first, fragment):
    with pytest.raises(InputError, match=fragment):
        predict_buckets(sizes, cap_bytes=cap, first_cap_bytes=first)


# ----------------------------------------------------------------------- logging data

@pytest.mark.parametrize(
    ("text", "lists"),
    [
        ("", []),
        ("  ", []),
        ("0", [[0]]),
        ("7 6 5 4, 3 2, 1 0", [[7, 6, 5, 4], [3, 2], [1, 0]]),
        ("9 8,7", [[9, 8], [7]]),
    ],
)
def test_parse_index_lists(text, lists):
    assert parse_index_lists(text) == lists


@pytest.mark.parametrize(
    ("text", "numbers"),
    [("", []), ("11569192", [11569192]), ("2119720, 9449472", [2119720, 9449472]),
     ("9, 8, 7", [9, 8, 7])],
)
def test_parse_sizes(text, numbers):
    assert parse_sizes(text) == numbers


@pytest.mark.parametrize("parse", [parse_index_lists, parse_sizes])
@pytest.mark.parametrize("bad", [None, 3, "1 x, 2", "a"])
def test_parsers_reject(parse, bad):
    with pytest.raises(InputError):
        parse(bad)


# ----------------------------------------------------------------------- overlap arithmetic

@pytest.mark.parametrize(
    ("spans", "busy"),
    [([], 0.0), ([(0, 1)], 1.0), ([(0, 1), (0.5, 2)], 2.0), ([(0, 1), (2, 3)], 2.0),
     ([(2, 3), (0, 1), (0.5, 0.7)], 2.0), ([(1, 1)], 0.0)],
)
def test_busy_seconds(spans, busy):
    assert busy_seconds(spans) == pytest.approx(busy)


@pytest.mark.parametrize(
    ("first", "second", "both"),
    [
        ([], [(0, 1)], 0.0),
        ([(0, 1)], [(1, 2)], 0.0),                   # touching is not overlapping
        ([(0, 2)], [(1, 3)], 1.0),
        ([(0, 1), (2, 3)], [(0.5, 2.5)], 1.0),
        ([(0, 10)], [(1, 2), (1.5, 3), (5, 6)], 3.0),  # overlapping comm counted once
        ([(0, 1)], [(0, 1)], 1.0),
    ],
)
def test_overlap_seconds(first, second, both):
    assert overlap_seconds(first, second) == pytest.approx(both)
    assert overlap_seconds(second, first) == pytest.approx(both)


def test_overlap_rejects_reversed_interval():
    with pytest.raises(InputError, match="end >= start"):
        busy_seconds([(2, 1)])


# ----------------------------------------------------------------------- profiler trace

def test_trace_spans_reads_backward_ops_and_all_reduces(tmp_path):
    events = [
        {"ph": "X", "name": "autograd::engine::evaluate_function: AddmmBackward0", "ts": 1000, "dur": 50, "tid": 1},
        {"ph": "X", "name": "autograd::engine::evaluate_function: ReluBackward0", "ts": 1060, "dur": 5, "tid": 1},
        {"ph": "X", "name": "gloo:all_reduce", "ts": 1070, "dur": 400, "tid": 7},
        {"ph": "X", "name": "c10d::allreduce_", "ts": 1065, "dur": 3, "tid": 1},   # the launch, not the transfer
        {"ph": "X", "name": "aten::mm", "ts": 1001, "dur": 20, "tid": 1},
        {"ph": "i", "name": "marker", "ts": 900},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    spans = trace_spans(path)
    assert [name for name, _, _ in spans["compute"]] == ["AddmmBackward0", "ReluBackward0"]
    assert spans["compute"][0][1:] == pytest.approx((0.0, 50e-6))
    assert [(n, t) for n, _, _, t in spans["comm"]] == [("gloo:all_reduce", "7")]
    assert spans["comm"][0][1:3] == pytest.approx((70e-6, 470e-6))


@pytest.mark.parametrize("content", ["not json", json.dumps({"no": "events"}), json.dumps([1, 2])])
def test_trace_spans_rejects_other_files(tmp_path, content):
    path = tmp_path / "trace.json"
    path.write_text(content)
    with pytest.raises(InputError, match="Chrome trace"):
        trace_spans(path)


def test_trace_spans_missing_file(tmp_path):
    with pytest.raises(InputError, match="Chrome trace"):
        trace_spans(tmp_path / "nope.json")


def test_backward_timer_rejects_layers_without_parameters():
    import torch

    with pytest.raises(InputError, match="own parameters"):
        BackwardTimer({"relu": torch.nn.ReLU()})
    with pytest.raises(InputError, match="at least one layer"):
        BackwardTimer({})


def test_backward_timer_times_each_layer_in_backward_order():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    timer = BackwardTimer({"fc1": model[0], "fc2": model[2]})
    model(torch.randn(3, 4)).sum().backward()
    timer.next_iteration()
    assert [s.name for s in timer.spans] == ["fc2", "fc1"]  # backward runs last layer first
    assert all(s.iteration == 0 and s.end_s >= s.start_s for s in timer.spans)
    assert timer.spans[0].end_s <= timer.spans[1].start_s
    timer.remove()
    model(torch.randn(3, 4)).sum().backward()
    assert len(timer.spans) == 2


# ----------------------------------------------------------------------- plots

BUCKETS = {"iteration 0": [11569192], "cap 4 MiB": [6318120, 4198400, 1052672]}


def test_bucket_sizes_plot_cuts_one_bar_per_setting():
    fig = plot_bucket_sizes(BUCKETS, caps={"cap 4 MiB": 4 * MiB},
                            labels={"cap 4 MiB": ["fc5, fc4, fc3", "fc2", "fc1"]})
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == list(BUCKETS)
    widths = sorted(round(p.get_width(), 3) for p in ax.patches)
    assert widths == sorted(round(b / MiB, 3) for sizes in BUCKETS.values() for b in sizes)
    assert "MiB" in ax.get_xlabel() and "cap" in ax.get_title()
    assert {t.get_text() for t in ax.texts} >= {"fc5, fc4, fc3", "fc2", "fc1", "b0"}
    assert fig.get_size_inches()[0] >= 10


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"buckets": {}}, "at least one entry"),
        ({"buckets": {"a": []}}, "non-empty list"),
        ({"buckets": {"a": [0]}}, "sizes in bytes > 0"),
        ({"buckets": {"a": "12"}}, "non-empty list"),
        ({"buckets": BUCKETS, "caps": {"b": 1}}, "caps: expected keys among"),
        ({"buckets": BUCKETS, "labels": {"cap 4 MiB": ["x"]}}, "3 texts"),
    ],
)
def test_bucket_sizes_plot_rejects(kwargs, fragment):
    buckets = kwargs.pop("buckets")
    with pytest.raises(InputError, match=fragment):
        plot_bucket_sizes(buckets, **kwargs)


def test_overlap_timeline_draws_lanes_in_ms_from_t0():
    compute = {"backward fc2": [(10.000, 10.002)], "backward fc1": [(10.003, 10.004)]}
    comm = {"bucket 0": [(10.002, 10.010)]}
    fig = plot_overlap_timeline(compute, comm, t0=10.0, marks={"backward() returns": 10.011})
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["backward fc2", "backward fc1", "bucket 0"]
    bars = ax.collections
    assert len(bars) == 3
    extent = bars[2].get_paths()[0].get_extents()  # the bucket's bar: 2 ms to 10 ms
    assert (extent.x0, extent.width) == pytest.approx((2.0, 8.0))
    assert ax.get_xlabel() == "time (ms)"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:2] == ["backward compute", "all-reduce"]
    assert legend[2] == "backward() returns (11.0 ms)"


@pytest.mark.parametrize(
    ("compute", "comm", "fragment"),
    [
        ({}, {}, "at least one span"),
        ({"a": [(2, 1)]}, {}, "end >= start"),
        ({"a": [(0, None)]}, {}, "start_s, end_s"),
        ({"a": [(0, float("nan"))]}, {}, "finite"),
        ([(0, 1)], {}, "compute: expected a dict"),
    ],
)
def test_overlap_timeline_rejects(compute, comm, fragment):
    with pytest.raises(InputError, match=fragment):
        plot_overlap_timeline(compute, comm)


def test_bucket_sweep_plot_has_measured_predicted_and_floor():
    measured = {"deep128": ([1 / 16, 1, 16], [0.03, 0.02, 0.025])}
    predicted = {"deep128": ([1 / 16, 1, 16], [0.028, 0.022, 0.022])}
    fig = plot_bucket_sweep(measured, predicted=predicted, compute_only={"deep128": 0.015})
    (ax,) = fig.axes
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1/16", "1", "16"]
    lines = ax.get_lines()
    assert list(lines[0].get_ydata()) == pytest.approx([30, 20, 25])  # ms
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0] == "deep128: measured" and "no overlap" in labels[1] and "no_sync" in labels[2]
    assert "ms" in ax.get_ylabel()


def test_bucket_sweep_plot_shades_between_the_two_predictions():
    caps = [1 / 16, 1, 16]
    fig = plot_bucket_sweep({"m": (caps, [0.03, 0.02, 0.025])},
                            predicted={"m": (caps, [0.035, 0.03, 0.025])},
                            perfect={"m": (caps[::-1], [0.025, 0.015, 0.018])})  # any cap order
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert list(lines[2].get_ydata()) == pytest.approx([18, 15, 25])  # sorted by cap, in ms
    assert lines[2].get_linestyle() == "-."
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["m: measured", "m: predicted, no overlap", "m: predicted, perfect overlap"]
    (band,) = ax.collections  # the shaded range between the predictions
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(15) and max(ys) == pytest.approx(35)


def test_bucket_sweep_plot_rejects_unknown_models():
    with pytest.raises(InputError, match="model labels among"):
        plot_bucket_sweep({"a": ([1], [0.1])}, compute_only={"b": 0.1})
    with pytest.raises(InputError, match="model labels among"):
        plot_bucket_sweep({"a": ([1], [0.1])}, perfect={"b": ([1], [0.1])})


# ----------------------------------------------------------------------- real DDP buckets

BUCKET_CHECK = '''
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labutils.course.ddp_probes import BucketRecorder, predict_buckets, reducer_buckets
from labutils.dist import init, report

rank, world_size, device = init()
for cap in (None, 0.25, 1.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 4))
    ddp = DDP(model, bucket_cap_mb=cap)
    recorder = BucketRecorder(ddp)
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + rank)
        F.cross_entropy(ddp(torch.randn(8, 64, generator=g)), torch.randint(0, 4, (8,), generator=g)).backward()
    info = reducer_buckets(ddp)
    order = info["ready_order"]
    predicted = predict_buckets([info["param_bytes"][n] for n in order], cap_bytes=info["bucket_cap_bytes"],
                                first_cap_bytes=2**20 if cap is None else None)
    report(cap=cap, info=info, predicted=[[order[i] for i in b] for b in predicted],
           calls=[c.to_json() for c in recorder.calls], counts=recorder.counts())
'''


@pytest.mark.slow
def test_bucket_reading_matches_ddp_logging_data(runs_dir, write_script):
    script = write_script("bucket_check.py", BUCKET_CHECK)
    result = launch(script, nproc=2, display="none", hang_timeout=60, timeout=240)
    assert result.ok, result.summary()
    assert len(result.records) == 6
    for rec in result.records:
        info, calls = rec["info"], rec["calls"]
        names = list(info["param_bytes"])
        # Iteration 0: one bucket holding every gradient, in parameter order.
        first = [c for c in calls if c["iteration"] == 0]
        assert [c["params"] for c in first] == [names]
        assert [c["nbytes"] for c in first] == info["initial_sizes"] == [info["total_parameter_size_bytes"]]
        # Iterations 1 and 2: what the hook saw is what DDP logged after the rebuild ...
        for it in (1, 2):
            seen = [c for c in calls if c["iteration"] == it]
            assert [c["params"] for c in seen] == info["rebuilt_params"]
            assert [c["nbytes"] for c in seen] == info["rebuilt_sizes"]
            assert [c["index"] for c in seen] == list(range(len(seen)))
            assert [c["is_last"] for c in seen] == [False] * (len(seen) - 1) + [True]
            assert all(c["end_s"] >= c["start_s"] for c in seen)
        # ... and what predict_buckets() gives for the logged gradient-ready order.
        assert rec["predicted"] == info["rebuilt_params"]
        assert info["rebuilt"] and info["comm_hook"] == "record_hook"
        assert rec["counts"] == {"0": 1, "1": len(info["rebuilt_sizes"]), "2": len(info["rebuilt_sizes"])}
    by_cap = {(r["rank"], r["cap"]): len(r["info"]["rebuilt_sizes"]) for r in result.records}
    # Ready order: fc4 (4 KiB), fc3 (0.5 MiB), fc2 (1 MiB), fc1 (130 KiB). With a 0.25 MiB
    # cap, fc3 and fc2 each close a bucket; unset, the 1 MiB first bucket closes at fc2.
    assert by_cap[(0, 0.25)] == by_cap[(1, 0.25)] == 3
    assert by_cap[(0, None)] == 2
