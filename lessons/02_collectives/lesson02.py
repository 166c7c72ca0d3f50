"""Helpers for the lesson 02 notebook: tables of the runs' records, the exercise checks.

The rank scripts (primitives.py, ring_bench.py, ring_deadlock.py, mismatch.py) do
not import this module; only the notebook does.
"""

from __future__ import annotations

import ast
import linecache
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

from labutils import selfcheck
from labutils.tables import text_table
from labutils.timing import (
    algbw, busbw, fit_alpha_beta, format_bytes, format_rate, format_seconds,
)

HERE = Path(__file__).parent


# ------------------------------------------------------------------ 1. primitives

def primitive_tables(records: Iterable[dict]) -> str:
    """One small table per primitive: what each rank held before and after the call."""
    by_op: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        if "before" in rec:
            by_op[rec["op"]].append(rec)
    blocks = []
    for op, recs in by_op.items():
        rows = [[r["rank"], r["before"], r["after"]] for r in sorted(recs, key=lambda r: r["rank"])]
        blocks.append(f"{op}\n" + text_table(["rank", "before", "after"], rows))
    return "\n\n".join(blocks)


def barrier_table(records: Iterable[dict]) -> str:
    """When each rank reached the barrier and when it left, in seconds from the start."""
    rows = [[r["rank"], f"{r['arrived_s']:.2f}", f"{r['left_s']:.2f}"]
            for r in sorted(records, key=lambda r: r["rank"]) if r.get("op") == "barrier"]
    return text_table(["rank", "arrived (s)", "left (s)"], rows, right=[1, 2])


def show_source(name: str, file: str = "ring.py") -> None:
    """Print the source of a top-level function of one of this lesson's files.

    Read from the file rather than imported, so the notebook needs no torch.
    """
    text = (HERE / file).read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            print(ast.get_source_segment(text, node))
            return
    raise LookupError(f"no function {name} in {file}")


_FRAME_RE = re.compile(r'File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>\w+)')


def frame_in(stack: str, file: str) -> str:
    """The innermost frame of a hang report's stack that lies in ``file``, as
    'file:line in func()' followed by the source line."""
    for m in _FRAME_RE.finditer(stack):
        if Path(m["file"]).name == file:
            source = linecache.getline(m["file"], int(m["line"])).strip()
            return f"{file}:{m['line']} in {m['func']}(): {source}"
    return f"(no frame in {file})"


# ------------------------------------------------------------------ 2-3. the ring

def correctness_table(records: Iterable[dict]) -> str:
    """The ring_bench.py checks: which group sizes and element counts matched all_reduce."""
    rows = [[r["group_size"], ", ".join(r["algorithms"]), " ".join(map(str, r["sizes"])),
             r["results_checked"],
             "yes" if r["max_abs_diff"] < 1e-12 else f"max diff {r['max_abs_diff']:g}"]
            for r in sorted((r for r in records if "check" in r), key=lambda r: r["group_size"])]
    return text_table(["ranks", "algorithms", "elements", "results", "equal to dist.all_reduce"],
                      rows, right=[3])


EXPECTED_SENT = {  # bytes a rank sends, as a multiple of the data size, on n ranks
    "ring": ("2(n-1)/n", lambda n, root: 2 * (n - 1) / n),
    "naive ring": ("n-1", lambda n, root: n - 1),
    "reduce+broadcast": ("n-1 at the root, 1 elsewhere", lambda n, root: n - 1 if root else 1),
}


def traffic_table(records: Iterable[dict]) -> str:
    """Bytes each rank sent per algorithm and group size, against the formula."""
    recs = sorted((r for r in records if "traffic" in r),
                  key=lambda r: (r["group_size"], list(EXPECTED_SENT).index(r["traffic"]), r["rank"]))
    rows = []
    for r in recs:
        n, data = r["group_size"], r["data_bytes"]
        formula, factor = EXPECTED_SENT[r["traffic"]]
        rows.append([n, r["traffic"], r["rank"], r["sent"], f"{r['sent'] / data:.3f}",
                     f"{factor(n, r['rank'] == 0):.3f}", formula])
    return text_table(["ranks", "algorithm", "rank", "bytes sent", "sent / data", "expected",
                       "formula"], rows, right=[3, 4, 5])


def traffic_summary(records: Iterable[dict]) -> str:
    """One line per group size: the ring's measured bytes per rank vs 2(n-1)/n."""
    lines = []
    recs = [r for r in records if r.get("traffic") == "ring"]
    for n in sorted({r["group_size"] for r in recs}):
        ratios = [r["sent"] / r["data_bytes"] for r in recs if r["group_size"] == n]
        mean = sum(ratios) / len(ratios)
        want = 2 * (n - 1) / n
        verdict = "matches" if math.isclose(mean, want, rel_tol=1e-3) else "DIFFERS from"
        lines.append(f"{n} ranks: ring sends {mean:.4f} x the data per rank on average, "
                     f"{verdict} 2(n-1)/n = {want:.4f}")
    return "\n".join(lines)


# ------------------------------------------------------------------ 5. bandwidth

def bandwidth_series(records: Iterable[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{algorithm: (sizes in bytes, median seconds per call)} from ring_bench.py's records."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        if "algorithm" in r:
            sizes, times = series.setdefault(r["algorithm"], ([], []))
            sizes.append(r["nbytes"])
            times.append(r["seconds"])
    return series


def bandwidth_table(series: dict, *, world_size: int, metric: str = "time") -> str:
    """An nccl-tests style table, one column per algorithm, for one metric.

    Args:
        series: {algorithm: (sizes in bytes, seconds per call)}.
        world_size: ranks that took part (the busbw factor).
        metric: "time" (per call), "algbw" or "busbw".
    """
    names = list(series)
    sizes = sorted({s for sz, _ in series.values() for s in sz})

    def value(size: int, t: float) -> str:
        if metric == "time":
            return format_seconds(t)
        if metric == "algbw":
            return format_rate(algbw(size, t))
        return format_rate(busbw(size, t, collective="all_reduce", world_size=world_size))

    rows = []
    for size in sizes:
        row = [format_bytes(size), size // 4]
        for name in names:
            sz, ts = series[name]
            row.append(value(size, ts[sz.index(size)]) if size in sz else "")
        rows.append(row)
    return text_table(["size", "floats", *names], rows, right=list(range(1, len(names) + 2)))


def fit_all(series: dict, *, min_bytes: int = 0) -> dict:
    """An alpha-beta fit per algorithm (sizes below min_bytes left out)."""
    fits = {}
    for name, (sizes, times) in series.items():
        pts = [(s, t) for s, t in zip(sizes, times) if s >= min_bytes]
        fits[name] = fit_alpha_beta([s for s, _ in pts], [t for _, t in pts])
    return fits


def fit_table(fits: dict, series: dict, *, world_size: int) -> str:
    """alpha, beta, n½ per algorithm, and algbw and busbw measured at the largest size."""
    rows = []
    for name, fit in fits.items():
        sizes, times = series[name]
        big = max(range(len(sizes)), key=sizes.__getitem__)
        rows.append([name, format_seconds(fit.alpha_s), format_rate(fit.beta_Bps),
                     format_bytes(fit.half_bandwidth_bytes), format_bytes(sizes[big]),
                     format_seconds(times[big]), format_rate(algbw(sizes[big], times[big])),
                     format_rate(busbw(sizes[big], times[big], collective="all_reduce",
                                       world_size=world_size))])
    return text_table(["algorithm", "alpha", "beta", "n½", "largest size", "time", "algbw",
                       "busbw"], rows, right=[1, 2, 3, 4, 5, 6, 7])


# ------------------------------------------------------------------ 7. exercises

def check_ring_bytes(ring_bytes: Callable[[int, int, int], int], records: Iterable[dict]) -> None:
    """Exercise 1: compare ring_bytes(numel, n, rank) with the bytes ring_bench.py measured."""
    recs = [r for r in records if r.get("traffic") == "ring"]
    wrong = 0
    for r in sorted(recs, key=lambda r: (r["group_size"], r["rank"])):
        numel = r["data_bytes"] // 4
        try:
            got = ring_bytes(numel, r["group_size"], r["rank"])
        except NotImplementedError:
            print("ring_bytes is not written yet: replace the raise with your formula")
            return
        if got != r["sent"]:
            wrong += 1
            print(f"{r['group_size']} ranks, rank {r['rank']}: you say {got} bytes, "
                  f"it sent {r['sent']}")
    if wrong:
        print("hint: tensor_split gives the first numel % n chunks one extra element; "
              "which chunks does a rank never send in each phase?")
    else:
        print(f"correct: your formula matches all {len(recs)} measured (group size, rank) pairs, "
              "to the byte")


PARITY_FILE = HERE / "exercise_parity_ring.py"


def check_parity_ring(nproc: int = 3) -> None:
    """Exercise 2: run exercise_parity_ring.py on nproc ranks (only once it is written)."""
    from labutils import launch

    if "raise NotImplementedError" in PARITY_FILE.read_text():
        print(f"not attempted yet: write parity_ring_all_reduce in {PARITY_FILE.name}, "
              "then run this cell again")
        return
    run = launch(PARITY_FILE, nproc=nproc, hang_timeout=5, timeout=120)
    if run.hang:
        print("it hangs: some rank sends while its neighbour also sends. "
              f"Where they wait: {run.hang.waiting}")
    elif not run.ok:
        print(f"it fails: {run.failure.exc_type}: {run.failure.message}")
    else:
        print(f"correct: equal to dist.all_reduce on {nproc} ranks for "
              f"{run.values('sizes_checked', rank=0)[0]} sizes, without a deadlock")


# ------------------------------------------------------------------ 8. self-check

def check_answers(answers: dict, *, fit=None) -> None:
    """Print, per question, whether the answer is right (answers left as None are skipped).

    Args:
        answers: question name -> your answer.
        fit: the library's AlphaBeta fit from this notebook (for q4).
    """
    predicted = fit.predict(64 * 2**20) if fit is not None else None
    expected = {
        "q1_busbw_factor_8_ranks": (1.75, "2(n-1)/n with n = 8", 1e-9),
        "q2_ring_mb_sent_per_rank": (150.0, "2(n-1)/n x 100 MB with n = 4", 1e-9),
        "q3_naive_mb_sent_per_rank": (300.0, "the whole tensor n-1 times", 1e-9),
        "q4_predicted_seconds_64mib": (predicted, "fit.predict(64 * 2**20)", 0.02),
        "q5_detail_catches_same_shape": (False, "look at what the check call returned in section 6", 0),
    }
    selfcheck.check_answers(answers, expected)

__all__ = [
    "primitive_tables", "barrier_table", "show_source", "frame_in", "correctness_table", "traffic_table",
    "traffic_summary", "bandwidth_series", "bandwidth_table", "fit_all", "fit_table",
    "check_ring_bytes", "check_parity_ring", "check_answers",
]
