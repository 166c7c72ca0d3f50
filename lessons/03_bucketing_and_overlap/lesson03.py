"""Helpers for the lesson 03 notebook: tables of the runs' records, plot inputs, the self-check.

The rank scripts (buckets.py, sweep.py, accumulation.py, ddp_options.py, unused.py,
comm_hooks.py) do not import this module; only the notebook does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from statistics import median

from labutils.course import selfcheck
from labutils.course.ddp_probes import predict_buckets
from labutils.course.spans import busy_seconds, overlap_seconds, trace_spans
from labutils.course.tables import text_table
from labutils.course.timing import AlphaBeta, fit_alpha_beta, format_bytes

from powersgd_race import first_difference, issue_orders, race_report  # noqa: F401  (the notebook's L.race_report)

MiB = 2**20
FIRST_BUCKET_BYTES = 2**20  # DDP's small first bucket, used only when bucket_cap_mb is unset


def _part(records: Iterable[dict], part: str) -> list[dict]:
    return [r for r in records if r.get("part") == part]


def members(params: list[str]) -> str:
    """The layers of a bucket's parameter names, in order: ["fc5.bias", "fc5.weight",
    "fc4.bias", "fc4.weight"] -> "fc5, fc4"; a layer with only some of its tensors in the
    list is named with them ("fc1.bias").

    Args:
        params: parameter names, as BucketRecorder and reducer_buckets give them.
    """
    layers: dict[str, list[str]] = {}
    for name in params:
        layer, _, tensor = name.rpartition(".")
        layers.setdefault(layer, []).append(tensor)
    return ", ".join(layer if len(tensors) == 2 else f"{layer}.{'+'.join(tensors)}"
                     for layer, tensors in layers.items())


def cap_label(cap: str) -> str:
    """buckets.py's cap names as the tables print them."""
    if cap == "default":
        return "unset (25 MiB)"
    if cap == "default+last":
        return "unset, LAST_BUCKET_CAP"
    return f"{float(cap):g} MiB"


# ------------------------------------------------------------------ 2. buckets

def bucket_table(records: Iterable[dict]) -> str:
    """Per cap, iterations 0 and 1: each bucket the hook saw, its size and its layers;
    then whether iteration 2 repeated iteration 1's buckets under every cap."""
    rows, same = [], True
    for rec in _part(records, "buckets"):
        calls = {it: [(c["index"], c["nbytes"], c["params"]) for c in rec["calls"] if c["iteration"] == it]
                 for it in (1, 2)}
        same = same and calls[1] == calls[2]
        for call in rec["calls"]:
            if call["iteration"] < 2:
                rows.append([cap_label(rec["cap"]), call["iteration"], call["index"],
                             f"{call['nbytes'] / MiB:.1f}", members(call["params"])])
    table = text_table(["bucket_cap_mb", "iteration", "bucket", "size (MiB)", "layers (in bucket order)"],
                       rows, right=[1, 2, 3])
    return f"{table}\niteration 2 has the same buckets as iteration 1 under every setting: {same}"


def bucket_predictions(records: Iterable[dict]) -> str:
    """DDP's rebuilt buckets against predict_buckets() on the gradient-ready order.

    With DDP_SET_LAST_BUCKET_CAP=1 the reducer walks the ready order backwards, so the
    small cap goes to the bucket that is ready last; the buckets are then put back in
    ready order.
    """
    lines = []
    for rec in _part(records, "buckets"):
        log = rec["logging"]
        order = log["ready_order"]
        last = rec["cap"] == "default+last"
        if last:
            order = order[::-1]
        sizes = [log["param_bytes"][name] for name in order]
        cap = log["bucket_cap_bytes"]
        first = FIRST_BUCKET_BYTES if rec["cap"].startswith("default") else None
        predicted = [[order[i] for i in bucket] for bucket in predict_buckets(sizes, cap_bytes=cap, first_cap_bytes=first)]
        if last:
            predicted = predicted[::-1]
        verdict = "matches DDP" if predicted == log["rebuilt_params"] else "DIFFERS from DDP"
        lines.append(f"cap {cap_label(rec['cap']):>22}: predicted {' | '.join(members(b) for b in predicted)}"
                     f"  -> {verdict}")
    return "\n".join(lines)


def bucket_sizes_for_plot(records: Iterable[dict]) -> tuple[dict, dict, dict]:
    """(buckets, caps, labels) for plots.plot_bucket_sizes: first iteration and each cap."""
    recs = _part(records, "buckets")
    buckets, caps, labels = {}, {}, {}
    first = recs[0]["logging"]
    buckets["iteration 0 (any cap)"] = first["initial_sizes"]
    labels["iteration 0 (any cap)"] = ["all 10 gradients"]
    for rec in recs:
        key = f"cap {cap_label(rec['cap'])}"
        buckets[key] = rec["logging"]["rebuilt_sizes"]
        caps[key] = rec["logging"]["bucket_cap_bytes"]
        labels[key] = [members(b) for b in rec["logging"]["rebuilt_params"]]
    return buckets, caps, labels


# ------------------------------------------------------------------ 3. overlap

def timeline_lanes(record: dict, *, iteration: int) -> dict:
    """One recorded backward of buckets.py (part="timeline") as plot inputs and numbers.

    The compute window runs from the call of loss.backward() to the last gradient
    stored; communication inside it was hidden behind compute, the rest was not.
    """
    layers = [s for s in record["layers"] if s["iteration"] == iteration]
    buckets = [b for b in record["buckets"] if b["iteration"] == iteration and b["end_s"] is not None]
    start, end = record["backward"][iteration - min(s["iteration"] for s in record["layers"])]
    compute = {f"backward {s['name']}": [(s["start_s"], s["end_s"])] for s in layers}
    comm = {f"bucket {b['index']}: {format_bytes(b['nbytes'])} ({members(b['params'])})":
            [(b["start_s"], b["end_s"])] for b in buckets}
    compute_end = max(s["end_s"] for s in layers)
    comm_spans = [span for spans in comm.values() for span in spans]
    return {
        "compute": compute, "comm": comm, "t0": start,
        "marks": {"last gradient ready": compute_end, "backward() returns": end},
        "backward_s": end - start,
        "compute_s": compute_end - start,
        "comm_s": busy_seconds(comm_spans),
        "hidden_s": overlap_seconds([(start, compute_end)], comm_spans),
        "after_compute_s": end - compute_end,
        "buckets": sorted((b["index"], b["start_s"], b["end_s"]) for b in buckets),
    }


def overlap_claims(lanes: dict) -> str:
    """What section 3's text reads in the timeline: every bucket but the last starts its
    all-reduce while backward still computes, the last one (fc1's) only once the last
    gradient is ready, an earlier one is still in flight when the computing ends (the link
    is the slower side), and a good part of the communication is hidden behind compute."""
    compute_end = lanes["marks"]["last gradient ready"]
    *early, last = lanes["buckets"]
    return "\n".join([
        f"{len(early)} of {len(lanes['buckets'])} buckets start their all-reduce while backward "
        f"still computes: {bool(early) and all(start < compute_end for _, start, _ in early)}",
        "the last bucket's all-reduce starts only when the last gradient is ready (within 5 ms): "
        f"{last[1] >= compute_end - 0.005}",
        "when the computing ends, an earlier bucket is still on the wire (backward waits for it "
        f"too): {any(end > compute_end for _, _, end in early)}",
        "at least a fifth of the communication runs while backward still computes: "
        f"{lanes['hidden_s'] >= 0.2 * lanes['comm_s']}",
    ])


def overlap_summary(lanes: dict, record: dict) -> str:
    """The timeline's numbers, the same backward without communication, and DDP's own
    (sampled) averages for comparison."""
    ms = 1e3
    comm = lanes["comm_s"]
    logging = record["logging"]
    lines = [
        f"loss.backward() took                 {lanes['backward_s'] * ms:7.1f} ms",
        f"  computing, until the last gradient {lanes['compute_s'] * ms:7.1f} ms",
        f"  then waiting for all-reduces       {lanes['after_compute_s'] * ms:7.1f} ms",
        f"some all-reduce in flight            {comm * ms:7.1f} ms (overlapping bars counted once)",
        f"  of it while still computing        {lanes['hidden_s'] * ms:7.1f} ms "
        f"= {lanes['hidden_s'] / comm:.0%} of the communication hidden behind compute",
        f"the same backward under no_sync()    {min(record['backward_alone_s']) * ms:7.1f} ms "
        "(no communication; fastest of "
        f"{len(record['backward_alone_s'])})",
        "",
        "DDP's logging data, averaged over this DDP model's sampled iterations:",
        f"  avg_backward_compute_time              {logging['avg_backward_compute_ns'] / 1e6:7.1f} ms",
        f"  avg_backward_comm_time                 {logging['avg_backward_comm_ns'] / 1e6:7.1f} ms",
        f"  avg_backward_compute_comm_overlap_time {logging['avg_overlap_ns'] / 1e6:7.1f} ms",
    ]
    return "\n".join(lines)


def trace_lanes(path: str | os.PathLike) -> tuple[dict, dict, dict]:
    """(compute, comm, counts) for plot_overlap_timeline from buckets.py's Chrome trace:
    one lane of backward ops, one lane per communication thread."""
    spans = trace_spans(path)
    compute = {"autograd ops (main thread)": [(a, b) for _, a, b in spans["compute"]]}
    comm: dict[str, list] = {}
    for name, a, b, tid in spans["comm"]:
        comm.setdefault(f"{name} (thread {tid})", []).append((a, b))
    counts = {"backward ops": len(spans["compute"]), "all-reduce events": len(spans["comm"])}
    return compute, comm, counts


# ------------------------------------------------------------------ 4. sweep

BETA_FROM = 1 << 20  # beta from the calls of at least 1 MiB


def alpha_beta_fit(records: Iterable[dict]) -> tuple[AlphaBeta, list[int], list[float]]:
    """The alpha-beta model of sweep.py's all_reduce timings (and the points).

    beta from the calls of BETA_FROM bytes and more: an HTB class lets a burst of some
    tens of KiB through at the machine's own speed before its rate applies, so the
    small calls run faster than the cap, and a fit over every size (which weighs each
    size's relative error alike) would put beta above the link's rate. alpha is then
    what is left of the small calls (under 64 KiB) once their bytes are paid at beta:
    the median of t - bytes / beta.
    """
    rec = _part(records, "alpha_beta")[0]
    sizes, times = rec["nbytes"], rec["seconds"]
    big = [(x, t) for x, t in zip(sizes, times) if x >= BETA_FROM]
    beta = fit_alpha_beta([x for x, _ in big], [t for _, t in big]).beta_Bps
    alpha = max(0.0, median(t - x / beta for x, t in zip(sizes, times) if x < 64 << 10))
    return AlphaBeta(alpha_s=alpha, beta_Bps=beta), sizes, times


def cap_mib(cap: float) -> str:
    """A cap in MiB as the sweep plot labels it: 0.25 -> "1/4", 4 -> "4"."""
    return f"1/{1 / cap:g}" if cap < 1 else f"{cap:g}"


def sweep_bounds(records: Iterable[dict]) -> list[dict]:
    """Per model and cap of sweep.py: the measured step and the two predictions.

    From the parts measured alone: F, B, O = forward, backward and optimizer step of
    the same model under no_sync() (no communication); A_k = one plain all_reduce of
    bucket k's size, on the same link. Then

        no overlap      = F + B + O + sum(A_k)        every all-reduce adds to the step
        perfect overlap = F + O + max(B + A_last, sum(A_k))

    Perfect overlap: every all-reduce but the last runs while backward computes, and
    the last bucket cannot start before backward ends; unless the all-reduces take
    longer than the backward, then the link is busy back to back and they set the time.
    """
    compute = {r["model"]: r for r in _part(records, "compute")}
    rows = []
    for rec in _part(records, "sweep"):
        c = compute[rec["model"]]
        alone = rec["alone_s"]
        rows.append({
            "model": rec["model"], "cap_mb": rec["cap_mb"], "bucket_sizes": rec["bucket_sizes"],
            "buckets": len(rec["bucket_sizes"]), "measured_s": rec["seconds"], "rounds_s": rec["round_s"],
            "compute_s": c["forward_s"] + c["backward_s"] + c["optimizer_s"],
            "backward_s": c["backward_s"], "comm_s": sum(alone), "last_s": alone[-1],
            "perfect_s": c["forward_s"] + c["optimizer_s"] + max(c["backward_s"] + alone[-1], sum(alone)),
            "none_s": c["forward_s"] + c["backward_s"] + c["optimizer_s"] + sum(alone),
        })
    return rows


def sweep_series(records: Iterable[dict]) -> tuple[dict, dict, dict, dict]:
    """(measured, perfect, none, compute_only) for plots.plot_bucket_sweep, caps in MiB."""
    measured, perfect, none, floor = {}, {}, {}, {}
    for row in sweep_bounds(records):
        for series, key in ((measured, "measured_s"), (perfect, "perfect_s"), (none, "none_s")):
            caps, secs = series.setdefault(row["model"], ([], []))
            caps.append(row["cap_mb"])
            secs.append(row[key])
        floor[row["model"]] = row["compute_s"]
    return measured, perfect, none, floor


def sweep_table(records: Iterable[dict], fit: AlphaBeta) -> str:
    """Per model and cap: buckets, the alpha-beta terms, both predictions and the step."""
    ms = 1e3
    rows = []
    for r in sweep_bounds(records):
        last = r["bucket_sizes"][-1]
        rows.append([r["model"], cap_mib(r["cap_mb"]), r["buckets"], f"{r['buckets'] * fit.alpha_s * ms:.1f}",
                     f"{last / MiB:.2f}", f"{fit.predict(last) * ms:.1f}", f"{r['comm_s'] * ms:.0f}",
                     f"{r['perfect_s'] * ms:.0f}", f"{r['measured_s'] * ms:.0f}", f"{r['none_s'] * ms:.0f}",
                     f"{round((r['none_s'] - r['measured_s']) / r['comm_s'], 2) + 0.0:.0%}"])  # no "-0%"
    return text_table(["model", "cap (MiB)", "buckets", "buckets x alpha (ms)", "last bucket (MiB)",
                       "its all-reduce (ms)", "all-reduces alone (ms)", "perfect overlap (ms)",
                       "step (ms)", "no overlap (ms)", "hidden"], rows, right=list(range(1, 11)))


def sweep_check(records: Iterable[dict], *, model: str, slack: float = 0.1) -> str:
    """Is the model's measured step between the two predictions at every cap that makes
    2 or more buckets (with one bucket nothing can overlap: the predictions coincide)?

    Each bound is widened by ``slack`` (a share of it): the step and the parts are timed
    apart, each the fastest of a few tries, and on a shared 2-core machine repeated runs
    of sweep.py put the same step up to several percent either side of its bounds'
    ratio. The gap between the bounds (the all-reduces' time) is several times larger.

    Both predictions assume a core per rank. Where other programs held the cores, so
    that the ranks' steps without communication waited for one a fifth of their time or
    more, a False says so: the scheduler then gives a rank that often sleeps on the
    network more of a core than one that only computes, and DDP's steps of many buckets
    came out faster than the compute alone (beside two busy processes on two cores:
    cap 1/4 MiB, steps 581-614 ms against compute alone 696-720 ms)."""
    several = [r for r in sweep_bounds(records) if r["model"] == model and r["buckets"] >= 2]
    caps = ", ".join(cap_mib(r["cap_mb"]) for r in several)
    outside = [f"cap {cap_mib(r['cap_mb'])} MiB: step {r['measured_s'] * 1e3:.0f} ms, predictions "
               f"{r['perfect_s'] * 1e3:.0f}-{r['none_s'] * 1e3:.0f} ms"
               for r in several
               if not r["perfect_s"] * (1 - slack) <= r["measured_s"] <= r["none_s"] * (1 + slack)]
    ok = bool(several) and not outside
    waited = next((r.get("waited_share") for r in _part(records, "compute") if r["model"] == model), None)
    if outside and waited is not None and waited >= 0.2:
        outside.append(f"the ranks waited for a core {waited:.0%} of their compute: other programs "
                       "held the cores, and the predictions assume a core per rank")
    return (f"{model}, caps {caps} MiB (2+ buckets): step time between the two predictions "
            f"(each widened by {slack:.0%}): {ok}" + (f" ({'; '.join(outside)})" if outside else ""))


def most_rounds(won: Iterable[bool]) -> bool:
    """More than half of the rounds (a list of one bool per round) said True."""
    won = list(won)
    return 2 * sum(won) > len(won)


def sweep_claims(records: Iterable[dict]) -> str:
    """The two ends of the curves, as the text after the plot reads them, each round by
    round (a round runs every setting once, back to back, so that a slow moment of the
    machine slows the steps compared alike): with a cap that makes several buckets
    deep256 steps faster than with its one bucket in the same round (the last bucket
    shrinks), and deep96x64 with one bucket per tensor steps slower than even the
    no-overlap prediction (a bucket costs DDP more than a bare all_reduce). Each holds
    when it holds in most rounds: under load a round can go either way."""
    rows = sweep_bounds(records)
    deep = [r for r in rows if r["model"] == "deep256"]
    one = [r for r in deep if r["buckets"] == 1]
    several = [r for r in deep if r["buckets"] >= 2]
    faster = bool(one and several) and all(
        most_rounds(a < b for a, b in zip(r["rounds_s"], one[0]["rounds_s"], strict=True)) for r in several)
    small = max((r for r in rows if r["model"] == "deep96x64"), key=lambda r: r["buckets"], default=None)
    slower = small is not None and most_rounds(t > small["none_s"] for t in small["rounds_s"])
    return "\n".join([
        f"deep256: every cap that makes 2+ buckets steps faster than its one bucket, in most rounds: {faster}",
        "deep96x64, one bucket per tensor: the step is slower than the no-overlap prediction, "
        f"in most rounds: {slower}",
    ])


# ------------------------------------------------------------------ 5-6. accumulation, options

def accumulation_table(records: Iterable[dict]) -> str:
    """Per way of writing the micro-steps: all-reduces per optimizer step, correctness."""
    rows = []
    for rec in _part(records, "accumulation"):
        if rec["rank"] == 0:
            rows.append([rec["way"], rec["all_reduces_per_step"],
                         "equal (assert_close)" if rec["equal_to_reference"] else "DIFFERENT",
                         rec["same_on_all_ranks"]])
    return text_table(["micro-step loop", "all-reduces per step", "weights vs one big batch",
                       "same on all ranks"], rows)


def options_table(records: Iterable[dict], *, with_time: bool) -> str:
    """Per DDP setting: buckets, where .grad lives, gradient memory (and step time)."""
    rows = []
    for rec in _part(records, "options"):
        row = [rec["setting"], rec["initial_buckets"], rec["rebuilt_buckets"], rec["grads_in_buckets"],
               f"{rec['gradient_mib']:.1f}"]
        if with_time:
            row.append(f"{rec['seconds'] * 1e3:.0f}")
        rows.append(row)
    header = ["setting", "buckets at start", "buckets rebuilt", ".grad views into buckets",
              "gradient memory (MiB)"] + (["step time (ms)"] if with_time else [])
    return text_table(header, rows, right=[1, 2, 4] + ([5] if with_time else []))


def unused_table(records: Iterable[dict]) -> str:
    rows = [[r["setting"], r["who_skips"], r["steps"], r["same_on_all_ranks"]]
            for r in _part(records, "unused")]
    return text_table(["setting", "branch skipped by", "steps done", "same weights on all ranks"], rows)


_INDICES_RE = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def unused_indices(stderr: str) -> tuple[int, list[int]] | None:
    """(rank, indices) from DDP's "did not receive grad" message, or None."""
    m = _INDICES_RE.search(stderr)
    return (int(m.group(1)), [int(i) for i in m.group(2).split()]) if m else None


# ------------------------------------------------------------------ 7. hooks

def hooks_table(records: Iterable[dict]) -> str:
    """Per hook: bytes all-reduced per step (first and last step), error and the median
    time of forward and backward."""
    rows = []
    base = None
    for rec in _part(records, "hooks"):
        sent = rec["bytes_per_step"]
        base = base or sent[-1]
        rows.append([rec["hook"], rec["bucket_cap_mb"], f"{sent[0] / MiB:.3f}", f"{sent[-1] / MiB:.3f}",
                     f"{base / sent[-1]:.0f}x", f"{rec['grad_rel_error']:.1e}",
                     f"{rec['weights_max_diff']:.1e}", f"{rec['seconds'] * 1e3:.0f}"])
    return text_table(["hook", "cap (MiB)", "sent, step 0 (MiB)", "sent, last step (MiB)", "less",
                       "gradient error", "weights vs allreduce", "forward + backward (ms)"], rows,
                      right=[1, 2, 3, 4, 5, 6, 7])


# ------------------------------------------------------------------ 8. self-check

def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (answers left as None are skipped)."""
    expected = {
        "q1_buckets_first_iteration": (1, "find_unused_parameters=False: one bucket with every gradient"),
        "q2_buckets_for_3_3_3_3_mib_cap_4": (2, "a bucket closes once it holds >= the cap: 3+3, then 3+3"),
        "q3_all_reduces_8_micro_3_buckets": (3, "no_sync around forward and backward: only the last micro-step syncs"),
        "q4_all_reduces_forward_outside": (24, "the forward decides: every micro-step syncs, 3 buckets each"),
        "q5_fp16_mib_sent_for_100_mib": (50, "fp16 is 2 bytes per value instead of 4"),
        "q6_hang_rank_waits_in": ("backward", "DDP's all-reduces run inside loss.backward()"),
    }
    selfcheck.check_answers(answers, expected, text="contains")

__all__ = [
    "bucket_table", "bucket_predictions", "bucket_sizes_for_plot", "timeline_lanes",
    "overlap_summary", "trace_lanes", "alpha_beta_fit", "sweep_bounds", "sweep_series", "sweep_table",
    "sweep_check", "cap_mib",
    "accumulation_table", "options_table", "unused_table", "unused_indices", "hooks_table",
    "issue_orders", "first_difference", "race_report", "check_answers", "cap_label",
]
