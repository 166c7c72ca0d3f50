"""What launch() costs, warm and cold, next to bare torchrun, side by side in one run.

    .venv/bin/python benchmarks/launcher.py [--repeats N] [--lines N] [--e2e-repeats N]
                                            [--json FILE]

Three sides: launch() warm (the default: the run's agent forked from this process's
warm server, the ranks forked by the agent), launch(warm=False) (cold: a new
interpreter for the agent and each rank) and bare ``python -m torch.distributed.run
--standalone``. Measurements (benchmarks/README.md says what each one counts and why):

1. a 4-rank hello (gloo init, one all_reduce, a print, destroy), runs interleaved
   (warm, cold, bare, warm, cold, bare...);
2. from the start to the first rank line, taken in those same runs;
3. a flood: rank 0 prints --lines lines, rank 1 exits at once; launch() with the
   bounded text display writing into an io.StringIO against ``torchrun ... > /dev/null``;
   every line must be in rank0/stdout.log and the text shown must stay bounded;
4. hang detection (warm): rank 0 sleeps before a collective, rank 1 waits in it;
   hang_timeout=5; the delay is (launch() returned) - (the stall began) - 5 s;
5. end to end, warm against LABUTILS_START=cold: a lesson notebook executed in a new
   kernel (nbconvert), and `labutils grade` of a lab's solution and starter.

launch() runs in this process, the way a notebook kernel calls it; bare torchrun runs
as a child process started here. Neither pays for starting the interpreter that
measures; the warm server is started by the untimed warm-up run, as a kernel's first
run (or its import of labutils) starts it.

Exit status: 0 when every run did what it should (timing targets missed or not),
1 when a run failed, lost lines, or a hang was not reported.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_IMPORT = time.monotonic()
import labutils  # noqa: E402 - timed: a notebook pays this once per kernel
from labutils import launch  # noqa: E402
from labutils.course.timing import machine_cpu_so_far  # noqa: E402
from labutils.notebook.display import Display, TextDisplay  # noqa: E402

IMPORT_S = time.monotonic() - T_IMPORT

HELLO_RANKS = 4
HANG_TIMEOUT_S = 5.0
TARGET_HELLO_RATIO = 1.10  # a cold launch() against bare torchrun
TARGET_WARM_RATIO = 0.20   # a warm launch() against bare torchrun
TARGET_HANG_EXTRA_S = 5.0

HELLO = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.ones(1)
dist.all_reduce(total)
print(f"hello from rank {rank} of {world}; all_reduce gave {int(total.item())}", flush=True)
dist.destroy_process_group()
"""

# What most of the course's runs are: DDP, whose constructor imports torch._dynamo (the
# warm server has it preloaded).
DDP_STEPS = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    loss = model(torch.randn(8, 16)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"rank {dist.get_rank()}: 5 DDP steps, loss {loss.item():.3f}", flush=True)
dist.destroy_process_group()
"""

FLOOD = """\
import os
import sys

n = int(sys.argv[1])
if int(os.environ["RANK"]) == 0:
    for i in range(n):
        print(f"flood line {i}")
"""

HANG = """\
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"stall-start {time.time():.6f}", flush=True)
if rank == 0:
    time.sleep(3600)  # the straggler: never reaches the collective
dist.all_reduce(torch.ones(1))  # rank 1 waits here for rank 0
"""


class StampDisplay(Display):
    """The "none" display plus clocks: first line, first note, first rank marked hung."""

    def __init__(self) -> None:
        super().__init__()
        self.first_line: float | None = None  # time.monotonic()
        # time.time() below: compared with the timestamps the ranks print
        self.first_note: float | None = None  # "no rank made progress...": hang detected
        self.first_hung: float | None = None  # every stack read, hang report built

    def lines(self, rank: int, stream: str, lines: list[str]) -> None:
        if self.first_line is None:
            self.first_line = time.monotonic()

    def note(self, text: str) -> None:
        if self.first_note is None:
            self.first_note = time.time()

    def state(self, rank: int, state: str) -> None:
        if state == "hung" and self.first_hung is None:
            self.first_hung = time.time()


class StampTextDisplay(TextDisplay):
    """The bounded text display, plus when its first and last lines arrived."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.first_line: float | None = None
        self.last_line: float | None = None

    def lines(self, rank: int, stream: str, lines: list[str]) -> None:
        self.last_line = time.monotonic()
        if self.first_line is None:
            self.first_line = self.last_line
        super().lines(rank, stream, lines)


class BenchError(RuntimeError):
    """A run that did not do what the measurement needs."""


def bare_torchrun(script: Path, nproc: int, args: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), str(script), *args]


def run_bare(cmd: list[str], *, read_stdout: bool, work: Path) -> dict:
    """Run bare torchrun; total seconds and, when reading stdout, the first line's time."""
    err_path = work / "bare-stderr.log"
    with open(err_path, "wb") as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=err,
                                stdout=subprocess.PIPE if read_stdout else subprocess.DEVNULL)
        first, lines = None, 0
        try:
            if read_stdout:
                for _ in proc.stdout:
                    if first is None:
                        first = time.monotonic() - t0
                    lines += 1
            proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: torchrun forwards SIGTERM to its ranks
                proc.terminate()
                proc.wait()
        total = time.monotonic() - t0
    if proc.returncode != 0:
        tail = err_path.read_text(errors="replace")[-2000:]
        raise BenchError(f"bare torchrun exited {proc.returncode}:\n{tail}")
    return {"total_s": total, "first_line_s": first, "lines": lines}


def count_lines(path: Path) -> tuple[int, bytes]:
    """Newlines in a file, and its last complete line."""
    count = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            count += chunk.count(b"\n")
        f.seek(max(0, f.tell() - 4096))
        tail = f.read().rstrip(b"\n")
    return count, tail.rsplit(b"\n", 1)[-1]


def stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "samples": samples}


# ------------------------------------------------------------------ measurements
SIDES = ("warm", "cold", "bare")  # launch() warm (the default), launch(warm=False), torchrun


def compare(samples: dict[str, list[float]]) -> dict:
    """Each side's stats and the ratios of the medians."""
    out = {side: stats(values) for side, values in samples.items()}
    med = {side: out[side]["median"] for side in samples}
    out["warm_over_bare"] = med["warm"] / med["bare"]
    out["cold_over_bare"] = med["cold"] / med["bare"]
    out["warm_over_cold"] = med["warm"] / med["cold"]
    return out


def machine_cpu() -> float:
    """The CPU-seconds of every process of the machine so far (0 where /proc/stat is not
    there): over a run on an otherwise idle machine, what the run cost, every process of
    it counted (a warm run's agent and ranks are not this process's children)."""
    return machine_cpu_so_far() or 0.0


def checked_launch(script: Path, side: str, **kwargs):
    """launch() warm or cold; BenchError unless it started the way asked."""
    result = launch(script, warm=side == "warm", **kwargs)
    if result.start != side:
        raise BenchError(f"asked for a {side} start, got {result.start}: {result.start_reason}")
    return result


def bench_hello(work: Path, runs: Path, repeats: int, log, *, name: str = "hello",
                source: str = HELLO) -> dict:
    """A script that prints one line per rank, each side `repeats` times, interleaved."""
    script = work / f"{name}.py"
    script.write_text(source)
    cmd = bare_torchrun(script, HELLO_RANKS)

    def one(side: str) -> dict:
        cpu0 = machine_cpu()
        if side == "bare":
            return {**run_bare(cmd, read_stdout=True, work=work), "cpu_s": machine_cpu() - cpu0}
        display = StampDisplay()
        t0 = time.monotonic()
        result = checked_launch(script, side, nproc=HELLO_RANKS, display=display, log_dir=runs)
        total = time.monotonic() - t0
        if not result.ok:
            raise BenchError(f"launch() of the {name} failed:\n{result.summary()}")
        lines = sum(r.stdout_lines for r in result.ranks)
        return {"total_s": total, "first_line_s": display.first_line - t0, "lines": lines,
                "cpu_s": machine_cpu() - cpu0}

    log(f"{name}: one untimed warm-up run of each side (file cache, __pycache__, the warm server)")
    for side in SIDES:
        one(side)
    samples = {side: [] for side in SIDES}
    for i in range(repeats):
        for side in SIDES:
            samples[side].append(one(side))
        log(f"{name} {i + 1}/{repeats}: " + ", ".join(
            f"{side} {samples[side][-1]['total_s']:.2f} s" for side in SIDES))
    for side, runs_ in samples.items():
        if any(r["lines"] != HELLO_RANKS for r in runs_):
            raise BenchError(f"{side}: expected {HELLO_RANKS} {name} lines per run, got "
                             f"{[r['lines'] for r in runs_]}")
    out = {key: compare({side: [r[key] for r in samples[side]] for side in SIDES})
           for key in ("total_s", "first_line_s", "cpu_s")}
    out["pass"] = out["total_s"]["warm_over_bare"] <= TARGET_WARM_RATIO
    out["pass_cold"] = out["total_s"]["cold_over_bare"] <= TARGET_HELLO_RATIO
    return out


def bench_flood(work: Path, runs: Path, repeats: int, n_lines: int, log) -> dict:
    script = work / "flood.py"
    script.write_text(FLOOD)
    cmd = bare_torchrun(script, 2, [str(n_lines)])
    launch_runs, samples = [], {side: [] for side in SIDES}
    for i in range(repeats):
        for side in SIDES:
            if side == "bare":
                samples[side].append(run_bare(cmd, read_stdout=False, work=work)["total_s"])
                continue
            shown = io.StringIO()  # what a notebook cell would receive
            display = StampTextDisplay(out=shown, err=shown)
            t0 = time.monotonic()
            result = checked_launch(script, side, nproc=2, args=[str(n_lines)], display=display,
                                    log_dir=runs)
            total = time.monotonic() - t0
            log_path = Path(result.log_dir) / "rank0" / "stdout.log"
            on_disk, last = count_lines(log_path)
            text = shown.getvalue()
            launch_runs.append({
                "side": side, "total_s": total, "ok": result.ok, "lines_on_disk": on_disk,
                "streaming_s": display.last_line - display.first_line,
                "last_line_ok": last == f"flood line {n_lines - 1}".encode(),
                "lines_counted": result.ranks[0].stdout_lines,
                "shown_bytes": len(text.encode()), "shown_lines": text.count("\n"),
                "shown_limit": display.limit, "shown_tail": display.tail_lines,
            })
            samples[side].append(total)
            log_path.unlink()  # millions of lines per run: keep the scratch disk small
        log(f"flood {i + 1}/{repeats}: " + ", ".join(
            f"{side} {samples[side][-1]:.2f} s" for side in SIDES))
    complete = all(r["ok"] and r["lines_on_disk"] == n_lines and r["last_line_ok"]
                   and r["lines_counted"] == n_lines for r in launch_runs)
    # Bounded: the limit, the kept tail, and a few lines of notes and summary; never
    # anything that grows with the number of lines printed.
    bound = launch_runs[0]["shown_limit"] + launch_runs[0]["shown_tail"] + 20
    bounded = all(r["shown_lines"] <= bound for r in launch_runs)
    out = compare(samples)
    return {
        "lines": n_lines, **out,
        "lines_per_s": {side: n_lines / out[side]["median"] for side in SIDES},
        "streaming_s": {side: stats([r["streaming_s"] for r in launch_runs if r["side"] == side])
                        for side in ("warm", "cold")},
        "runs": launch_runs, "complete": complete, "bounded": bounded,
        "shown_line_bound": bound, "pass": complete and bounded,
    }


def bench_end_to_end(work: Path, repeats: int, notebook: Path, lab: Path, log) -> dict:
    """A lesson notebook executed in a fresh kernel, and a grading batch (the lab's
    solution and its starter), each warm (the default) and with LABUTILS_START=cold,
    interleaved; wall-clock seconds of the whole command."""
    repo = Path(__file__).resolve().parent.parent
    solution = repo / "solutions" / lab.name

    def command(kind: str, out: Path) -> list[str]:
        if kind == "notebook":
            return [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                    "--ExecutePreprocessor.timeout=900", f"--output-dir={out}", str(notebook)]
        return [sys.executable, "-m", "labutils", "grade", str(lab), str(solution), str(lab),
                "--out", str(out)]

    samples = {kind: {"warm": [], "cold": []} for kind in ("notebook", "grading")}
    for i in range(repeats):
        for kind in samples:
            for side in ("warm", "cold"):
                out = work / f"{kind}-{side}-{i}"
                env = {**os.environ, "LABUTILS_RUNS_DIR": str(work / "e2e-runs")}
                env.pop("LABUTILS_START", None)
                if side == "cold":
                    env["LABUTILS_START"] = "cold"
                t0 = time.monotonic()
                done = subprocess.run(command(kind, out), cwd=notebook.parent if kind ==
                                      "notebook" else repo, env=env, capture_output=True,
                                      text=True)
                took = time.monotonic() - t0
                if done.returncode != 0:
                    raise BenchError(f"{kind} ({side}) exited {done.returncode}:\n"
                                     f"{done.stderr[-2000:]}")
                samples[kind][side].append(took)
                log(f"{kind} {i + 1}/{repeats} {side}: {took:.1f} s")
    out = {}
    for kind, sides in samples.items():
        out[kind] = {side: stats(v) for side, v in sides.items()}
        out[kind]["warm_over_cold"] = out[kind]["warm"]["median"] / out[kind]["cold"]["median"]
    out["notebook"]["path"] = str(notebook.relative_to(repo))
    out["grading"]["lab"] = str(lab.relative_to(repo))
    return out


def bench_hang(work: Path, runs: Path, repeats: int, log) -> dict:
    script = work / "hang.py"
    script.write_text(HANG)
    samples = []
    for i in range(repeats):
        display = StampDisplay()
        result = launch(script, nproc=2, hang_timeout=HANG_TIMEOUT_S, timeout=120,
                        display=display, log_dir=runs)
        returned = time.time()
        stamps = [float(line.split()[1]) for r in result.ranks
                  for line in r.stdout.splitlines() if line.startswith("stall-start ")]
        if result.reason != "hang" or len(stamps) != 2 or not display.first_hung:
            raise BenchError(f"hang run {i + 1}: expected a hang after both stamps, got "
                             f"reason={result.reason}, stamps={stamps}\n{result.summary()}")
        stall = max(stamps)  # the later rank printed; from then on nobody moves
        last_event = max(ev["t"] for r in result.ranks for ev in _events(result.log_dir, r.rank)
                         if ev.get("kind") in ("start", "progress", "record"))
        waiting = result.hang.waiting if result.hang else {}
        samples.append({
            "returned_after_stall_s": returned - stall,
            "extra_s": returned - stall - HANG_TIMEOUT_S,
            "noted_extra_s": display.first_note - stall - HANG_TIMEOUT_S,
            "stacks_read_extra_s": display.first_hung - stall - HANG_TIMEOUT_S,
            "extra_after_last_event_s": returned - last_event - HANG_TIMEOUT_S,
            "waiting": {str(k): v for k, v in waiting.items()},
            "stragglers": result.hang.stragglers if result.hang else [],
        })
        log(f"hang {i + 1}/{repeats}: returned {returned - stall:.2f} s after the stall "
            f"(+{samples[-1]['extra_s']:.2f} s beyond hang_timeout); stragglers "
            f"{samples[-1]['stragglers']}")
    every_line = all(set(s["waiting"]) == {"0", "1"} and all(
        Path(w.rsplit(":", 1)[0]).name == "hang.py" for w in s["waiting"].values())
        for s in samples)
    extra = stats([s["extra_s"] for s in samples])
    return {
        "hang_timeout_s": HANG_TIMEOUT_S,
        "extra_s": extra,
        "noted_extra_s": stats([s["noted_extra_s"] for s in samples]),
        "stacks_read_extra_s": stats([s["stacks_read_extra_s"] for s in samples]),
        "extra_after_last_event_s": stats([s["extra_after_last_event_s"] for s in samples]),
        "each_rank_waiting_line": every_line,
        "runs": samples,
        "pass": every_line and extra["max"] <= TARGET_HANG_EXTRA_S,
    }


def _events(run_dir, rank: int) -> list[dict]:
    path = Path(run_dir) / f"rank{rank}" / "events.jsonl"
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return events


def leftover_processes(marker: str) -> list[str]:
    """Processes whose command line names our scratch folder (none may survive)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [ln.strip() for ln in out.splitlines() if marker in ln and "ps -eo" not in ln]


# ------------------------------------------------------------------ reporting
def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(res: dict) -> str:
    h, f, g = res["hello"], res["flood"], res["hang"]
    env = res["environment"]
    rows = []

    def row(name, warm="", cold="", bare="", wb="", cb="", target=""):
        rows.append(f"{name:<34} {warm:>10} {cold:>10} {bare:>10} {wb:>7} {cb:>7}  {target}")

    def med(s):
        return f"{s['median']:.2f} s"

    def spread(s):
        return f"{s['min']:.2f}-{s['max']:.2f}"

    def sides(name, c, target=""):
        row(name, med(c["warm"]), med(c["cold"]), med(c["bare"]), f"{c['warm_over_bare']:.2f}x",
            f"{c['cold_over_bare']:.2f}x", target)
        row("  min-max (s)", spread(c["warm"]), spread(c["cold"]), spread(c["bare"]))

    def cpu_row(c):
        row("  CPU-s of the machine per run", f"{c['warm']['median']:.2f}",
            f"{c['cold']['median']:.2f}", f"{c['bare']['median']:.2f}",
            f"{c['warm_over_bare']:.2f}x", f"{c['cold_over_bare']:.2f}x")

    row("measurement (medians)", "warm", "cold", "bare", "w/bare", "c/bare", "target")
    row("-" * 34, "-" * 10, "-" * 10, "-" * 10, "-" * 7, "-" * 7, "-" * 24)
    sides(f"{HELLO_RANKS}-rank hello", h["total_s"],
          f"warm <= {TARGET_WARM_RATIO:.2f}x {verdict(h['pass'])}; "
          f"cold <= {TARGET_HELLO_RATIO:.2f}x {verdict(h['pass_cold'])}")
    sides("start to first rank line", h["first_line_s"])
    cpu_row(h["cpu_s"])
    if "ddp" in res:
        sides(f"{HELLO_RANKS}-rank DDP, 5 steps", res["ddp"]["total_s"])
        cpu_row(res["ddp"]["cpu_s"])
    sides(f"flood {f['lines']:,} lines", f)
    lps = f["lines_per_s"]
    row("  lines/s", f"{lps['warm']:,.0f}", f"{lps['cold']:,.0f}", f"{lps['bare']:,.0f}")
    shown = f["runs"]
    row("  every line in rank0/stdout.log",
        f"{min(r['lines_on_disk'] for r in shown):,}", "", "", "", "", verdict(f["complete"]))
    row("  text shown (notebook), largest", f"{max(r['shown_lines'] for r in shown)} lines",
        "", "", "", "", f"<= {f['shown_line_bound']} lines  {verdict(f['bounded'])}")
    e2e = res.get("end_to_end")
    if e2e:
        for kind, label in (("notebook", e2e["notebook"]["path"]),
                            ("grading", f"grade {e2e['grading']['lab']} (2 subm.)")):
            c = e2e[kind]
            row(label[:34], med(c["warm"]), med(c["cold"]), "", "", "",
                f"warm/cold {c['warm_over_cold']:.2f}x")
    e = g["extra_s"]
    row(f"hang (warm): beyond timeout={g['hang_timeout_s']:g} s", f"{e['median']:.2f} s",
        "", "", "", "", f"max {e['max']:.2f} s <= {TARGET_HANG_EXTRA_S:g} s  {verdict(g['pass'])}")
    row("  each rank's waiting line", "yes" if g["each_rank_waiting_line"] else "NO")
    head = (f"labutils launcher benchmark: torch {env['torch']}, Python {env['python']}, "
            f"{env['cores']} cores, load {env['load_before']} before, "
            f"{env['load_after']} after; repeats {res['settings']['repeats']}; labutils import "
            f"{env['labutils_import_s']:.2f} s (once per kernel, not counted)")
    foot = (f"warm: launch() forking from this process's warm server; cold: launch(warm=False); "
            f"bare: python -m torch.distributed.run --standalone.\nleft behind: "
            f"{len(res['leftover_processes'])} process(es); wall time {res['wall_s']:.0f} s")
    return "\n".join([head, "", *rows, "", foot])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs of each side per measurement (default 5)")
    parser.add_argument("--lines", type=int, default=1_000_000,
                        help="lines rank 0 prints in the flood (default 1,000,000)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    parser.add_argument("--e2e-repeats", type=int, default=2,
                        help="runs of each side of the notebook and the grading batch "
                        "(default 2; 0 leaves them out)")
    parser.add_argument("--notebook", default="lessons/00_first_distributed_run.ipynb",
                        help="the lesson executed end to end")
    parser.add_argument("--lab", default="labs/01_data_sharding",
                        help="the lab graded end to end (its solution and its starter)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.lines < 1:
        parser.error("--repeats and --lines must be at least 1")

    import torch

    start = time.monotonic()
    log = lambda text: print(f"  {text}", file=sys.stderr, flush=True)  # noqa: E731
    res: dict = {
        "settings": {"repeats": args.repeats, "lines": args.lines, "hello_ranks": HELLO_RANKS,
                     "e2e_repeats": args.e2e_repeats,
                     "hang_timeout_s": HANG_TIMEOUT_S},
        "environment": {
            "torch": torch.__version__, "python": platform.python_version(),
            "labutils": labutils.__version__, "cores": os.cpu_count(),
            "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "labutils_import_s": IMPORT_S,
        },
    }
    with tempfile.TemporaryDirectory(prefix="labutils-bench-") as tmp:
        work, runs = Path(tmp), Path(tmp) / "runs"
        try:
            res["hello"] = bench_hello(work, runs, args.repeats, log)
            res["ddp"] = bench_hello(work, runs, args.repeats, log, name="ddp", source=DDP_STEPS)
            res["flood"] = bench_flood(work, runs, args.repeats, args.lines, log)
            res["hang"] = bench_hang(work, runs, args.repeats, log)
            if args.e2e_repeats:
                repo = Path(__file__).resolve().parent.parent
                res["end_to_end"] = bench_end_to_end(
                    work, args.e2e_repeats, (repo / args.notebook).resolve(),
                    (repo / args.lab).resolve(), log)
        except BenchError as exc:
            print(f"benchmark run failed: {exc}", file=sys.stderr)
            return 1
        finally:
            time.sleep(0.5)
            res["leftover_processes"] = leftover_processes(tmp)
    res["wall_s"] = time.monotonic() - start
    res["environment"]["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    res["targets"] = {"hello_warm_ratio": res["hello"]["pass"],
                      "hello_cold_ratio": res["hello"]["pass_cold"],
                      "flood": res["flood"]["pass"], "hang": res["hang"]["pass"]}
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"figures written to {args.json}")
    worked = (res["flood"]["complete"] and res["hang"]["each_rank_waiting_line"]
              and not res["leftover_processes"])
    return 0 if worked else 1


if __name__ == "__main__":
    sys.exit(main())
