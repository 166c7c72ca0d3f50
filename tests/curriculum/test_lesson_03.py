"""Lesson 03's notebook helpers (lessons/03_bucketing_and_overlap/lesson03.py): the two
predictions of a step, the check built on them, the bucket rule with
DDP_SET_LAST_BUCKET_CAP, table units and the PowerSGD race report. Pure functions on
hand-made records; the notebook itself runs the scripts (nbval)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import LESSONS

from labutils.course import lesson
from labutils.course.timing import AlphaBeta

LESSON = LESSONS / "03_bucketing_and_overlap"
L = lesson.load(LESSON, "lesson03")

MiB = 2**20


def sweep_records(steps: dict[float, float | list[float]], *, alone: dict[float, list[float]]) -> list[dict]:
    """sweep.py's records for one model: forward 10 ms, backward 40 ms, optimizer 2 ms;
    per cap the step of each of 3 rounds (one number: the same in every round)."""
    records = [{"part": "compute", "model": "m", "batch": 8, "forward_s": 0.010,
                "backward_s": 0.040, "optimizer_s": 0.002, "param_bytes": 4 * MiB}]
    for cap, seconds in steps.items():
        rounds = seconds if isinstance(seconds, list) else [seconds] * 3
        records.append({"part": "sweep", "model": "m", "cap_mb": cap, "seconds": min(rounds),
                        "round_s": rounds, "bucket_sizes": [MiB] * len(alone[cap]),
                        "alone_s": alone[cap]})
    return records


# --------------------------------------------------------------------- the two predictions

def test_bounds_when_backward_is_the_longer_side():
    # 3 buckets of 10 ms: backward (40) + the last bucket (10) > all buckets (30)
    (row,) = L.sweep_bounds(sweep_records({1: 0.070}, alone={1: [0.010, 0.010, 0.010]}))
    assert row["perfect_s"] == pytest.approx(0.010 + 0.002 + 0.040 + 0.010)
    assert row["none_s"] == pytest.approx(0.052 + 0.030)
    assert row["buckets"] == 3 and row["comm_s"] == pytest.approx(0.030)


def test_bounds_when_the_link_is_the_longer_side():
    # 2 buckets of 45 ms: back to back (90) > backward (40) + the last bucket (45)
    (row,) = L.sweep_bounds(sweep_records({1: 0.120}, alone={1: [0.045, 0.045]}))
    assert row["perfect_s"] == pytest.approx(0.012 + 0.090)
    assert row["none_s"] == pytest.approx(0.052 + 0.090)


def test_one_bucket_makes_both_predictions_equal():
    (row,) = L.sweep_bounds(sweep_records({16: 0.1}, alone={16: [0.030]}))
    assert row["perfect_s"] == pytest.approx(row["none_s"])


@pytest.mark.parametrize(
    ("step_at_cap_1", "verdict"),
    [(0.070, "True"),    # between 0.062 and 0.082
     (0.057, "True"),    # below perfect overlap, within 10% of it
     (0.090, "True"),    # above no overlap, within 10% of it
     (0.055, "False"),   # well below perfect overlap: something is wrong with the parts
     (0.091, "False")],  # well above no overlap
)
def test_check_compares_every_cap_with_two_or_more_buckets(step_at_cap_1, verdict):
    records = sweep_records({1: step_at_cap_1, 16: 0.5},  # one bucket: not checked
                            alone={1: [0.010] * 3, 16: [0.030]})
    said = (f"m, caps 1 MiB (2+ buckets): step time between the two predictions "
            f"(each widened by 10%): {verdict}")
    if verdict == "False":  # which cap, and its numbers
        said += f" (cap 1 MiB: step {step_at_cap_1 * 1e3:.0f} ms, predictions 62-82 ms)"
    assert L.sweep_check(records, model="m") == said


@pytest.mark.parametrize(("waited", "step", "note"), [
    (0.45, 0.050, True),    # below perfect overlap on a machine whose cores others held: said why
    (0.05, 0.050, False),   # below it on a quiet machine: nothing to blame
    (0.45, 0.070, False),   # between the bounds: True, with nothing to add
])
def test_check_says_when_other_programs_held_the_cores(waited, step, note):
    records = sweep_records({1: step}, alone={1: [0.010] * 3})
    records[0]["waited_share"] = waited
    said = L.sweep_check(records, model="m")
    assert said.split("(each widened by 10%): ")[1].startswith("True" if step == 0.070 else "False")
    assert ("the ranks waited for a core 45% of their compute" in said) is note


def test_check_without_any_cap_of_several_buckets_is_false():
    records = sweep_records({16: 0.08}, alone={16: [0.030]})
    assert L.sweep_check(records, model="m").endswith(": False")


def test_sweep_table_has_one_unit_per_column():
    records = sweep_records({2**-12: 0.2, 1: 0.07}, alone={2**-12: [0.001] * 40, 1: [0.010] * 3})
    table = L.sweep_table(records, AlphaBeta(alpha_s=200e-6, beta_Bps=50e6))
    header, _, *rows = table.splitlines()
    assert "(ms)" in header and "(MiB)" in header
    assert "µs" not in table and " s " not in table
    assert rows[0].split()[1] == "1/4096" and rows[0].split()[3] == "8.0"  # 40 x 0.2 ms
    assert rows[1].split()[-1] == f"{(0.082 - 0.07) / 0.03:.0%}"  # hidden share


def test_series_for_the_plot():
    records = sweep_records({1: 0.07, 4: 0.08}, alone={1: [0.010] * 3, 4: [0.030]})
    measured, perfect, none, floor = L.sweep_series(records)
    assert measured == {"m": ([1, 4], [0.07, 0.08])}
    assert perfect["m"][1] == pytest.approx([0.062, 0.082]) and none["m"][1] == pytest.approx([0.082, 0.082])
    assert floor == {"m": pytest.approx(0.052)}


def _named(records, model):
    return [{**r, "model": model} for r in records]


def test_the_curves_ends_are_read_as_the_text_says_and_can_be_denied():
    # deep256: one bucket of 16 MiB at 0.20 s; several buckets faster (True) or not (False)
    one = {16: [0.030]}

    def claims(step_at_1, small_step):
        deep = _named(sweep_records({1: step_at_1, 16: 0.20}, alone={1: [0.010] * 3, **one}), "deep256")
        small = _named(sweep_records({2**-12: small_step}, alone={2**-12: [0.001] * 40}), "deep96x64")
        return L.sweep_claims(deep + small).splitlines()

    assert [line.rsplit(": ", 1)[1] for line in claims(0.07, 0.2)] == ["True", "True"]
    # the step at 1 MiB above the one bucket's; the small cap's step under no overlap (0.092)
    assert [line.rsplit(": ", 1)[1] for line in claims(0.21, 0.08)] == ["False", "False"]


def test_the_curves_ends_are_read_round_by_round_not_from_one_lucky_step():
    """sweep.py runs every setting once per round; a claim holds when it holds in most
    rounds, so that one fast (or slow) step of either side cannot decide it."""
    def claims(step_at_1, one_bucket, small_step):
        deep = _named(sweep_records({1: step_at_1, 16: one_bucket},
                                    alone={1: [0.010] * 3, 16: [0.030]}), "deep256")
        small = _named(sweep_records({2**-12: small_step}, alone={2**-12: [0.001] * 40}), "deep96x64")
        return [line.rsplit(": ", 1)[1] for line in L.sweep_claims(deep + small).splitlines()]

    # no overlap predicted for deep96x64: 0.052 s of compute + 40 x 1 ms = 0.092 s
    assert claims([0.15, 0.22, 0.18], [0.20, 0.21, 0.20], [0.10, 0.09, 0.12]) == ["True", "True"]
    # the fastest steps say the opposite of most rounds: a lucky step on either side
    assert claims([0.15, 0.22, 0.21], [0.20, 0.20, 0.20], [0.09, 0.08, 0.12]) == ["False", "False"]
    assert claims([0.19, 0.19, 0.19], [0.18, 0.20, 0.20], [0.08, 0.095, 0.10]) == ["True", "True"]
    # a tie in a round is not faster; half the rounds are not most
    assert claims([0.20, 0.19, 0.21, 0.19], [0.20, 0.20, 0.20, 0.20], [0.08] * 3) == ["False", "False"]


def test_the_timeline_claims_say_false_when_nothing_overlaps():
    def lanes(buckets, hidden):
        return {"marks": {"last gradient ready": 1.0}, "buckets": buckets, "hidden_s": hidden, "comm_s": 0.4}

    overlapping = lanes([(0, 0.5, 0.7), (1, 0.8, 1.1), (2, 1.0, 1.2)], hidden=0.3)
    assert L.overlap_claims(overlapping).count(": True") == 4
    after = lanes([(0, 1.01, 1.1), (1, 1.1, 1.2), (2, 1.2, 1.3)], hidden=0.0)
    assert [line.rsplit(": ", 1)[1] for line in L.overlap_claims(after).splitlines()] == \
        ["False", "True", "True", "False"]
    # the link the faster side: the earlier buckets are done before the computing ends
    done = lanes([(0, 0.5, 0.7), (1, 0.7, 0.9), (2, 1.0, 1.2)], hidden=0.4)
    assert "still on the wire (backward waits for it too): False" in L.overlap_claims(done)


# --------------------------------------------------------------------- buckets

@pytest.mark.parametrize(
    ("params", "text"),
    [(["fc5.bias", "fc5.weight", "fc4.bias", "fc4.weight"], "fc5, fc4"),
     (["fc1.bias", "fc2.weight", "fc2.bias"], "fc1.bias, fc2"),
     (["fc1.weight"], "fc1.weight")],
)
def test_members_names_partial_layers(params, text):
    assert L.members(params) == text


def buckets_record(cap: str, rebuilt: list[list[str]]) -> dict:
    ready = ["fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]
    sizes = {"fc3.bias": 40, "fc3.weight": 2 * MiB, "fc2.bias": 4096, "fc2.weight": 4 * MiB,
             "fc1.bias": 4096, "fc1.weight": MiB}
    return {"part": "buckets", "cap": cap, "calls": [],
            "logging": {"ready_order": ready, "param_bytes": sizes, "bucket_cap_bytes": 25 * MiB,
                        "rebuilt_params": rebuilt}}


def test_predictions_with_the_small_cap_first_or_last():
    first = buckets_record("default", [["fc3.bias", "fc3.weight"],
                                       ["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]])
    # DDP_SET_LAST_BUCKET_CAP=1: walked from the end, fc1.weight (1 MiB) closes a bucket
    last = buckets_record("default+last", [["fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"],
                                           ["fc1.weight"]])
    lines = L.bucket_predictions([first, last]).splitlines()
    assert lines[0].endswith("predicted fc3 | fc2, fc1  -> matches DDP")
    assert lines[1].endswith("predicted fc1.bias, fc2, fc3 | fc1.weight  -> matches DDP")
    wrong = buckets_record("default+last", first["logging"]["rebuilt_params"])
    assert L.bucket_predictions([wrong]).endswith("DIFFERS from DDP")


def test_bucket_table_shows_iterations_0_and_1_and_says_whether_2_repeats():
    call = {"index": 0, "nbytes": 11 * MiB, "params": ["fc1.weight", "fc1.bias"]}
    rec = {"part": "buckets", "cap": "25", "calls": [{**call, "iteration": it} for it in range(3)]}
    table = L.bucket_table([rec])
    assert table.count("25 MiB") == 2 and "11.0" in table
    assert table.endswith("under every setting: True")
    rec["calls"][2] = {**call, "iteration": 2, "index": 1}
    assert L.bucket_table([rec]).endswith(": False")


# --------------------------------------------------------------------- PowerSGD race

def race_run(tmp_path: Path, *, stdout: dict[int, str], hang: bool, stderr: str = ""):
    ranks = [SimpleNamespace(rank=r, stdout=out, stderr=stderr) for r, out in stdout.items()]
    hang_info = SimpleNamespace(calls={r: "backward" for r in stdout}) if hang else None
    failure = None if hang else SimpleNamespace(rank=1, exc_type="SIGABRT")
    return SimpleNamespace(ranks=ranks, hang=hang_info, failure=failure, log_dir=tmp_path,
                           reason="hang" if hang else "failed")


def test_race_report_of_a_hang_names_the_blocked_callbacks(tmp_path):
    out = ("all_reduce of  1546 floats from thread MainThread\n"
           "all_reduce of  3092 floats from thread Dummy-1\n"
           "all_reduce of  2048 floats from thread Dummy-2\n")
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "stacks.txt").write_text(
            'Thread 0x1 (most recent call first):\n'
            '  File "/x/torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py", line 589 '
            'in unpack_uncompressed_tensors_and_allreduce_ps\n\n'
            'Thread 0x2 (most recent call first):\n'
            '  File "/x/powerSGD_hook.py", line 611 in compute_qs\n\n'
            'Current thread 0x3 (most recent call first):\n'
            '  File "/x/comm_hooks.py", line 104 in train\n')
    report = L.race_report(race_run(tmp_path, stdout={0: out, 1: out}, hang=True))
    assert "rank 0: 1546 3092* 2048*" in report
    assert "the first 3 calls match in size on every rank" in report
    assert "main threads wait in backward()" in report
    assert ("rank 1: 2 thread(s) blocked inside PowerSGD's callbacks: "
            "unpack_uncompressed_tensors_and_allreduce_ps (line 589), compute_qs (line 611)") in report


def test_race_report_of_a_mismatch_quotes_gloo_without_build_paths(tmp_path):
    stderr = ("  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
              "pair.cc:456] op.preamble.length <= op.nbytes. 3092 vs 1024. Received data size "
              "doesn't match expected size.\n")
    report = L.race_report(race_run(tmp_path, hang=False, stderr=stderr, stdout={
        0: "all_reduce of  3092 floats from thread Dummy-1\n",
        1: "all_reduce of  1024 floats from thread MainThread\n"}))
    assert "call 1: rank 0 sends 3092 floats, rank 1 sends 1024 floats: a mismatch" in report
    assert "outcome: rank 1 died (SIGABRT)" in report
    assert "gloo said: op.preamble.length <= op.nbytes. 3092 vs 1024." in report
    assert "/__w/" not in report


# --------------------------------------------------------------------- other tables

def test_hooks_table_has_one_unit_per_column():
    recs = [{"part": "hooks", "hook": "allreduce", "bucket_cap_mb": 4, "bytes_per_step": [11 * MiB] * 2,
             "grad_rel_error": 0.0, "weights_max_diff": 0.0, "seconds": 0.0987},
            {"part": "hooks", "hook": "PowerSGD", "bucket_cap_mb": 64, "bytes_per_step": [11 * MiB, 73848],
             "grad_rel_error": 0.5, "weights_max_diff": 2e-4, "seconds": 1.17}]
    table = L.hooks_table(recs)
    assert "KiB" not in table and "µs" not in table and " s " not in table
    row = table.splitlines()[3].split()
    assert row[2:5] == ["11.000", "0.070", "156x"] and row[-1] == "1170"


def test_beta_comes_from_the_large_calls_and_alpha_from_the_small_ones():
    """A link capped at 48 MB/s whose HTB burst lets calls under 64 KiB through at
    twice the rate: a fit over every size would put beta above the cap; the lesson's
    model gives the cap and the fixed cost."""
    from labutils.course.timing import fit_alpha_beta

    alpha, cap = 150e-6, 48e6
    sizes = [2**k for k in range(12, 23, 2)]  # sweep.py's: 4 KiB .. 4 MiB
    times = [alpha + x / (2 * cap if x < 64 << 10 else cap) for x in sizes]
    fit, got_sizes, got_times = L.alpha_beta_fit([{"part": "alpha_beta", "nbytes": sizes,
                                                   "seconds": times}])
    assert (got_sizes, got_times) == (sizes, times)
    assert fit.beta_Bps == pytest.approx(cap, rel=1e-6)
    assert fit.alpha_s == pytest.approx(alpha + (4096 + 16384) / 2 * (1 / (2 * cap) - 1 / cap))
    assert fit_alpha_beta(sizes, times).beta_Bps > 1.02 * cap  # what the lesson avoids


def test_deep256_makes_24_buckets_at_a_quarter_mib_and_48_under_1_kib():
    """Section 4's reading of the sweep: DDP's rule on deep256's gradients in the order
    backward makes them ready (per layer, the bias before the weight, last layer first)."""
    import sys

    from labutils.course.ddp_probes import predict_buckets

    sys.path.insert(0, str(LESSON))
    try:
        from models import make_mlp, linear_layers
    finally:
        sys.path.remove(str(LESSON))
    layers = list(linear_layers(make_mlp("deep256")).values())[::-1]
    sizes = [t.numel() * t.element_size() for layer in layers for t in (layer.bias, layer.weight)]
    assert len(sizes) == 48
    assert len(predict_buckets(sizes, cap_bytes=MiB // 4)) == 24
    assert len(predict_buckets(sizes, cap_bytes=512)) == 48
