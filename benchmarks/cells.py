"""A one-line cell on 4 ranks: %%ranks (labutils' persistent world) beside ipyparallel's
%%px on 4 engines, side by side in one process, one IPython shell.

    .venv/bin/python benchmarks/cells.py [--ranks 4] [--repeats 50] [--json FILE]

Both worlds are started first (untimed), then the same cells alternate, %%ranks then
%%px, --repeats times each: a one-line cell whose value every rank prints (``rank``),
and a cell with one all_reduce of 4 floats over gloo (%%ranks only: ipyparallel's
engines have no process group; the line says what a collective adds). Each figure is
the wall time of ``shell.run_cell(...)``, from the cell's start until the shell has it
back with every rank's output printed; output goes to a sink, as a saved notebook's
text output would be written, for both. Medians and min-max are printed, and the
ratio ours / %%px. Exit status 1 when a cell did not print every rank's value.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time


def _timed(shell, cell: str, expect: list[str]) -> float:
    sink = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        shell.run_cell(cell)
    elapsed = time.perf_counter() - t0
    missing = [e for e in expect if e not in sink.getvalue()]
    if missing:
        sys.stderr.write(f"cell {cell!r} did not print {missing}:\n{sink.getvalue()}\n")
        raise SystemExit(1)
    return elapsed


def _stats(samples: list[float]) -> dict:
    return {"median_ms": round(1000 * statistics.median(samples), 2),
            "min_ms": round(1000 * min(samples), 2), "max_ms": round(1000 * max(samples), 2),
            "samples_ms": [round(1000 * s, 3) for s in samples]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)

    import ipyparallel as ipp
    from IPython.core.interactiveshell import InteractiveShell

    os.environ["LABUTILS_RUNS_DIR"] = tempfile.mkdtemp(prefix="bench-cells-")
    os.environ["LABUTILS_DISPLAY"] = "text"
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext labutils")
    n = opts.ranks
    t0 = time.perf_counter()
    shell.run_cell(f"%dist start -n {n}")
    ours_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=n, log_level=40)
    client = cluster.start_and_connect_sync()
    client.wait_for_engines(n, timeout=120)
    client.activate()  # %px, %%px in this shell
    px_start = time.perf_counter() - t0
    try:
        for i, engine in enumerate(client.ids):  # each engine's own rank, as a world's
            client[engine].push({"rank": i}, block=True)
        expect_ours = [f"[rank {r}] {r}" for r in range(n)]
        expect_px = [f"Out[{e}:" for e in client.ids]
        ours, px, reduce = [], [], []
        _timed(shell, "%%ranks\nrank", expect_ours)  # untimed warm-up of each side
        _timed(shell, "%%px\nrank", expect_px)
        for _ in range(opts.repeats):
            ours.append(_timed(shell, "%%ranks\nrank", expect_ours))
            px.append(_timed(shell, "%%px\nrank", expect_px))
            reduce.append(_timed(shell, "%%ranks\nt = torch.ones(4)\ndist.all_reduce(t)\nt[0].item()",
                                 [f"[rank {r}] {float(n)}" for r in range(n)]))
    finally:
        with contextlib.redirect_stdout(io.StringIO()):
            shell.run_cell("%dist stop")
        cluster.stop_cluster_sync()
    result = {"ranks": n, "repeats": opts.repeats, "start_s": {"ranks": round(ours_start, 2),
                                                               "px": round(px_start, 2)},
              "ranks_cell": _stats(ours), "px_cell": _stats(px), "ranks_all_reduce_cell": _stats(reduce)}
    ratio = statistics.median(ours) / statistics.median(px)
    result["ratio_ranks_over_px"] = round(ratio, 3)
    print(f"one-line cell on {n} ranks, medians of {opts.repeats} (min-max), ms:")
    for name, key in (("%%ranks (labutils)", "ranks_cell"), ("%%px (ipyparallel)", "px_cell"),
                      ("%%ranks with an all_reduce", "ranks_all_reduce_cell")):
        s = result[key]
        print(f"  {name:28s} {s['median_ms']:8.2f}  ({s['min_ms']:.2f}-{s['max_ms']:.2f})")
    print(f"  ratio %%ranks / %%px: {ratio:.2f}")
    print(f"start: %dist start {ours_start:.1f} s, ipyparallel cluster {px_start:.1f} s")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
