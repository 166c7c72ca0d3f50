"""Helpers for the lesson 02 notebook: tables of the runs' records, the exercise checks.

The rank scripts (primitives.py, ring_bench.py, ring_deadlock.py, mismatch.py) do
not import this module; only the notebook does.
"""

from __future__ import annotations

import ast
import linecache
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

from labutils.course import selfcheck
from labutils.course.tables import significant, text_table
from labutils.course.timing import algbw, busbw, busbw_factor, fit_alpha_beta, format_bytes
from labutils.runtime.frames import dump_frames

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


def frame_in(stack: str, file: str) -> str:
    """The innermost frame of a hang report's stack that lies in ``file``, as
    'file:line in func()' followed by the source line."""
    for frame in dump_frames(stack):
        if Path(frame.file).name == file:
            source = linecache.getline(frame.file, frame.line).strip()
            return f"{file}:{frame.line} in {frame.func}(): {source}"
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
    "pipelined ring": ("2(n-1)/n", lambda n, root: 2 * (n - 1) / n),
    "naive ring": ("n-1", lambda n, root: n - 1),
    "reduce+broadcast": ("n-1 at the root, 1 elsewhere", lambda n, root: n - 1 if root else 1),
}


def _ratios(values: Iterable[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def traffic_table(records: Iterable[dict]) -> str:
    """Bytes each rank sent per algorithm and group size, as a multiple of the data,
    against the formula (one row per group size and algorithm, ranks 0, 1, ... in order)."""
    recs = [r for r in records if "traffic" in r]
    rows = []
    for n in sorted({r["group_size"] for r in recs}):
        for name, (formula, factor) in EXPECTED_SENT.items():
            ranks = sorted((r for r in recs if r["group_size"] == n and r["traffic"] == name),
                           key=lambda r: r["rank"])
            if not ranks:
                continue
            rows.append([n, name, _ratios(r["sent"] / r["data_bytes"] for r in ranks),
                         _ratios(factor(n, r["rank"] == 0) for r in ranks), formula])
    return text_table(["ranks", "algorithm", "sent / data, rank 0 1 ...", "expected", "formula"],
                      rows)


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


UNITS = {"time": ("ms", 1e3), "algbw": ("MB/s", 1e-6), "busbw": ("MB/s", 1e-6)}


def bandwidth_table(series: dict, *, world_size: int, metric: str = "time") -> str:
    """An nccl-tests style table, one column per algorithm, for one metric, in one unit
    (ms for time, MB/s = 1e6 bytes per second for the bandwidths).

    Args:
        series: {algorithm: (sizes in bytes, seconds per call)}.
        world_size: ranks that took part (the busbw factor).
        metric: "time" (per call), "algbw" or "busbw".
    """
    unit, scale = UNITS[metric]
    names = list(series)
    sizes = sorted({s for sz, _ in series.values() for s in sz})

    def value(size: int, t: float) -> str:
        if metric == "time":
            return significant(t * scale)
        if metric == "algbw":
            return significant(algbw(size, t) * scale)
        return significant(busbw(size, t, collective="all_reduce", world_size=world_size) * scale)

    rows = []
    for size in sizes:
        row = [size, size // 4]
        for name in names:
            sz, ts = series[name]
            row.append(value(size, ts[sz.index(size)]) if size in sz else "")
        rows.append(row)
    return (f"{metric} of one all_reduce on {world_size} ranks, {unit}\n"
            + text_table(["bytes", "floats", *names], rows, right=list(range(len(names) + 2))))


def fit_all(series: dict, *, min_bytes: int = 0) -> dict:
    """An alpha-beta fit per algorithm (sizes below min_bytes left out)."""
    fits = {}
    for name, (sizes, times) in series.items():
        pts = [(s, t) for s, t in zip(sizes, times) if s >= min_bytes]
        fits[name] = fit_alpha_beta([s for s, _ in pts], [t for _, t in pts])
    return fits


def fit_table(fits: dict, series: dict, *, world_size: int) -> str:
    """alpha, beta, n½ per algorithm, and time, algbw and busbw measured at the largest size."""
    rows = []
    biggest = max(max(sizes) for sizes, _ in series.values())
    for name, fit in fits.items():
        sizes, times = series[name]
        t = times[sizes.index(biggest)]
        rows.append([name, significant(fit.alpha_s * 1e3), significant(fit.beta_Bps / 1e6),
                     significant(fit.half_bandwidth_bytes / 2**10), significant(t * 1e3),
                     significant(algbw(biggest, t) / 1e6),
                     significant(busbw(biggest, t, collective="all_reduce", world_size=world_size) / 1e6)])
    return (f"alpha-beta fit per algorithm; time and bandwidths at {format_bytes(biggest)}\n"
            + text_table(["algorithm", "alpha (ms)", "beta (MB/s)", "n½ (KiB)", "time (ms)",
                          "algbw (MB/s)", "busbw (MB/s)"], rows, right=[1, 2, 3, 4, 5, 6]))


def fit_text(fit) -> str:
    """One alpha-beta fit in the fit table's units: ms, MB/s, KiB."""
    return (f"alpha = {significant(fit.alpha_s * 1e3)} ms, beta = {significant(fit.beta_Bps / 1e6)} MB/s, "
            f"n½ = {significant(fit.half_bandwidth_bytes / 2**10)} KiB")


def busbw_ratio(series: dict, name: str, reference: str, size: int) -> float:
    """busbw of algorithm `name` over that of `reference` at `size` bytes (= their time ratio
    inverted: the same bytes and world size)."""
    def seconds(algorithm: str) -> float:
        sizes, times = series[algorithm]
        return times[sizes.index(size)]

    return seconds(reference) / seconds(name)


def loopback_claims(series: dict, *, small_below: int = 64 * 2**10) -> str:
    """Section 5's reading of the plot, on loopback: at the largest size the naive ring and
    reduce+broadcast fall behind the ring and the library; below small_below bytes, where
    a call costs about alpha, reduce+broadcast's 2 rounds beat the ring's 6 steps."""
    big = max(series["library"][0])

    def at(name: str, size: int) -> float:
        sizes, times = series[name]
        return times[sizes.index(size)]

    def small(name: str) -> float:
        return statistics.median(t for s, t in zip(*series[name]) if s < small_below)

    behind = all(at(slow, big) > at(fast, big) for slow in ("naive ring", "reduce+broadcast")
                 for fast in ("ring", "library"))
    return "\n".join([
        f"at {format_bytes(big)} the naive ring and reduce+broadcast take longer than the ring "
        f"and the library: {behind}",
        f"below {format_bytes(small_below)} a reduce+broadcast call takes less time than a ring "
        f"call (median): {small('reduce+broadcast') < small('ring')}",
    ])


def wire_claims(series: dict) -> str:
    """Section 6's reading: at the largest size the plain Python ring keeps up with gloo's
    all_reduce too; at the smallest, where a chunk is one segment, posting the receives
    early (the pipelined ring) is worth more than at the largest, where the steps are long."""
    sizes = sorted(series["library"][0])
    small, big = sizes[0], sizes[-1]

    def ratio(name: str, size: int) -> float:
        return busbw_ratio(series, name, "library", size)

    return "\n".join([
        f"at {format_bytes(big)} the plain ring reaches at least 0.8x the library's busbw too: "
        f"{ratio('ring', big) >= 0.8}",
        f"at {format_bytes(small)} the pipelined ring is ahead of the plain ring: "
        f"{ratio('pipelined ring', small) > ratio('ring', small)}",
        f"the plain ring loses less to the library at {format_bytes(big)} than at "
        f"{format_bytes(small)}: {ratio('ring', big) > ratio('ring', small)}",
    ])


# ------------------------------------------------------------------ 6. on a wire

LINK_LOAD = {  # bytes the busiest link carries one after the other, as a multiple of the data
    "library": ("2(n-1)/n", lambda n: 2 * (n - 1) / n),
    "ring": ("2(n-1)/n", lambda n: 2 * (n - 1) / n),
    "pipelined ring": ("2(n-1)/n", lambda n: 2 * (n - 1) / n),
    "naive ring": ("n-1", lambda n: n - 1),
    "reduce+broadcast": ("(n-1) in, then (n-1) out", lambda n: 2 * (n - 1)),
}


def wire_predictions(records: Iterable[dict], *, link_Bps: float, world_size: int) -> dict:
    """{algorithm: (predicted s, measured s)} at the largest size of a run on a capped link:
    predicted = LINK_LOAD x data / link_Bps, the wire time alone."""
    recs = [r for r in records if "algorithm" in r]
    biggest = max(r["nbytes"] for r in recs)
    return {r["algorithm"]: (LINK_LOAD[r["algorithm"]][1](world_size) * biggest / link_Bps,
                             r["seconds"])
            for r in recs if r["nbytes"] == biggest}


WIRE_BAND = (0.9, 1.5)  # measured / predicted, for every algorithm
BUSY_ELSEWHERE = 0.4  # the share of the cores other programs held that explains a miss


def wire_check(records: Iterable[dict], *, link_Bps: float, world_size: int) -> str:
    """Section 6's check: every algorithm's time at the largest size within WIRE_BAND of
    the time its busiest link's bytes need. When it fails, too slow, while other programs kept
    BUSY_ELSEWHERE of the machine's cores or more busy (ring_bench.py's others_cores),
    the line says so: the ranks then waited for a core, and the wire waited with them."""
    recs = [r for r in records if "algorithm" in r]
    low, high = WIRE_BAND
    predicted = wire_predictions(recs, link_Bps=link_Bps, world_size=world_size)
    ratios = [measured / pred for pred, measured in predicted.values()]
    held = all(low <= ratio <= high for ratio in ratios)
    slow = not held and min(ratios) >= low  # too slow, none too fast: a reason may be the load
    line = f"every algorithm takes {low}x to {high}x the time its bytes need on the link: {held}"
    biggest = max(r["nbytes"] for r in recs)
    busy = max((r for r in recs if r["nbytes"] == biggest and "others_cores" in r),
               key=lambda r: r["others_cores"], default=None)
    if slow and busy is not None and busy["others_cores"] >= BUSY_ELSEWHERE * busy["cores"]:
        line += (f" (other programs kept {busy['others_cores']:.1f} of this machine's {busy['cores']} "
                 "cores busy while the calls were timed: the ranks waited for a core, and the wire "
                 "with them)")
    return line


def wire_table(records: Iterable[dict], *, link_Bps: float, world_size: int) -> str:
    """At the largest size: bytes each rank's link carried (counted on the interface) and
    the time the link rate predicts from the busiest link's load, against the time measured."""
    recs = [r for r in records if "algorithm" in r]
    biggest = max(r["nbytes"] for r in recs)
    predicted = wire_predictions(recs, link_Bps=link_Bps, world_size=world_size)
    rows = []
    for r in recs:
        if r["nbytes"] != biggest:
            continue
        pred, measured = predicted[r["algorithm"]]
        formula, load = LINK_LOAD[r["algorithm"]]
        sent = _ratios(b / biggest for b in r["link_sent"]) if "link_sent" in r else "not counted"
        rows.append([r["algorithm"], sent, f"{formula} = {load(world_size):g}", significant(pred * 1e3),
                     significant(measured * 1e3), f"{measured / pred:.2f}",
                     f"{busbw(biggest, measured, collective='all_reduce', world_size=world_size) / link_Bps:.2f}"])
    ranks = " ".join(map(str, range(world_size)))
    return (f"{format_bytes(biggest)} on {world_size} hosts, link {significant(link_Bps / 1e6)} MB/s each way; "
            "times in ms\n"
            + text_table(["algorithm", f"sent / data, rank {ranks}", "busiest link (x data)",
                          "predicted", "measured", "measured / predicted", "busbw / link"],
                         rows, right=[3, 4, 5, 6]))


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
    "traffic_summary", "bandwidth_series", "bandwidth_table", "fit_all", "fit_table", "busbw_ratio",
    "wire_predictions", "wire_check", "wire_table", "check_ring_bytes", "check_parity_ring",
    "check_answers",
]
