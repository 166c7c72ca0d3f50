"""Lesson 13's tables, checks and debug-server helpers, from the records of its scripts.

    from labutils.course import lesson
    L = lesson.load("13_where_time_goes", "lesson13")

Every rank of step.py writes a torch.profiler trace and the wall-clock time of its "clock"
span; the traces are put on one clock (labutils.course.spans.trace_events) and each
profiled step is cut into: the rank's own work (the "data", "forward" and "optimizer"
spans and every backward op the autograd engine ran), the time an all-reduce was in
flight, and the exposed communication: in flight while the rank did no work of its own.
"""

from __future__ import annotations

import json
import re
import socket
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from labutils.course import selfcheck
from labutils.course.spans import busy_seconds, is_comm, merge_traces, overlap_seconds, trace_events
from labutils.course.tables import text_table

OWN_WORK = ("data", "forward", "optimizer")
BACKWARD_OP = "autograd::engine::evaluate_function: "
STEP = re.compile(r"step (\d+)$")


def _traces(run) -> dict[int, tuple[str, int]]:
    """{rank: (trace path, clock_ns)} from step.py's records."""
    return {r["rank"]: (r["path"], r["clock_ns"]) for r in run.records if r.get("part") == "trace"}


def _facts(run) -> dict:
    return next(r for r in run.records if r.get("part") == "trace")


def merged_trace(run, name: str = "all_ranks_trace.json") -> Path:
    """Every rank's trace on one clock, one process per rank, written into the run folder."""
    return merge_traces(_traces(run), Path(run.log_dir) / name)


def _clip(spans, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


def rank_steps(run) -> dict[int, list[dict]]:
    """Per rank, per profiled step: start and end (wall clock, s), and in seconds the
    step, the rank's own work, the all-reduces in flight and the exposed part of them;
    with the spans, for plots: work {phase: spans} and comm spans."""
    out = {}
    for rank, (path, clock_ns) in sorted(_traces(run).items()):
        events = trace_events(path, marker=("clock", clock_ns))
        steps = []
        for step in (e for e in events if STEP.match(e["name"])):
            lo, hi = step["start"], step["end"]
            work = {phase: _clip([(e["start"], e["end"]) for e in events if e["name"] == phase], lo, hi)
                    for phase in OWN_WORK}
            work["backward ops"] = _clip([(e["start"], e["end"]) for e in events
                                          if e["name"].startswith(BACKWARD_OP)], lo, hi)
            comm = _clip([(e["start"], e["end"]) for e in events if is_comm(e["name"])], lo, hi)
            own = [span for spans in work.values() for span in spans]
            in_flight = busy_seconds(comm)
            steps.append({"start": lo, "end": hi, "step": hi - lo, "own": busy_seconds(own),
                          "comm": in_flight, "exposed": in_flight - overlap_seconds(own, comm),
                          "work": work, "comm_spans": comm})
        out[rank] = steps
    return out


def _median(steps: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in steps)


def step_table(runs: dict) -> str:
    """One row per run and rank: the median over the profiled steps, in ms, and the
    exposed communication as a share of the step."""
    rows = []
    for label, run in runs.items():
        for rank, steps in rank_steps(run).items():
            step, exposed = _median(steps, "step"), _median(steps, "exposed")
            rows.append([label, rank, f"{step * 1e3:.0f}", f"{_median(steps, 'own') * 1e3:.0f}",
                         f"{_median(steps, 'comm') * 1e3:.0f}", f"{exposed * 1e3:.0f}",
                         f"{exposed / step:.0%}"])
    return text_table(["run", "rank", "step ms", "own work ms", "all-reduce in flight ms", "exposed ms",
                       "exposed share"], rows, right=(1, 2, 3, 4, 5, 6))


def exposed_share(run) -> float:
    """The exposed communication as a share of the step: the median over steps and ranks."""
    return statistics.median(s["exposed"] / s["step"] for steps in rank_steps(run).values() for s in steps)


def exposure_line(one_bucket, buckets) -> str:
    """The exposed share of the step, one bucket against many, in one line."""
    return (f"exposed communication, share of the step: one bucket {exposed_share(one_bucket):.0%}, "
            f"{_facts(buckets)['bucket_mb']:g} MiB buckets {exposed_share(buckets):.0%}")


def buckets_line(*runs) -> str:
    """How many buckets DDP's reducer made in each run (step.py reports it), in one line."""
    return "DDP's buckets: " + ", ".join(
        f"bucket_cap_mb={_facts(run)['bucket_mb']:g}: {_facts(run)['buckets']}" for run in runs)


def overlap_claims(one_bucket, buckets) -> str:
    """What changed when the gradients travel in many buckets instead of one: checks that
    hold on a slow or a fast machine (how much is hidden depends on how long backward
    computes against how long the bytes travel)."""
    def starts_in_backward(s: dict) -> bool:
        return bool(s["comm_spans"] and s["work"]["backward ops"]) and \
            min(a for a, _ in s["comm_spans"]) < max(b for _, b in s["work"]["backward ops"])

    many = [s for steps in rank_steps(buckets).values() for s in steps]
    one = [s for steps in rank_steps(one_bucket).values() for s in steps]
    hidden_one = sum(overlap_seconds(s["work"]["backward ops"], s["comm_spans"]) for s in one)
    exposed_one = statistics.median(s["exposed"] for s in one)
    exposed_many = statistics.median(s["exposed"] for s in many)
    mb = _facts(buckets)["bucket_mb"]
    return "\n".join([
        f"one bucket: its all-reduce runs after backward, hardly any of it beside a backward op "
        f"(< 5%): {hidden_one < 0.05 * sum(s['comm'] for s in one)}",
        f"{mb:g} MiB buckets: the first all-reduce of every step starts before backward's last op ends, "
        f"on every rank: {all(starts_in_backward(s) for s in many)}",
        f"{mb:g} MiB buckets: the exposed time per step is at least a fifth shorter: "
        f"{exposed_many <= 0.8 * exposed_one}",
    ])


def straggler_table(run) -> str:
    """Per rank: the median step, own work and time waiting in all-reduces (exposed), in ms."""
    rows = [[rank, f"{_median(steps, 'step') * 1e3:.0f}", f"{_median(steps, 'own') * 1e3:.0f}",
             f"{_median(steps, 'exposed') * 1e3:.0f}"] for rank, steps in rank_steps(run).items()]
    return text_table(["rank", "step ms", "own work ms", "waiting in all-reduce ms"], rows, right=(0, 1, 2, 3))


def straggler_claims(run) -> str:
    """The slowed rank, found from the per-rank steps, against the one step.py slowed."""
    facts = _facts(run)
    steps = rank_steps(run)
    own = {rank: _median(s, "own") for rank, s in steps.items()}
    wait = {rank: _median(s, "exposed") for rank, s in steps.items()}
    step = {rank: _median(s, "step") for rank, s in steps.items()}
    slowest = max(own, key=own.get)
    others = [r for r in steps if r != slowest]
    slow_s = facts["slow_ms"] / 1e3
    return "\n".join([
        f"every rank's step takes the same time, within 10%: {max(step.values()) <= 1.1 * min(step.values())}",
        f"the rank with the most work of its own is rank {slowest}, the one slowed: {slowest == facts['slow_rank']}",
        f"it waits least in all-reduce: {all(wait[slowest] < wait[r] for r in others)}",
        f"the others wait at least half the {facts['slow_ms']:g} ms longer than it does: "
        f"{all(wait[r] - wait[slowest] >= slow_s / 2 for r in others)}",
    ])


def timeline_lanes(run, step: int = 1) -> tuple[dict, float]:
    """({rank: {phase: spans, "all-reduce": spans}}, t0) of one profiled step, for plots."""
    lanes, t0 = {}, None
    for rank, steps in rank_steps(run).items():
        s = steps[step]
        lanes[rank] = {**s["work"], "all-reduce": s["comm_spans"]}
        t0 = s["start"] if t0 is None else min(t0, s["start"])
    return lanes, t0


# ------------------------------------------------------------------ the debug server

def free_port() -> int:
    """A TCP port nothing listens on now, for the debug server's page."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _per_rank(page: str) -> dict[int, str]:
    """The debug server's page, cut into each rank's answer (the text under "Rank N: ...")."""
    import html

    return {int(rank): html.unescape(body) for rank, body in
            re.findall(r"<h2>Rank (\d+):[^<]*</h2>\s*<pre>(.*?)</pre>", page, flags=re.S)}


class DebugServerWatch(threading.Thread):
    """Reads the debug server's pages while the job hangs, from the notebook's side.

    Polls http://127.0.0.1:PORT/fr_trace_json until the flight recorder shows one rank
    further on than another (a collective enqueued there and not elsewhere: the job is
    stuck), then reads /stacks. The pages are kept in .pages; .error says what failed."""

    def __init__(self, port: int, *, timeout: float = 60.0) -> None:
        super().__init__(daemon=True)
        self.port, self.timeout = port, timeout
        self.pages: dict[str, str] = {}
        self.error = ""

    def _get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=20) as answer:
            return answer.read().decode()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                page = self._get("/fr_trace_json")
                if len(set(flight_recorder(page).values())) > 1:
                    self.pages = {"/fr_trace_json": page, "/stacks": self._get("/stacks")}
                    return
            except (OSError, ValueError):
                pass  # not up yet, or a rank not answering yet
            time.sleep(0.5)
        self.error = f"the debug server on port {self.port} showed no stuck job within {self.timeout:g} s"


def flight_recorder(page: str) -> dict[int, int]:
    """{rank: the last collective its default group enqueued}, from /fr_trace_json."""
    out = {}
    for rank, body in _per_rank(page).items():
        status = json.loads(body).get("pg_status", {})
        out[rank] = int(status.get("0", {}).get("last_enqueued_collective", -1))
    return out


def script_frames(page: str, script: str) -> dict[int, str]:
    """{rank: 'file:line in function'}: the innermost frame in the script of the thread
    that ran it, from /stacks."""
    out = {}
    for rank, body in _per_rank(page).items():
        frames = re.findall(rf'File "[^"]*{re.escape(script)}", line (\d+) in (\S*)', body)
        if frames:
            line, function = frames[0]
            out[rank] = f"{script}:{line}" + (f" in {function}" if function else "")
    return out


def debug_server_table(pages: dict, script: str) -> str:
    """Per rank: its line in the script (/stacks) and the last collective it enqueued (/fr_trace_json)."""
    frames = script_frames(pages["/stacks"], script)
    recorder = flight_recorder(pages["/fr_trace_json"])
    rows = [[rank, frames.get(rank, "(none)"), recorder[rank]] for rank in sorted(recorder)]
    return text_table(["rank", "its line in the script (/stacks)", "last collective enqueued (/fr_trace_json)"],
                      rows, right=(0, 2))


def debug_server_claims(pages: dict, hang_run, script: str) -> str:
    """The debug server's view against the launcher's hang report of the same run."""
    recorder = flight_recorder(pages["/fr_trace_json"])
    behind = min(recorder, key=recorder.get)
    frames = script_frames(pages["/stacks"], script)
    stragglers = hang_run.hang.stragglers if hang_run.hang else []
    report = hang_run.summary()
    same_lines = all(frame.split(" in ")[0] in report for frame in frames.values())
    return "\n".join([
        f"the launcher reported a hang: {hang_run.reason == 'hang'}",
        f"the flight recorder's rank behind (rank {behind}) is the launcher's straggler: {stragglers == [behind]}",
        f"the debug server's lines in the script are the hang report's: {bool(frames) and same_lines}",
    ])


def check_answers(answers: dict) -> None:
    """Print, per question, whether the answer is right (answers left as None are skipped)."""
    expected = {
        "q1_what_exposed_means": ("idle", "communication in flight while the rank does no work of its own: "
                                          "it sits idle"),
        "q2_which_rank_is_the_straggler": ("1", "the rank with the most work of its own waits least"),
        "q3_why_step_times_are_equal": ("all-reduce", "every rank waits in the all-reduce for the slowest"),
    }
    selfcheck.check_answers(answers, expected, text="contains")


__all__ = ["merged_trace", "rank_steps", "step_table", "exposed_share", "exposure_line", "overlap_claims",
           "straggler_table", "straggler_claims", "timeline_lanes", "free_port", "DebugServerWatch", "flight_recorder",
           "script_frames", "debug_server_table", "debug_server_claims", "check_answers"]
